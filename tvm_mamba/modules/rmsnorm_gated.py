"""mamba_ssm 2.3.x's ``ops/triton/layernorm_gated`` modules on the TVM kernels: ``RMSNorm`` (also exported as
``RMSNormGated``) and ``LayerNorm``, gated group norms with upstream's constructor signatures and parameter
names, so a mamba_ssm state_dict loads strictly."""
from __future__ import annotations

import torch
from torch import nn

from ..torch_ops.rmsnorm_gated import layernorm_fn, rmsnorm_fn


def _check_group(hidden_size, group_size) -> None:
    if group_size is not None and (group_size < 1 or hidden_size % group_size):
        raise ValueError(f"group_size: must divide hidden_size={hidden_size}, got {group_size}")


class _GatedNorm(nn.Module):
    """What both gated norms share: upstream's constructor arguments, ``weight`` (hidden,) initialized to ones,
    ``bias`` (hidden,) zeros or registered as None (``with_bias``), the forward through the torch op ``_fn``
    (rmsnorm_fn / layernorm_fn, one signature) and the repr."""

    _fn = None

    def __init__(self, hidden_size, eps, group_size, norm_before_gate, device, dtype, with_bias: bool):
        super().__init__()
        _check_group(hidden_size, group_size)
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        if with_bias:
            self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x, z=None):
        return self._fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                        norm_before_gate=self.norm_before_gate)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}")


class RMSNorm(_GatedNorm):
    """Gated RMSNorm over the last dim. Parameters as mamba_ssm (``weight`` (hidden,), ones; ``bias``
    registered as None). forward(x: (..., hidden), z: (..., hidden) | None) -> (..., hidden):
    x/rms_g(x)*weight*silu(z) (norm_before_gate) or (x*silu(z))/rms_g(x*silu(z))*weight."""

    _fn = staticmethod(rmsnorm_fn)

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__(hidden_size, eps, group_size, norm_before_gate, device, dtype, with_bias=False)


RMSNormGated = RMSNorm


class LayerNorm(_GatedNorm):
    """Gated group LayerNorm over the last dim (mamba_ssm ``layernorm_gated.LayerNorm``): parameters ``weight``
    (ones) and ``bias`` (zeros), (hidden,). forward(x: (..., hidden), z: (..., hidden) | None) ->
    (..., hidden): norm_g(x)*weight + bias, times silu(z) (norm_before_gate), or norm_g(x*silu(z))*weight +
    bias; norm_g subtracts each group's mean and divides by its standard deviation."""

    _fn = staticmethod(layernorm_fn)

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__(hidden_size, eps, group_size, norm_before_gate, device, dtype, with_bias=True)
