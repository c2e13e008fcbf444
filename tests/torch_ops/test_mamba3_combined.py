"""mamba3_siso_combined (the chunked SISO forward: the preprocess kernel, then the SSD pieces with diag_skip) on
the CPU against the float64 reference: fp32 and bf16 (mamba_ssm's 2 * err(bf16 reference) + atol), ragged
lengths, input / final states, GQA, partial and full rotary, D / Z absent; == chained decode-step kernels and
== itself split in two through its returned states; opcheck, torch.compile, bad input, cu_seqlens refused (the backward: test_mamba3_backward.py)."""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.compute.test_mamba3_ref import make_inputs, step_inputs, with_changes
from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref
from tvm_mamba.runtime.dispatch import record_keys
from tvm_mamba.torch_ops.mamba3 import mamba3_siso_combined, mamba3_siso_fwd_op

F32, BF16 = torch.float32, torch.bfloat16
ACT = ("Q", "K", "V", "Z")
NAMES = ("angle", "ssm", "k", "v")


def _cast(inp: dict, dtype) -> dict:
    """Activations (and the K / V states) in ``dtype``, the rest float32 (as upstream's module passes them)."""
    out = {k: (v.to(dtype if k in ACT else F32) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    if inp.get("Input_States") is not None:
        a, ssm, k, v = inp["Input_States"]
        out["Input_States"] = (a.to(F32), ssm.to(F32), k.to(dtype), v.to(dtype))
    return out


# (nheads_qk, nheads, headdim_qk, headdim_v, headdim_angles, seqlen, chunk_size, input states)
CASES = [(1, 4, 8, 4, 2, 11, 4, True),     # GQA 4:1, partial rotary, ragged last chunk, states in
         (2, 2, 16, 8, 8, 16, 8, False)]   # full rotary, seqlen a multiple of the chunk, zero states


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("HQ, H, N, P, S, L, chunk, states", CASES)
def test_combined_matches_reference(dtype, HQ, H, N, P, S, L, chunk, states):
    inp = _cast(make_inputs(batch=2, seqlen=L, nheads_qk=HQ, nheads=H, N=N, P=P, S=S, seed=L, states=states,
                            dtype=torch.float64), dtype)
    with record_keys() as used:
        out, *final = mamba3_siso_combined(**inp, chunk_size=chunk, return_final_states=True)
    assert [(k.op, k.direction) for k, _ in used] == [("mamba3", "siso_preprocess"), ("ssd", "bmm_chunk"),
                                                      ("ssd", "chunk_state"), ("ssd", "state_passing"),
                                                      ("ssd", "chunk_scan")]
    assert all(k.target.startswith("llvm") for k, _ in used)
    ref, *ref_final = mamba3_siso_combined_ref(**inp, return_final_states=True)
    assert out.dtype == dtype and [f.dtype for f in final] == [F32, F32, F32, dtype]
    assert torch.equal(final[3], inp["V"][:, -1])
    if dtype == BF16:
        low, *low_final = mamba3_siso_combined_ref(**inp, return_final_states=True, dtype=BF16)
        assert_close_to_ref(out, ref, low, name="out")
        for name, got, r, lo in zip(NAMES[:3], final, ref_final, low_final):
            assert_close_to_ref(got, r, lo, atol=1e-4, name=name)
    else:
        for name, got, r in zip(("out",) + NAMES[:3], (out, *final[:3]), (ref, *ref_final[:3])):
            assert_close_to_ref(got, r, atol=2e-5, rtol=2e-5, name=name)


def test_without_D_Z_and_defaults():
    """D and Z absent, no states, upstream's default chunk (64 > seqlen: one ragged chunk), out only."""
    inp = dict(make_inputs(batch=2, seqlen=9, S=3, states=False, dtype=F32), D=None, Z=None)
    out = tvm_mamba.mamba3_siso_combined(**inp)
    assert isinstance(out, torch.Tensor)
    assert_close_to_ref(out, mamba3_siso_combined_ref(**inp), atol=2e-5, rtol=2e-5)


def test_equals_chained_steps_and_split_sequence():
    """The chunked forward == eight decode-step kernels chained through their states; and two chunked calls,
    the second fed the first's final states (its K / V states enter through the trapezoid term), == one call."""
    inp = make_inputs(batch=2, seqlen=8, nheads_qk=1, nheads=4, N=8, P=4, S=2, dtype=F32)
    out, *final = mamba3_siso_combined(**inp, chunk_size=4, return_final_states=True)
    states, outs = list(inp["Input_States"]), []
    for t in range(8):
        y, states = tvm_mamba.mamba3_siso_step(**step_inputs(inp, t), Input_States=states)
        outs.append(y)
    assert_close_to_ref(out, torch.stack(outs, dim=1), atol=2e-5, rtol=2e-5, name="out")
    for name, got, want in zip(NAMES, final, states):
        assert_close_to_ref(got, want, atol=2e-5, rtol=2e-5, name=name)
    part = lambda lo, hi: {k: _time_slice(k, v, lo, hi) for k, v in inp.items() if k != "Input_States"}  # noqa
    first, *mid = mamba3_siso_combined(**part(0, 5), Input_States=inp["Input_States"], chunk_size=4,
                                       return_final_states=True)
    second, *end = mamba3_siso_combined(**part(5, 8), Input_States=mid, chunk_size=4, return_final_states=True)
    assert_close_to_ref(torch.cat((first, second), dim=1), out, atol=2e-5, rtol=2e-5, name="split out")
    for name, got, want in zip(NAMES, end, final):
        assert_close_to_ref(got, want, atol=2e-5, rtol=2e-5, name=name)


def _time_slice(name, t, lo, hi):
    axis = {"ADT": 2, "DT": 2, "Trap": 2, "Q_bias": None, "K_bias": None, "D": None}.get(name, 1)
    return t if axis is None else t.narrow(axis, lo, hi - lo)


def _op_args(inp, chunk=4):
    a, ssm, k, v = inp["Input_States"]
    return (inp["Q"], inp["K"], inp["V"], inp["ADT"], inp["DT"], inp["Trap"], inp["Q_bias"], inp["K_bias"],
            inp["Angles"], inp["D"], inp["Z"], a, ssm, k, v, chunk)


def test_fake_and_schema_and_inputs_untouched():
    inp = make_inputs(batch=2, seqlen=11, nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=11, dtype=F32)
    before = [t.clone() for t in _op_args(inp)[:-1]]
    torch.library.opcheck(mamba3_siso_fwd_op, _op_args(inp), test_utils=("test_schema", "test_faketensor"))
    assert all(torch.equal(a, b) for a, b in zip(before, _op_args(inp)[:-1]))


def test_torch_compile_fullgraph():
    inp = make_inputs(batch=2, seqlen=11, nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=11, dtype=F32)
    fn = lambda kw: mamba3_siso_combined(**kw, chunk_size=4, return_final_states=True)  # noqa: E731
    got, want = torch.compile(fn, fullgraph=True)(inp), fn(inp)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _bad(**change):
    return with_changes(make_inputs(batch=2, seqlen=5, nheads_qk=1, nheads=2, N=8, P=4, S=2, dtype=F32), change)


@pytest.mark.parametrize("change, err, name", [
    (dict(Q=torch.randn(2, 5, 3, 8)), ValueError, "Q"),  # 3 Q/K heads do not divide 2 heads
    (dict(Q=torch.randn(2, 4, 1, 8)), ValueError, "Q"),  # seqlen differs from V's
    (dict(K=torch.randn(2, 5, 1, 8, dtype=BF16)), TypeError, "K"),
    (dict(V=torch.randn(2, 5, 2, 4, dtype=torch.float64)), TypeError, "V"),  # no float64 chunked kernels
    (dict(ADT=torch.randn(2, 5, 2)), ValueError, "ADT"),  # (batch, seqlen, nheads): not upstream's layout
    (dict(Angles=torch.randn(2, 5, 2, 5)), ValueError, "Angles"),
    (dict(D=torch.randn(2, 4)), ValueError, "D"),
    (dict(Z=torch.randn(2, 5, 2, 5)), ValueError, "Z"),
    (dict(state1=torch.randn(2, 2, 8, 4)), ValueError, "ssm_state"),
    (dict(Input_States=(torch.zeros(1),)), TypeError, "Input_States"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(V=torch.randn(2, 0, 2, 4), Q=torch.randn(2, 0, 1, 8), K=torch.randn(2, 0, 1, 8), ADT=torch.randn(2, 2, 0),
          DT=torch.randn(2, 2, 0), Trap=torch.randn(2, 2, 0), Angles=torch.randn(2, 0, 2, 2), Z=None), ValueError,
     "seqlen"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError, "cu_seqlens"),  # batch 2
    (dict(V=torch.randn(2, 5, 2, 258), Z=None, state3=torch.randn(2, 2, 258), state1=torch.randn(2, 2, 258, 8)),
     ValueError, "headdim_v"),  # the SSD pieces' headdim <= 256
])
def test_bad_input_names_the_argument(change, err, name):
    kw = _bad(**change)
    with pytest.raises(err, match=name):
        mamba3_siso_combined(**kw)


def test_workspace_past_32_bit_indexing_is_refused():
    """Expanded views (no memory), each input within 32-bit indexing: the per-head q / k workspace (2^32
    elements: 64 heads x headdim_qk 256 from one Q/K head) is refused before anything is allocated."""
    B, L, H, N = 1 << 6, 1 << 12, 64, 256
    big = lambda *shape: torch.zeros((1,) * len(shape)).expand(*shape)  # noqa: E731
    kw = dict(Q=big(B, L, 1, N), K=big(B, L, 1, N), V=big(B, L, H, 2), ADT=big(B, H, L), DT=big(B, H, L),
              Trap=big(B, H, L), Q_bias=big(H, N), K_bias=big(H, N), Angles=big(B, L, H, 1))
    with pytest.raises(ValueError, match="q / k workspace"):
        mamba3_siso_combined(**kw)
