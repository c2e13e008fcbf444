"""layer_norm_fn / rms_norm_fn: mamba_ssm 2.3.x's fused residual-add norm (``ops/triton/layer_norm.py``), as
Block (fused_add_norm=True) and MixerModel's final norm call it, on the TVM norm kernels.

The kernels and custom ops are the gated norm's (``tvm_mamba::rmsnorm_gated_fwd/bwd``: one definition of the
norm math, with a static residual flag; compute/rmsnorm_gated.py): one forward kernel adds the residual in
float32, writes residual_out and normalizes the unrounded sum; the backward recomputes xhat from the stored
residual_out (upstream's choice), adds the gradient of residual_out (prenorm) and writes d residual in
residual's dtype when it differs from x's.

Backward memory: residual_out (rows * hidden in residual_out's dtype; it is also the prenorm output, so no
extra copy), weight, bias and the float32 statistics (rstd, and mean for LayerNorm: rows * 4 bytes each).
"""
from __future__ import annotations

import torch

from ._dlpack import FLOATS, check_shape, check_tensor, run_op
from .rmsnorm_gated import check_norm_args, rmsnorm_gated_fwd


def _refuse_extras(x1, weight1, bias1, dropout_p) -> None:
    """ValueError for a dropout_p outside [0, 1) and for the upstream extra that is not implemented (the
    parallel x1 / weight1 / bias1 norm); checked before any kernel runs."""
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    for name, value in (("x1", x1), ("weight1", weight1), ("bias1", bias1)):
        if value is not None:
            raise ValueError(f"{name}: not supported by tvm_mamba's fused add-norm (mamba_ssm's parallel second "
                             f"norm); pass None")


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, is_rms_norm=False,
                  return_dropout_mask=False):
    """Fused residual add + LayerNorm / RMSNorm (mamba_ssm 2.3.x ``layer_norm.layer_norm_fn``).

    x: (..., hidden) float32/float16/bfloat16; residual: (..., hidden) like x's shape, any float dtype;
    weight, bias: (hidden,) float32 or x's dtype (bias may be None); rowscale: x.shape[:-1] (or flat), any
    float dtype, used in float32 (no gradient, as upstream).
    s = x * rowscale + residual (float32); out = (s - mean(s)) / sqrt(var(s) + eps) * weight (+ bias) in x's dtype
    (mean = 0 with is_rms_norm). Returns out, or (out, residual_out) with prenorm, residual_out = s in
    residual's dtype (given), else float32 if residual_in_fp32, else x's dtype (then it is x itself).
    dropout_p: x (after rowscale) is dropped elementwise with this probability, the kept elements scaled by
    1 / (1 - dropout_p); one int32 seed per row drawn from torch's generator, the mask recomputed from it in
    the backward. return_dropout_mask appends (dropout_mask, None): the bool keep mask of x's shape (None when
    dropout_p = 0) and x1's (always None), as upstream. x1 / weight1 / bias1 raise ValueError (not
    implemented).
    """
    _refuse_extras(x1, weight1, bias1, dropout_p)
    hidden = check_norm_args(x, weight, bias, eps)
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOATS, device=x.device)
        check_shape("residual", residual, tuple(x.shape))
    shape = x.shape
    x2 = x.reshape(-1, hidden)
    if rowscale is not None:
        check_tensor("rowscale", rowscale, dtypes=FLOATS, device=x.device)
        if tuple(rowscale.shape) not in (tuple(shape[:-1]), (x2.shape[0],)):
            raise ValueError(f"rowscale: expected shape {tuple(shape[:-1])} (x's leading dims), got "
                             f"{tuple(rowscale.shape)}")
        rowscale = rowscale.reshape(-1)
    r2 = residual.reshape(-1, hidden) if residual is not None else None
    seeds = None
    if dropout_p > 0:  # one seed per row from torch's generator (torch.manual_seed reproduces the mask)
        seeds = torch.randint(-2 ** 31, 2 ** 31 - 1, (x2.shape[0],), dtype=torch.int32, device=x.device)
    out, rout, mask, _, _ = run_op(rmsnorm_gated_fwd, x2, weight, bias, None, r2, rowscale, seeds, float(eps),
                                   hidden, True, bool(is_rms_norm), bool(residual_in_fp32), float(dropout_p),
                                   bool(return_dropout_mask))
    out = out.reshape(shape)
    keep = mask.view(torch.bool).reshape(shape) if mask.dim() == 2 else None
    masks = (keep, None) if return_dropout_mask else ()
    if not prenorm:
        return (out, *masks) if masks else out
    residual_out = rout.reshape(shape) if rout.dim() == 2 else x
    return (out, residual_out, *masks)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """Fused residual add + RMSNorm (mamba_ssm 2.3.x ``layer_norm.rms_norm_fn``): :func:`layer_norm_fn` with
    is_rms_norm=True, out = s / sqrt(mean(s^2) + eps) * weight (+ bias), s = x + residual."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, True, return_dropout_mask)

