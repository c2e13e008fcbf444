"""mamba_ssm 2.3.x's ``ops/triton/layer_norm.RMSNorm`` module (the norm of mixer_seq_simple's Block with
rms_norm=True) on the TVM fused add-norm kernel; upstream's constructor signature and parameter names."""
from __future__ import annotations

import torch
from torch import nn

from ..torch_ops.layer_norm import rms_norm_fn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with an optional fused residual add. Parameters as mamba_ssm: ``weight``
    (hidden,), ones; ``bias`` registered as None. forward(x: (..., hidden), residual=None, prenorm=False,
    residual_in_fp32=False) -> out (..., hidden), or (out, residual_out) with prenorm (see
    :func:`tvm_mamba.torch_ops.layer_norm.layer_norm_fn`). dropout_p > 0 is kept as upstream's ``drop``
    module (no parameters) but refused (ValueError) by the kernel in training mode."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                           prenorm=prenorm, residual_in_fp32=residual_in_fp32)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
