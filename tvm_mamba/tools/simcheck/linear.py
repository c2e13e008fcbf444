"""sim-check of linear on the CUDA execution harness, through the public function of torch_ops/linear.py:

- ``fwd``: ``linear(x, weight, bias, scale)`` at 3 rows (not a multiple of anything) with the configuration's
  dims and dtypes, against the float64 reference from the same stored weight;
- ``bwd``: the input gradient of that call (autograd runs the ``linear_bwd`` kernel).

The int8 weights come from ``quantize_weight`` (per-channel scales), so they span the full code range.
"""
from __future__ import annotations

import torch

from . import CheckFailed, compare, ran, recording, tolerance, generator, size, target

OP = "linear"
ROWS = 3


def _inputs(d, seed: int = 0):
    from ...torch_ops.linear import quantize_weight

    g = generator(seed)
    xdt = getattr(torch, d.x_dtype)
    x = torch.randn(size("rows", ROWS), d.in_features, generator=g).to(xdt)
    w, s = quantize_weight(torch.randn(d.out_features, d.in_features, generator=g) / d.in_features ** 0.5,
                           d.weight_dtype)
    b = torch.randn(d.out_features, generator=g) if d.has_bias else None
    return x, w, b, s


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Sums of in_features products: atol relative to the reference's magnitude, and for a bf16 output its
    rounding (2^-8 relative) on top."""
    rtol, atol = tolerance(got.dtype)
    compare(name, got, want, rtol, atol * max(1.0, want.abs().max().item()))


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of linear in the harness (module docstring)."""
    from ...compute.linear import LinearDims
    from ...reference.linear import linear_grad_input_ref, linear_ref
    from ...torch_ops.linear import linear

    if direction not in ("fwd", "bwd"):
        raise CheckFailed(f"{OP}: unknown direction {direction!r}")
    d = LinearDims.from_key(static, dtypes)
    x, w, b, s = _inputs(d)
    x.requires_grad_(direction == "bwd")
    with recording() as keys, target(arch):
        y = linear(x, w, b, s)
        if direction == "bwd":
            dy = torch.randn(y.shape, generator=generator(1)).to(y.dtype)
            y.backward(dy)
    ran(keys, OP, direction, static, dtypes)
    if direction == "fwd":
        _close(f"{OP}.fwd {arch}: y", y, linear_ref(x.detach(), w, b, s))
    else:
        _close(f"{OP}.bwd {arch}: dx", x.grad, linear_grad_input_ref(dy, w, s))
