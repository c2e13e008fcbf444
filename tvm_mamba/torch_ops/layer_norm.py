"""layer_norm_fn / rms_norm_fn: mamba_ssm 2.3.x's fused residual-add norm (``ops/triton/layer_norm.py``), as
Block (fused_add_norm=True) and MixerModel's final norm call it, on the TVM norm kernels.

The kernels and custom ops are the gated norm's (``tvm_mamba::rmsnorm_gated_fwd/bwd``: one definition of the
norm math, with a static residual flag; compute/rmsnorm_gated/): one forward kernel adds the residual in
float32, writes residual_out and normalizes the unrounded sum; the backward recomputes xhat from the stored
residual_out (upstream's choice), adds the gradient of residual_out (prenorm) and writes d residual in
residual's dtype when it differs from x's.

Backward memory: residual_out (rows * hidden in residual_out's dtype; it is also the prenorm output, so no
extra copy), weight, bias (weight1) and the float32 statistics (rstd, and mean for LayerNorm: rows * 4 bytes
each), the int32 dropout seeds (4 bytes per row and input; the masks are recomputed, not saved) and rowscale.
"""
from __future__ import annotations

import torch

from ._dlpack import FLOATS, check_shape, check_tensor, run_op
from .rmsnorm_gated import check_norm_args, rmsnorm_gated_fwd


def _check_extras(x, weight, residual, x1, weight1, bias1, dropout_p, rowscale) -> None:
    """TypeError / ValueError naming the argument for a bad residual, x1, weight1, bias1, rowscale or
    dropout_p; checked before any kernel runs."""
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOATS, device=x.device)
        check_shape("residual", residual, tuple(x.shape))
    if x1 is not None:
        check_tensor("x1", x1, dtypes=(x.dtype,), device=x.device)
        check_shape("x1", x1, tuple(x.shape))
        if rowscale is not None:
            raise ValueError("rowscale: not supported together with x1 (the parallel norm), as upstream")
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1: given without weight1 (bias1 belongs to the second norm's weight1)")
    for name, t in (("weight1", weight1), ("bias1", bias1)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=(weight.dtype,), device=x.device)
            check_shape(name, t, tuple(weight.shape))
    if rowscale is not None:
        check_tensor("rowscale", rowscale, dtypes=FLOATS, device=x.device)
        if tuple(rowscale.shape) not in (tuple(x.shape[:-1]), (x.numel() // x.shape[-1],)):
            raise ValueError(f"rowscale: expected shape {tuple(x.shape[:-1])} (x's leading dims), got "
                             f"{tuple(rowscale.shape)}")


def _seeds(rows: int, device, on: bool):
    """One int32 dropout seed per row from torch's generator (torch.manual_seed reproduces the mask)."""
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (rows,), dtype=torch.int32, device=device) if on else None


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, is_rms_norm=False,
                  return_dropout_mask=False):
    """Fused residual add + LayerNorm / RMSNorm (mamba_ssm 2.3.x ``layer_norm.layer_norm_fn``).

    x, x1: (..., hidden) float32/float16/bfloat16 (x1 in x's dtype); residual: x's shape, any float dtype;
    weight, bias, weight1, bias1: (hidden,) float32 or x's dtype (bias, weight1, bias1 may be None; the
    second weights in weight's dtype); rowscale: x.shape[:-1] (or flat), used in float32 (no gradient).
    s = dropout(x * rowscale) + dropout(x1) + residual (float32); xhat = (s - mean(s)) / sqrt(var(s) + eps)
    (mean = 0 with is_rms_norm); out = xhat * weight (+ bias), out1 = xhat * weight1 (+ bias1), in x's dtype.
    Returns out (, out1 with weight1) (, residual_out with prenorm) (, dropout_mask, dropout_mask1 with
    return_dropout_mask), upstream's order. residual_out = s in residual's dtype (given), else float32 if
    residual_in_fp32, else x's dtype (then it is x itself). dropout_p: each element of x * rowscale and of x1
    is dropped with this probability, the kept ones scaled by 1 / (1 - dropout_p); the masks come from one
    int32 seed per row (and per input) drawn from torch's generator and are recomputed in the backward; the
    returned masks are bool of x's shape, None when dropout_p = 0 (x1's also when x1 is None).
    """
    hidden = check_norm_args(x, weight, bias, eps)
    _check_extras(x, weight, residual, x1, weight1, bias1, dropout_p, rowscale)
    shape = x.shape
    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    rowscale = rowscale.reshape(-1) if rowscale is not None else None
    r2 = residual.reshape(-1, hidden) if residual is not None else None
    x12 = x1.reshape(-1, hidden) if x1 is not None else None
    seeds, seeds1 = _seeds(rows, x.device, dropout_p > 0), _seeds(rows, x.device, dropout_p > 0 and x1 is not None)
    out, rout, mask, out1, mask1, _, _ = run_op(
        rmsnorm_gated_fwd, x2, weight, bias, None, r2, rowscale, seeds, x12, weight1, bias1, seeds1, float(eps),
        hidden, True, bool(is_rms_norm), bool(residual_in_fp32), float(dropout_p), bool(return_dropout_mask))
    outs = [out.reshape(shape)] + ([out1.reshape(shape)] if weight1 is not None else [])
    if prenorm:
        outs.append(rout.reshape(shape) if rout.dim() == 2 else x)
    if return_dropout_mask:
        outs += [m.view(torch.bool).reshape(shape) if m.dim() == 2 else None for m in (mask, mask1)]
    return outs[0] if len(outs) == 1 else tuple(outs)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """Fused residual add + RMSNorm (mamba_ssm 2.3.x ``layer_norm.rms_norm_fn``): :func:`layer_norm_fn` with
    is_rms_norm=True, xhat = s / sqrt(mean(s^2) + eps), s = x + residual (+ x1)."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, True, return_dropout_mask)

