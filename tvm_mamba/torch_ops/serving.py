"""vLLM's call forms of the decode steps, on tvm_mamba's kernels (names and semantics of vLLM 0.32's
``vllm.model_executor.layers.mamba.ops``; mamba_ssm's forms stay in selective_scan.py / causal_conv1d.py).

vLLM keeps every sequence's states in pools of pages and names slots with block ids: indices may be 2-D
(sequence, token) for speculative decoding, a row whose slot is ``null_block_id`` (block 0, which vLLM never
hands out) is padding, a step may read its state from one slot and write it to another (``dst`` indices,
prefix caching) and writes its output into a tensor the caller owns (``out``). These functions translate
that into the kernels' own conventions (1-D slots, negative = padding) and run them on the pools in place
(the kernels take a pool's strides). Padding rows' outputs are 0 (vLLM leaves them unspecified).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .causal_conv1d import (causal_conv1d_fn as _conv_fn, causal_conv1d_update as _conv_update,
                            causal_conv1d_update_into_x as _conv_update_into_x)
from .selective_scan import selective_state_update as _ssu, selective_state_update_into as _ssu_into

NULL_BLOCK_ID = 0  # vllm.v1.attention.backends.utils.NULL_BLOCK_ID


def _slots(name: str, idx: Optional[Tensor], rows: int) -> Optional[Tensor]:
    """``idx`` as a (rows, tokens) int tensor (a 1-D one is one token per row); None stays None."""
    if idx is None:
        return None
    if not isinstance(idx, Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() not in (1, 2):
        raise TypeError(f"{name}: expected a 1-D or 2-D int32/int64 tensor")
    idx = idx if idx.dim() == 2 else idx[:, None]
    if idx.shape[0] < rows or idx.shape[1] < 1:
        raise ValueError(f"{name}: expected at least ({rows}, 1) entries, got shape {tuple(idx.shape)}")
    return idx


def _one_per_row(idx, rows: int) -> bool:
    """``idx`` a 1-D int32 / int64 tensor of exactly ``rows`` slots: the kernels take it as it is."""
    return type(idx) in (Tensor, torch.nn.Parameter) and idx.dim() == 1 and idx.shape[0] == rows and \
        idx.dtype in (torch.int32, torch.int64)


def offsets(name: str, loc, tokens: int) -> list[int]:
    """vLLM's (batch + 1,) cumulative offsets (``query_start_loc`` / ``cu_seqlens``) as a list, checked: int,
    1-D, from 0, non-decreasing, ending at most at ``tokens`` (ValueError / TypeError naming ``name``)."""
    if not isinstance(loc, Tensor) or loc.dtype not in (torch.int32, torch.int64) or loc.dim() != 1:
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor")
    b = loc.tolist()
    if not b or b[0] != 0 or any(e < s for s, e in zip(b, b[1:])) or b[-1] > tokens:
        raise ValueError(f"{name}: expected (batch + 1,) non-decreasing offsets from 0 to at most {tokens}, got {b}")
    return b


def _kernel_slots(src: Tensor, null_block_id: int) -> Tensor:
    """vLLM's slots -> the kernels': the null block becomes -1 (a padding row). ``src`` itself when no row is
    padding and it is int32 (a CPU decode step's usual case: a decode batch's slots read as a list, ~1 us)."""
    if src.dtype == torch.int32 and src.device.type == "cpu":
        if src.numel() <= 128 and src.dim() == 1:
            if null_block_id not in src.tolist():
                return src
        elif not (src.numpy() == null_block_id).any():
            return src
    return torch.where(src == null_block_id, -1, src).to(torch.int32)


def _write_out(out: Optional[Tensor], result: Tensor, like: Tensor) -> Tensor:
    if out is None:
        return result
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out: expected shape {tuple(like.shape)}, dtype {like.dtype} on {like.device} (x's), got "
                         f"{tuple(out.shape)}, {out.dtype} on {out.device}")
    out.copy_(result)
    return out


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, dst_state_batch_indices=None, null_block_id=NULL_BLOCK_ID,
                           out=None, num_accepted_tokens=None, cu_seqlens=None, is_blackwell=False,
                           enable_stochastic_rounding=False, cache_philox_rounds=0):
    """vLLM's ``selective_state_update``: shapes as mamba_ssm's (state (pool, nheads, headdim, dstate) or
    (pool, dim, dstate), x (batch, nheads, headdim) or (batch, dim), ...), plus:

    state_batch_indices / dst_state_batch_indices: (batch,) or (batch, tokens) block ids; a row reads slot
    ``state_batch_indices[b, 0]`` and writes ``dst[b, 0]`` (default: the same slot); a row whose source is
    ``null_block_id`` is padding (nothing read or written, out 0). With ``num_accepted_tokens`` (batch,)
    (speculative decoding), sequence b starts from slot ``state_batch_indices[b, max(n_b - 1, 0)]`` and runs
    its tokens in order (rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of x, or row b when ``cu_seqlens`` is None),
    the state after its i-th token written to ``dst[b, i]`` unless that is the null block. out: written and
    returned when given (x's shape and dtype). ``is_blackwell`` (a CUDA tuning hint) is accepted and ignored.
    """
    if enable_stochastic_rounding:
        raise ValueError("enable_stochastic_rounding: stochastic rounding of the state is not supported")
    if num_accepted_tokens is None and cu_seqlens is None:
        if _one_per_row(state_batch_indices, x.shape[0]) and (dst_state_batch_indices is None or
                                                               dst_state_batch_indices is state_batch_indices):
            idx = _kernel_slots(state_batch_indices, null_block_id)  # a decode step's usual call: no views
            if out is None:
                return _ssu(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices=idx)
            return _ssu_into(out, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx)  # the kernel writes out
        src = _slots("state_batch_indices", state_batch_indices, x.shape[0])
        dst = _slots("dst_state_batch_indices", dst_state_batch_indices, x.shape[0])
        if src is None:
            if dst is not None:
                raise ValueError("dst_state_batch_indices: given without state_batch_indices")
            return _write_out(out, _ssu(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus), x)
        same = dst_state_batch_indices is None or dst_state_batch_indices is state_batch_indices
        src = src[:x.shape[0], 0]
        if not same and not torch.equal(dst[:x.shape[0], 0], src):
            _copy_slots(state, src, dst[:x.shape[0], 0], null_block_id)  # read at src, update in place at dst
            src = dst[:x.shape[0], 0]
        idx = _kernel_slots(src, null_block_id)
        return _write_out(out, _ssu(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices=idx), x)
    return _write_out(out, _speculative(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                                        dst_state_batch_indices, null_block_id, num_accepted_tokens, cu_seqlens), x)


def selective_state_update_dispatch(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                                    state_batch_indices=None, dst_state_batch_indices=None,
                                    null_block_id=NULL_BLOCK_ID, out=None, num_accepted_tokens=None, cu_seqlens=None,
                                    is_blackwell=False) -> None:
    """The form vLLM's layers call (``vllm.model_executor.layers.mamba.ops.ssu_dispatch.selective_state_update``):
    D and dt_bias come before z, the result goes only into ``out`` (required), nothing is returned. Otherwise
    :func:`selective_state_update`."""
    if out is None:
        raise ValueError("out: vLLM's dispatch form writes its result into out; pass it")
    selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                           dst_state_batch_indices, null_block_id, out, num_accepted_tokens, cu_seqlens, is_blackwell)


def _check_blocks(name: str, ids: Tensor, pool: int) -> None:
    """ValueError unless every block id lies in the pool (before anything is read or written)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pool):
        raise ValueError(f"{name}: block ids must lie in 0..{pool - 1} (the pool's blocks), got "
                         f"{int(ids.min())}..{int(ids.max())}")


