"""layernorm_fn / rmsnorm_fn: mamba_ssm 2.3.x's gated group norm (``ops/triton/layernorm_gated.py``) on TVM
kernels, and the custom ops that layer_norm.py's fused residual-add norm (torch_ops/layer_norm.py) shares.

Ops (namespace ``tvm_mamba``): ``rmsnorm_gated_fwd`` and ``rmsnorm_gated_bwd`` over (rows, hidden); each
has a fake implementation, and the forward has autograd registered. The public functions flatten leading
dims of any rank into rows.

Backward memory: the forward saves its inputs (x, weight, bias, z; with a residual the stored residual_out
instead of x, as upstream) and the per-row/group statistics (float32 rstd, and mean for LayerNorm: rows *
hidden/group_size * 4 bytes each, 1/group_size of an fp32 copy of x) so the backward does not redo the
reductions over x. The weight/bias gradients use a float32 workspace of (nparts, 2, hidden),
nparts = ceil(rows / 32) (compute.rmsnorm_gated.PART_ROWS: a function of the row count only, so the same
input gives the same bits on any machine), summed part by part in a fixed order: deterministic, no atomics.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute.rmsnorm_gated import PART_ROWS, RMSNormGatedBwd, RMSNormGatedFwd
from ._dlpack import (FLOATS, TORCH_TO_TVM, check_shape, check_tensor, dummy, kernel_for, prepare, run_op,
                      tvm_dtype)

OP = "rmsnorm_gated"


def _dims(cls, x: Tensor, weight: Tensor, bias, z, eps: float, group_size: int, norm_before_gate: bool,
          is_rms_norm: bool, **flags):
    """The kernel's typed dims (``cls``: RMSNormGatedFwd / RMSNormGatedBwd); ``flags``: the direction's own
    flags, and its extra dtypes where they differ from x's (None keeps them out of the key)."""
    return cls.cached(x.shape[1], group_size, float(eps), bias is not None, z is not None,
                      bool(norm_before_gate) if z is not None else True, bool(is_rms_norm), x_dtype=tvm_dtype(x),
                      weight_dtype=tvm_dtype(weight), **flags)


def _opt(t: Optional[Tensor], like: Tensor, dtype, ndim: int) -> Tensor:
    return prepare(t.to(dtype)) if t is not None else dummy(like.device, dtype, ndim)


def residual_dtype(x: Tensor, residual: Optional[Tensor], residual_in_fp32: bool) -> torch.dtype:
    """residual_out's dtype (upstream layer_norm.py): residual's if given, else float32 with
    residual_in_fp32, else x's."""
    return residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)


def _fwd_plan(x, residual, rowscale, x1, residual_in_fp32, dropout_p, return_dropout_mask):
    """(residual_out dtype, store residual_out, store the dropout masks): upstream stores residual_out when it
    differs from x (a residual, another dtype, rowscale, dropout or x1)."""
    rdt = residual_dtype(x, residual, residual_in_fp32)
    store = residual is not None or rdt != x.dtype or rowscale is not None or dropout_p > 0 or x1 is not None
    return rdt, store, bool(return_dropout_mask and dropout_p > 0)


def _empty(like: Tensor, on: bool, dtype=None, shape=None) -> Tensor:
    """An output of like's shape (or ``shape``) when ``on``, else the (0,) stand-in of an absent output."""
    dtype = like.dtype if dtype is None else dtype
    if not on:
        return like.new_empty((0,), dtype=dtype)
    return like.new_empty(tuple(like.shape) if shape is None else shape, dtype=dtype)


