"""Upstream's two-function Mamba-3 decode path (apply_rotary_qk_inference_fwd, mamba3_step_fn) on the CUDA kernels,
run on the CPU by the CUDA execution harness: the rotary pass SISO (rank 1, interleaved pairs, broadcast heads) and
MIMO (rank 4, halved, conjugate, in place), the update SISO (in place, bf16) and MIMO (R outputs, a separate
state), each against its float64 reference (mirrors tests/torch_ops/test_mamba3_step_parts.py)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tests.torch_ops.test_mamba3_step_parts import _rotate_inputs, _update_inputs
from tvm_mamba.reference.mamba3_mimo import apply_rotary_qk_inference_ref, mamba3_step_fn_ref
from tvm_mamba.torch_ops.mamba3_step_parts import apply_rotary_qk_inference_fwd, mamba3_step_fn

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("R, pairwise, conj, inplace, expanded", [(1, True, False, False, True),
                                                                   (4, False, True, True, False)])
def test_rotary(sim, R, pairwise, conj, inplace, expanded):
    a = _rotate_inputs(F32, R, True, expanded, seed=R)
    if inplace:
        a.update(q=a["q"].clone(), k=a["k"].clone(), angle_state=a["angle_state"].clone())
    ref = apply_rotary_qk_inference_ref(**{k: v.clone() if v is not None else None for k, v in a.items()},
                                        conjugate=conj, rotate_pairwise=pairwise)
    got = apply_rotary_qk_inference_fwd(**a, inplace=inplace, conjugate=conj, rotate_pairwise=pairwise)
    assert [k.direction for k, _ in sim] == ["step_rotate"]
    for name, g, want in zip(("q", "k", "angle"), got, ref):
        assert_close_to_ref(g, want, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("dtype, R, z, outproj, inplace", [(BF16, 1, True, True, True), (F32, 4, False, False, False)])
def test_step_fn(sim, dtype, R, z, outproj, inplace):
    a = _update_inputs(dtype, R, z, outproj, seed=5)
    args = {k: v for k, v in a.items() if k != "out"}
    ref, h_ref = mamba3_step_fn_ref(**args)
    low = mamba3_step_fn_ref(**args, dtype=BF16)[0] if dtype == BF16 else None
    state_out = None if inplace else torch.empty_like(a["state"])
    mamba3_step_fn(**a, state_out=state_out)
    assert [k.direction for k, _ in sim] == ["step_update"]
    assert_close_to_ref(a["out"], ref, low, atol=None if low is not None else 1e-5, rtol=1e-5, name="out")
    assert_close_to_ref(a["state"] if inplace else state_out, h_ref, atol=1e-5, rtol=1e-5, name="state")
