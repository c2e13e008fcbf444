"""ssd_chunk_scan_bwd_dstates: the gradient each chunk sends into the state entering it,
dSloc_c[p, n] = sum_l g[l, p] (e[l] C[l, n]), g = dy silu(z), e[l] = exp(dA_cs[l]) (the carried state's decay
to position l), and dz = dy y_pre silu'(z). A template laid out by the strategy: the P x Q x N matmul per
(batch, chunk, head) by ``scaled_matmul`` (strategy.py); dz where the strategy ``visits_lhs`` as the visit of
its lhs g (written from the dy / z that g's copy loads), else by a second pass, a task per (batch, position,
head) row of headdim lanes (upstream's _chunk_scan_bwd_dstates; dz as its _chunk_scan_bwd_dz)."""
from __future__ import annotations

from types import SimpleNamespace

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, I32, Z4, batch_sids, c32, carried_decay, gate, ld
from .dims import DstatesDims, dims_of
from .strategy import SERIAL, ChunkStrategy, unravel


def _decay_in(m, seq_idx, dA_cs, b, h, c, l, Q, seqlen, has_seq_idx):
    """e[l]: common.carried_decay at position l of chunk c (its sequence id read at l clamped into range), 0 past
    seqlen."""
    e = carried_decay(m, dA_cs[b, h, c, l], seq_idx[b, tirx.min(c * Q + l, seqlen - 1)], batch_sids(seq_idx, b), c,
                      Q, has_seq_idx)
    return tirx.Select(c * Q + l < seqlen, e, c32(0.0))


@T.macro
def _dz_at(m, xd, dz, y_pre, idx, inside, vals):
    """dz[idx] = dy y_pre silu'(z) from vals = (dy, z) as g's copy loaded them, at a position inside the
    sequence."""
    if inside:
        dz[idx] = (vals[0] * y_pre[idx].astype(F32) * m.silu_grad(vals[1])).astype(xd)


def _gate_lhs(d: DstatesDims, m, visited: bool, dy, z, y_pre, dz, seqlen, nchunks):
    """The matmul's lhs g(t, p, l) = dy silu(z) at chunk position l of task t (0 past seqlen): a callable, or
    with ``visited`` the strategy's visited operand whose visit writes dz from the same loads."""
    H, Q = d.nheads, d.chunk_size

    def idx(t, p, l):
        return (t // (nchunks * H), T.min(t // H % nchunks * Q + l, seqlen - 1), t % H, p)

    def pos(t, l):
        return t // H % nchunks * Q + l

    if not visited:
        return lambda t, p, l: gate(m, dy, z, idx(t, p, l), seqlen, pos(t, l), d.has_z)
    return SimpleNamespace(
        loads=(lambda t, p, l: ld(dy, idx(t, p, l), seqlen, pos(t, l)),
               lambda t, p, l: ld(z, idx(t, p, l), seqlen, pos(t, l))),
        value=lambda t, p, l, v: v[0] * m.silu(v[1]),
        visit=lambda t, p, l, v: _dz_at(m, d.x_dtype, dz, y_pre, idx(t, p, l), pos(t, l) < seqlen, v))


def dstates_template(d: DstatesDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_chunk_scan_bwd_dstates kernel laid out by ``S``: task t = (batch, chunk, head) for dstates_local
    (rows past seqlen: e = 0, g = 0, C read at the last position); with z, dz
    elementwise: the visit of the matmul's lhs g (``visits_lhs``) or a pass of its own."""
    H, G, P, N, Q, m, xd = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size, S.math, d.x_dtype
    R = H // G
    run = S.scaled_matmul(P, N, Q)
    V = S.lanes(P)
    NV = P // V
    tasks = S.tasks()
    visited = d.has_z and S.visits_lhs(P, N, Q)

    @T.macro
    def dz_row(i, dy, y_pre, z, dz, seqlen):
        b, t, h, pb = T.meta_var(unravel(i, (None, seqlen, H, NV)))
        for v in S.lane_loop(V):
            dz[b, t, h, pb * V + v] = (dy[b, t, h, pb * V + v].astype(F32) * y_pre[b, t, h, pb * V + v].astype(F32)
                                       * m.silu_grad(z[b, t, h, pb * V + v].astype(F32))).astype(xd)

    @T.prim_func
    def func(dy_h: T.handle, z_h: T.handle, yp_h: T.handle, c_h: T.handle, dac_h: T.handle, s_h: T.handle,
             dsl_h: T.handle, dz_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        dy = T.match_buffer(dy_h, (batch, seqlen, H, P), xd)
        z = T.match_buffer(z_h, (batch, seqlen, H, P) if d.has_z else Z4, xd)
        y_pre = T.match_buffer(yp_h, (batch, seqlen, H, P) if d.has_z else Z4, xd)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), d.bc_dtype)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        dsl = T.match_buffer(dsl_h, (batch, nchunks, H, P, N), F32)
        dz = T.match_buffer(dz_h, (batch, seqlen, H, P) if d.has_z else Z4, xd)
        run(batch * nchunks * H, _gate_lhs(d, m, visited, dy, z, y_pre, dz, seqlen, nchunks),
            lambda t, l: _decay_in(m, seq_idx, dA_cs, t // (nchunks * H), t % H, t // H % nchunks, l, Q, seqlen,
                                   d.has_seq_idx),
            lambda t, l, n: Cm[t // (nchunks * H), T.min(t // H % nchunks * Q + l, seqlen - 1), t % H // R,
                               n].astype(F32),
            lambda t, p, n, v: T.buffer_store(dsl, v, [t // (nchunks * H), t // H % nchunks, t % H, p, n]))
        if d.has_z and not visited:  # dz = dy y_pre silu'(z): a task per (batch, position, head), lanes of headdim
            tasks(batch * seqlen * H * NV, lambda i: dz_row(i, dy, y_pre, z, dz, seqlen))

    return func


def ssd_chunk_scan_bwd_dstates(dims: DstatesDims | None = None, strategy: ChunkStrategy = SERIAL,
                               **kw) -> tirx.PrimFunc:
    """dy, z, y_pre: (batch, seqlen, nheads, headdim); C: (batch, seqlen, ngroups, dstate); dA_cumsum:
    (batch, nheads, nchunks, chunk_size); seq_idx: (batch, seqlen)
    -> dstates_local: (batch, nchunks, nheads, headdim, dstate) f32, dz: (batch, seqlen, nheads, headdim).

    dstates_local[c, p, n] = sum_l g[l, p] exp(dA_cs[l]) C[l, n] (seq-masked), g = dy silu(z);
    dz = dy * y_pre * silu'(z). The CPU strategy's knobs rows x cols x order: the matmul's register block (mm.py).
    """
    d = dims_of(DstatesDims, dims, kw)
    return stamp(dstates_template(d, strategy), "ssd_chunk_scan_bwd_dstates")
