"""layernorm_fn / rmsnorm_fn: mamba_ssm 2.3.x's gated group norm (``ops/triton/layernorm_gated.py``) on TVM
kernels, and the custom ops that layer_norm.py's fused residual-add norm (torch_ops/layer_norm.py) shares.

Ops (namespace ``tvm_mamba``): ``rmsnorm_gated_fwd`` and ``rmsnorm_gated_bwd`` over (rows, hidden); each
has a fake implementation, and the forward has autograd registered. The public functions flatten leading
dims of any rank into rows.

Backward memory: the forward saves its inputs (x, weight, bias, z; with a residual the stored residual_out
instead of x, as upstream) and the per-row/group statistics (float32 rstd, and mean for LayerNorm: rows *
hidden/group_size * 4 bytes each, 1/group_size of an fp32 copy of x) so the backward does not redo the
reductions over x. The weight/bias gradients use a float32 workspace of (nparts, 2, hidden),
nparts = min(rows, 64) (a function of the row count only: the same input gives the same bits on any
machine), summed part by part in a fixed order: deterministic, no atomics.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute.rmsnorm_gated import NormDims
from ._dlpack import (FLOATS, TORCH_TO_TVM, check_shape, check_tensor, dummy, kernel_for, prepare, run_op,
                      tvm_dtype)

OP = "rmsnorm_gated"
MAX_PARTS = 64


def _dims(x: Tensor, bias, z, eps: float, group_size: int, norm_before_gate: bool, is_rms_norm: bool,
          **flags) -> NormDims:
    return NormDims(x.shape[1], group_size, float(eps), bias is not None, z is not None,
                    bool(norm_before_gate) if z is not None else True, bool(is_rms_norm), **flags)


def _opt(t: Optional[Tensor], like: Tensor, dtype, ndim: int) -> Tensor:
    return prepare(t.to(dtype)) if t is not None else dummy(like.device, dtype, ndim)


def residual_dtype(x: Tensor, residual: Optional[Tensor], residual_in_fp32: bool) -> torch.dtype:
    """residual_out's dtype (upstream layer_norm.py): residual's if given, else float32 with
    residual_in_fp32, else x's."""
    return residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)


