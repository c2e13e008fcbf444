"""rmsnorm_fn: mamba_ssm 2.3.x's gated RMSNorm (``ops/triton/layernorm_gated.py``) on TVM kernels.

Ops (namespace ``tvm_mamba``): ``rmsnorm_gated_fwd`` and ``rmsnorm_gated_bwd`` over (rows, hidden); each
has a fake implementation, and the forward has autograd registered. The public :func:`rmsnorm_fn`
flattens leading dims of any rank into rows.

Backward memory: the forward saves its inputs (x, weight, bias, z) and the per-row/group inverse RMS
(float32, rows * hidden/group_size * 4 bytes: 1/group_size of an fp32 copy of x) so the backward does not
redo the reduction over x. The weight/bias gradients use a float32 workspace of (nparts, 2, hidden),
nparts = min(rows, 64) (a function of the row count only: the same input gives the same bits on any
machine), summed part by part in a fixed order: deterministic, no atomics.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._dlpack import FLOATS, check_shape, check_tensor, dummy, kernel_for, prepare, run_op, tvm_dtype

OP = "rmsnorm_gated"
MAX_PARTS = 64


def _static(x: Tensor, bias, z, eps: float, group_size: int, norm_before_gate: bool) -> dict:
    return dict(hidden=x.shape[1], group_size=group_size, eps=float(eps), has_bias=bias is not None,
                has_z=z is not None, norm_before_gate=bool(norm_before_gate) if z is not None else True)


def _dtypes(x: Tensor, weight: Tensor) -> dict:
    return {"x": tvm_dtype(x), "weight": tvm_dtype(weight)}


def _opt(t: Optional[Tensor], like: Tensor, dtype, ndim: int) -> Tensor:
    return prepare(t.to(dtype)) if t is not None else dummy(like.device, dtype, ndim)


@torch.library.custom_op("tvm_mamba::rmsnorm_gated_fwd", mutates_args=())
def rmsnorm_gated_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor], eps: float,
                      group_size: int, norm_before_gate: bool) -> tuple[Tensor, Tensor]:
    """x, z: (rows, hidden) -> out: (rows, hidden) in x's dtype, rstd: (rows, hidden/group_size) float32."""
    rows, hidden = x.shape
    x, weight = prepare(x), prepare(weight)
    out = torch.empty_like(x)
    rstd = torch.empty((rows, hidden // group_size), device=x.device, dtype=torch.float32)
    if rows == 0:
        return out, rstd
    kern = kernel_for(OP, "fwd", x.device, _dtypes(x, weight),
                      _static(x, bias, z, eps, group_size, norm_before_gate), rows=rows)
    kern(x, weight, _opt(bias, x, weight.dtype, 1), _opt(z, x, x.dtype, 2), out, rstd)
    return out, rstd


@rmsnorm_gated_fwd.register_fake
def _(x, weight, bias, z, eps, group_size, norm_before_gate):
    rows, hidden = x.shape
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((rows, hidden // group_size), dtype=torch.float32))


@torch.library.custom_op("tvm_mamba::rmsnorm_gated_bwd", mutates_args=())
def rmsnorm_gated_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor], dout: Tensor,
                      rstd: Tensor, eps: float, group_size: int,
                      norm_before_gate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, dz or (0,), dweight, dbias or (0,)) of rmsnorm_gated_fwd, from the saved rstd."""
    rows, hidden = x.shape
    x, weight, dout, rstd = prepare(x), prepare(weight), prepare(dout.to(x.dtype)), prepare(rstd)
    dx = torch.empty_like(x)
    dz = torch.empty_like(x) if z is not None else x.new_empty((0,))
    dweight = torch.zeros_like(weight)
    dbias = torch.zeros_like(weight) if bias is not None else weight.new_empty((0,))
    if rows == 0:
        return dx, dz, dweight, dbias
    nparts = min(rows, MAX_PARTS)
    partial = torch.empty((nparts, 2, hidden), device=x.device, dtype=torch.float32)
    kern = kernel_for(OP, "bwd", x.device, _dtypes(x, weight),
                      _static(x, bias, z, eps, group_size, norm_before_gate), rows=rows)
    kern(x, weight, _opt(bias, x, weight.dtype, 1), _opt(z, x, x.dtype, 2), dout, rstd, dx,
         dz if z is not None else dummy(x.device, x.dtype, 2), dweight,
         dbias if bias is not None else dummy(x.device, weight.dtype, 1), partial)
    return dx, dz, dweight, dbias


@rmsnorm_gated_bwd.register_fake
def _(x, weight, bias, z, dout, rstd, eps, group_size, norm_before_gate):
    dz = torch.empty_like(x, memory_format=torch.contiguous_format) if z is not None else x.new_empty((0,))
    dbias = torch.empty_like(weight) if bias is not None else weight.new_empty((0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), dz, torch.empty_like(weight), dbias


def _setup_context(ctx, inputs, output):
    x, weight, bias, z, eps, group_size, norm_before_gate = inputs
    ctx.save_for_backward(x, weight, bias, z, output[1])
    ctx.args = (eps, group_size, norm_before_gate)


def _backward(ctx, dout, _drstd):
    x, weight, bias, z, rstd = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(x)
    dx, dz, dweight, dbias = torch.ops.tvm_mamba.rmsnorm_gated_bwd(x, weight, bias, z, dout, rstd, *ctx.args)
    return (dx, dweight, dbias if bias is not None else None, dz if z is not None else None, None, None, None)


rmsnorm_gated_fwd.register_autograd(_backward, setup_context=_setup_context)


def rmsnorm_fn(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm (mamba_ssm 2.3.x ``rmsnorm_fn``).

    x: (..., hidden) float32/float16/bfloat16, any number of leading dims; weight, bias: (hidden,) float32
    or x's dtype; z: (..., hidden) like x; group_size divides hidden (None = hidden).
    Returns out: (..., hidden) in x's dtype (math in float32):
    norm_before_gate: out = x / rms_g(x) * weight (+ bias) * silu(z); else out = u / rms_g(u) * weight
    (+ bias) with u = x * silu(z); rms_g is the root mean square over each group of group_size features.
    """
    check_tensor("x", x, dtypes=FLOATS)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected (..., hidden) with hidden >= 1, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=(torch.float32, x.dtype), device=x.device)
    check_shape("weight", weight, (hidden,))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(weight.dtype,), device=x.device)
        check_shape("bias", bias, (hidden,))
    if z is not None:
        check_tensor("z", z, dtypes=(x.dtype,), device=x.device)
        check_shape("z", z, tuple(x.shape))
    if group_size is None:
        group_size = hidden
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size: expected an int or None, got {type(group_size).__name__}")
    if group_size < 1 or hidden % group_size:
        raise ValueError(f"group_size: must divide hidden={hidden}, got {group_size}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    shape = x.shape
    x2 = x.reshape(-1, hidden)
    z2 = z.reshape(-1, hidden) if z is not None else None
    out, _ = run_op(rmsnorm_gated_fwd, x2, weight, bias, z2, float(eps), int(group_size), bool(norm_before_gate))
    return out.reshape(shape)
