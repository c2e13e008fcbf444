"""vLLM's call forms of the prefill ops, on tvm_mamba's kernels (names and semantics of vLLM 0.32's
``vllm.model_executor.layers.mamba.ops``: ``causal_conv1d_fn``, ``mamba_chunk_scan_combined_varlen`` and
Mamba-1's ``selective_scan_fn``; mamba_ssm's forms of the same names stay in causal_conv1d.py / ssd.py /
selective_scan.py).

vLLM packs a step's prefill sequences along the token axis (``query_start_loc`` / ``cu_seqlens``: (batch + 1,)
offsets) and keeps each sequence's states in a pool slot (``cache_indices``). A sequence continued from an
earlier chunk (chunked prefill) starts from its slot's state (``has_initial_state``); every sequence's final
state is written back to its slot. The kernels continue an initial state only for the first sequence of a
row, so each sequence is one call of the batch-1 kernel from its own initial state, except that many short
fresh sequences (no initial state, under ``PACK_BELOW`` tokens each on average) are one packed call
(sequences apart through seq_idx): a call per sequence costs ~0.1 ms of Python, little beside a long
sequence's compute, and a long packed row parallelizes worse than a sequence of its own.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._dlpack import FLOATS, check_shape, check_tensor
from .causal_conv1d import causal_conv1d_fn as _conv_fn, causal_conv1d_varlen_states as _conv_varlen_states
from .selective_scan import selective_scan_fn as _scan_fn
from .serving import offsets
from .ssd import mamba_chunk_scan_combined as _ssd

PAD_SLOT_ID = -1  # vllm.v1.attention.backends.utils.PAD_SLOT_ID
NULL_BLOCK_ID = 0  # vllm.v1.attention.backends.utils.NULL_BLOCK_ID
_INTS = (torch.int32, torch.int64)
PACK_BELOW = 64  # mean tokens per sequence under which a fresh prefill step is one packed call


def _pack(bounds: list[int]) -> bool:
    return len(bounds) > 2 and bounds[-1] < PACK_BELOW * (len(bounds) - 1)


def _slot_list(name: str, idx, batch: int, pool: int, skip: int) -> list[int]:
    """Each sequence's pool slot (``skip``: padding, the sequence is not run); ValueError for a slot outside
    the pool or two sequences sharing one, before anything is written."""
    if idx is None:
        if batch > pool:
            raise ValueError(f"{name}: {batch} sequences but the pool has {pool} slots")
        return list(range(batch))
    check_tensor(name, idx, dtypes=_INTS)
    if idx.dim() == 2:  # vLLM's (batch, blocks) table without prefix caching: each sequence's first block
        idx = idx[:, 0]
    if idx.dim() != 1 or idx.shape[0] < batch:
        raise ValueError(f"{name}: expected ({batch},) slots, got shape {tuple(idx.shape)}")
    slots = idx[:batch].tolist()
    live = [s for s in slots if s != skip]
    if any(s < 0 or s >= pool for s in live):
        raise ValueError(f"{name}: slots must lie in 0..{pool - 1} (the pool's slots) or be {skip} (padding), "
                         f"got {slots}")
    if len(set(live)) != len(live):
        raise ValueError(f"{name}: two sequences name the same slot: {slots}")
    return slots


def _has_init(has_initial_state, batch: int) -> list[bool]:
    if has_initial_state is None:
        return [False] * batch
    check_tensor("has_initial_state", has_initial_state, ndim=1)
    if has_initial_state.shape[0] < batch:
        raise ValueError(f"has_initial_state: expected ({batch},), got shape {tuple(has_initial_state.shape)}")
    return [bool(v) for v in has_initial_state[:batch].tolist()]


def _refuse_prefix_caching(**pointers) -> None:
    for name, value in pointers.items():
        if value is not None:
            raise ValueError(f"{name}: prefix caching's per-block pointers (vLLM's mamba_cache_mode 'all') are "
                             "not supported on the prefill path ('align', Mamba-2's default, is)")


def _seq_idx(bounds: list[int], tokens: int, device) -> Tensor:
    """(1, tokens) int32: sequence i's positions hold i, the tokens past the last offset -1 (padding)."""
    lens = torch.tensor([e - s for s, e in zip(bounds, bounds[1:])] + [tokens - bounds[-1]])
    ids = torch.arange(len(bounds), dtype=torch.int32)
    ids[-1] = -1
    return torch.repeat_interleave(ids, lens)[None].to(device)


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                     activation="silu", pad_slot_id=PAD_SLOT_ID, null_block_id=NULL_BLOCK_ID,
                     block_idx_first_scheduled_token=None, block_idx_last_scheduled_token=None,
                     initial_state_idx=None, num_computed_tokens=None, block_size_to_align=0, metadata=None,
                     validate_data=False):
    """vLLM's packed prefill conv: x (dim, tokens) (vLLM passes it channel-last), weight (dim, width), bias
    (dim,) or None, conv_states (pool, dim, state_len >= width - 1) in any strides (the first width - 1
    columns are the state; speculative decoding keeps more), query_start_loc (batch + 1,),
    cache_indices (batch,) slots (``pad_slot_id``: skipped), has_initial_state (batch,) bool. Sequence i
    starts from ``conv_states[cache_indices[i]]`` when ``has_initial_state[i]`` (else zeros), and its last
    width - 1 inputs are written there. x is computed in conv_states' dtype, as vLLM does. Returns out with
    x's shape, strides and dtype (positions of skipped sequences and past the last offset: 0).
    ``metadata`` / ``validate_data`` (Triton launch hints) are accepted and ignored; the prefix-caching
    pointers are refused (ValueError)."""
    check_tensor("x", x, ndim=2, dtypes=FLOATS)
    dim, tokens = x.shape
    check_tensor("weight", weight, ndim=2, dtypes=FLOATS, device=x.device)
    check_tensor("conv_states", conv_states, ndim=3, dtypes=FLOATS, device=x.device)
    if conv_states.shape[1] != dim or conv_states.shape[2] < weight.shape[1] - 1:
        raise ValueError(f"conv_states: expected (pool, {dim}, >= {weight.shape[1] - 1}) (x's dim, width - 1 or more "
                         f"columns), got {tuple(conv_states.shape)}")
    conv_states = conv_states[..., :weight.shape[1] - 1]  # with speculative decoding vLLM's state is longer
    _refuse_prefix_caching(block_idx_first_scheduled_token=block_idx_first_scheduled_token,
                           block_idx_last_scheduled_token=block_idx_last_scheduled_token,
                           initial_state_idx=initial_state_idx)
    bounds = offsets("query_start_loc", query_start_loc, tokens)
    batch = len(bounds) - 1
    slots = _slot_list("cache_indices", cache_indices, batch, conv_states.shape[0], pad_slot_id)
    init = _has_init(has_initial_state, batch)
    activation = "silu" if activation is True or activation == "swish" else (activation or None)
    xs = x.to(conv_states.dtype)
    out = torch.zeros_like(xs)
    weight = weight.to(xs.dtype) if weight.dtype not in (torch.float32, xs.dtype) else weight
    bias = bias.to(weight.dtype) if bias is not None else None
    live = [i for i in range(batch) if slots[i] != pad_slot_id and bounds[i + 1] > bounds[i]]
    if not any(init[i] for i in live) and len(live) == batch and _pack(bounds):
        y = _conv_fn(xs[None], weight, bias, seq_idx=_seq_idx(bounds, tokens, x.device), activation=activation)
        out.copy_(y[0])
        finals = _conv_varlen_states(xs.t(), query_start_loc, weight.shape[1] - 1)
        for i in live:
            conv_states[slots[i]].copy_(finals[i])
    else:
        for i in live:
            s, e = bounds[i], bounds[i + 1]
            start = conv_states[slots[i]][None].to(xs.dtype) if init[i] else None
            y, final = _conv_fn(xs[None, :, s:e], weight, bias, initial_states=start, return_final_states=True,
                                activation=activation)
            out[:, s:e] = y[0]
            conv_states[slots[i]].copy_(final[0])
    return out.to(x.dtype)