@torch.library.custom_op("tvm_mamba::rmsnorm_gated_fwd", mutates_args=())
def rmsnorm_gated_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor],
                      residual: Optional[Tensor], rowscale: Optional[Tensor], seeds: Optional[Tensor],
                      eps: float, group_size: int, norm_before_gate: bool, is_rms_norm: bool,
                      residual_in_fp32: bool, dropout_p: float,
                      return_dropout_mask: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x, z, residual: (rows, hidden), rowscale: (rows,) float32, seeds: (rows,) int32 (dropout_p > 0) ->
    out: (rows, hidden) in x's dtype; residual_out: (rows, hidden) (s = dropout(x (* rowscale)) + residual, in
    :func:`residual_dtype`; (0,) when it would be x itself); dropout_mask: (rows, hidden) uint8 keep mask
    (return_dropout_mask, else (0,)); mean: (rows, ngroups) float32
    ((0,) for RMSNorm); rstd: (rows, hidden/group_size) float32."""
    rows, hidden = x.shape
    x, weight = prepare(x), prepare(weight)
    rdt = residual_dtype(x, residual, residual_in_fp32)
    store = residual is not None or rdt != x.dtype or rowscale is not None or dropout_p > 0
    store_mask = return_dropout_mask and dropout_p > 0
    out = torch.empty_like(x)
    mask = torch.empty_like(x, dtype=torch.uint8) if store_mask else x.new_empty((0,), dtype=torch.uint8)
    rout = torch.empty_like(x, dtype=rdt) if store else x.new_empty((0,))
    ngroups = hidden // group_size
    mean = x.new_empty((0,), dtype=torch.float32) if is_rms_norm else \
        torch.empty((rows, ngroups), device=x.device, dtype=torch.float32)
    rstd = torch.empty((rows, ngroups), device=x.device, dtype=torch.float32)
    if rows == 0:
        return out, rout, mask, mean, rstd
    d = _dims(x, bias, z, eps, group_size, norm_before_gate, is_rms_norm, has_residual=residual is not None,
              store_residual=store, has_rowscale=rowscale is not None, dropout_p=float(dropout_p),
              store_dropout_mask=store_mask)
    dtypes = {"x": tvm_dtype(x), "weight": tvm_dtype(weight)}
    if residual is not None and residual.dtype != x.dtype:
        dtypes["residual"] = tvm_dtype(residual)
    if rdt != x.dtype:
        dtypes["residual_out"] = TORCH_TO_TVM[rdt]
    kern = kernel_for(OP, "fwd", x.device, dtypes, d.static(), rows=rows)
    f32 = torch.float32
    kern(x, weight, _opt(bias, x, weight.dtype, 1), _opt(z, x, x.dtype, 2),
         prepare(residual) if residual is not None else dummy(x.device, x.dtype, 2),
         _opt(rowscale, x, torch.float32, 1), _opt(seeds, x, torch.int32, 1), out,
         rout if store else dummy(x.device, rdt, 2), mask if store_mask else dummy(x.device, torch.uint8, 2),
         dummy(x.device, f32, 2) if is_rms_norm else mean, rstd)
    return out, rout, mask, mean, rstd


@rmsnorm_gated_fwd.register_fake
def _(x, weight, bias, z, residual, rowscale, seeds, eps, group_size, norm_before_gate, is_rms_norm,
      residual_in_fp32, dropout_p, return_dropout_mask):
    rows, hidden = x.shape
    rdt = residual_dtype(x, residual, residual_in_fp32)
    store = residual is not None or rdt != x.dtype or rowscale is not None or dropout_p > 0
    store_mask = return_dropout_mask and dropout_p > 0
    stats = x.new_empty((rows, hidden // group_size), dtype=torch.float32)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((rows, hidden), dtype=rdt) if store else x.new_empty((0,)),
            x.new_empty((rows, hidden) if store_mask else (0,), dtype=torch.uint8),
            x.new_empty((0,), dtype=torch.float32) if is_rms_norm else torch.empty_like(stats), stats)


@torch.library.custom_op("tvm_mamba::rmsnorm_gated_bwd", mutates_args=())
def rmsnorm_gated_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor], dout: Tensor,
                      mean: Tensor, rstd: Tensor, dresidual: Optional[Tensor], rowscale: Optional[Tensor],
                      seeds: Optional[Tensor], eps: float, group_size: int, norm_before_gate: bool,
                      is_rms_norm: bool, has_residual: bool,
                      dropout_p: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, dz or (0,), dweight, dbias or (0,), dresidual_in or (0,)) of rmsnorm_gated_fwd from the
    saved statistics. x: the forward's s (residual_out when it was stored); dout: in the forward's x dtype,
    which dx and dz get; dresidual: the gradient of residual_out, added to d s; dx = dropout(d s) (*
    rowscale), the forward's mask recomputed from seeds;
    dresidual_in: d s in x's dtype, written only when has_residual and it differs from dx (another dtype, or a
    rowscale; else the caller reuses dx)."""
    rows, hidden = x.shape
    x, weight, dout, rstd = prepare(x), prepare(weight), prepare(dout), prepare(rstd)
    store_dres = has_residual and (dout.dtype != x.dtype or rowscale is not None or dropout_p > 0)
    dx = torch.empty_like(dout)
    dz = torch.empty_like(dout) if z is not None else x.new_empty((0,))
    dweight = torch.zeros_like(weight)
    dbias = torch.zeros_like(weight) if bias is not None else weight.new_empty((0,))
    dres_in = torch.empty_like(x) if store_dres else x.new_empty((0,))
    if rows == 0:
        return dx, dz, dweight, dbias, dres_in
    nparts = min(rows, MAX_PARTS)
    partial = torch.empty((nparts, 2, hidden), device=x.device, dtype=torch.float32)
    d = _dims(x, bias, z, eps, group_size, norm_before_gate, is_rms_norm, has_dresidual=dresidual is not None,
              store_dresidual=store_dres, has_rowscale=rowscale is not None, dropout_p=float(dropout_p))
    dtypes = {"x": tvm_dtype(x), "weight": tvm_dtype(weight)}
    if dout.dtype != x.dtype:
        dtypes["dout"] = tvm_dtype(dout)
    kern = kernel_for(OP, "bwd", x.device, dtypes, d.static(), rows=rows)
    f32 = torch.float32
    kern(x, weight, _opt(bias, x, weight.dtype, 1), _opt(z, x, dout.dtype, 2), dout,
         dummy(x.device, f32, 2) if is_rms_norm else prepare(mean), rstd, _opt(dresidual, x, x.dtype, 2),
         _opt(rowscale, x, torch.float32, 1), _opt(seeds, x, torch.int32, 1), dx,
         dz if z is not None else dummy(x.device, dout.dtype, 2), dweight,
         dbias if bias is not None else dummy(x.device, weight.dtype, 1),
         dres_in if store_dres else dummy(x.device, x.dtype, 2), partial)
    return dx, dz, dweight, dbias, dres_in


