"""The Mamba-3 chunked forward's preprocess backward (compute/mamba3/preprocess_bwd.py) on the CPU: every
gradient it returns against torch.autograd of the float64 ``mamba3_siso_preprocess_ref`` (random upstream
gradients for every forward output; simcheck/mamba3.py ``preprocess_bwd_case``), and that reference against
the forward kernel it differentiates. Two chunks of 4 and a ragged third (seqlen 10), ADT of one position below
DA_MIN. The CUDA layout: tests/cudasim/test_mamba3.py."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.compute.mamba3.dims import PreDims
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref, mamba3_siso_preprocess_ref
from tvm_mamba.tools.simcheck.mamba3 import combined_inputs, preprocess_bwd_results, preprocess_results

BASE = dict(nheads=4, headdim_qk=8, headdim_v=4, chunk_size=4)


def _check(res: dict, expected: set) -> None:
    assert set(res) == expected
    for name, (got, want) in res.items():
        assert_close_to_ref(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-4, name=name)


@pytest.mark.parametrize("static, dtypes", [
    # GQA 2:1, partial rotary (3 of 4 pairs), input states and D, fp32
    (dict(BASE, nheads_qk=2, headdim_angles=3, has_D=True, has_init=True), {"qk": "float32", "vstate": "float32"}),
    # bf16 Q / K, full rotary, no states, no D
    (dict(BASE, nheads_qk=4, headdim_angles=4, has_D=False, has_init=False), {"qk": "bfloat16", "vstate": "float32"}),
    # bf16 Q / K and K / V states (the inference cache's), one angle of 4 pairs, MQA
    (dict(BASE, nheads_qk=1, headdim_angles=1, has_D=True, has_init=True),
     {"qk": "bfloat16", "vstate": "bfloat16", "kstate": "bfloat16"}),
])
def test_kernel_matches_autograd_of_reference(static, dtypes):
    res = preprocess_bwd_results(static, dtypes, batch=2, seqlen=10)
    states = {"dangle_state", "dk_state", "dv_state"} if static["has_init"] else set()
    _check(res, {"dQh", "dKh", "dADT", "dDT", "dTrap", "dQb_part", "dKb_part", "dAngles"} | states)
    dadt, _ = res["dADT"]
    assert (dadt[:, :, 1] == 0).all() and (dadt[:, :, 0] != 0).all()  # the clamped step passes no gradient


def test_kernel_across_pair_blocks():
    """seqlen 37: three tasks of the pairs pass (16 steps each, the last ragged) and their bias-gradient parts,
    the dots' blocks over five chunks of 8, 8 heads over 2 Q / K heads, 3 of 4 pairs rotated, input states."""
    static = dict(BASE, nheads=8, nheads_qk=2, headdim_angles=3, chunk_size=8, has_D=True, has_init=True)
    res = preprocess_bwd_results(static, {}, batch=2, seqlen=37)
    _check(res, {"dQh", "dKh", "dADT", "dDT", "dTrap", "dQb_part", "dKb_part", "dAngles", "dangle_state",
                 "dk_state", "dv_state"})


def test_reference_matches_the_forward_kernel():
    """The reference's outputs (q, k, dA_cs with its padded slots, scale, skip, final angle, init) == the
    forward preprocess kernel's in fp32: the backward differentiates the function the forward computes."""
    static = dict(BASE, nheads_qk=2, headdim_angles=3, has_D=True, has_init=True)
    res = preprocess_results(static, {}, batch=2, seqlen=10)
    _check(res, {"q", "k", "dA_cs", "scale", "skip", "angle_out", "init"})


# packed sequences of lengths 3, 5, 3 in seqlen 11, chunk 4: a boundary inside chunk 0, one on chunk 2's edge
LENS = (3, 5, 3)
SEQ = dict(BASE, nheads_qk=2, headdim_angles=3, has_D=True, has_seq_idx=True)
SEQ_IDX = torch.repeat_interleave(torch.arange(len(LENS), dtype=torch.int32), torch.tensor(LENS))[None]


def test_packed_reference_is_per_sequence():
    """The packed reference == each sequence run alone: its q, k and scale rows those of the slice through
    the reference, its per-sequence angles mamba3_siso_combined_ref(cu_seqlens)'s final angle states."""
    inp = combined_inputs(SEQ, {}, batch=1, seqlen=sum(LENS), has_z=False)
    pre = {k: v for k, v in inp.items() if k not in ("V", "Z")}
    q, k, _, scale, _, aout, init = mamba3_siso_preprocess_ref(**pre, chunk_size=4, seq_idx=SEQ_IDX)
    assert init is None and aout.shape == (len(LENS), 4, 3)
    cu = torch.tensor([0, 3, 8, 11], dtype=torch.int32)
    final = mamba3_siso_combined_ref(**inp, chunk_size=4, cu_seqlens=cu, return_final_states=True)[1]
    torch.testing.assert_close(aout, final, rtol=0, atol=1e-12)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        axis = {"Q": 1, "K": 1, "Angles": 1, "ADT": 2, "DT": 2, "Trap": 2}
        part = {n: v.narrow(axis[n], lo, hi - lo) if n in axis else v for n, v in pre.items()}
        sq, sk, _, ss, *_ = mamba3_siso_preprocess_ref(**part, chunk_size=4)
        torch.testing.assert_close(q[:, lo:hi], sq, rtol=0, atol=1e-12)
        torch.testing.assert_close(k[:, lo:hi], sk, rtol=0, atol=1e-12)
        torch.testing.assert_close(scale.flatten(-2)[..., lo:hi], ss.flatten(-2)[..., :hi - lo], rtol=0, atol=1e-12)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_packed_kernels_match_reference(direction):
    """has_seq_idx: the forward's outputs (per-sequence angle_out) against the packed reference, every backward
    output against its autograd (no input states: zero initial states per sequence)."""
    if direction == "forward":
        res = preprocess_results(SEQ, {}, batch=1, seqlen=sum(LENS), seq_idx=SEQ_IDX)
        _check(res, {"q", "k", "dA_cs", "scale", "skip", "angle_out"})
    else:
        res = preprocess_bwd_results(SEQ, {}, batch=1, seqlen=sum(LENS), seq_idx=SEQ_IDX)
        _check(res, {"dQh", "dKh", "dADT", "dDT", "dTrap", "dQb_part", "dKb_part", "dAngles"})


def test_packed_refuses_input_states():
    """Packed sequences start from zero states: PreDims and the reference refuse the pair."""
    with pytest.raises(ValueError, match="has_seq_idx"):
        PreDims(**dict(SEQ, has_init=True))
    inp = combined_inputs(dict(SEQ, has_init=True), {}, batch=1, seqlen=sum(LENS), has_z=False)
    with pytest.raises(ValueError, match="seq_idx"):
        mamba3_siso_preprocess_ref(**{k: v for k, v in inp.items() if k not in ("V", "Z")}, seq_idx=SEQ_IDX)
