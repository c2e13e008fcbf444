"""linear on the CUDA kernels, run on the CPU by the CUDA execution harness (tvm_mamba.simulate_cuda): one
warp per output feature (forward) and one thread per dx element (input gradient) against the float64
reference (mirrors tests/torch_ops/test_linear.py)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.linear import linear_grad_input_ref, linear_ref
from tvm_mamba.torch_ops.linear import linear, quantize_weight


# K = 131: a ragged last 32-lane step; N = 37: a ragged last block of 4 warps
@pytest.mark.parametrize("wdt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_forward_and_input_gradient(sim, wdt, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 131, generator=g).requires_grad_()
    w, s = quantize_weight(torch.randn(37, 131, generator=g) / 12, wdt)
    b = torch.randn(37, generator=g) if rows != 1 else None
    y = linear(x, w, b, s)
    assert_close_to_ref(y, linear_ref(x.detach(), w, b, s), atol=1e-5, rtol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    assert_close_to_ref(x.grad, linear_grad_input_ref(dy, w, s), atol=1e-5, rtol=1e-5, name="dx")
    assert {k.direction for k, _ in sim if k.op == "linear"} == {"fwd", "bwd"}


def test_bf16_x(sim):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    w, s = quantize_weight(torch.randn(24, 64, generator=g) / 8, "int8")
    y = linear(x, w, None, s)
    low = torch.nn.functional.linear(x, (w.double() * s.double()[:, None]).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert_close_to_ref(y, linear_ref(x, w, None, s), low, atol=1e-2)
