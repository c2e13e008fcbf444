"""Decode step of the causal conv1d (``causal_conv1d_update``, causal-conv1d 1.7.0 semantics) as one
loop-nest template, laid onto the machine by a strategy (compute/strategy.py): a task per (batch, channel) row;
serial, parallel rows on a CPU, one thread per row on CUDA (as upstream's update kernel).

Per row b, channel c, with slot = conv_state_indices[b] (or b) and S = state_len, W = width:

    window[j] = conv_state[slot, c, (base + S - (W-1) + j) mod S], j < W-1   (base = cache_seqlens[b] mod S
                                                                            circular, else 0)
    xs = [window | x[b, c, :]];  out[b, c, t] = act(bias[c] + sum_k weight[c, k] * xs[t + k])
    linear state:   conv_state[slot, c, :] <- [conv_state[slot, c, :] | x[b, c, :]][-S:]
    circular state: conv_state[slot, c, (base + i) mod S] <- x[b, c, i], i ascending (a later token wins)

A row whose slot is negative is padding: its out is 0 and no slot is touched. ``in_place`` (one token a row):
out is x itself, written after the row's state update has read the token (vLLM's decode step). conv_state is a pool
(pool, dim, S) of any strides (a server's pages: slots apart, vLLM's (S, dim) storage transposed) updated in
place: each row reads its window before it writes, and a slot belongs to one
row (the torch op refuses duplicate slots), so the in-place update is race-free on every target.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import CausalConv1dUpdate
from .signature import conv_kernel
from .._common import stamp
from .._math import math_for
from ..strategy import Strategy, slot_checks

F32 = "float32"


def update_template(d: CausalConv1dUpdate, strategy: Strategy) -> tirx.PrimFunc:
    """The decode-step loop nest (see the module docstring; its signature: conv_kernel): a task per row, laid
    out by ``strategy`` (its loops, scratch scope and SiLU)."""
    D, W, S = d.dim, d.width, d.state_len
    G = strategy  # (S is the state length here)
    # plain names: TVMScript folds these Python values into the kernel's static branches
    activation, has_bias, has_indices, has_cache_seqlens = d.activation, d.has_bias, d.has_indices, d.has_cache_seqlens
    in_place = d.in_place
    x_dtype, state_dtype = d.x_dtype, d.state_dtype
    SCOPE, serial_work = G.scope, G.serial_work

    def act(v):
        return G.math.silu(v) if activation == "silu" else v

    @T.macro
    def row_step(x, state, weight, bias, idx, cseq, out, L, row):
        b = T.meta_var(row // D)
        c = T.meta_var(row % D)
        slot = T.meta_var(idx[b] if has_indices else b)
        acc = T.alloc_buffer((1,), F32, scope=SCOPE)
        if slot < 0:  # padding row (upstream: conv_state_indices < 0): out 0, state untouched
            for t in range(L):
                out[b, c, t] = T.Cast(x_dtype, T.float32(0))
        else:
            base = T.meta_var(T.floormod(cseq[b], S) if has_cache_seqlens else 0)
            for t in range(L):
                acc[0] = bias[c].astype(F32) if has_bias else T.float32(0)
                for k in T.unroll(W):
                    acc[0] = acc[0] + weight[c, k].astype(F32) * T.if_then_else(
                        t + k < W - 1,
                        state[slot, c, T.floormod(base + S - (W - 1) + T.min(t + k, W - 2), S)].astype(F32),
                        x[b, c, T.max(t + k - (W - 1), 0)].astype(F32))
                if not in_place:
                    out[b, c, t] = act(acc[0]).astype(x_dtype)
            if has_cache_seqlens:
                for i in range(L):
                    state[slot, c, T.floormod(base + i, S)] = x[b, c, i].astype(state_dtype)
            else:  # shift left by L, ascending: each read index j + L is ahead of every write so far
                for j in range(S):
                    state[slot, c, j] = T.if_then_else(j + L < S, state[slot, c, T.min(j + L, S - 1)],
                                                       x[b, c, T.max(j + L - S, 0)].astype(state_dtype))
            if in_place:  # out is x (one token): written over the token only after the state took it
                out[b, c, 0] = act(acc[0]).astype(x_dtype)

    @T.macro
    def rows(x, state, weight, bias, idx, cseq, out, B, L):
        if G.threads == 1:  # a row a block: no thread loop, no bound check
            for row in G.outer(B * D):
                row_step(x, state, weight, bias, idx, cseq, out, L, row)
        else:
            for ro in G.outer(B * D):
                for ri in G.inner():
                    if G.index(ro, ri) < B * D:
                        row_step(x, state, weight, bias, idx, cseq, out, L, G.index(ro, ri))

    CHECK = G.checks_values
    check = slot_checks("conv_state_indices", "conv_state")

    @T.macro
    def body(x, state, weight, bias, idx, cseq, out, B, L):
        if CHECK:  # before the first write: a refused call leaves the pool as it was
            if has_indices:
                check(idx, B, state.shape[0])
            if has_cache_seqlens:  # a padding row's value is never read
                for b in T.serial(B):
                    if has_indices:
                        T.Assert(tirx.Or(idx[b] < 0, cseq[b] >= 0), "cache_seqlens: must be >= 0", "ValueError")
                    else:
                        T.Assert(cseq[b] >= 0, "cache_seqlens: must be >= 0", "ValueError")
        if serial_work is not None:
            if B * D * (L + S) <= serial_work:  # decode-size: on the calling thread, no thread-pool launch
                for row in T.serial(B * D):
                    row_step(x, state, weight, bias, idx, cseq, out, L, row)
            else:
                rows(x, state, weight, bias, idx, cseq, out, B, L)
        else:
            rows(x, state, weight, bias, idx, cseq, out, B, L)

    return conv_kernel(d, body)


def causal_conv1d_update(*dims, **fields) -> tirx.PrimFunc:
    """Decode step, conv_state updated in place. x: (batch, dim, seqlen); conv_state: (pool, dim, state_len)
    (pool = batch without conv_state_indices), state_len >= width-1; weight: (dim, width); bias: (dim,);
    conv_state_indices: (batch,) int32; cache_seqlens: (batch,) int32 -> out: (batch, dim, seqlen).

    out[t] = act(bias + sum_k weight[k] * [window | x][t + k]); see the module docstring for the window and
    the state update (linear shift or circular buffer). ``dims``: a :class:`CausalConv1dUpdate`, or its fields.
    """
    d = CausalConv1dUpdate.of(*dims, **fields)
    return stamp(update_template(d, Strategy(math_for(native=True))), "causal_conv1d_update")