@rmsnorm_gated_bwd.register_fake
def _(x, weight, bias, z, dout, mean, rstd, dresidual, rowscale, seeds, eps, group_size, norm_before_gate,
      is_rms_norm, has_residual, dropout_p):
    like = torch.empty_like(dout, memory_format=torch.contiguous_format)
    dz = torch.empty_like(like) if z is not None else x.new_empty((0,))
    dbias = torch.empty_like(weight) if bias is not None else weight.new_empty((0,))
    store_dres = has_residual and (dout.dtype != x.dtype or rowscale is not None or dropout_p > 0)
    dres_in = torch.empty_like(x, memory_format=torch.contiguous_format) if store_dres else x.new_empty((0,))
    return like, dz, torch.empty_like(weight), dbias, dres_in


def _setup_context(ctx, inputs, output):
    (x, weight, bias, z, residual, rowscale, seeds, eps, group_size, norm_before_gate, is_rms_norm,
     residual_in_fp32, dropout_p, _) = inputs
    out, rout, _, mean, rstd = output
    stored = rout.dim() == 2
    ctx.save_for_backward(rout if stored else x, weight, bias, z, mean, rstd, rowscale, seeds)
    ctx.dropout_p = dropout_p
    ctx.stored = stored
    ctx.x_dtype = x.dtype
    ctx.has_residual = residual is not None
    ctx.args = (eps, group_size, norm_before_gate, is_rms_norm)


def _backward(ctx, dout, drout, _dmask, _dmean, _drstd):
    x, weight, bias, z, mean, rstd, rowscale, seeds = ctx.saved_tensors
    dout = torch.zeros_like(x, dtype=ctx.x_dtype) if dout is None else dout.to(ctx.x_dtype)
    dres = drout if ctx.stored else None
    dx, dz, dweight, dbias, dres_in = torch.ops.tvm_mamba.rmsnorm_gated_bwd(
        x, weight, bias, z, dout, mean, rstd, dres, rowscale, seeds, *ctx.args, ctx.has_residual, ctx.dropout_p)
    dresidual = (dres_in if dres_in.dim() == 2 else dx) if ctx.has_residual else None
    return (dx, dweight, dbias if bias is not None else None, dz if z is not None else None, dresidual,
            None, None, None, None, None, None, None, None, None)


rmsnorm_gated_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_norm_args(x, weight, bias, eps) -> int:
    """Validate x: (..., hidden), weight / bias: (hidden,) and eps (names the argument); returns hidden."""
    check_tensor("x", x, dtypes=FLOATS)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected (..., hidden) with hidden >= 1, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=(torch.float32, x.dtype), device=x.device)
    check_shape("weight", weight, (hidden,))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(weight.dtype,), device=x.device)
        check_shape("bias", bias, (hidden,))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    return hidden


def layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """Gated group LayerNorm / RMSNorm (mamba_ssm 2.3.x ``layernorm_gated.layernorm_fn``).

    x: (..., hidden) float32/float16/bfloat16, any number of leading dims; weight, bias: (hidden,) float32
    or x's dtype (bias may be None); z: (..., hidden) like x; group_size divides hidden (None = hidden).
    Returns out: (..., hidden) in x's dtype (math in float32, the reductions over x in float64):
    norm_before_gate: out = norm_g(x) * weight (+ bias) * silu(z); else out = norm_g(u) * weight (+ bias)
    with u = x * silu(z); norm_g(v) = (v - mean_g(v)) / sqrt(var_g(v) + eps) over each group of group_size
    features (mean_g = 0 when is_rms_norm: v / rms_g(v)).
    """
    hidden = check_norm_args(x, weight, bias, eps)
    if z is not None:
        check_tensor("z", z, dtypes=(x.dtype,), device=x.device)
        check_shape("z", z, tuple(x.shape))
    if group_size is None:
        group_size = hidden
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size: expected an int or None, got {type(group_size).__name__}")
    if group_size < 1 or hidden % group_size:
        raise ValueError(f"group_size: must divide hidden={hidden}, got {group_size}")
    shape = x.shape
    x2 = x.reshape(-1, hidden)
    z2 = z.reshape(-1, hidden) if z is not None else None
    out = run_op(rmsnorm_gated_fwd, x2, weight, bias, z2, None, None, None, float(eps), int(group_size),
                 bool(norm_before_gate), bool(is_rms_norm), False, 0.0, False)[0]
    return out.reshape(shape)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm (mamba_ssm 2.3.x ``layernorm_gated.rmsnorm_fn``): :func:`layernorm_fn` with
    is_rms_norm=True.

    x: (..., hidden); weight, bias: (hidden,) (bias may be None); z: (..., hidden) like x.
    norm_before_gate: out = x / rms_g(x) * weight (+ bias) * silu(z); else out = u / rms_g(u) * weight
    (+ bias) with u = x * silu(z); rms_g is the root mean square over each group of group_size features.
    """
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, True)
