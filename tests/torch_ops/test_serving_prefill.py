"""torch_ops/serving_prefill.py: vLLM's packed prefill forms (conv, Mamba-2 SSD, Mamba-1 scan) with
per-sequence initial states read from pool slots and final states written back, against float64
references run sequence by sequence from the math."""
from __future__ import annotations

import contextlib

import pytest
import torch

import tvm_mamba
from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref
from tvm_mamba.reference.selective_scan import selective_scan_ref
from tvm_mamba.reference.ssd import ssd_recurrence_ref
from tvm_mamba.torch_ops import serving_prefill as sp

LENS = [5, 1, 9, 3]  # one sequence shorter than the conv's state
POOL = 6


def _target(sim: bool):
    """The CUDA kernels through the CPU harness, or the CPU kernels."""
    return tvm_mamba.simulate_cuda("sm_90") if sim else contextlib.nullcontext()


# (dtype, sim): both dtypes on the CPU kernels, float32 on the CUDA kernels through the harness
CASES = [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
CASE_IDS = ["fp32-cpu", "bf16-cpu", "fp32-cudasim"]


def _loc(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)


def _page_pool(pool, *shape, dtype, g):
    """A pool whose slots are views into larger pages (vLLM's layout): the rest of each page must stay as is."""
    pages = torch.randn(pool, int(torch.tensor(shape).prod()) + 7, generator=g).to(dtype)
    return pages, pages[:, 7:].view(pool, *shape)


@pytest.mark.parametrize("dtype, sim", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("with_init", [False, True])
def test_conv_prefill_continues_slots_and_writes_final_states(dtype, sim, with_init):
    g = torch.Generator().manual_seed(0)
    dim, width, tokens = 16, 4, sum(LENS)
    x = torch.randn(tokens, dim, generator=g).to(dtype).t()  # (dim, tokens), channel-last as vLLM passes it
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    pages, raw = _page_pool(POOL, width - 1, dim, dtype=dtype, g=g)
    conv_states = raw.transpose(1, 2)  # vLLM's SD layout: (pool, dim, width - 1), dim innermost
    before, pages0 = conv_states.clone(), pages.clone()
    slots = torch.tensor([4, 1, 5, 2], dtype=torch.int32)
    init = torch.tensor([True, False, True, True]) if with_init else torch.zeros(4, dtype=torch.bool)
    with _target(sim):
        out = sp.causal_conv1d_fn(x, weight, bias, conv_states, _loc(LENS), cache_indices=slots,
                                  has_initial_state=init, activation="silu")
    assert out.shape == x.shape and out.stride() == x.stride() and out.dtype == dtype
    bounds = _loc(LENS).tolist()
    for i, slot in enumerate(slots.tolist()):
        s, e = bounds[i], bounds[i + 1]
        start = before[slot][None].double() if init[i] else torch.zeros(1, dim, width - 1, dtype=torch.float64)
        y, final = causal_conv1d_ref(x[None, :, s:e].double(), weight.double(), bias.double(), initial_states=start,
                                     return_final_states=True, activation="silu")
        torch.testing.assert_close(out[:, s:e].double(), y[0], **_tol(dtype))
        torch.testing.assert_close(conv_states[slot].double(), final[0], **_tol(dtype))
    untouched = [0, 3]
    assert torch.equal(conv_states[untouched], before[untouched])
    assert torch.equal(pages[:, :7], pages0[:, :7])


def test_conv_prefill_padding_slot_and_bad_indices():
    g = torch.Generator().manual_seed(1)
    dim, width = 8, 4
    x = torch.randn(dim, sum(LENS), generator=g)
    weight = torch.randn(dim, width, generator=g)
    conv_states = torch.randn(POOL, dim, width - 1, generator=g)
    before = conv_states.clone()
    slots = torch.tensor([3, -1, 0, 2], dtype=torch.int32)  # sequence 1 is padding (vLLM's PAD_SLOT_ID)
    out = sp.causal_conv1d_fn(x, weight, None, conv_states, _loc(LENS), cache_indices=slots, activation=None)
    assert torch.equal(out[:, 5:6], torch.zeros(dim, 1))
    y, final = causal_conv1d_ref(x[None, :, :5].double(), weight.double(), return_final_states=True)
    torch.testing.assert_close(out[:, :5].double(), y[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_states[3].double(), final[0], atol=1e-6, rtol=1e-6)
    for bad, match in [(torch.tensor([3, 9, 0, 2], dtype=torch.int32), "cache_indices"),
                       (torch.tensor([3, 3, 0, 2], dtype=torch.int32), "same slot")]:
        conv_states.copy_(before)
        with pytest.raises(ValueError, match=match):
            sp.causal_conv1d_fn(x, weight, None, conv_states, _loc(LENS), cache_indices=bad)
        assert torch.equal(conv_states, before)
    with pytest.raises(ValueError, match="query_start_loc"):
        sp.causal_conv1d_fn(x, weight, None, conv_states, torch.tensor([0, 30], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state_idx"):
        sp.causal_conv1d_fn(x, weight, None, conv_states, _loc(LENS), initial_state_idx=torch.zeros(4))


def _ssd_inputs(dtype, g, tokens, H=4, P=8, G=2, N=16):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(tokens, H, P).to(dtype), dt=r(tokens, H).to(dtype), A=-torch.rand(H, generator=g) - 0.5,
                B=r(tokens, G, N).to(dtype), C=r(tokens, G, N).to(dtype), D=r(H), dt_bias=r(H))


@pytest.mark.parametrize("dtype, sim", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("with_init", [False, True])
def test_ssd_prefill_per_sequence_initial_states(dtype, sim, with_init):
    g = torch.Generator().manual_seed(2)
    lens = [40, 3, 17]
    tokens = sum(lens)
    inp = _ssd_inputs(dtype, g, tokens)
    H, P, N = 4, 8, 16
    init = torch.randn(len(lens), H, P, N, generator=g) if with_init else None
    if init is not None:
        init[1] = 0  # vLLM passes zeros for a sequence without a state (torch.where(has_initial_states, ...))
    out = torch.full((tokens, H, P), float("nan"), dtype=dtype)
    with _target(sim):
        states = sp.mamba_chunk_scan_combined_varlen(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, _loc(lens), out=out, D=inp["D"],
            dt_bias=inp["dt_bias"], initial_states=init, dt_softplus=True, state_dtype=torch.float32)
    assert states.shape == (3, H, P, N) and states.dtype == torch.float32
    bounds = _loc(lens).tolist()
    d = lambda t, s, e: t[None, s:e].double()  # noqa: E731
    for i in range(len(lens)):
        s, e = bounds[i], bounds[i + 1]
        start = init[i:i + 1].double() if init is not None else None
        y, final = ssd_recurrence_ref(d(inp["x"], s, e), d(inp["dt"], s, e), inp["A"].double(), d(inp["B"], s, e),
                                      d(inp["C"], s, e), inp["D"].double(), None, inp["dt_bias"].double(),
                                      initial_states=start, dt_softplus=True, return_final_states=True)
        torch.testing.assert_close(out[s:e].double(), y[0], **_tol(dtype))
        torch.testing.assert_close(states[i].double(), final[0], **_tol(dtype))


def test_ssd_prefill_refusals():
    g = torch.Generator().manual_seed(3)
    inp = _ssd_inputs(torch.float32, g, 8)
    out = torch.empty(8, 4, 8)
    with pytest.raises(ValueError, match="cu_chunk_seqlens"):
        sp.mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, _loc([8]),
                                            out=out, return_intermediate_states=True)
    with pytest.raises(ValueError, match="out"):
        sp.mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, _loc([8]),
                                            out=torch.empty(7, 4, 8))
    with pytest.raises(ValueError, match="cu_seqlens"):
        sp.mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16,
                                            torch.tensor([0, 9], dtype=torch.int32), out=out)


@pytest.mark.parametrize("dtype, sim", CASES, ids=CASE_IDS)
def test_mamba1_prefill_scan_writes_z_and_pool(dtype, sim):
    g = torch.Generator().manual_seed(4)
    dim, N, tokens = 12, 8, sum(LENS)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    u, delta, z = (r(tokens, dim).to(dtype).t() for _ in range(3))  # (dim, tokens) views, as vLLM's split gives
    B, C = r(1, N, tokens).to(dtype), r(1, N, tokens).to(dtype)
    A, D, bias = -torch.rand(dim, N, generator=g) - 0.1, r(dim), r(dim)
    pages, pool = _page_pool(POOL, dim, N, dtype=dtype, g=g)
    before, pages0 = pool.clone(), pages.clone()
    slots = torch.tensor([2, 0, 5, 4], dtype=torch.int32)  # sequence 1 on the null block: padding
    init = torch.tensor([True, True, False, True])
    z0 = z.clone()
    with _target(sim):
        res = sp.selective_scan_fn(u, pool, delta, A, B, C, D, z, bias, True, query_start_loc=_loc(LENS),
                                   cache_indices=slots, has_initial_state=init)
    assert res is z
    bounds = _loc(LENS).tolist()
    for i, slot in enumerate(slots.tolist()):
        s, e = bounds[i], bounds[i + 1]
        if slot == 0:
            assert torch.equal(z[:, s:e], z0[:, s:e]) and torch.equal(pool[0], before[0])
            continue
        d = lambda t: t[None, ..., s:e].double()  # noqa: E731
        start = before[slot][None].double() if init[i] else None
        y, last = selective_scan_ref(d(u), d(delta), A.double(), d(B), d(C), D.double(), d(z0), bias.double(), True,
                                     return_last_state=True, initial_state=start)
        torch.testing.assert_close(z[:, s:e].double(), y[0], **_tol(dtype))
        torch.testing.assert_close(pool[slot].double(), last[0], **_tol(dtype))
    assert torch.equal(pages[:, :7], pages0[:, :7])
    with pytest.raises(ValueError, match="cache_indices"):
        sp.selective_scan_fn(u, pool, delta, A, B, C, D, z, bias, True, query_start_loc=_loc(LENS),
                             cache_indices=torch.tensor([2, 9, 5, 4], dtype=torch.int32))


def test_ssd_prefill_intermediate_states_at_vllms_chunk_ends():
    """Prefix caching: the state at the end of each logical chunk (vLLM's cu_chunk_seqlens: a continued
    sequence's first chunk is partial, chunks never cross sequences), then the checkpoint store."""
    g = torch.Generator().manual_seed(5)
    lens = [21, 9]
    inp = _ssd_inputs(torch.float32, g, sum(lens))
    H, P, N = 4, 8, 16
    init = torch.randn(2, H, P, N, generator=g)
    edges = [0, 5, 13, 21, 24, 30]  # sequence 0: 5 (finishing a chunk of 8), 8, 8; sequence 1: 3, 6
    out = torch.empty(30, H, P)
    states = sp.mamba_chunk_scan_combined_varlen(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, _loc(lens),
        cu_chunk_seqlens=torch.tensor(edges, dtype=torch.int32), out=out, D=inp["D"], dt_bias=inp["dt_bias"],
        initial_states=init, dt_softplus=True, return_intermediate_states=True, state_dtype=torch.float32)
    assert states.shape == (5, H, P, N)
    d = lambda t, s, e: t[None, s:e].double()  # noqa: E731
    for c, (s, e) in enumerate(zip(edges, edges[1:])):
        seq, first = (0, 0) if s < 21 else (1, 21)
        y, final = ssd_recurrence_ref(d(inp["x"], first, e), d(inp["dt"], first, e), inp["A"].double(),
                                      d(inp["B"], first, e), d(inp["C"], first, e), inp["D"].double(), None,
                                      inp["dt_bias"].double(), initial_states=init[seq:seq + 1].double(),
                                      dt_softplus=True, return_final_states=True)
        torch.testing.assert_close(states[c].double(), final[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[s:e].double(), y[0, s - first:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cu_chunk_seqlens"):  # a chunk across the sequence boundary
        sp.mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, _loc(lens),
                                            cu_chunk_seqlens=torch.tensor([0, 16, 30], dtype=torch.int32), out=out,
                                            return_intermediate_states=True)

    class Checkpoint:  # vLLM's MambaPrefillCheckpointMetadata: per row, its offset (0: none) and block
        checkpoint_offsets = torch.tensor([13, 0], dtype=torch.int32)
        state_indices = torch.tensor([3, 1], dtype=torch.int32)

    x = torch.randn(12, 30, generator=g)  # the pre-conv input (dim, tokens)
    conv, ssm = torch.randn(5, 12, 5, generator=g), torch.randn(5, H, P, N, generator=g)
    conv0, ssm0 = conv.clone(), ssm.clone()
    sp.store_prefill_checkpoint(Checkpoint, torch.tensor([1, -1], dtype=torch.int32), x, conv, states, ssm,
                                _loc(lens), state_len=3)
    assert torch.equal(conv[3, :, :3], x[:, 10:13]) and torch.equal(conv[3, :, 3:], conv0[3, :, 3:])
    assert torch.equal(ssm[3], states[1])
    keep = [0, 1, 2, 4]
    assert torch.equal(conv[keep], conv0[keep]) and torch.equal(ssm[keep], ssm0[keep])
    Checkpoint.state_indices = torch.tensor([7, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="checkpoint"):
        sp.store_prefill_checkpoint(Checkpoint, torch.tensor([1, -1], dtype=torch.int32), x, conv, states, ssm,
                                    _loc(lens), state_len=3)
