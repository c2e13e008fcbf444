"""The int8 TE definitions (unscheduled, compiled for llvm) against the integer references."""
from __future__ import annotations

import torch
import tvm

from tvm_mamba.compute.int8_dot import int8_dot_matmul, int8_dot_pack, int8_dot_unpack
from tvm_mamba.reference.int8_dot import int8_matmul_ref, pack_int8x4_ref
from tvm_mamba.runtime import cpu_target


def _build(func, name):
    return tvm.compile(tvm.IRModule({name: func}), target=cpu_target())[name]


def test_te_int8_matmul_and_pack():
    a = torch.randint(-128, 128, (5, 13), dtype=torch.int8)
    b = torch.randint(-128, 128, (6, 13), dtype=torch.int8)
    c = torch.empty(5, 6, dtype=torch.int32)
    _build(int8_dot_matmul(6, 13), "int8_dot_matmul")(a, b, c)
    assert torch.equal(c.long(), int8_matmul_ref(a, b))
    p = torch.empty(5, 4, dtype=torch.int32)
    _build(int8_dot_pack(13), "int8_dot_pack")(a, p)
    assert torch.equal(p, pack_int8x4_ref(a))
    back = torch.empty(5, 13, dtype=torch.int8)
    _build(int8_dot_unpack(13), "int8_dot_unpack")(p, back)
    assert torch.equal(back, a)
