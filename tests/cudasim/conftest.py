"""Shared fixture: run a test with every kernel simulated (sm_90 CUDA in the CPU harness)."""
from __future__ import annotations

import pytest

import tvm_mamba
from tvm_mamba.runtime.dispatch import record_keys


@pytest.fixture
def sim():
    """Every kernel of the test runs simulated CUDA (sm_90 unless the test nests another arch); fails the test
    if any kernel ran elsewhere (e.g. on the CPU kernels)."""
    with record_keys() as used, tvm_mamba.simulate_cuda("sm_90"):
        yield used
    targets = {k.target for k, _ in used}
    assert all(t.startswith("cudasim-") for t in targets), targets
