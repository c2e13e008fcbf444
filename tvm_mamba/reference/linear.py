"""Linear with weight-only quantized weights, from the math in plain PyTorch (float64-capable; no TVM).

The references of the tests: per-output-channel int8 / bf16 weight rounding, the forward and the input
gradient of y = x · (scale ⊙ W)ᵀ + bias.
"""
from __future__ import annotations

import torch


def quantize_weight_ref(weight: torch.Tensor, dtype: str):
    """weight: (out_features, in_features) float -> (stored weight, scale or None).

    "int8": per output channel (row) scale[n] = max_k |w[n, k]| / 127 (1 for an all-zero row), stored as
    float32, codes = clamp(round(w / scale), -127, 127) against that stored scale, round half to even;
    "bfloat16": w rounded to nearest even bf16 (no scale); "float32": w in float32 (no scale)."""
    w = weight.detach().double()
    if dtype == "int8":
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.float32)
        codes = torch.clamp(torch.round(w / scale.double()[:, None]), -127, 127).to(torch.int8)
        return codes, scale
    if dtype == "bfloat16":
        return weight.detach().to(torch.float32).to(torch.bfloat16), None
    return weight.detach().to(torch.float32), None


def dequantize_ref(weight: torch.Tensor, scale) -> torch.Tensor:
    """The float64 weight a stored weight stands for: codes * scale[:, None] for int8, else the weight."""
    w = weight.double()
    return w * scale.double()[:, None] if scale is not None else w


def linear_ref(x, weight, bias=None, scale=None):
    """x: (..., in_features), weight: (out_features, in_features) (int8 with scale: (out_features,)),
    bias: (out_features,) -> (..., out_features) float64; y = x · (scale ⊙ W)ᵀ + bias."""
    y = x.double() @ dequantize_ref(weight, scale).T
    return y + bias.double() if bias is not None else y


def linear_grad_input_ref(dy, weight, scale=None):
    """dy: (..., out_features) -> dx: (..., in_features) float64; dx = dy · (scale ⊙ W)."""
    return dy.double() @ dequantize_ref(weight, scale)
