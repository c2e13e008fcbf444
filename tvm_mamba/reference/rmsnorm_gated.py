"""Gated RMSNorm / LayerNorm (mamba_ssm 2.3.x ``ops/triton/layernorm_gated.py``: ``rms_norm_ref`` semantics and
``layernorm_fn``'s mean-subtracted variant), plain PyTorch.

Float64-capable, no TVM; the independent reference of the tests and the eager baseline of the benchmark.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def layernorm_gated_ref(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                        is_rms_norm=False, upcast=True):
    """x, z: (..., hidden); weight, bias: (hidden,) -> out: (..., hidden) in x's dtype.

    norm_before_gate: out = norm_g(x) * weight (+ bias) * silu(z);
    else:             out = norm_g(u) * weight (+ bias), u = x * silu(z);
    norm_g(v) = (v - mean_g(v)) / sqrt(mean_g((v - mean_g(v))^2) + eps) over each group of group_size
    consecutive features (mean_g(v) taken as 0 when is_rms_norm).
    upcast=True computes in float32 (or float64 when x is float64); False keeps x's dtype throughout.
    """
    dtype = x.dtype
    hidden = x.shape[-1]
    gs = hidden if group_size is None else group_size
    cdt = torch.promote_types(dtype, torch.float32) if upcast else dtype
    x = x.to(cdt)
    weight = weight.to(cdt)
    bias = bias.to(cdt) if bias is not None else None
    z = z.to(cdt) if z is not None else None
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    xg = x.reshape(*x.shape[:-1], hidden // gs, gs)
    if not is_rms_norm:
        xg = xg - xg.mean(dim=-1, keepdim=True)
    rstd = 1.0 / torch.sqrt(xg.square().mean(dim=-1, keepdim=True) + eps)
    out = (xg * rstd).reshape(x.shape) * weight
    if bias is not None:
        out = out + bias
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


def rmsnorm_gated_ref(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                      upcast=True):
    """x, z: (..., hidden); weight, bias: (hidden,) -> out: (..., hidden): :func:`layernorm_gated_ref` with
    is_rms_norm=True, out = u / rms_g(u) * weight (+ bias) (* silu(z)), rms_g(v) = sqrt(mean_g(v^2) + eps)."""
    return layernorm_gated_ref(x, weight, bias, z, eps, group_size, norm_before_gate, True, upcast)
