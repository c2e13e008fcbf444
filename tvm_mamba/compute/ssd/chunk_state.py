"""ssd_chunk_state: the state each chunk adds, states[c] = x^T (w B) over the chunk, w[l] = dt'[l] exp(dA_cs[Q-1]
- dA_cs[l]): one P x Q x N matmul per (batch, chunk, head), a template laid out by the strategy's
``scaled_matmul`` (strategy.py: a task per output on CUDA, the staged register-blocked matmul on a CPU)."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, I32, batch_sids, c32, last_sid
from .dims import StateDims, dims_of
from .strategy import SERIAL, ChunkStrategy


def _weight(m, dt_out, dA_cs, seq_idx, b, c, h, l, Q, seqlen, has_seq_idx):
    """w[l] = dt'[l] exp(dA_cs[Q-1] - dA_cs[l]); 0 past seqlen and, with seq_idx, where position l is not in
    the sequence of the chunk's last position (its state counts toward that sequence only)."""
    w = dt_out[b, h, c, l] * m.exp(dA_cs[b, h, c, Q - 1] - dA_cs[b, h, c, l])
    if has_seq_idx:
        w = tirx.Select(seq_idx[b, tirx.min(c * Q + l, seqlen - 1)] == last_sid(batch_sids(seq_idx, b), c, Q, seqlen),
                        w, c32(0.0))
    return tirx.Select(c * Q + l < seqlen, w, c32(0.0))


def chunk_state_template(d: StateDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_chunk_state kernel laid out by ``S``: task t = (batch, chunk, head), out[p, n] =
    sum_l x[l, p] (w[l] B[l, n]) (rows past seqlen: w = 0, x / B read at the last position)."""
    H, G, P, N, Q, m = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size, S.math
    R = H // G
    run = S.scaled_matmul(P, N, Q)

    @T.prim_func
    def func(x_h: T.handle, b_h: T.handle, dto_h: T.handle, dac_h: T.handle, s_h: T.handle, st_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        x = T.match_buffer(x_h, (batch, seqlen, H, P), d.x_dtype)
        Bm = T.match_buffer(b_h, (batch, seqlen, G, N), d.bc_dtype)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        states = T.match_buffer(st_h, (batch, nchunks, H, P, N), F32)
        run(batch * nchunks * H,
            lambda t, p, l: x[t // (nchunks * H), T.min(t // H % nchunks * Q + l, seqlen - 1), t % H, p].astype(F32),
            lambda t, l: _weight(m, dt_out, dA_cs, seq_idx, t // (nchunks * H), t // H % nchunks, t % H, l, Q, seqlen,
                                 d.has_seq_idx),
            lambda t, l, n: Bm[t // (nchunks * H), T.min(t // H % nchunks * Q + l, seqlen - 1), t % H // R,
                               n].astype(F32),
            lambda t, p, n, v: T.buffer_store(states, v, [t // (nchunks * H), t // H % nchunks, t % H, p, n]))

    return func


def ssd_chunk_state(dims: StateDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """x: (batch, seqlen, nheads, headdim); B: (batch, seqlen, ngroups, dstate); dt_out, dA_cumsum:
    (batch, nheads, nchunks, chunk_size) f32; seq_idx: (batch, seqlen) int32
    -> states: (batch, nchunks, nheads, headdim, dstate) f32.

    states[c, p, n] = sum_l x[l, p] dt_out[l] exp(dA_cs[Q-1] - dA_cs[l]) B[l, n] over the chunk's positions
    of the sequence its last position belongs to. The CPU strategy's knobs rows x cols x order: the matmul's
    register block (mm.py).
    """
    d = dims_of(StateDims, dims, kw)
    return stamp(chunk_state_template(d, strategy), "ssd_chunk_state")