def _copy_slots(state: Tensor, src: Tensor, dst: Tensor, null_block_id: int, names=("state_batch_indices",
                "dst_state_batch_indices")) -> None:
    """state[dst[b]] = state[src[b]] for the rows that are not padding (ids checked first)."""
    live = (src != null_block_id) & (dst != null_block_id)
    _check_blocks(names[0], src[live], state.shape[0])
    _check_blocks(names[1], dst[live], state.shape[0])
    if dst[live].unique().numel() != int(live.sum()):
        raise ValueError(f"{names[1]}: two rows write the same block")
    state[dst[live].long()] = state[src[live].long()]


def _speculative(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, src_idx, dst_idx, null_block_id,
                 num_accepted_tokens, cu_seqlens) -> Tensor:
    """Several tokens per sequence: each sequence's state taken from its accepted slot into a working copy,
    stepped token by token through the kernel, the state after each token written to its dst slot."""
    nseq = num_accepted_tokens.shape[0] if num_accepted_tokens is not None else cu_seqlens.shape[0] - 1
    src = _slots("state_batch_indices", src_idx, nseq)
    if src is None:
        raise ValueError("state_batch_indices: speculative decoding (num_accepted_tokens / cu_seqlens) needs it")
    dst = _slots("dst_state_batch_indices", dst_idx, nseq) if dst_idx is not None else src
    bounds = offsets("cu_seqlens", cu_seqlens, x.shape[0]) if cu_seqlens is not None else list(range(nseq + 1))
    if len(bounds) != nseq + 1:
        raise ValueError(f"cu_seqlens: expected {nseq + 1} offsets (one more than the sequences), got {len(bounds)}")
    first = (num_accepted_tokens.long().clamp(min=1) - 1) if num_accepted_tokens is not None \
        else torch.zeros(nseq, dtype=torch.long)
    if nseq and int(first.max()) >= src.shape[1]:
        raise ValueError(f"num_accepted_tokens: {int(first.max()) + 1} accepted, but state_batch_indices has "
                         f"{src.shape[1]} blocks per sequence")
    _check_blocks("state_batch_indices", src[:nseq], state.shape[0])
    _check_blocks("dst_state_batch_indices", dst[:nseq], state.shape[0])
    start = src[torch.arange(nseq), first.to(src.device)].long()
    work = torch.where((start != null_block_id).view(-1, *[1] * (state.dim() - 1)), state[start],
                       torch.zeros((), dtype=state.dtype))
    out = torch.zeros_like(x)
    longest = max((e - b for b, e in zip(bounds, bounds[1:])), default=0)
    for i in range(longest):
        rows = [s for s in range(nseq) if bounds[s] + i < bounds[s + 1]]
        tok, sel = torch.tensor([bounds[s] + i for s in rows]), torch.tensor(rows)
        part = lambda t: None if t is None else t[tok]  # noqa: E731  (this step's token of each live sequence)
        out[tok] = _ssu(work, part(x), part(dt), A, part(B), part(C), D, part(z), dt_bias, dt_softplus,
                        state_batch_indices=sel.to(torch.int32))
        keep = dst[sel, i].long() if dst.shape[1] > i else torch.full((len(rows),), null_block_id)
        live = keep != null_block_id
        if keep[live].unique().numel() != int(live.sum()):
            raise ValueError("dst_state_batch_indices: two sequences write the same block at one token position")
        state[keep[live]] = work[sel[live]]
    return out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, query_start_loc=None, max_query_len=-1,
                         null_block_id=NULL_BLOCK_ID, block_idx_last_scheduled_token=None, initial_state_idx=None,
                         validate_data=False, out=None):
    """vLLM's ``causal_conv1d_update``: x (batch, dim) or (batch, dim, seqlen); conv_state (pool, dim, state_len)
    in any strides (vLLM's (state_len, dim) pages transposed); conv_state_indices (batch,) or (batch, blocks)
    block ids, ``null_block_id`` rows padding (out 0, nothing touched). With prefix caching,
    ``initial_state_idx`` / ``block_idx_last_scheduled_token`` (batch,) point into each row's blocks: the
    state is read from the first and written to the second. The result is written into ``out``, or into x
    itself when ``out`` is None (vLLM's convention), and returned. Speculative decoding
    (``num_accepted_tokens``) and packed rows (``query_start_loc``): see :func:`_conv_window`."""
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    elif activation == "swish":
        activation = "silu"
    if num_accepted_tokens is not None or query_start_loc is not None:
        if initial_state_idx is not None or block_idx_last_scheduled_token is not None:
            raise ValueError("initial_state_idx: prefix caching with speculative / packed conv steps is not supported")
        result = _conv_window(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                              query_start_loc, max_query_len, null_block_id)
        return _write_out(x if out is None else out, result, x)
    if _one_per_row(conv_state_indices, x.shape[0]) and initial_state_idx is None and \
            block_idx_last_scheduled_token is None:  # a decode step's usual call: the slots as they are
        idx = _kernel_slots(conv_state_indices, null_block_id)
        if out is None:  # vLLM's convention: the result over x (the kernel writes it there)
            return _conv_update_into_x(x, conv_state, weight, bias, activation, idx)
        return _write_out(out, _conv_update(x, conv_state, weight, bias, activation, None, idx), x)
    idx = _slots("conv_state_indices", conv_state_indices, x.shape[0])
    if idx is not None:
        def pick(name, pointer):  # each row's block at ``pointer`` (per row), or its first one
            if pointer is None:
                return idx[: x.shape[0], 0]
            if pointer.numel() != x.shape[0] or (pointer.numel() and (int(pointer.min()) < 0
                                                                       or int(pointer.max()) >= idx.shape[1])):
                raise ValueError(f"{name}: expected ({x.shape[0]},) positions in 0..{idx.shape[1] - 1} "
                                 "(conv_state_indices' columns)")
            return idx[torch.arange(x.shape[0], device=idx.device), pointer.long()]

        src = pick("initial_state_idx", initial_state_idx)
        dst = pick("block_idx_last_scheduled_token", block_idx_last_scheduled_token)
        if initial_state_idx is not block_idx_last_scheduled_token and not torch.equal(src, dst):
            _copy_slots(conv_state, src, dst, null_block_id, ("conv_state_indices", "conv_state_indices"))
        idx = _kernel_slots(dst, null_block_id)
    result = _conv_update(x, conv_state, weight, bias, activation, None, idx)
    return _write_out(x if out is None else out, result, x)


