"""ssd_chunk_state: the state each chunk adds, states[c] = (x dt' w)^T B over the chunk (a P x Q x N matmul
per (batch, chunk, head), register-blocked by mm.py)."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .. import _math
from .._common import stamp
from .common import F32, I32
from .dims import StateDims, dims_of
from .mm import DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, matmul, zero


def ssd_chunk_state(dims: StateDims | None = None, *, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS,
                    order: int = DEFAULT_ORDER, **kw) -> tirx.PrimFunc:
    """x: (batch, seqlen, nheads, headdim); B: (batch, seqlen, ngroups, dstate); dt_out, dA_cumsum:
    (batch, nheads, nchunks, chunk_size) f32; seq_idx: (batch, seqlen) int32
    -> states: (batch, nchunks, nheads, headdim, dstate) f32.

    states[c, p, n] = sum_l x[l, p] dt_out[l] exp(dA_cs[Q-1] - dA_cs[l]) B[l, n] over the chunk's positions
    of the sequence its last position belongs to. ``rows`` x ``cols``: the matmul's register block.
    """
    d = dims_of(StateDims, dims, kw)
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    x_dtype, bc_dtype, has_seq_idx = d.x_dtype, d.bc_dtype, d.has_seq_idx
    R = H // G
    mm = matmul(P, N, rows, cols, order=order)

    @T.prim_func
    def func(x_h: T.handle, b_h: T.handle, dto_h: T.handle, dac_h: T.handle, s_h: T.handle, st_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        x = T.match_buffer(x_h, (batch, seqlen, H, P), x_dtype)
        Bm = T.match_buffer(b_h, (batch, seqlen, G, N), bc_dtype)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if has_seq_idx else (1, 1), I32)
        states = T.match_buffer(st_h, (batch, nchunks, H, P, N), F32)
        for bch in T.parallel(batch * nchunks * H):
            b = T.meta_var(bch // (nchunks * H))
            c = T.meta_var(bch // H % nchunks)
            h = T.meta_var(bch % H)
            bw = T.alloc_buffer((Q, N), F32)  # B rows scaled by the decay weight w[l]
            xt = T.alloc_buffer((P, Q), F32)  # x transposed: the l loop reads it contiguously
            w = T.alloc_buffer((1,), F32)
            for l in range(Q):
                w[0] = T.float32(0)
                if c * Q + l < seqlen:
                    w[0] = dt_out[b, h, c, l] * _math.exp(dA_cs[b, h, c, Q - 1] - dA_cs[b, h, c, l])
                    if has_seq_idx:
                        w[0] = T.Select(seq_idx[b, c * Q + l] == seq_idx[b, T.min(c * Q + Q, seqlen) - 1], w[0],
                                        T.float32(0))
                for n in T.vectorized(N):
                    bw[l, n] = w[0] * Bm[b, T.min(c * Q + l, seqlen - 1), h // R, n].astype(F32)
                for p in range(P):
                    xt[p, l] = x[b, T.min(c * Q + l, seqlen - 1), h, p].astype(F32)
            mm(lambda lo, hi: 0, lambda lo, hi: Q, lambda p, l: xt[p, l], lambda l, n: bw[l, n], zero,
               lambda p, n, v: T.buffer_store(states, v, [b, c, h, p, n]))

    return stamp(func, "ssd_chunk_state", d.stamp_static())


