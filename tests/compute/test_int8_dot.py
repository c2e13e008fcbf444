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


def test_te_straight_through_dgrad_wgrad():
    from tvm_mamba.compute.int8_dot import int8_dot_dgrad, int8_dot_wgrad

    g = torch.randn(2, 5, 7, dtype=torch.float32)
    codes = torch.randint(-128, 128, (2, 7, 3), dtype=torch.int8)
    out = torch.empty(2, 5, 3)
    _build(int8_dot_dgrad(2, 3, 7), "int8_dot_dgrad")(g, codes, torch.tensor([0.5]), out)
    torch.testing.assert_close(out.double(), 0.5 * torch.einsum("hmk,hkn->hnm", g.double(), codes.double())
                               .transpose(1, 2), atol=1e-4, rtol=1e-5)
    a = torch.randint(-128, 128, (1, 11, 3), dtype=torch.int8)
    g2 = torch.randn(2, 11, 4)
    out2, part = torch.empty(2, 3, 4), torch.empty(3, 2, 3, 4)  # 3 parts of ceil(11/3) = 4 rows (last: 3)
    _build(int8_dot_wgrad(2, 1, 3, 4), "int8_dot_wgrad")(a, g2, torch.tensor([0.25]), out2, part)
    ref = 0.25 * torch.einsum("mn,hmk->hnk", a[0].double(), g2.double())
    torch.testing.assert_close(out2.double(), ref, atol=1e-4, rtol=1e-5)
