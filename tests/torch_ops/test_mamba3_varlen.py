"""mamba3_siso_combined with cu_seqlens (packed sequences, batch 1) on the CPU: out and the per-sequence final
states against the float64 reference (which runs each sequence on its own), fp32 and bf16; every gradient
(out, every final state) against autograd of that reference; per-sequence input states (forward, every
gradient, an empty sequence keeping its states); an empty sequence; bad cu_seqlens and state rows."""
from __future__ import annotations

import pytest
import torch

from tests.compute.test_mamba3_ref import make_inputs
from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref
from tvm_mamba.runtime.dispatch import record_keys
from tvm_mamba.torch_ops.mamba3 import mamba3_siso_combined

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
ACT = ("Q", "K", "V", "Z")
# three sequences of 3, 6 and 2 positions: a boundary inside a chunk of 4, one on a chunk edge (position 9 is
# not; 3 and 9 fall inside chunks 0 and 2), so every mask of the SSD pieces and the preprocess is crossed
CU = [0, 3, 9, 11]


def _packed(dtype, seed=4) -> dict:
    inp = make_inputs(batch=1, seqlen=CU[-1], nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=seed, states=False,
                      dtype=F64)
    return {k: v.to(dtype if k in ACT else F32) for k, v in inp.items()}


def _cu(values=CU):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_out_and_final_states_match_reference(dtype):
    inp = _packed(dtype)
    with record_keys() as used:
        out, *final = mamba3_siso_combined(**inp, chunk_size=4, return_final_states=True, cu_seqlens=_cu())
    assert ("ssd", "chunk_state_varlen") in [(k.op, k.direction) for k, _ in used]
    ref, *ref_final = mamba3_siso_combined_ref(**inp, cu_seqlens=_cu(), return_final_states=True)
    assert [tuple(f.shape) for f in final] == [(3, 4, 2), (3, 4, 4, 8), (3, 4, 8), (3, 4, 4)]
    if dtype == BF16:
        low, *low_final = mamba3_siso_combined_ref(**inp, cu_seqlens=_cu(), return_final_states=True, dtype=BF16)
        assert_close_to_ref(out, ref, low, name="out")
        for name, got, r, lo in zip(("angle", "ssm", "k"), final, ref_final, low_final):
            assert_close_to_ref(got, r, lo, atol=1e-4, name=name)
    else:
        for name, got, r in zip(("out", "angle", "ssm", "k", "v"), (out, *final), (ref, *ref_final)):
            assert_close_to_ref(got, r, atol=2e-5, rtol=2e-5, name=name)


def _grads(fn, inp: dict, cot: list) -> dict:
    outs = fn(**inp)
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cot) if c is not None)
    names = [k for k, v in inp.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    return dict(zip(names, torch.autograd.grad(loss, [inp[n] for n in names])))


def _states(seed=9, nseq=3):
    return make_inputs(batch=nseq, seqlen=1, nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=seed, dtype=F32)["Input_States"]


@pytest.mark.parametrize("with_states", [False, True])
def test_gradients_match_reference(with_states):
    """Gradients of out and of every final state per sequence (the ssm state's, and the input states', on the
    left-padded batch), against autograd of the float64 reference."""
    base = _packed(F32, seed=6)
    if with_states:
        base.update(zip(("angle", "ssm", "kst", "vst"), _states()))
    g = torch.Generator().manual_seed(7)
    cot = [torch.randn(1, CU[-1], 4, 4, generator=g, dtype=F64), torch.randn(3, 4, 2, generator=g, dtype=F64),
           torch.randn(3, 4, 4, 8, generator=g, dtype=F64), torch.randn(3, 4, 8, generator=g, dtype=F64),
           torch.randn(3, 4, 4, generator=g, dtype=F64)]

    def call(fn, **kw):
        states = tuple(kw.pop(k) for k in ("angle", "ssm", "kst", "vst")) if with_states else None
        return fn(**kw, Input_States=states, return_final_states=True, cu_seqlens=_cu())

    leaves = lambda dtype: {k: v.detach().to(dtype).requires_grad_() for k, v in base.items()}  # noqa: E731
    got = _grads(lambda **kw: call(mamba3_siso_combined, chunk_size=4, **kw), leaves(F32), cot)
    want = _grads(lambda **kw: call(mamba3_siso_combined_ref, **kw), leaves(F64), cot)
    assert set(got) == set(want) == set(base)
    for name, gr in got.items():
        assert_close_to_ref(gr, want[name], atol=1e-4 * max(1.0, want[name].abs().max().item()), rtol=1e-4,
                            name=f"d{name}")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_input_states_per_sequence(dtype):
    """Each sequence starts from its row of Input_States (an empty second sequence keeps its row as final
    states); sequences of 3, 0 and 8 positions over chunks of 4."""
    inp, cu = _packed(dtype, seed=10), _cu([0, 3, 3, 11])
    states = _states(seed=11)
    out, *final = mamba3_siso_combined(**inp, Input_States=states, chunk_size=4, return_final_states=True,
                                       cu_seqlens=cu)
    ref, *ref_final = mamba3_siso_combined_ref(**inp, Input_States=states, cu_seqlens=cu, return_final_states=True)
    low = (mamba3_siso_combined_ref(**inp, Input_States=states, cu_seqlens=cu, return_final_states=True, dtype=BF16)
           if dtype == BF16 else None)
    for i, (name, got, r) in enumerate(zip(("out", "angle", "ssm", "k", "v"), (out, *final), (ref, *ref_final))):
        if low is None:
            assert_close_to_ref(got, r, atol=2e-5, rtol=2e-5, name=name)
        else:
            assert_close_to_ref(got, r, low[i], atol=1e-4, name=name)
    for got, st in zip(final, states):
        torch.testing.assert_close(got[1], st[1].to(got.dtype), rtol=0, atol=0)  # v: in V's dtype


def test_empty_sequence_changes_nothing_else():
    """An empty sequence between two others: the same out, zero final states for its row."""
    inp = _packed(F32, seed=8)
    out, *final = mamba3_siso_combined(**inp, chunk_size=4, return_final_states=True, cu_seqlens=_cu([0, 3, 3, 11]))
    out2, *final2 = mamba3_siso_combined(**inp, chunk_size=4, return_final_states=True, cu_seqlens=_cu([0, 3, 11]))
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    for f, f2 in zip(final, final2):
        assert torch.equal(f[1], torch.zeros_like(f[1]))
        torch.testing.assert_close(f[[0, 2]], f2, rtol=0, atol=0)


def test_bad_cu_seqlens_and_state_rows():
    inp = _packed(F32)
    with pytest.raises(ValueError, match=r"Input_States \(angle_state\).*\(3, 4, 2\)"):
        mamba3_siso_combined(**inp, Input_States=_states(nseq=2), cu_seqlens=_cu())
    for bad, match in (([0, 3, 10], "end at seqlen"), ([1, 3, 11], "start at 0"), ([0, 9, 3, 11], "non-decreasing")):
        with pytest.raises(ValueError, match=match):
            mamba3_siso_combined(**inp, cu_seqlens=_cu(bad))
    two = {k: torch.cat([v, v]) if k in ("Q", "K", "V", "Z", "ADT", "DT", "Trap", "Angles") else v
           for k, v in inp.items()}
    with pytest.raises(ValueError, match="batch 1"):
        mamba3_siso_combined(**two, cu_seqlens=_cu())