def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens=None,
                                     last_chunk_indices=None, seq_idx=None, out=None, D=None, z=None, dt_bias=None,
                                     initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                     return_intermediate_states=False, state_dtype=None):
    """vLLM's packed prefill SSD: x (tokens, nheads, headdim), dt (tokens, nheads), A (nheads,), B, C (tokens,
    ngroups, dstate), cu_seqlens (batch + 1,), out (tokens, nheads, headdim) written in place, D (nheads,) or
    (nheads, headdim), z as x or None, dt_bias (nheads,), initial_states (batch, nheads, headdim, dstate) or
    None (sequence i continues initial_states[i]). Returns varlen_states (batch, nheads, headdim, dstate),
    each sequence's final state, in ``state_dtype`` (default x's dtype, as vLLM); with
    ``return_intermediate_states`` (prefix caching) the state at the end of each of vLLM's logical chunks
    instead: (nchunks, nheads, headdim, dstate), the chunks given by ``cu_chunk_seqlens`` (nchunks + 1,), each
    inside one sequence. ``last_chunk_indices`` and vLLM's per-chunk ``seq_idx`` are not needed."""
    check_tensor("x", x, ndim=3, dtypes=FLOATS)
    tokens = x.shape[0]
    check_tensor("out", out, ndim=3, dtypes=(x.dtype,), device=x.device)
    check_shape("out", out, x.shape)
    bounds = offsets("cu_seqlens", cu_seqlens, tokens)
    batch = len(bounds) - 1
    if initial_states is not None:
        check_tensor("initial_states", initial_states, ndim=4, dtypes=FLOATS, device=x.device)
        check_shape("initial_states", initial_states, (batch,) + tuple(initial_states.shape[1:]))
    out_dtype = state_dtype if state_dtype is not None else x.dtype
    if initial_states is None and not return_intermediate_states and _pack(bounds):
        y, varlen = _ssd(x[None], dt[None], A, B[None], C[None], chunk_size, D, None if z is None else z[None],
                         dt_bias, seq_idx=_seq_idx(bounds, tokens, x.device), cu_seqlens=cu_seqlens,
                         dt_softplus=dt_softplus, dt_limit=dt_limit, return_varlen_states=True,
                         state_dtype=torch.float32)
        out.copy_(y[0])
        return varlen.to(out_dtype)
    pieces = _chunk_pieces(cu_chunk_seqlens, bounds, tokens) if return_intermediate_states \
        else [[(s, e)] if e > s else [] for s, e in zip(bounds, bounds[1:])]
    states = []
    for i, seq_pieces in enumerate(pieces):
        state = initial_states[i:i + 1] if initial_states is not None else None
        for s, e in seq_pieces:  # one call per piece, each continuing the state the previous one left
            part = lambda t: None if t is None else t[None, s:e]  # noqa: E731
            y, state = _ssd(part(x), part(dt), A, part(B), part(C), chunk_size, D, part(z), dt_bias,
                            initial_states=state, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=True)
            out[s:e] = y[0]
            states.append(state[0])
        if not seq_pieces and not return_intermediate_states:  # an empty sequence keeps its state
            states.append(initial_states[i].float() if initial_states is not None
                          else x.new_zeros(x.shape[1:] + B.shape[-1:], dtype=torch.float32))
    if not states:
        return x.new_zeros((0,) + tuple(x.shape[1:]) + (B.shape[-1],), dtype=out_dtype)
    return torch.stack(states).to(out_dtype)


