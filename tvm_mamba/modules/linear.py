"""The blocks' fp32 projections: ``torch.nn.Linear`` on the linear op at inference."""
from __future__ import annotations

import torch
from torch import Tensor

from ..torch_ops.linear import fp32_linear


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (the same parameters, state_dict, hooks and ``isinstance``) whose forward is
    :func:`~tvm_mamba.torch_ops.linear.fp32_linear`: x (..., in_features) -> (..., out_features) on the linear
    op at fp32 inference on the CPU (the GEMV kernel at decode, its row tiles at prefill where the host has
    AVX-512), ``F.linear`` everywhere else (training, other devices and dtypes, tracing)."""

    def forward(self, x: Tensor) -> Tensor:
        return fp32_linear(x, self.weight, self.bias)
