"""linear: y = x · Wᵀ (+ bias) on TVM kernels, with fp32, bf16 or int8 weight-only weights.

Ops (namespace ``tvm_mamba``): ``linear_fwd`` (x: (rows, in_features), weight: (out_features,
in_features), scale: (out_features,) float32 for an int8 weight, bias: (out_features,) float32) and
``linear_bwd`` (the input gradient dx = dy · (scale ⊙ W)); both have fake implementations, and the forward
has autograd registered.

Gradients: only the input's. The op serves frozen low-precision weights (``quantize_weights`` for
inference): int8 codes and bf16 weights are not trained, so there is no weight, scale or bias gradient, and
:func:`linear` refuses such a tensor that requires grad (a ValueError, not a silently missing gradient).
fp32 training keeps ``torch.nn.Linear``. Saved for backward: the weight and scale themselves (no copy).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compute.linear import LinearDims
from ..runtime.target import host_has_avx512
from ._dlpack import (TORCH_TO_TVM, check_shape, check_size, check_tensor, dummy, eager_direct, kernel_for,
                      kernel_device_type, prepare, run_op)

OP = "linear"
X_DTYPES = (torch.float32, torch.bfloat16)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


@functools.lru_cache(maxsize=4096)
def _parts(K: int, N: int, has_bias: bool, x_dtype: torch.dtype, w_dtype: torch.dtype):
    """(dtypes, static) of a call's LinearDims (memoized: decode calls the same few layers every step)."""
    static, dtypes = LinearDims(K, N, has_bias, TORCH_TO_TVM[x_dtype], TORCH_TO_TVM[w_dtype]).key_parts()
    return dtypes, static


def _opt(t: Optional[Tensor], like: Tensor) -> Tensor:
    """The kernel argument of an optional float32 vector: the tensor, or the (1,) placeholder of an absent one."""
    return prepare(t) if t is not None else dummy(like.device, torch.float32, 1)


@torch.library.custom_op("tvm_mamba::linear_fwd", mutates_args=())
def linear_fwd(x: Tensor, weight: Tensor, scale: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """x: (rows, in_features) -> y: (rows, out_features) in x's dtype; y = (x · Wᵀ) * scale + bias."""
    rows, K = x.shape
    N = weight.shape[0]
    y = torch.empty((rows, N), device=x.device, dtype=x.dtype)
    if rows == 0:
        return y
    dtypes, static = _parts(K, N, bias is not None, x.dtype, weight.dtype)
    kern = kernel_for(OP, "fwd", x.device, dtypes, static, rows=rows)
    kern(prepare(x), prepare(weight), _opt(scale, x), _opt(bias, x), y)
    return y


@linear_fwd.register_fake
def _(x, weight, scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("tvm_mamba::linear_bwd", mutates_args=())
def linear_bwd(dy: Tensor, weight: Tensor, scale: Optional[Tensor]) -> Tensor:
    """dy: (rows, out_features) -> dx: (rows, in_features) in dy's dtype; dx = dy · (scale ⊙ W)."""
    rows, N = dy.shape
    K = weight.shape[1]
    dx = torch.empty((rows, K), device=dy.device, dtype=dy.dtype)
    if rows == 0:
        return dx
    dtypes, static = _parts(K, N, False, dy.dtype, weight.dtype)
    kern = kernel_for(OP, "bwd", dy.device, dtypes, static, rows=rows)
    kern(prepare(dy), prepare(weight), _opt(scale, dy), dx)
    return dx


@linear_bwd.register_fake
def _(dy, weight, scale):
    return dy.new_empty((dy.shape[0], weight.shape[1]))


def _setup_context(ctx, inputs, output):
    _, weight, scale, _ = inputs
    ctx.save_for_backward(weight, scale)


def _backward(ctx, dy):
    weight, scale = ctx.saved_tensors
    return torch.ops.tvm_mamba.linear_bwd(dy.contiguous(), weight, scale), None, None, None


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_args(x, weight, bias, scale) -> None:
    check_tensor("x", x, dtypes=X_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=WEIGHT_DTYPES, device=x.device)
    if x.dim() < 1:
        raise ValueError("x: expected (..., in_features), got a 0-dim tensor")
    N, K = weight.shape
    if K == 0 or N == 0:
        raise ValueError(f"weight: expected (out_features, in_features) with both >= 1, got {tuple(weight.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"x: last dim must be in_features = weight.shape[1] = {K}, got shape {tuple(x.shape)}")
    if weight.dtype == torch.int8:
        if scale is None:
            raise ValueError("scale: an int8 weight needs its per-output-channel scales (out_features,) float32")
        check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,), device=x.device)
        check_shape("scale", scale, (N,))
    elif scale is not None:
        raise ValueError(f"scale: only an int8 weight takes a scale, got a {str(weight.dtype)[6:]} weight")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(torch.float32, x.dtype), device=x.device)
        check_shape("bias", bias, (N,))
    if torch.is_grad_enabled():
        for name, t in (("weight", weight), ("scale", scale), ("bias", bias)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name}: requires grad, but linear has no weight / scale / bias gradient (frozen "
                                 f"low-precision weights for inference); detach it, or train with torch.nn.Linear")
    check_size("out", x.numel() // K * N)


def linear(x, weight, bias=None, scale=None):
    """y = x · (scale ⊙ W)ᵀ + bias with weight-only low-precision weights (float32 accumulation).

    x: (..., in_features) float32 / bfloat16; weight: (out_features, in_features) float32, bfloat16 or int8;
    scale: (out_features,) float32, required with an int8 weight (y[.., n] = scale[n] * sum_k x[.., k] *
    weight[n, k]) and refused otherwise; bias: (out_features,) float32 or x's dtype, or None.
    Returns y: (..., out_features) in x's dtype. Differentiable in x only (dx = dy · (scale ⊙ W)); weight,
    scale and bias must not require grad.
    """
    _check_args(x, weight, bias, scale)
    K, N = weight.shape[1], weight.shape[0]
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.to(torch.float32)
    y = run_op(linear_fwd, x.reshape(-1, K), weight, scale, bias)
    return y.reshape(*x.shape[:-1], N)


GEMV_ROWS = 8  # fp32 inference calls of up to this many rows (decode: one per sequence) take the GEMV kernel


def fp32_on_kernel(x, weight, bias=None) -> bool:
    """Whether :func:`fp32_linear` runs ``F.linear(x, weight, bias)`` on the linear op: float32 x (rows of
    in_features), weight and bias on a CPU device served by the CPU kernels (not ``simulate_cuda``), eager mode,
    no gradient needed, and either at most GEMV_ROWS rows (decode: the GEMV kernel reads the weight at the
    core's streaming speed, faster than torch's batch-1 GEMV) or a host with AVX-512 (prefill: the kernel's
    16-lane row tiles outran torch's fp32 GEMM there; on AVX2 they only matched it, so larger matmuls keep
    F.linear; docs/linear.md). A row gets the same bits at any row count, so a
    prompt's projections equal its decode steps'. Autograd and tracing keep F.linear."""
    if not (x.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)):
        return False
    if not eager_direct(x):  # first: tracing (torch.compile) must not reach the host query below
        return False
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.device != weight.device:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if not (rows >= 1 and x.device.type == "cpu" and kernel_device_type(x.device) == "cpu"):
        return False
    if rows > GEMV_ROWS and not host_has_avx512():
        return False
    params = [t for t in (weight, bias) if t is not None]  # nn.Parameter or plain tensors
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in params):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in params))


