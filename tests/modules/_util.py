"""Helpers for the block tests: float64 parameter copies, a fixed random loss, gradient comparison."""
from __future__ import annotations

import torch

from tests.conftest import assert_close_to_ref


def params64(module) -> dict:
    """The module's parameters as float64 leaf tensors keyed by state_dict names (for the reference)."""
    return {k: v.detach().double().requires_grad_(True) for k, v in module.named_parameters()}


def weighted_loss(out: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """sum(out * w) with a fixed random w (every output element gets a distinct gradient)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return (out.double() * w).sum()


def assert_rel_close(got: torch.Tensor, ref: torch.Tensor, rel: float, name: str) -> None:
    """max |got - ref| <= rel * max |ref| (+ a tiny floor): a tolerance scaled to the tensor's magnitude."""
    scale = ref.detach().double().abs().max().item()
    assert_close_to_ref(got.detach(), ref.detach(), atol=rel * scale + 1e-7, rtol=0.0, name=name)


def compare_grads(module, p64: dict, rel: float, skip=()) -> None:
    """Every parameter gradient of the module against the reference gradient of the float64 copy."""
    for name, param in module.named_parameters():
        if name in skip:
            continue
        assert param.grad is not None, f"{name}: no gradient"
        assert p64[name].grad is not None, f"{name}: no reference gradient"
        assert_rel_close(param.grad, p64[name].grad, rel, f"grad {name}")
