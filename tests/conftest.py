"""Shared test helpers: tolerances from how far the reference itself drifts in low precision."""
from __future__ import annotations

import os

import pytest
import torch

# The harness's race / alignment checker (docs/cuda_sim.md) is on by default for users and in `sim-check`, and
# reports hazards in harness test files not sorted yet into real ones and false positives. Until they are, the
# suite runs the harness without the checker (its kernels then built without the instrumentation, faster);
# tests/runtime/test_cudasim_checks.py turns it on for its own kernels.
os.environ.setdefault("TVM_MAMBA_SIM_CHECKS", "0")

# fp32 kernels against a float64 reference; bf16/fp16 follow mamba_ssm's rule:
# err(kernel) <= 2 * err(reference computed in the low precision) + atol.
ATOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def assert_close_to_ref(out: torch.Tensor, ref64: torch.Tensor, ref_low: torch.Tensor | None = None,
                        atol: float | None = None, rtol: float = 1e-4, name: str = "out") -> None:
    """out vs the float64 reference; with ref_low (the reference run in out's dtype), the bound is
    2 * |ref_low - ref64| + atol elementwise-max, else rtol/atol."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    atol = ATOL.get(out.dtype, 1e-4) if atol is None else atol
    err = (out.double() - ref64.double()).abs()
    if ref_low is not None:
        ref_err = (ref_low.double() - ref64.double()).abs().max().item()
        bound = 2 * ref_err + atol
        assert err.max().item() <= bound, f"{name}: max err {err.max().item():.3g} > 2*{ref_err:.3g}+{atol}"
    else:
        bound = atol + rtol * ref64.double().abs()
        bad = err > bound
        assert not bad.any(), (f"{name}: {int(bad.sum())} elements off, max err {err.max().item():.3g} "
                               f"(atol {atol}, rtol {rtol})")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache directory and an empty in-process memo for this test."""
    from tvm_mamba.runtime import cache

    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memo()
    yield tmp_path / "cache"
    cache.clear_memo()