def fp32_linear(x, weight, bias=None):
    """F.linear(x, weight, bias) for an fp32 layer at inference, on the linear op where :func:`fp32_on_kernel`
    says so (the modules' projections, the decode plans and the blocks' step paths call this one function, so
    all give the same bits). x: (..., in_features), weight: (out_features, in_features), bias: (out_features,)
    -> (..., out_features)."""
    if fp32_on_kernel(x, weight, bias):
        return linear(x, weight, bias)
    return F.linear(x, weight, bias)


def fp32_linear_if(infer: bool):
    """:func:`fp32_linear` for a call that needs no gradient, else ``F.linear``: for code inside an autograd
    Function's forward, where grad mode is off either way and the caller decided ``infer`` beforehand."""
    return fp32_linear if infer else F.linear


def quantize_weight(weight, dtype: str = "int8"):
    """weight: (out_features, in_features) float -> (stored weight, scale or None), for :func:`linear`.

    "int8": per output channel scale[n] = max_k |w[n, k]| / 127 (1 for an all-zero row) and codes =
    clamp(round(w / scale), -127, 127), round half to even (computed in float64; scale stored float32 and
    the codes rounded against the float32 scale actually stored, so |codes * scale - w| <= scale / 2);
    "bfloat16": w rounded to the nearest bf16; "float32": a float32 copy.
    """
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    if dtype not in ("int8", "bfloat16", "float32"):
        raise ValueError(f"dtype: expected 'int8', 'bfloat16' or 'float32', got {dtype!r}")
    w = weight.detach()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight: contains NaN or Inf; it cannot be quantized")
    if dtype == "bfloat16":
        return w.to(torch.float32).to(torch.bfloat16).contiguous(), None
    if dtype == "float32":
        return w.to(torch.float32).contiguous(), None
    w64 = w.to(torch.float64)
    amax = w64.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.float32)
    codes = torch.clamp(torch.round(w64 / scale.double()[:, None]), -127, 127).to(torch.int8)
    return codes.contiguous(), scale
