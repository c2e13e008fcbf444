"""Weight-only bf16 / int8 projections for CPU (and CUDA) inference: ``quantize_weights(model, dtype)``.

It swaps, in place, the projection ``nn.Linear`` layers of every Mamba / Mamba2 block and the LM head for a
:class:`QuantizedLinear` that stores the low-precision weight and calls the ``linear`` op (torch_ops/linear.py):
- Mamba: ``in_proj``, ``x_proj``, ``out_proj``; Mamba2: ``in_proj``, ``out_proj``; the model's ``lm_head``.
  These are the weight bytes a decode step reads (>= 99% of the 130M model's projection weights).
- ``dt_proj`` stays float32: it is 0.3% of a layer's projection bytes (dt_rank x d_inner), Mamba's own code
  reads ``dt_proj.weight`` directly (``F.linear(dt, dt_proj.weight)``), and dt feeds exp(dt * A), where a
  weight rounding error becomes a relative error of the state decay.
Only submodules are swapped; the blocks' code is untouched. Where a block reads a swapped layer's
``.weight`` itself (Mamba's fused ``mamba_inner_fn`` and Mamba2's fused split path, taken by a forward with
no inference cache), :attr:`QuantizedLinear.weight` gives the dequantized float32 weight: the same
quantized model, computed by the fused kernels instead of the linear op. ``generate`` / decoding (a cache
is passed) calls the swapped layers, so it runs the linear op.

State dict: a swapped layer saves ``qweight`` (int8 codes or bf16 weight), ``scale`` (int8: per output
channel float32) and ``bias`` (float32) in place of ``weight`` / ``bias``, so a quantized model saves its
small weights and loads them back into a model quantized the same way; an fp32 checkpoint loads into the
fp32 model, which is then quantized. The swapped layers are frozen (buffers, no gradient); the input
gradient still flows through them.
"""
from __future__ import annotations

import torch
from torch import nn

from ..torch_ops.linear import linear, quantize_weight

DTYPES = {"int8": "int8", "bfloat16": "bfloat16", "bf16": "bfloat16", torch.int8: "int8",
          torch.bfloat16: "bfloat16"}
BLOCK_LAYERS = {"Mamba": ("in_proj", "x_proj", "out_proj"), "Mamba2": ("in_proj", "out_proj")}


class QuantizedLinear(nn.Module):
    """A frozen linear layer with a weight-only bf16 or int8 weight: y = x · (scale ⊙ W)ᵀ + bias.

    qweight: (out_features, in_features) int8 codes or bf16; scale: (out_features,) float32 (int8 only);
    bias: (out_features,) float32 or None. x: (..., in_features) float32 / bf16 -> (..., out_features)."""

    def __init__(self, in_features: int, out_features: int, dtype: str = "int8", bias: bool = False,
                 device=None):
        super().__init__()
        if dtype not in ("int8", "bfloat16"):
            raise ValueError(f"dtype: expected 'int8' or 'bfloat16', got {dtype!r}")
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        wdt = torch.int8 if dtype == "int8" else torch.bfloat16
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=wdt, device=device))
        self.register_buffer("scale", torch.ones(out_features, device=device) if dtype == "int8" else None)
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_linear(cls, layer: nn.Linear, dtype: str) -> "QuantizedLinear":
        """The quantized copy of ``layer`` (int8: per output channel absmax / 127 scales, round half to even;
        bf16: round to nearest even)."""
        q = cls(layer.in_features, layer.out_features, dtype, layer.bias is not None, layer.weight.device)
        w, s = quantize_weight(layer.weight.detach(), dtype)
        q.qweight.copy_(w)
        if s is not None:
            q.scale.copy_(s)
        if layer.bias is not None:
            q.bias.copy_(layer.bias.detach().float())
        return q

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight (out_features, in_features), made on each access: for the blocks'
        fused paths that take a weight tensor; the layer's own forward never builds it."""
        w = self.qweight.float()
        return w * self.scale[:, None] if self.scale is not None else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.qweight, self.bias, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, " \
               f"bias={self.bias is not None}"


def quantize_weights(model: nn.Module, dtype="int8", lm_head: bool = True) -> nn.Module:
    """Swap the projections of every Mamba / Mamba2 block in ``model`` (and its ``lm_head`` when ``lm_head``)
    for :class:`QuantizedLinear` layers with ``dtype`` ("int8" or "bfloat16") weights, in place; returns the
    model. For inference: run it under ``torch.no_grad()`` (the swapped weights are frozen). Layers already
    quantized are left as they are. See the module docstring for which layers and why."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected 'int8' or 'bfloat16', got {dtype!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    dtype = DTYPES[dtype]
    from .mamba import Mamba
    from .mamba2 import Mamba2

    for module in list(model.modules()):
        names = BLOCK_LAYERS["Mamba"] if isinstance(module, Mamba) else \
            BLOCK_LAYERS["Mamba2"] if isinstance(module, Mamba2) else ()
        for name in names:
            layer = getattr(module, name)
            if isinstance(layer, nn.Linear):
                setattr(module, name, QuantizedLinear.from_linear(layer, dtype))
    head = getattr(model, "lm_head", None)
    if lm_head and isinstance(head, nn.Linear):
        model.lm_head = QuantizedLinear.from_linear(head, dtype)
    return model
