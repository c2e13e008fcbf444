"""GatedMLP: mamba_ssm 2.3.x's ``modules/mlp.GatedMLP`` (the MLP of a Block with d_intermediate > 0).

Same constructor, parameter names and shapes (fc1.weight (2*hidden, in), fc2.weight (out, hidden)), so a
mamba_ssm state_dict loads. Two GEMMs (the blocks' fp32 ``Linear``: the linear op at CPU inference) and a SiLU gate, as upstream.
"""
from __future__ import annotations

from torch import nn
from torch.nn import functional as F

from .linear import Linear


class GatedMLP(nn.Module):
    """x: (..., in_features) -> fc2(y * act(gate)), (y, gate) = fc1(x).chunk(2); hidden_features defaults to
    8/3 * in_features, rounded up to a multiple of multiple_of (upstream's rule)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.silu, bias=False,
                 multiple_of=128, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden_features = (hidden_features + multiple_of - 1) // multiple_of * multiple_of
        self.fc1 = Linear(in_features, 2 * hidden_features, bias=bias, **fk)
        self.activation = activation
        self.fc2 = Linear(hidden_features, out_features, bias=bias, **fk)

    def forward(self, x):
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * self.activation(gate))