def _chunk_pieces(cu_chunk_seqlens, bounds: list[int], tokens: int) -> list[list[tuple[int, int]]]:
    """vLLM's logical chunks grouped by sequence: [[(start, end), ...] per sequence]; ValueError unless the
    chunks cover the packed tokens and every sequence starts at a chunk boundary."""
    if cu_chunk_seqlens is None:
        raise ValueError("cu_chunk_seqlens: return_intermediate_states needs vLLM's logical chunks")
    edges = offsets("cu_chunk_seqlens", cu_chunk_seqlens, tokens)
    if edges[-1] != bounds[-1] or not set(bounds) <= set(edges):
        raise ValueError(f"cu_chunk_seqlens: every sequence boundary {bounds} must be a chunk boundary, got {edges}")
    pieces = [[] for _ in range(len(bounds) - 1)]
    seq = 0
    for s, e in zip(edges, edges[1:]):
        while bounds[seq + 1] <= s:
            seq += 1
        pieces[seq].append((s, e))
    return pieces


def store_prefill_checkpoint(checkpoint, chunk_idx, x, conv_state, chunk_states, ssm_state, query_start_loc, *,
                             state_len):
    """vLLM's prefix-caching checkpoint store (``ops.ssd_checkpoint.store_prefill_checkpoint``, a Triton kernel
    in vLLM): for each prefill row r with ``checkpoint.checkpoint_offsets[r] = k > 0``, block
    ``d = checkpoint.state_indices[r]`` receives the conv state after the row's first k tokens (x's columns
    ``query_start_loc[r] + k - state_len`` .. ``+ k``: x is the pre-conv input (dim, tokens)) and the SSM state
    ``chunk_states[chunk_idx[r]]``. Blocks and chunk indices are checked before anything is written."""
    at = checkpoint.checkpoint_offsets.tolist()
    dst = checkpoint.state_indices.tolist()
    src = chunk_idx.tolist()
    starts = query_start_loc.tolist()
    rows = [r for r, k in enumerate(at) if k > 0]
    for r in rows:
        a = starts[r] + at[r] - state_len
        if not 0 <= dst[r] < ssm_state.shape[0] or not 0 <= src[r] < chunk_states.shape[0] or a < 0 \
                or starts[r] + at[r] > x.shape[1]:
            raise ValueError(f"checkpoint: row {r} (block {dst[r]}, chunk {src[r]}, offset {at[r]}) lies "
                             f"outside the pools ({ssm_state.shape[0]} blocks), the chunk states "
                             f"({chunk_states.shape[0]}) or x's {x.shape[1]} tokens")
    for r in rows:
        a = starts[r] + at[r] - state_len
        conv_state[dst[r], :, :state_len] = x[:, a:a + state_len]
        ssm_state[dst[r]] = chunk_states[src[r]]