@torch.library.custom_op("tvm_mamba::rmsnorm_gated_fwd", mutates_args=())
def rmsnorm_gated_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor],
                      residual: Optional[Tensor], rowscale: Optional[Tensor], seeds: Optional[Tensor],
                      x1: Optional[Tensor], weight1: Optional[Tensor], bias1: Optional[Tensor],
                      seeds1: Optional[Tensor], eps: float, group_size: int, norm_before_gate: bool,
                      is_rms_norm: bool, residual_in_fp32: bool, dropout_p: float,
                      return_dropout_mask: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x, z, residual, x1: (rows, hidden), rowscale: (rows,) float32, seeds, seeds1: (rows,) int32 (dropout_p
    > 0) -> out: (rows, hidden) in x's dtype; residual_out: (rows, hidden) (s = dropout(x (* rowscale)) (+
    dropout(x1)) + residual, in :func:`residual_dtype`; (0,) when it would be x itself); dropout_mask: (rows,
    hidden) uint8 keep mask (return_dropout_mask, else (0,)); out1: xhat * weight1 (+ bias1) ((0,) without
    weight1); dropout_mask1: x1's mask; mean: (rows, ngroups) float32 ((0,) for RMSNorm); rstd: (rows,
    hidden/group_size) float32."""
    rows, hidden = x.shape
    x, weight = prepare(x), prepare(weight)
    rdt, store, store_mask = _fwd_plan(x, residual, rowscale, x1, residual_in_fp32, dropout_p, return_dropout_mask)
    stats = (rows, hidden // group_size)
    out, rout, out1 = torch.empty_like(x), _empty(x, store, rdt), _empty(x, weight1 is not None)
    mask, mask1 = _empty(x, store_mask, torch.uint8), _empty(x, store_mask and x1 is not None, torch.uint8)
    mean, rstd = _empty(x, not is_rms_norm, torch.float32, stats), _empty(x, True, torch.float32, stats)
    if rows == 0:
        return out, rout, mask, out1, mask1, mean, rstd
    d = _dims(RMSNormGatedFwd, x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm,
              has_residual=residual is not None, store_residual=store, has_rowscale=rowscale is not None,
              dropout_p=float(dropout_p), store_dropout_mask=store_mask, has_x1=x1 is not None,
              has_weight1=weight1 is not None, has_bias1=weight1 is not None and bias1 is not None,
              residual_dtype=tvm_dtype(residual) if residual is not None and residual.dtype != x.dtype else None,
              residual_out_dtype=TORCH_TO_TVM[rdt] if rdt != x.dtype else None)
    kern = kernel_for(OP, "fwd", x.device, d, rows=rows)
    f32, i32, u8, wdt = torch.float32, torch.int32, torch.uint8, weight.dtype
    kern(x, weight, _opt(bias, x, wdt, 1), _opt(z, x, x.dtype, 2), _opt(residual, x, rdt if residual is not None
                                                                       else x.dtype, 2),
         _opt(rowscale, x, f32, 1), _opt(seeds, x, i32, 1), _opt(x1, x, x.dtype, 2), _opt(weight1, x, wdt, 1),
         _opt(bias1 if weight1 is not None else None, x, wdt, 1), _opt(seeds1, x, i32, 1),
         out, _out(rout, store, x, rdt), _out(mask, store_mask, x, u8), _out(out1, weight1 is not None, x, x.dtype),
         _out(mask1, store_mask and x1 is not None, x, u8), _out(mean, not is_rms_norm, x, f32), rstd)
    return out, rout, mask, out1, mask1, mean, rstd


def _out(t: Tensor, on: bool, like: Tensor, dtype) -> Tensor:
    """The kernel's argument for an output: the tensor itself, or the (1, 1) placeholder of an absent one."""
    return t if on else dummy(like.device, dtype, 2)


@rmsnorm_gated_fwd.register_fake
def _(x, weight, bias, z, residual, rowscale, seeds, x1, weight1, bias1, seeds1, eps, group_size,
      norm_before_gate, is_rms_norm, residual_in_fp32, dropout_p, return_dropout_mask):
    rows, hidden = x.shape
    rdt, store, store_mask = _fwd_plan(x, residual, rowscale, x1, residual_in_fp32, dropout_p, return_dropout_mask)
    stats = (rows, hidden // group_size)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), _empty(x, store, rdt),
            _empty(x, store_mask, torch.uint8), _empty(x, weight1 is not None),
            _empty(x, store_mask and x1 is not None, torch.uint8), _empty(x, not is_rms_norm, torch.float32, stats),
            _empty(x, True, torch.float32, stats))


