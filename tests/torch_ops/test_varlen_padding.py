"""Packed sequences followed by padding: cu_seqlens[-1] < seqlen, as mamba_ssm 2.3.2.post1's
test_generation_varlen_with_padding passes it (the positions from cu_seqlens[-1] on belong to no sequence).

Upstream's meaning, matched here: cu_seqlens only bounds the varlen states (``chunk_state_varlen`` reads
positions cu[i] .. cu[i+1]-1, ``causal_conv1d_varlen_states`` the last tokens before cu[i+1]); y and the
final state follow seq_idx alone, whatever ids the padding carries (upstream's test leaves the last
sequence's id there, a vLLM-style caller marks it -1: causal-conv1d's padding marker). Checked against each
sequence run alone through the float64 recurrence, on the CPU kernels and on the CUDA kernels through the
harness, and against the same row cut at cu[-1] (bit for bit: the padding changes nothing before it).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import tvm_mamba
from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.ssd import ssd_recurrence_ref
from tvm_mamba.torch_ops.causal_conv1d import causal_conv1d_varlen_states
from tvm_mamba.torch_ops.mamba_split import mamba_split_conv1d_scan_combined
from tvm_mamba.torch_ops.ssd import mamba_chunk_scan_combined

H, G, P, N, Q = 4, 2, 8, 16, 16  # as test_ssd_varlen.py (shared kernel builds)
# sequence 0 ends in chunk 0 (it holds initial_states), 1 spans chunks 0-2, 2 is empty, 3 ends inside chunk 2;
# positions 48..59 are padding (the rest of chunk 2 and chunk 3)
CU = [0, 5, 37, 37, 48]
SEQLEN = 60
FULL = dict(dt_softplus=True, dt_limit=(0.0, 2.0))
# the padding's seq_idx: a sequence of its own (what Mamba2 derives), -1 (causal-conv1d's padding marker) or
# the last sequence's id continued (y there continues sequence 3; its varlen state still stops at cu[-1])
TAILS = {"own": len(CU) - 1, "negative": -1, "last": len(CU) - 2}
TARGETS = ("cpu", "cudasim")


def _target(name):
    return tvm_mamba.simulate_cuda("sm_90") if name == "cudasim" else contextlib.nullcontext()


def _inputs(seed=0, seqlen=SEQLEN):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    return dict(x=r(1, seqlen, H, P), dt=r(1, seqlen, H) - 1.0, A=-(torch.rand(H, generator=g) + 0.5),
                B=r(1, seqlen, G, N, scale=0.5), C=r(1, seqlen, G, N, scale=0.5), D=r(H, P), z=r(1, seqlen, H, P),
                dt_bias=r(H, scale=0.5), initial_states=r(1, H, P, N, scale=0.5))


def _seq_idx(tail: int) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(CU) - 1, dtype=torch.int32), torch.diff(torch.tensor(CU)))
    return torch.cat([ids, torch.full((SEQLEN - CU[-1],), tail, dtype=torch.int32)])[None]


def _ours(inp, **kw):
    return mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q, D=inp["D"], z=inp["z"],
                                     dt_bias=inp["dt_bias"], initial_states=inp["initial_states"], **FULL, **kw)


def _alone(inp, s: int, e: int, first: bool):
    """Positions s .. e-1 run alone through the float64 recurrence (initial_states only for the row's first
    sequence) -> (y (e - s, nheads, headdim), final state (nheads, headdim, dstate))."""
    d = {k: v.double() for k, v in inp.items()}
    cut = {k: d[k][:, s:e] for k in ("x", "dt", "B", "C", "z")}
    y, h = ssd_recurrence_ref(cut["x"], cut["dt"], d["A"], cut["B"], cut["C"], D=d["D"], z=cut["z"],
                              dt_bias=d["dt_bias"], initial_states=d["initial_states"] if first else None,
                              return_final_states=True, **FULL)
    return y[0], h[0]


def _close(got, want, name):
    assert_close_to_ref(got, want, atol=2e-5 * max(want.abs().max().item(), 1.0), rtol=1e-4, name=name)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tail", list(TAILS))
def test_ssd_padding_is_no_sequence(target, tail):
    """Every sequence's y and varlen state equal it run alone (an empty one: a zero state); the padding's y and
    the final state are those of the padding run alone (or, with the last id continued, of sequence 3 run on
    through the padding); y before cu[-1] and the varlen states equal the row cut at cu[-1], bit for bit."""
    inp, seq = _inputs(), _seq_idx(TAILS[tail])
    with _target(target):
        y, final, varlen = _ours(inp, seq_idx=seq, cu_seqlens=torch.tensor(CU, dtype=torch.int32),
                                 return_final_states=True, return_varlen_states=True)
        cut = {k: v[:, :CU[-1]] if v.dim() >= 3 and k != "initial_states" else v for k, v in inp.items()}
        y_cut, v_cut = _ours(cut, seq_idx=seq[:, :CU[-1]].contiguous(), cu_seqlens=torch.tensor(CU),
                             return_varlen_states=True)
    assert varlen.shape == (len(CU) - 1, H, P, N)
    for i, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
        if s == e:
            assert torch.all(varlen[i] == 0), f"empty sequence {i}: state not zero"
            continue
        y_ref, h_ref = _alone(inp, s, e, first=i == 0)
        _close(y[0, s:e], y_ref, f"y of sequence {i}")
        _close(varlen[i], h_ref, f"varlen state {i}")
    pad_from = CU[-2] if tail == "last" else CU[-1]  # sequence 3 runs on through the padding
    y_ref, h_ref = _alone(inp, pad_from, SEQLEN, first=False)
    _close(y[0, pad_from:], y_ref, "y of the padding")
    _close(final[0], h_ref, "final state (after the padding)")
    assert torch.equal(y[:, :CU[-1]], y_cut) and torch.equal(varlen, v_cut)


def test_ssd_padding_gradients_follow_seq_idx():
    """Backward with the padding marked -1: every gradient equals the float64 recurrence's autograd with the
    same seq_idx (the padding a sequence of its own: it passes nothing back to the sequences before it)."""
    inp, seq = _inputs(seed=1), _seq_idx(-1)
    dy = torch.randn(1, SEQLEN, H, P, generator=torch.Generator().manual_seed(2))
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

    def grads(fn, dtype):
        leaves = {k: v.detach().clone().to(dtype).requires_grad_(k in names) for k, v in inp.items()}
        y = fn(leaves)
        y.backward(dy.to(dtype))
        return {k: leaves[k].grad for k in names}

    got = grads(lambda t: _ours(t, seq_idx=seq), torch.float32)
    want = grads(lambda t: ssd_recurrence_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"],
                                              dt_bias=t["dt_bias"], initial_states=t["initial_states"],
                                              seq_idx=seq, **FULL), torch.float64)
    for k in names:
        _close(got[k], want[k], f"d{k}")
    # what the padding's dy reaches: its own positions only
    tail = grads(lambda t: _ours(t, seq_idx=seq) * (torch.arange(SEQLEN) >= CU[-1])[None, :, None, None],
                 torch.float32)
    assert torch.all(tail["x"][:, :CU[-1]] == 0) and torch.all(tail["initial_states"] == 0)


@pytest.mark.parametrize("target", TARGETS)
def test_conv_varlen_states_ignore_padding(target):
    """causal_conv1d_varlen_states with tokens after cu[-1]: each sequence's last state_len tokens, right
    aligned (zeros left of a short one, an empty one all zeros), never a padding token."""
    dim, state_len = 24, 4  # as test_causal_conv1d.py
    x = torch.randn(SEQLEN, dim, generator=torch.Generator().manual_seed(3))
    with _target(target):
        states = causal_conv1d_varlen_states(x, torch.tensor(CU, dtype=torch.int32), state_len)
        cut = causal_conv1d_varlen_states(x[:CU[-1]].contiguous(), torch.tensor(CU), state_len)
    assert states.shape == (len(CU) - 1, dim, state_len) and torch.equal(states, cut)
    for i, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
        want = torch.zeros(dim, state_len)
        n = min(e - s, state_len)
        if n:
            want[:, state_len - n:] = x[e - n:e].T
        assert torch.equal(states[i], want), f"sequence {i}"


@pytest.fixture
def no_kernel(monkeypatch):
    from tvm_mamba.torch_ops import _dlpack, causal_conv1d, ssd

    def refuse(*a, **k):
        raise AssertionError("a kernel was requested before validation finished")

    for module in (_dlpack, causal_conv1d, ssd):
        monkeypatch.setattr(module, "kernel_for", refuse)


BAD_CU = [  # (cu_seqlens, exception, what mamba_chunk_scan_combined says, what causal_conv1d_varlen_states says)
    ([1, 5, 48], ValueError, "must start at 0", "must start at 0"),
    ([0, 37, 5, 48], ValueError, "must be non-decreasing", "must be non-decreasing"),
    ([0, 5, SEQLEN + 1], ValueError, f"must end at seqlen={SEQLEN} or before it",
     f"end at or before total_tokens = {SEQLEN}"),
    ([0.0, 5.0, 48.0], TypeError, "dtype must be one of", "dtype must be one of"),
]


@pytest.mark.parametrize("cu,exc,ssd_says,conv_says", BAD_CU, ids=["start", "decreasing", "past-seqlen", "float"])
def test_bad_cu_seqlens_refused_before_any_kernel(no_kernel, cu, exc, ssd_says, conv_says):
    """Truly bad cu_seqlens stay refused, naming the argument, before any kernel runs."""
    cu = torch.tensor(cu, dtype=torch.float32 if exc is TypeError else torch.int32)
    with pytest.raises(exc, match=f"cu_seqlens: {ssd_says}"):
        _ours(_inputs(), cu_seqlens=cu, return_varlen_states=True)
    with pytest.raises(exc, match=f"cu_seqlens: .*{conv_says}"):
        causal_conv1d_varlen_states(torch.randn(SEQLEN, 24), cu, 4)


@pytest.mark.parametrize("ids,name", [
    ([0] * 20 + [-1] * 20 + [1] * 20, "a sequence after the padding"),
    ([0] * 30 + [-1] * 15 + [-2] * 15, "padding ids decreasing"),
    ([0] * 30 + [1] * 15 + [0] * 15, "an id back after another (0 1 0)"),
])
def test_seq_idx_negative_only_as_trailing_padding(no_kernel, ids, name):
    """Negative ids only from some position to the row's end (each id still one contiguous run, so the
    kernels' answers do not depend on chunk_size); anything else is refused, naming seq_idx."""
    inp, seq = _inputs(), torch.tensor([ids], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_idx: must be nondecreasing"):
        _ours(inp, seq_idx=seq)
    zx = torch.randn(1, SEQLEN, 2 * 16 + 2 * 8 + 2)
    with pytest.raises(ValueError, match="seq_idx: must be nondecreasing"):
        mamba_split_conv1d_scan_combined(zx, torch.randn(16 + 16, 4), None, torch.zeros(2), -torch.ones(2),
                                         torch.ones(2), 16, seq_idx=seq, headdim=8)


def test_seq_idx_must_match_cu_seqlens_before_the_padding(no_kernel):
    """With padding, seq_idx must still change exactly where a sequence starts before cu[-1]."""
    inp, seq = _inputs(), _seq_idx(-1)
    seq[0, 40:CU[-1]] = len(CU) - 1  # a new id inside sequence 3 (still nondecreasing)
    with pytest.raises(ValueError, match="cu_seqlens: inconsistent with seq_idx at position 40"):
        _ours(inp, seq_idx=seq, cu_seqlens=torch.tensor(CU), return_varlen_states=True)