def selective_scan_fn(u, ssm_states, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      query_start_loc=None, cache_indices=None, has_initial_state=None, null_block_id=NULL_BLOCK_ID,
                      block_size=1024, block_idx_first_scheduled_token=None, block_idx_last_scheduled_token=None,
                      initial_state_idx=None, cu_chunk_seqlen=None, last_chunk_indices=None):
    """vLLM's Mamba-1 prefill scan (packed): u, delta, z (dim, tokens); ssm_states (pool, dim, dstate) updated
    in place; A (dim, dstate); B, C (ngroups, dstate, tokens) or (dstate, tokens); D, delta_bias (dim,);
    query_start_loc (batch + 1,); cache_indices (batch,) slots (``null_block_id``: padding, skipped);
    has_initial_state (batch,). Sequence i starts from ``ssm_states[cache_indices[i]]`` when
    ``has_initial_state[i]`` (else zeros) and its final state is written there. The output is written into
    z (into delta when z is None) and that tensor returned, as vLLM's op does."""
    check_tensor("u", u, ndim=2, dtypes=FLOATS)
    dim, tokens = u.shape
    check_tensor("ssm_states", ssm_states, ndim=3, dtypes=FLOATS, device=u.device)
    _refuse_prefix_caching(block_idx_first_scheduled_token=block_idx_first_scheduled_token,
                           block_idx_last_scheduled_token=block_idx_last_scheduled_token,
                           initial_state_idx=initial_state_idx)
    if query_start_loc is None:
        raise ValueError("query_start_loc: the packed form needs it (for batched rows call "
                         "tvm_mamba.selective_scan_fn)")
    bounds = offsets("query_start_loc", query_start_loc, tokens)
    batch = len(bounds) - 1
    slots = _slot_list("cache_indices", cache_indices, batch, ssm_states.shape[0], null_block_id)
    init = _has_init(has_initial_state, batch)
    B4, C4 = (M if M.dim() == 3 else M[None] for M in (B, C))
    dest = z if z is not None else delta
    results = []
    for i in range(batch):
        s, e = bounds[i], bounds[i + 1]
        if slots[i] == null_block_id or e == s:
            continue
        part = lambda t: None if t is None else t[None, ..., s:e]  # noqa: E731
        start = ssm_states[slots[i]][None].float() if init[i] else None
        y, last = _scan_fn(part(u), part(delta), A, part(B4), part(C4), D, part(z), delta_bias, delta_softplus,
                           return_last_state=True, initial_state=start)
        results.append((s, e, y[0], slots[i], last[0]))
    for s, e, y, slot, last in results:  # written once every sequence has run: nothing half-written on an error
        dest[:, s:e] = y
        ssm_states[slot].copy_(last)
    return dest