def _bwd_plan(x, dout, rowscale, has_residual, has_x1, dropout_p):
    """(store dresidual_in, store dx1): d residual needs its own output when it differs from dx (another
    dtype, rowscale, dropout or x1), dx1 when x1 was dropped out."""
    return (has_residual and (dout.dtype != x.dtype or rowscale is not None or dropout_p > 0 or has_x1),
            has_x1 and dropout_p > 0)


@torch.library.custom_op("tvm_mamba::rmsnorm_gated_bwd", mutates_args=())
def rmsnorm_gated_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor], dout: Tensor,
                      mean: Tensor, rstd: Tensor, dresidual: Optional[Tensor], rowscale: Optional[Tensor],
                      seeds: Optional[Tensor], weight1: Optional[Tensor], dout1: Optional[Tensor],
                      seeds1: Optional[Tensor], eps: float, group_size: int, norm_before_gate: bool,
                      is_rms_norm: bool, has_residual: bool, dropout_p: float, has_x1: bool,
                      has_bias1: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, dz, dweight, dbias, dresidual_in, dx1, dweight1, dbias1; (0,) where absent) of
    rmsnorm_gated_fwd from the saved statistics. x: the forward's s (residual_out when it was stored); dout,
    dout1: in the forward's x dtype, which dx, dz, dx1 get; dresidual: the gradient of residual_out, added to
    d s; dx = dropout(d s) (* rowscale), the forward's mask recomputed from seeds; dx1 = dropout1(d s), only
    with dropout (else the caller reuses dx); dresidual_in: d s in x's dtype, written only when it differs
    from dx (:func:`_bwd_plan`; else the caller reuses dx)."""
    rows, hidden = x.shape
    x, weight, dout, rstd = prepare(x), prepare(weight), prepare(dout), prepare(rstd)
    store_dres, store_dx1 = _bwd_plan(x, dout, rowscale, has_residual, has_x1, dropout_p)
    w1, b1 = weight1 is not None, weight1 is not None and has_bias1
    dx, dz, dres_in = torch.empty_like(dout), _empty(dout, z is not None), _empty(x, store_dres)
    dx1 = _empty(dout, store_dx1)
    dweight, dbias = torch.zeros_like(weight), _empty(weight, bias is not None).zero_()
    dweight1, dbias1 = _empty(weight, w1).zero_(), _empty(weight, b1).zero_()
    if rows == 0:
        return dx, dz, dweight, dbias, dres_in, dx1, dweight1, dbias1
    nparts = -(-rows // PART_ROWS)
    partial = torch.empty((nparts, 4 if w1 else 2, hidden), device=x.device, dtype=torch.float32)
    d = _dims(RMSNormGatedBwd, x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm,
              has_dresidual=dresidual is not None, store_dresidual=store_dres, has_rowscale=rowscale is not None,
              dropout_p=float(dropout_p), has_x1=has_x1, has_weight1=w1, has_bias1=b1,
              dout_dtype=tvm_dtype(dout) if dout.dtype != x.dtype else None)
    kern = kernel_for(OP, "bwd", x.device, d, rows=rows)
    f32, i32, wdt = torch.float32, torch.int32, weight.dtype
    kern(x, weight, _opt(bias, x, wdt, 1), _opt(z, x, dout.dtype, 2), dout, _out(prepare(mean), not is_rms_norm,
                                                                                 x, f32),
         rstd, _opt(dresidual, x, x.dtype, 2), _opt(rowscale, x, f32, 1), _opt(seeds, x, i32, 1),
         _opt(weight1, x, wdt, 1), _opt(dout1, x, dout.dtype, 2), _opt(seeds1, x, i32, 1), dx,
         _out(dz, z is not None, x, dout.dtype), dweight, _out1(dbias, bias is not None, x, wdt),
         _out(dres_in, store_dres, x, x.dtype), _out(dx1, store_dx1, x, dout.dtype), _out1(dweight1, w1, x, wdt),
         _out1(dbias1, b1, x, wdt), partial)
    return dx, dz, dweight, dbias, dres_in, dx1, dweight1, dbias1


def _out1(t: Tensor, on: bool, like: Tensor, dtype) -> Tensor:
    """:func:`_out` for a (hidden,) output (its placeholder is (1,))."""
    return t if on else dummy(like.device, dtype, 1)


@rmsnorm_gated_bwd.register_fake
def _(x, weight, bias, z, dout, mean, rstd, dresidual, rowscale, seeds, weight1, dout1, seeds1, eps, group_size,
      norm_before_gate, is_rms_norm, has_residual, dropout_p, has_x1, has_bias1):
    store_dres, store_dx1 = _bwd_plan(x, dout, rowscale, has_residual, has_x1, dropout_p)
    like = torch.empty_like(dout, memory_format=torch.contiguous_format)
    w1 = weight1 is not None
    return (like, _empty(dout, z is not None), torch.empty_like(weight), _empty(weight, bias is not None),
            _empty(x, store_dres), _empty(dout, store_dx1), _empty(weight, w1), _empty(weight, w1 and has_bias1))


def _setup_context(ctx, inputs, output):
    (x, weight, bias, z, residual, rowscale, seeds, x1, weight1, bias1, seeds1, eps, group_size, norm_before_gate,
     is_rms_norm, residual_in_fp32, dropout_p, _) = inputs
    out, rout, _, out1, _, mean, rstd = output
    stored = rout.dim() == 2
    ctx.save_for_backward(rout if stored else x, weight, bias, z, mean, rstd, rowscale, seeds, weight1, seeds1)
    ctx.stored, ctx.x_dtype, ctx.dropout_p = stored, x.dtype, dropout_p
    ctx.has_residual, ctx.has_x1, ctx.has_bias1 = residual is not None, x1 is not None, bias1 is not None
    ctx.args = (eps, group_size, norm_before_gate, is_rms_norm)


def _backward(ctx, dout, drout, _dmask, dout1, _dmask1, _dmean, _drstd):
    x, weight, bias, z, mean, rstd, rowscale, seeds, weight1, seeds1 = ctx.saved_tensors
    dout = torch.zeros_like(x, dtype=ctx.x_dtype) if dout is None else dout.to(ctx.x_dtype)
    if weight1 is not None:
        dout1 = torch.zeros_like(dout) if dout1 is None else dout1.to(ctx.x_dtype)
    dres = drout if ctx.stored else None
    dx, dz, dweight, dbias, dres_in, dx1, dweight1, dbias1 = torch.ops.tvm_mamba.rmsnorm_gated_bwd(
        x, weight, bias, z, dout, mean, rstd, dres, rowscale, seeds, weight1, dout1 if weight1 is not None else None,
        seeds1, *ctx.args, ctx.has_residual, ctx.dropout_p, ctx.has_x1, ctx.has_bias1)
    dresidual = (dres_in if dres_in.dim() == 2 else dx) if ctx.has_residual else None
    dx1 = (dx1 if dx1.dim() == 2 else dx) if ctx.has_x1 else None
    w1 = weight1 is not None
    return (dx, dweight, dbias if bias is not None else None, dz if z is not None else None, dresidual, None, None,
            dx1, dweight1 if w1 else None, dbias1 if w1 and ctx.has_bias1 else None, None, None, None, None, None,
            None, None, None)


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
    out = run_op(rmsnorm_gated_fwd, x2, weight, bias, z2, None, None, None, None, None, None, None, float(eps),
                 int(group_size), bool(norm_before_gate), bool(is_rms_norm), False, 0.0, False)[0]
    return out.reshape(shape)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm (mamba_ssm 2.3.x ``layernorm_gated.rmsnorm_fn``): :func:`layernorm_fn` with
    is_rms_norm=True.

    x: (..., hidden); weight, bias: (hidden,) (bias may be None); z: (..., hidden) like x.
    norm_before_gate: out = x / rms_g(x) * weight (+ bias) * silu(z); else out = u / rms_g(u) * weight
    (+ bias) with u = x * silu(z); rms_g is the root mean square over each group of group_size features.
    """
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, True)