def _conv_window(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens, query_start_loc,
                 max_query_len, null_block_id) -> Tensor:
    """Several tokens per sequence (vLLM's Triton ``causal_conv1d_update`` rules): x (batch, dim, seqlen), or
    (tokens, dim) packed by ``query_start_loc``; conv_state (pool, dim, state_len), state_len >= width - 1.
    Sequence b's window starts ``o = num_accepted_tokens[b] - 1`` columns into its slot (0 without it): its
    tokens are convolved after columns o .. o + width - 2, and the slot becomes columns o + s .. of the old
    state then its tokens (s = 1 with num_accepted_tokens, a sliding window; else its token count), over its
    first ``state_len - (max_query_len - tokens)`` columns (the rest stays). One kernel call for all
    sequences, each padded to the longest (later positions never feed earlier ones)."""
    dt = conv_state.dtype
    width, state_len = weight.shape[1], conv_state.shape[-1]
    if query_start_loc is not None:
        bounds = offsets("query_start_loc", query_start_loc, x.shape[0])
        lens = [e - b for b, e in zip(bounds, bounds[1:])]
        tokens = lambda b: x[bounds[b]:bounds[b + 1]].t()  # noqa: E731  (dim, len)
    else:
        x3 = x if x.dim() == 3 else x[..., None]
        lens = [x3.shape[-1]] * x3.shape[0]
        tokens = lambda b: x3[b]  # noqa: E731
    nseq, longest = len(lens), max(lens, default=0)
    span = max_query_len if max_query_len is not None and max_query_len > 0 else longest
    idx = _slots("conv_state_indices", conv_state_indices, nseq)
    if idx is None:
        raise ValueError("conv_state_indices: speculative / packed conv steps need it")
    slots = idx[:nseq, 0].long()
    offs = (num_accepted_tokens[:nseq].long() - 1).tolist() if num_accepted_tokens is not None else [0] * nseq
    live = [b for b in range(nseq) if int(slots[b]) != null_block_id and lens[b] > 0]
    _check_blocks("conv_state_indices", slots[live], conv_state.shape[0])
    if len(set(slots[live].tolist())) != len(live):
        raise ValueError("conv_state_indices: two sequences write the same block")
    if any(not 0 <= offs[b] <= state_len - width + 1 for b in live) or longest > span:
        raise ValueError(f"num_accepted_tokens: each window (offset n - 1, then width - 1 = {width - 1} columns) "
                         f"must fit the conv state's {state_len} columns, and no sequence exceed max_query_len")
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if not live:
        return out
    old = conv_state[slots[live]]  # (live, dim, state_len): a copy, read before any slot is written
    prior = torch.stack([old[i, :, offs[b]:offs[b] + width - 1] for i, b in enumerate(live)])
    xs = torch.zeros(len(live), x.shape[-1] if query_start_loc is not None else x.shape[1], longest, dtype=dt,
                     device=x.device)
    for i, b in enumerate(live):
        xs[i, :, :lens[b]] = tokens(b)
    y = _conv_fn(xs, weight, bias, initial_states=prior, activation=activation)
    shift = 1 if num_accepted_tokens is not None else None
    for i, b in enumerate(live):
        n, o = lens[b], offs[b]
        keep_to = state_len - (span - n) if query_start_loc is not None else state_len
        keep = max(keep_to - n, 0)
        s = o + (shift if shift is not None else n)
        new = torch.cat([old[i, :, s:s + keep], xs[i, :, max(n - keep_to, 0):n]], dim=-1)
        conv_state[int(slots[b]), :, :keep_to] = new
        if query_start_loc is not None:
            out[bounds[b]:bounds[b + 1]] = y[i, :, :n].t()
        else:
            out[b] = y[i, :, :n].reshape(out[b].shape)
    return out
