"""SSD chunk-scan kernels (forward, dstates, per-chunk backward); see the package docstring for the algorithm.

ssd_chunk_scan is one template for every target (``chunk_scan_template``: its math written once, laid out by
the strategy's ``causal_matmul``). The CPU loop nests here (bmm_chunk, dstates) run one (batch, chunk, head)
per parallel iteration and stage the chunk in float32 stack buffers (x, B, C, transposes), so each
chunk-local matmul is a row update vectorized over its contiguous static axis (headdim, dstate or
chunk_size): acc[l, :] += a[l, k] * b[k, :]. Positions past seqlen are staged as zeros (their dt_out is 0
too), so the ragged last chunk needs no special case inside the matmuls.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .. import _math
from .._common import stamp
from .._math import Math
from .mm import DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, matmul, zero

from .common import F32, I32, Z4, c32, gate, ld, seg_exp
from .dims import BmmDims, DstatesDims, ScanDims, dims_of
from .strategy import SERIAL, Strategy

_m = Math()  # the CPU loop nests' math: the vectorizable polynomials


def ssd_bmm_chunk(dims: BmmDims | None = None, *, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS,
                  order: int = DEFAULT_ORDER, **kw) -> tirx.PrimFunc:
    """B, C: (batch, seqlen, ngroups, dstate) -> cb: (batch, nchunks, ngroups, chunk_size, chunk_size) f32.

    cb[c, g, l, s] = C_l . B_s within chunk c (positions past seqlen count as zero rows): computed once per
    group and shared by its heads (upstream's _bmm_chunk_fwd; the causal / sequence masks are applied by
    the consumers). One (batch, chunk, group) per parallel iteration; the full Q x Q block is computed.
    """
    d = dims_of(BmmDims, dims, kw)
    G, N, Q, bc_dtype = d.ngroups, d.dstate, d.chunk_size, d.bc_dtype
    mm = matmul(Q, Q, rows, cols, order=order)

    @T.prim_func
    def func(b_h: T.handle, c_h: T.handle, cb_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        Bm = T.match_buffer(b_h, (batch, seqlen, G, N), bc_dtype)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), bc_dtype)
        cb = T.match_buffer(cb_h, (batch, nchunks, G, Q, Q), F32)
        for bcg in T.parallel(batch * nchunks * G):
            b = T.meta_var(bcg // (nchunks * G))
            c = T.meta_var(bcg // G % nchunks)
            g = T.meta_var(bcg % G)
            cl = T.alloc_buffer((Q, N), F32)
            bt = T.alloc_buffer((N, Q), F32)
            for l in range(Q):
                t = T.meta_var(T.min(c * Q + l, seqlen - 1))
                for n in T.vectorized(N):
                    cl[l, n] = ld(Cm, (b, t, g, n), seqlen, c * Q + l)
                for n in range(N):
                    bt[n, l] = ld(Bm, (b, t, g, n), seqlen, c * Q + l)
            mm(lambda lo, hi: 0, lambda lo, hi: N, lambda l, n: cl[l, n], lambda n, s: bt[n, s], zero,
               lambda l, s, v: T.buffer_store(cb, v, [b, c, g, l, s]))

    return stamp(func, "ssd_bmm_chunk", d.stamp_static())


def _task(t, nchunks, H):
    """Task t of the chunk scan -> (batch, chunk, head)."""
    return t // (nchunks * H), t // H % nchunks, t % H


def _pos(c, l, Q, seqlen):
    """Chunk position l as a sequence index clamped into range (the loads past seqlen are masked)."""
    return tirx.min(c * Q + l, seqlen - 1)


def _row(buf, task, l, head, j, Q, seqlen):
    """buf[b, c Q + l, head, j] of task (b, c, h) as float32, 0 past seqlen."""
    b, c, _ = task
    return ld(buf, (b, _pos(c, l, Q, seqlen), head, j), seqlen, c * Q + l)


def _carry(m, d: ScanDims, dA_cs, seq_idx, Dm, task, l, p, seqlen, v, xv):
    """e[l] (C_l Sin)[p] + D x[l, p], e[l] = exp(dA_cs[l]), 0 where the carried state belongs to another
    sequence than position l (its id differs from the previous chunk's last id, 0 before position 0)."""
    b, c, h = task
    Q = d.chunk_size
    e = m.exp(dA_cs[b, h, c, l])
    if d.has_seq_idx:
        prev = tirx.if_then_else(c > 0, seq_idx[b, tirx.max(c * Q, 1) - 1], tirx.const(0, I32))
        e = tirx.Select(seq_idx[b, _pos(c, l, Q, seqlen)] == prev, e, c32(0.0))
    if d.has_D:
        return e * v + (Dm[h, p] if d.D_has_hdim else Dm[h]) * xv
    return e * v


class _Row:
    """A chunk row read where it lies, row[q] = at(q) (seg_exp indexes rows the CPU loop nests stage)."""

    def __init__(self, at):
        self.at = at

    def __getitem__(self, q):
        return self.at(q)


def _weight(m, d: ScanDims, cb, dA_cs, dt_out, seq_idx, task, l, s, seqlen):
    """(C_l.B_s) exp(dA_cs[l] - dA_cs[s]) dt'[s] for s <= l in the same sequence, else 0 (the decay masked
    before the exp)."""
    b, c, h = task
    Q = d.chunk_size
    acs = _Row(lambda q: dA_cs[b, h, c, q])
    sid = _Row(lambda q: seq_idx[b, _pos(c, q, Q, seqlen)])
    return cb[b, c, h // d.heads_per_group, l, s] * seg_exp(m, acs, sid, l, s, d.has_seq_idx) * dt_out[b, h, c, s]


def _put(m, d: ScanDims, y, y_pre, z, task, l, p, v):
    """y = v silu(z) and y_pre = v with z, else y = v (in x's dtype), at position l of the task's chunk."""
    b, c, h = task
    idx = [b, c * d.chunk_size + l, h, p]
    if d.has_z:
        T.buffer_store(y_pre, v.astype(d.x_dtype), idx)
        T.buffer_store(y, (v * m.silu(z[idx].astype(F32))).astype(d.x_dtype), idx)
    else:
        T.buffer_store(y, v.astype(d.x_dtype), idx)


def chunk_scan_template(d: ScanDims, S: Strategy) -> tirx.PrimFunc:
    """The ssd_chunk_scan kernel laid out by ``S``: task t = (batch, chunk, head), its chunk_size x headdim
    output by the strategy's ``causal_matmul`` (strategy.py): y0[l, p] = e[l] (C_l Sin)[p] + D x[l, p]
    + sum_{s<=l} w[l, s] x[s, p], w = (C.B^T) exp(segsum) dt'; then the z gate. Positions past seqlen read as 0
    and are not stored."""
    H, G, P, N, Q, R, m = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size, d.heads_per_group, S.math
    run = S.causal_matmul(Q, P, N)

    @T.prim_func
    def func(x_h: T.handle, z_h: T.handle, cb_h: T.handle, c_h: T.handle, dto_h: T.handle, dac_h: T.handle,
             sin_h: T.handle, d_h: T.handle, s_h: T.handle, y_h: T.handle, yp_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        x = T.match_buffer(x_h, (batch, seqlen, H, P), d.x_dtype)
        z = T.match_buffer(z_h, (batch, seqlen, H, P) if d.has_z else Z4, d.x_dtype)
        cb = T.match_buffer(cb_h, (batch, nchunks, G, Q, Q), F32)  # C_l . B_s (ssd_bmm_chunk)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), d.bc_dtype)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        sin = T.match_buffer(sin_h, (batch, nchunks, H, P, N), d.state_dtype)
        Dm = T.match_buffer(d_h, ((H, P) if d.D_has_hdim else (H,)) if d.has_D else (1,), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        y = T.match_buffer(y_h, (batch, seqlen, H, P), d.x_dtype)
        y_pre = T.match_buffer(yp_h, (batch, seqlen, H, P) if d.has_z else Z4, d.x_dtype)
        run(batch * nchunks * H,
            lambda t: T.min(Q, seqlen - t // H % nchunks * Q),
            lambda t, l, n: _row(Cm, _task(t, nchunks, H), l, t % H // R, n, Q, seqlen),
            lambda t, n, p: sin[t // (nchunks * H), t // H % nchunks, t % H, p, n].astype(F32),
            lambda t, l, p, v, xv: _carry(m, d, dA_cs, seq_idx, Dm, _task(t, nchunks, H), l, p, seqlen, v, xv),
            lambda t, l, s: _weight(m, d, cb, dA_cs, dt_out, seq_idx, _task(t, nchunks, H), l, s, seqlen),
            lambda t, s, p: _row(x, _task(t, nchunks, H), s, t % H, p, Q, seqlen),
            lambda t, l, p, v: _put(m, d, y, y_pre, z, _task(t, nchunks, H), l, p, v))

    return func


def ssd_chunk_scan(dims: ScanDims | None = None, strategy: Strategy = SERIAL, **kw) -> tirx.PrimFunc:
    """x, z: (batch, seqlen, nheads, headdim); cb: (batch, nchunks, ngroups, chunk_size, chunk_size) f32 (C.B^T,
    ssd_bmm_chunk); C: (batch, seqlen, ngroups, dstate); dt_out, dA_cumsum: (batch, nheads, nchunks, chunk_size)
    f32; states_in: (batch, nchunks, nheads, headdim, dstate) in state_dtype; D: (nheads,) or (nheads, headdim) f32;
    seq_idx: (batch, seqlen) int32
    -> y: (batch, seqlen, nheads, headdim), y_pre: same (the pre-gate output, written only with z).

    y0[l] = sum_{s<=l} (C_l.B_s) exp(dA_cs[l]-dA_cs[s]) dt_out[s] x[s] + exp(dA_cs[l]) Sin C_l + D x[l];
    y = y0 * silu(z). One template (``chunk_scan_template``) laid out by ``strategy``; the CPU strategy's knobs
    rows x cols x order: the register block of its chunk matmuls (mm.py).
    """
    d = dims_of(ScanDims, dims, kw)
    return stamp(chunk_scan_template(d, strategy), "ssd_chunk_scan", d.stamp_static())


def ssd_chunk_scan_bwd_dstates(dims: DstatesDims | None = None, *, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS,
                               order: int = DEFAULT_ORDER, **kw) -> tirx.PrimFunc:
    """dy, z, y_pre: (batch, seqlen, nheads, headdim); C: (batch, seqlen, ngroups, dstate); dA_cumsum:
    (batch, nheads, nchunks, chunk_size); seq_idx: (batch, seqlen)
    -> dstates_local: (batch, nchunks, nheads, headdim, dstate) f32, dz: (batch, seqlen, nheads, headdim).

    dstates_local[c, p, n] = sum_l exp(dA_cs[l]) g[l, p] C[l, n] (seq-masked), g = dy silu(z);
    dz = dy * y_pre * silu'(z). ``rows`` x ``cols``: the register block of the matmul.
    """
    d = dims_of(DstatesDims, dims, kw)
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    x_dtype, bc_dtype, has_seq_idx, has_z = d.x_dtype, d.bc_dtype, d.has_seq_idx, d.has_z
    R = H // G
    mm = matmul(P, N, rows, cols, order=order)
    zshape = (1, 1, 1, 1)

    @T.prim_func
    def func(dy_h: T.handle, z_h: T.handle, yp_h: T.handle, c_h: T.handle, dac_h: T.handle, s_h: T.handle,
             dsl_h: T.handle, dz_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        dy = T.match_buffer(dy_h, (batch, seqlen, H, P), x_dtype)
        z = T.match_buffer(z_h, (batch, seqlen, H, P) if has_z else zshape, x_dtype)
        y_pre = T.match_buffer(yp_h, (batch, seqlen, H, P) if has_z else zshape, x_dtype)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), bc_dtype)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if has_seq_idx else (1, 1), I32)
        dsl = T.match_buffer(dsl_h, (batch, nchunks, H, P, N), F32)
        dz = T.match_buffer(dz_h, (batch, seqlen, H, P) if has_z else zshape, x_dtype)
        for bch in T.parallel(batch * nchunks * H):
            b = T.meta_var(bch // (nchunks * H))
            c = T.meta_var(bch // H % nchunks)
            h = T.meta_var(bch % H)
            ce = T.alloc_buffer((Q, N), F32)  # C rows scaled by exp(dA_cs[l]) (0 past seqlen)
            gt = T.alloc_buffer((P, Q), F32)  # g transposed
            gv = T.alloc_buffer((P,), F32)
            e = T.alloc_buffer((1,), F32)
            for l in range(Q):
                t = T.meta_var(T.min(c * Q + l, seqlen - 1))
                e[0] = T.float32(0)
                if c * Q + l < seqlen:
                    e[0] = _math.exp(dA_cs[b, h, c, l])
                    if has_seq_idx:
                        e[0] = T.Select(seq_idx[b, t] == T.if_then_else(c > 0, seq_idx[b, T.max(c * Q, 1) - 1], 0),
                                        e[0], T.float32(0))
                for n in T.vectorized(N):
                    ce[l, n] = Cm[b, t, h // R, n].astype(F32) * e[0]
                for p in T.vectorized(P):  # vectorized (silu's exp), then transposed by a scalar copy
                    gv[p] = gate(_m, dy, z, (b, t, h, p), seqlen, c * Q + l, has_z)
                for p in range(P):
                    gt[p, l] = gv[p]
                if has_z:
                    if c * Q + l < seqlen:
                        for p in T.vectorized(P):
                            dz[b, t, h, p] = (dy[b, t, h, p].astype(F32) * y_pre[b, t, h, p].astype(F32)
                                              * _math.silu_grad(z[b, t, h, p].astype(F32))).astype(x_dtype)
            mm(lambda lo, hi: 0, lambda lo, hi: Q, lambda p, l: gt[p, l], lambda l, n: ce[l, n], zero,
               lambda p, n, v: T.buffer_store(dsl, v, [b, c, h, p, n]))

    return stamp(func, "ssd_chunk_scan_bwd_dstates", d.stamp_static())
