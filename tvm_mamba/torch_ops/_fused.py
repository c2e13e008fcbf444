"""The gated-RMSNorm calls of the fused layer paths (mamba_inner.py, mamba_split.py), in one place.

The ``tvm_mamba::rmsnorm_gated_fwd/bwd`` custom ops gain residual / LayerNorm arguments on the norms branch of
issue #15 (``(x, weight, bias, z, residual, eps, group_size, norm_before_gate, is_rms_norm, residual_in_fp32)``
-> (out, residual_out, mean, rstd)); the fused paths call whichever schema is registered, so they work before
and after that lands. Drop the older branch once it has.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dlpack import run_op
from .rmsnorm_gated import rmsnorm_gated_bwd, rmsnorm_gated_fwd

_WITH_RESIDUAL = "residual" in [a.name for a in torch.ops.tvm_mamba.rmsnorm_gated_fwd.default._schema.arguments]


def norm_fwd(x: Tensor, weight: Tensor, z, eps: float, group_size: int, norm_before_gate: bool):
    """RMSNorm (gated by z when given) of x: (rows, hidden) -> out (rows, hidden) in x's dtype, rstd
    (rows, hidden/group_size) float32."""
    if _WITH_RESIDUAL:
        out, _, _, rstd = run_op(rmsnorm_gated_fwd, x, weight, None, z, None, eps, group_size, norm_before_gate,
                                 True, False)
        return out, rstd
    return run_op(rmsnorm_gated_fwd, x, weight, None, z, eps, group_size, norm_before_gate)


def norm_bwd(x: Tensor, weight: Tensor, z, dout: Tensor, rstd: Tensor, eps: float, group_size: int,
             norm_before_gate: bool):
    """Gradients (dx, dz or (0,), dweight) of :func:`norm_fwd` from its rstd."""
    dout = dout.to(x.dtype)
    if _WITH_RESIDUAL:
        mean = x.new_empty((0,), dtype=torch.float32)  # RMSNorm: no mean
        dx, dz, dweight, _, _ = run_op(rmsnorm_gated_bwd, x, weight, None, z, dout, mean, rstd, None, eps,
                                       group_size, norm_before_gate, True, False)
        return dx, dz, dweight
    dx, dz, dweight, _ = run_op(rmsnorm_gated_bwd, x, weight, None, z, dout, rstd, eps, group_size,
                                norm_before_gate)
    return dx, dz, dweight
