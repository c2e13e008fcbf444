"""torch_ops/serving.py: vLLM's call forms of the decode steps (block ids, the null block, dst slots, out=,
speculative decoding), against float64 references that apply vLLM's documented semantics row by row."""
from __future__ import annotations

import contextlib

import pytest
import torch

import tvm_mamba

from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from tvm_mamba.reference.selective_scan import selective_state_update_ref
from tvm_mamba.torch_ops import serving

POOL, H, P, N = 8, 2, 4, 16


def _inputs(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(state=r(POOL, H, P, N), x=r(tokens, H, P), dt=torch.rand(tokens, H, P, generator=g),
                A=-torch.rand(H, P, N, generator=g), B=r(tokens, 1, N), C=r(tokens, 1, N), D=r(H, P), z=r(tokens, H, P),
                dt_bias=r(H, P))


def _ref_step(state_row, inp, t):
    """One token of one sequence from a (H, P, N) state, float64: (out (H, P), new state)."""
    d = lambda k: inp[k].double()  # noqa: E731
    out, new = selective_state_update_ref(state_row[None].double(), d("x")[t:t + 1], d("dt")[t:t + 1], d("A"),
                                          d("B")[t:t + 1], d("C")[t:t + 1], d("D"), d("z")[t:t + 1], d("dt_bias"),
                                          dt_softplus=True)
    return out[0], new[0]


def _call(inp, **kw):
    return serving.selective_state_update(inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                                          inp["z"], inp["dt_bias"], dt_softplus=True, **kw)


@pytest.mark.parametrize("dst_differs", [False, True])
def test_decode_with_block_ids_null_block_dst_and_out(dst_differs):
    inp = _inputs(4)
    pool0 = inp["state"].clone()
    src = torch.tensor([[3, 9], [0, 9], [5, 9], [1, 9]], dtype=torch.int32)  # 2-D; row 1 is the null block
    dst = torch.tensor([[6], [0], [7], [1]], dtype=torch.int32) if dst_differs else None
    out = torch.full((4, H, P), 99.0)
    got = _call(inp, state_batch_indices=src, dst_state_batch_indices=dst, out=out)
    assert got is out
    want_pool = pool0.double()
    for b, (s, d) in enumerate(zip([3, 0, 5, 1], [6, 0, 7, 1] if dst_differs else [3, 0, 5, 1])):
        if s == serving.NULL_BLOCK_ID:
            assert torch.equal(out[b], torch.zeros(H, P))
            continue
        o, new = _ref_step(pool0[s], inp, b)
        torch.testing.assert_close(out[b].double(), o, rtol=1e-5, atol=1e-5)
        want_pool[d] = new
    torch.testing.assert_close(inp["state"].double(), want_pool, rtol=1e-5, atol=1e-5)  # src slots kept when dst


@pytest.mark.parametrize("varlen", [False, True])
def test_speculative_decoding_writes_the_state_after_each_token(varlen):
    """num_accepted_tokens picks each sequence's starting slot among its blocks; each token's state goes to its
    dst block (the null block: not kept). varlen: 3, 1 and 2 tokens per sequence; else one token each."""
    lens = [3, 1, 2] if varlen else [1, 1, 1]
    inp = _inputs(sum(lens), seed=1)
    pool0 = inp["state"].clone()
    src = torch.tensor([[2, 3, 4], [5, 0, 0], [0, 6, 7]], dtype=torch.int32)
    dst = torch.tensor([[2, 3, 4], [5, 0, 0], [1, 6, 0]], dtype=torch.int32)
    accepted = torch.tensor([2, 1, 1], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) if varlen else None
    out = _call(inp, state_batch_indices=src, dst_state_batch_indices=dst, num_accepted_tokens=accepted,
                cu_seqlens=cu)
    want_pool, bos = pool0.double(), 0
    for b, n in enumerate(lens):
        s = int(src[b, max(int(accepted[b]) - 1, 0)])
        state = pool0[s].double() if s != serving.NULL_BLOCK_ID else torch.zeros(H, P, N, dtype=torch.float64)
        for i in range(n):
            o, state = _ref_step(state, inp, bos + i)
            torch.testing.assert_close(out[bos + i].double(), o, rtol=1e-5, atol=1e-5)
            if int(dst[b, i]) != serving.NULL_BLOCK_ID:
                want_pool[int(dst[b, i])] = state
        bos += n
    torch.testing.assert_close(inp["state"].double(), want_pool, rtol=1e-5, atol=1e-5)


def test_conv_update_block_ids_prefix_pointers_and_in_place_x():
    g = torch.Generator().manual_seed(2)
    D, W = 16, 4
    page = torch.randn(POOL, W - 1, D + 8, generator=g)
    state = page[:, :, :D].transpose(1, 2)  # vLLM's SD layout: (state_len, dim) stored, (dim, state_len) passed
    pool0, page0 = state.clone(), page.clone()
    x, w, b = torch.randn(3, D, generator=g), torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    x0 = x.clone()
    blocks = torch.tensor([[4, 5], [0, 0], [2, 6]], dtype=torch.int32)
    first, last = torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([1, 0, 1], dtype=torch.int32)
    got = serving.causal_conv1d_update(x, state, w, b, True, blocks, initial_state_idx=first,
                                       block_idx_last_scheduled_token=last)
    assert got is x  # out=None: vLLM overwrites x
    for row, (s, d) in enumerate([(4, 5), (0, 0), (2, 6)]):
        if s == serving.NULL_BLOCK_ID:
            assert torch.equal(x[row], torch.zeros(D))
            continue
        o, new = causal_conv1d_update_ref(x0[row:row + 1].double(), pool0[s:s + 1].double(), w.double(), b.double(),
                                          "silu")
        torch.testing.assert_close(x[row].double(), o[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[d].double(), new[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(state[s], pool0[s])  # read from the first block, written to the last
    assert torch.equal(page[:, :, D:], page0[:, :, D:])  # the rest of each page
    assert torch.equal(state[[1, 3, 7]], pool0[[1, 3, 7]])  # blocks no row names


def test_refusals_name_the_argument():
    inp = _inputs(2)
    with pytest.raises(ValueError, match="enable_stochastic_rounding"):
        _call(inp, enable_stochastic_rounding=True)
    with pytest.raises(TypeError, match="state_batch_indices"):
        _call(inp, state_batch_indices=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="out"):
        _call(inp, out=torch.empty(3, H, P))
    x, state, w = torch.randn(2, 8), torch.randn(4, 8, 3), torch.randn(8, 4)
    with pytest.raises(ValueError, match="conv_state_indices"):
        serving.causal_conv1d_update(x, state, w, num_accepted_tokens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_accepted_tokens"):  # a window past the state's columns
        serving.causal_conv1d_update(x, state, w, conv_state_indices=torch.tensor([1, 2], dtype=torch.int32),
                                     num_accepted_tokens=torch.tensor([1, 3], dtype=torch.int32))
    blocks = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_idx_last_scheduled_token"):
        serving.causal_conv1d_update(x, state, w, conv_state_indices=blocks,
                                     block_idx_last_scheduled_token=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="conv_state_indices: block ids"):
        serving.causal_conv1d_update(x, state, w, conv_state_indices=torch.tensor([[1, 9], [3, 0]], dtype=torch.int32),
                                     block_idx_last_scheduled_token=torch.tensor([1, 0], dtype=torch.int32))


def test_block_ids_out_of_the_pool_are_refused_before_anything_is_written():
    inp = _inputs(2)
    pool0 = inp["state"].clone()
    src = torch.tensor([[3], [2]], dtype=torch.int32)
    cases = [(dict(state_batch_indices=src, dst_state_batch_indices=torch.tensor([[4], [POOL]], dtype=torch.int32)),
              "dst_state_batch_indices: block ids"),
             (dict(state_batch_indices=torch.tensor([[3], [-2]], dtype=torch.int32),
                   dst_state_batch_indices=torch.tensor([[4], [5]], dtype=torch.int32)), "state_batch_indices: block"),
             (dict(state_batch_indices=src, dst_state_batch_indices=torch.tensor([[4], [4]], dtype=torch.int32)),
              "same block"),
             (dict(state_batch_indices=torch.tensor([[3, POOL + 1], [2, 1]], dtype=torch.int32),
                   num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32)), "state_batch_indices: block ids"),
             (dict(state_batch_indices=torch.tensor([[3], [2]], dtype=torch.int32),
                   num_accepted_tokens=torch.tensor([2, 1], dtype=torch.int32)), "num_accepted_tokens")]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _call(inp, **kw)
        assert torch.equal(inp["state"], pool0)


@pytest.mark.parametrize("dtype, sim", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32-cpu", "bf16-cpu", "fp32-cudasim"])
@pytest.mark.parametrize("form", ["speculative", "packed"])
def test_conv_update_sliding_window_of_speculative_and_packed_steps(form, dtype, sim):
    """vLLM's multi-token conv step: each sequence's window starts num_accepted - 1 columns into its slot (a
    state of width - 1 + num_spec columns), its tokens follow; the slot becomes the window less its first column
    then the tokens (speculative), or shifts by its token count (packed), over state_len - (max_query_len -
    tokens) columns (vLLM's Triton kernel's rules). Reference: float64 causal_conv1d_ref from the window's
    columns; the new state cut from old columns + tokens."""
    g = torch.Generator().manual_seed(7)
    D, W, spec = 8, 4, 2
    state_len = W - 1 + spec if form == "speculative" else W - 1
    pool = torch.randn(6, state_len, D, generator=g).to(dtype).transpose(1, 2)  # vLLM's SD layout
    pool0 = pool.clone()
    lens = [3, 3, 1, 2] if form == "speculative" else [1, 3, 2, 2]
    loc = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(sum(lens), D, generator=g).to(dtype)
    w, bias = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    slots = torch.tensor([[4, 0, 0], [0, 0, 0], [2, 0, 0], [5, 0, 0]], dtype=torch.int32)  # row 1: null block
    accepted = torch.tensor([2, 1, 1, 3], dtype=torch.int32) if form == "speculative" else None
    out = torch.full_like(x, float("nan"))
    with tvm_mamba.simulate_cuda("sm_90") if sim else contextlib.nullcontext():
        res = serving.causal_conv1d_update(x, pool, w, bias, "silu", conv_state_indices=slots,
                                           num_accepted_tokens=accepted, query_start_loc=loc, max_query_len=3,
                                           out=out)
    assert res is out
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for b, n in enumerate(lens):
        s, e, slot = int(loc[b]), int(loc[b + 1]), int(slots[b, 0])
        if slot == 0:
            assert torch.equal(out[s:e], torch.zeros_like(out[s:e]))
            continue
        o = int(accepted[b]) - 1 if accepted is not None else 0
        old = pool0[slot].double()
        y = causal_conv1d_ref(x[s:e].t()[None].double(), w.double(), bias.double(),
                              initial_states=old[None, :, o:o + W - 1], activation="silu")
        torch.testing.assert_close(out[s:e].double(), y[0].t(), **tol)
        span = state_len - (3 - n)
        if form == "speculative":  # the window without its first column, then the tokens
            want = torch.cat([old[:, o:o + W - 1], x[s:e].t().double()], -1)[:, 1:1 + span]
        else:  # shifted by the token count
            want = torch.cat([old[:, :span], x[s:e].t().double()], -1)[:, n:n + span]
        torch.testing.assert_close(pool[slot, :, :span].double(), want, **tol)
        assert torch.equal(pool[slot, :, span:], pool0[slot, :, span:])
    assert torch.equal(pool[[0, 1, 3]], pool0[[0, 1, 3]])


@pytest.mark.parametrize("layout", ["heads", "tied", "mamba1"])
def test_decode_out_is_written_by_the_kernel_or_copied_when_it_cannot_be(layout):
    """vLLM's decode call with 1-D slots and ``out``: the kernel writes ``out`` itself (no output allocated,
    a repeated call's recipe takes ``out`` as an input), bitwise the mamba_ssm form's result; an ``out`` that is
    strided or shares memory with an input (here x itself) gets the result copied instead, same values."""
    from tvm_mamba.torch_ops import selective_scan as scan_ops

    inp = _inputs(3, seed=4)
    if layout == "tied":
        inp.update(dt=inp["dt"][:, :, :1].expand(3, H, P), A=inp["A"][:, :1, :1].expand(H, P, N),
                   D=inp["D"][:, :1].expand(H, P), dt_bias=inp["dt_bias"][:, :1].expand(H, P))
    if layout == "mamba1":
        dim = H * P
        inp = dict(state=inp["state"].reshape(POOL, dim, N), x=inp["x"].reshape(3, dim), dt=inp["dt"].reshape(3, dim),
                   A=inp["A"].reshape(dim, N), B=inp["B"][:, 0], C=inp["C"][:, 0], D=inp["D"].reshape(dim),
                   z=inp["z"].reshape(3, dim), dt_bias=inp["dt_bias"].reshape(dim))
    idx = torch.tensor([5, 0, 2], dtype=torch.int32)  # row 1: the null block
    pool0 = inp["state"].clone()
    want = tvm_mamba.selective_state_update(pool0.clone(), *(inp[k] for k in ("x", "dt", "A", "B", "C", "D", "z",
                                                                                "dt_bias")),
                                            dt_softplus=True, state_batch_indices=torch.tensor([5, -1, 2]))
    scan_ops._SSU_FAST.clear()
    for _ in range(3):
        inp["state"].copy_(pool0)
        out = torch.full_like(inp["x"], float("nan"))
        assert _call(inp, state_batch_indices=idx, out=out) is out
        assert torch.equal(out, want)
    (recipe,) = scan_ops._SSU_FAST._hot
    assert recipe.outputs == () and recipe.result == ("id", 10)  # the kernel wrote out: nothing allocated for it
    for out in (torch.full((3, 2 * out.numel() // 3), float("nan"))[:, ::2].view(out.shape), inp["x"].clone()):
        inp["state"].copy_(pool0)
        if out.is_contiguous():  # out is x: the kernel must not write what it reads
            inp["x"], x = out, out.clone()
            got = _call(inp, state_batch_indices=idx, out=out)
            inp["x"] = x
        else:
            got = _call(inp, state_batch_indices=idx, out=out)
        assert got is out and torch.equal(out, want)
    scan_ops._SSU_FAST.clear()


def test_conv_decode_over_x_is_written_by_the_kernel_or_copied_when_it_cannot_be():
    """vLLM's conv step with 1-D slots and no ``out``: the kernel writes the result over x itself (a
    repeated call's recipe allocates nothing and returns x), bitwise the mamba form's result; a strided x
    (a row slice of a projection's output) gets the result copied over it instead, same values."""
    from tvm_mamba.torch_ops import causal_conv1d as conv_ops

    g = torch.Generator().manual_seed(5)
    D, W = 24, 4
    state0, w, b = torch.randn(POOL, D, W - 1, generator=g), torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    idx = torch.tensor([6, 0, 3], dtype=torch.int32)  # row 1: the null block
    x0 = torch.randn(3, D, generator=g)
    want_state = state0.clone()
    want = tvm_mamba.causal_conv1d_update(x0, want_state, w, b, "silu", None, torch.tensor([6, -1, 3]).int())
    conv_ops._UPDATE_FAST.clear()
    for _ in range(3):
        x, state = x0.clone(), state0.clone()
        assert serving.causal_conv1d_update(x, state, w, b, "silu", idx) is x
        assert torch.equal(x, want) and torch.equal(state, want_state)
    (recipe,) = conv_ops._UPDATE_FAST._hot
    assert recipe.outputs == () and recipe.result == ("id", 0)
    wide = torch.cat([x0, torch.randn(3, 8, generator=g)], dim=1)
    x, state = wide[:, :D], state0.clone()
    assert serving.causal_conv1d_update(x, state, w, b, "silu", idx) is x
    assert torch.equal(x, want) and torch.equal(state, want_state)
    conv_ops._UPDATE_FAST.clear()
