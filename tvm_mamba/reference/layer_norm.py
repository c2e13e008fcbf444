"""Fused residual-add LayerNorm / RMSNorm (mamba_ssm 2.3.x ``ops/triton/layer_norm.py``: ``layer_norm_fn`` /
``rms_norm_fn`` semantics; dropout through given keep masks, as upstream's ``layer_norm_ref``), plain PyTorch.

Float64-capable, no TVM; the independent reference of the tests.
"""
from __future__ import annotations

import torch


def layer_norm_ref(x, weight, bias=None, residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False,
                   is_rms_norm=False, upcast=True, rowscale=None, dropout_p=0.0, dropout_mask=None, x1=None,
                   weight1=None, bias1=None, dropout_mask1=None):
    """x, residual: (..., hidden); weight, bias: (hidden,); rowscale: x.shape[:-1] -> out: (..., hidden) in
    x's dtype, and with prenorm also residual_out: (..., hidden); with weight1 out1 follows out.

    s = dropout(x (* rowscale[..., None])) + residual, dropout(v) = v * dropout_mask / (1 - dropout_p) (the
    mask is required when dropout_p > 0), plus dropout(x1) (its own mask dropout_mask1) when x1 is given;
    out1 = xhat * weight1 (+ bias1) with the same xhat (upstream's parallel norm) (computed in float32, or float64 for float64 inputs, when upcast);
    out = (s - mean(s)) / sqrt(var(s) + eps) * weight (+ bias), mean taken as 0 when is_rms_norm;
    residual_out = s stored in residual's dtype if residual is given, else float32 if residual_in_fp32, else
    x's dtype. The norm reads the unrounded s (as upstream's kernel does).
    """
    dtype = x.dtype
    res_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else dtype)
    cdt = torch.promote_types(torch.promote_types(dtype, torch.float32), res_dtype) if upcast else dtype
    s = x.to(cdt) * rowscale.reshape(x.shape[:-1]).to(cdt)[..., None] if rowscale is not None else x.to(cdt)
    if dropout_p > 0:
        s = s.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    if x1 is not None:
        s = s + (x1.to(cdt).masked_fill(~dropout_mask1, 0.0) / (1.0 - dropout_p) if dropout_p > 0 else x1.to(cdt))
    s = s + residual.to(cdt) if residual is not None else s
    c = s if is_rms_norm else s - s.mean(dim=-1, keepdim=True)
    xhat = c / torch.sqrt(c.square().mean(dim=-1, keepdim=True) + eps)
    outs = [xhat * weight.to(cdt) + (bias.to(cdt) if bias is not None else 0)]
    if weight1 is not None:
        outs.append(xhat * weight1.to(cdt) + (bias1.to(cdt) if bias1 is not None else 0))
    outs = [o.to(dtype) for o in outs]
    if prenorm:
        outs.append(s.to(res_dtype))
    return tuple(outs) if len(outs) > 1 else outs[0]


def rms_norm_ref(x, weight, bias=None, residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False,
                 upcast=True, **kwargs):
    """:func:`layer_norm_ref` with is_rms_norm=True: out = s / sqrt(mean(s^2) + eps) * weight (+ bias)."""
    return layer_norm_ref(x, weight, bias, residual, eps, prenorm, residual_in_fp32, True, upcast, **kwargs)
