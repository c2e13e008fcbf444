"""NaN semantics of Mamba-3 (issue #41) on the CUDA kernels, run on the CPU by the CUDA execution harness
(tvm_mamba.simulate_cuda): a NaN in each input of mamba3_siso_combined, mamba3_siso_step, mamba3_mimo and
mamba3_mimo_step reaches what the float64 recurrence's NaN reaches (out, final states and, for the chunked scans,
every gradient); the cases, masks and allowed differences of tests/torch_ops/test_mamba3_nan.py, at the dims of
tests/cudasim/test_mamba3*.py (their kernels). On CUDA, fmaxf
in the preprocess's decay clamp dropped a NaN ADT (CUDA's own expf / tanhf keep NaN)."""
from __future__ import annotations

import pytest

from tests.torch_ops.test_mamba3_nan import (MIMO_SEQ_INPUTS, MIMO_SITES, SISO_SITES, check_mimo, check_mimo_step,
                                             check_siso_combined, check_siso_step)


@pytest.mark.parametrize("bad", list(SISO_SITES))
def test_siso_combined_nan(sim, bad):
    check_siso_combined(bad)


@pytest.mark.parametrize("bad", list(SISO_SITES))
def test_siso_step_nan(sim, bad):
    check_siso_step(bad)


@pytest.mark.parametrize("bad", MIMO_SEQ_INPUTS)
def test_mimo_nan(sim, bad):
    check_mimo(bad, nheads_qk=2)  # GQA 2:1: tests/cudasim/test_mamba3_mimo.py's kernels


@pytest.mark.parametrize("bad", list(MIMO_SITES))
def test_mimo_step_nan(sim, bad):
    check_mimo_step(bad)
