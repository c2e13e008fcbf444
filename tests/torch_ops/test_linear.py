"""linear (weight-only fp32 / bf16 / int8 weights) against the float64 reference: forward for rows 1, 3, 8
and odd in_features, leading dims, bias, the input gradient (reference and gradcheck), opcheck, per-channel
quantization, and bad input."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.linear import (dequantize_ref, linear_grad_input_ref, linear_ref,
                                        quantize_weight_ref)
from tvm_mamba.modules.linear import Linear
from tvm_mamba.torch_ops import linear as linear_mod
from tvm_mamba.torch_ops.linear import GEMV_ROWS, fp32_linear, fp32_on_kernel, linear, quantize_weight

WDT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _case(rows, K, N, wdt, xdt=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g).to(xdt)
    w, s = quantize_weight(torch.randn(N, K, generator=g) / K ** 0.5, wdt)
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b, s


def _check(y, x, w, b, s):
    ref = linear_ref(x, w, b, s)
    if y.dtype == torch.float32:
        assert_close_to_ref(y, ref, atol=1e-5, rtol=1e-5)
    else:  # bf16 output: within 2x the reference's own bf16 drift (the weight computed in bf16 too)
        low = torch.nn.functional.linear(x, dequantize_ref(w, s).to(x.dtype), None if b is None else b.to(x.dtype))
        assert_close_to_ref(y, ref, low, atol=1e-2)


# K = 131: 8 vectors of 16 + 3 scalar columns, not a multiple of the unrolled step; N = 37: a ragged last task
# and a ragged last feature tile; rows 1 (decode), 3 (a ragged row tile), 8
@pytest.mark.parametrize("wdt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_forward_fp32_x(wdt, rows):
    x, w, b, s = _case(rows, 131, 37, wdt, bias=rows == 3)
    y = linear(x, w, b, s)
    assert y.dtype == torch.float32 and y.shape == (rows, 37)
    _check(y, x, w, b, s)


@pytest.mark.parametrize("wdt", ["bfloat16", "int8"])
def test_forward_bf16_x_and_leading_dims(wdt):
    x, w, b, s = _case(6, 96, 40, wdt, xdt=torch.bfloat16, bias=True, seed=1)
    y = linear(x.reshape(2, 3, 96), w, b, s)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 40)
    _check(y.reshape(6, 40), x, w, b, s)


def test_large_rows_and_projection_shape():
    # the 130M out_proj shape (1536 -> 768) at 8 rows and at a prefill-size 70 rows
    for rows in (8, 70):
        x, w, b, s = _case(rows, 1536, 768, "int8", seed=2)
        _check(linear(x, w, b, s), x, w, b, s)


def test_empty_rows():
    x, w, b, s = _case(0, 16, 8, "int8")
    assert linear(x, w, b, s).shape == (0, 8)


@pytest.mark.parametrize("wdt", ["float32", "bfloat16", "int8"])
def test_input_gradient(wdt):
    x, w, b, s = _case(3, 131, 37, wdt, bias=True, seed=3)
    x.requires_grad_()
    y = linear(x, w, b, s)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    y.backward(dy)
    assert_close_to_ref(x.grad, linear_grad_input_ref(dy, w, s), atol=1e-5, rtol=1e-5, name="dx")


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient")
def test_gradcheck_tiny():
    # linear in x, so fp32 finite differences at eps 1e-2 are exact up to rounding
    x, w, b, s = _case(2, 19, 5, "int8", bias=True, seed=4)
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: linear(t, w, b, s), (x,), eps=1e-2, atol=1e-3, rtol=1e-3)


def test_bf16_x_gradient():
    x, w, b, s = _case(4, 40, 24, "bfloat16", xdt=torch.bfloat16, seed=6)
    x.requires_grad_()
    y = linear(x, w, b, s)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    y.backward(dy)
    low = dy @ w
    assert_close_to_ref(x.grad, linear_grad_input_ref(dy, w, s), low, atol=1e-2, name="dx")


@pytest.mark.parametrize("wdt", ["bfloat16", "int8"])
def test_opcheck(wdt):
    x, w, b, s = _case(3, 24, 8, wdt, bias=True)
    torch.library.opcheck(torch.ops.tvm_mamba.linear_fwd.default, (x, w, s, b))
    torch.library.opcheck(torch.ops.tvm_mamba.linear_fwd.default, (x.requires_grad_(), w, s, None))
    torch.library.opcheck(torch.ops.tvm_mamba.linear_bwd.default, (torch.randn(3, 8), w, s))


def test_quantize_weight_matches_formula():
    w = torch.randn(33, 70, generator=torch.Generator().manual_seed(8))
    w[3] = 0  # an all-zero row: scale 1, codes 0
    codes, scale = quantize_weight(w, "int8")
    rc, rs = quantize_weight_ref(w, "int8")
    assert codes.dtype == torch.int8 and torch.equal(codes, rc) and torch.equal(scale, rs)
    assert scale[3] == 1 and not codes[3].any() and int(codes.abs().amax(1)[0]) == 127
    err = (codes.double() * scale.double()[:, None] - w.double()).abs()
    assert bool((err <= scale.double()[:, None] / 2 + 1e-12).all())
    bf, none = quantize_weight(w, "bfloat16")
    assert none is None and bf.dtype == torch.bfloat16 and torch.equal(bf, quantize_weight_ref(w, "bfloat16")[0])


def test_bad_input():
    x, w, b, s = _case(2, 16, 8, "int8", bias=True)
    with pytest.raises(TypeError, match="x: dtype"):
        linear(x.half(), w, b, s)
    with pytest.raises(ValueError, match="x: last dim"):
        linear(x[:, :15], w, b, s)
    with pytest.raises(ValueError, match="scale: an int8 weight"):
        linear(x, w, b)
    with pytest.raises(ValueError, match="scale: expected shape"):
        linear(x, w, b, s[:7])
    with pytest.raises(ValueError, match="scale: only an int8"):
        linear(x, w.float(), b, s)
    with pytest.raises(ValueError, match="bias: expected shape"):
        linear(x, w, b[:4], s)
    with pytest.raises(TypeError, match="weight: dtype"):
        linear(x, w.to(torch.int32), b, s)
    with pytest.raises(ValueError, match="weight: requires grad"):
        linear(x, w.float().requires_grad_(), b)
    with pytest.raises(ValueError, match="dtype: expected"):
        quantize_weight(w.float(), "int4")
    with pytest.raises(ValueError, match="weight: contains NaN"):
        quantize_weight(torch.full((2, 2), float("nan")))


@pytest.mark.parametrize("avx512", [True, False])
def test_fp32_linear_takes_the_kernel_at_inference_only(monkeypatch, avx512):
    """fp32_linear: the linear op for fp32 inference of 1..GEMV_ROWS rows, and of more rows where the host has
    AVX-512 (close to float64, a row's bits the same at any row count); F.linear's own result under autograd,
    for other dtypes and for more rows on other hosts."""
    monkeypatch.setattr(linear_mod, "host_has_avx512", lambda: avx512)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(GEMV_ROWS + 3, 24, generator=g)
    layer = Linear(24, 40)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
        assert fp32_on_kernel(x[:1], layer.weight, layer.bias) and fp32_on_kernel(x[:GEMV_ROWS], w, b)
        y = layer(x[:GEMV_ROWS])
        assert torch.equal(y, linear(x[:GEMV_ROWS], w, b))
        assert torch.equal(fp32_linear(x[:1], w, b), y[:1])  # same bits per row at any row count
        assert (y.double() - linear_ref(x[:GEMV_ROWS], w, b)).abs().max().item() < 1e-5
        assert fp32_on_kernel(x, w, b) == avx512
        big = layer(x)
        assert torch.equal(big, linear(x, w, b) if avx512 else torch.nn.functional.linear(x, w, b))
        if avx512:
            assert torch.equal(big[:GEMV_ROWS], y)
        assert not fp32_on_kernel(x[:1].bfloat16(), w.bfloat16())
        assert not fp32_on_kernel(x[:0], w)
    assert not fp32_on_kernel(x[:1], layer.weight, layer.bias)  # grad mode, parameters that need gradients
    out = layer(x[:1])
    assert out.requires_grad and torch.equal(out, torch.nn.functional.linear(x[:1], w, b))
