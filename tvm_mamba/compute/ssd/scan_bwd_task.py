"""ssd_chunk_scan_bwd laid out a task per (batch, chunk, group, part) (scan_bwd.py; the CPU strategy): the
task stages its group's B / C rows once, runs the part's heads in order on staged operands with the
register-blocked matmuls of mm.py (knobs rows / cols / order of the strategy), and sums their dB / dC rows
in head order; the intra-chunk dB / dC terms run once per part on gsum after the last head.

Every piece is a macro over ``o`` (the kernel's buffers and symbolic sizes, scan_bwd.py) and ``w`` (the task's
indices and stack scratch: ``ChunkStrategy.scratch`` and ``_at_task``). Rows past seqlen are staged as zeros and
never stored.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from . import scan_bwd_spec as spec
from .common import I32, batch_sids, carried_decay, causal, gate, ld, seg_exp, skip_at, state_decay
from .dims import ScanBwdDims
from .mm import lower_cols, matmul, vblock
from .strategy import ChunkStrategy


def task_body(d: ScanBwdDims, S: ChunkStrategy):
    """The macro ``body(o)``: a parallel task per (batch, chunk, group, part) running the pieces below."""
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    R = H // G
    W2 = max(P, N)
    stage_group, stage_head = _stage(d, S)
    rows_pass, dx_piece = _head_pieces(d, S)
    dc_db_heads, intra = _part_pieces(d, S)

    @T.macro
    def body(o):
        for task in S.outer(o.batch * o.nchunks * o.gparts):
            # dcar: the carried-state term of d dA_cs (reverse-cumsummed at the end); rsuf: R[k] = sum_{l'>=l}
            # G[l', k], column sums of the rows done so far; t1 / t2: the two matmul products of dx, then dC,
            # then dB; sc: scalar accumulators ([0] reductions, [1] chunk-state prefix); dBa / dCa: the part's
            # dB / dC rows, summed over its heads in order
            w = T.meta_var(_at_task(S.scratch(
                acs=(Q,), dtl=(Q,), sid=((Q,), I32), e=(Q,), wst=(Q,), xl=(Q, P), xt=(P, Q), gl=(Q, P), cl=(Q, N),
                bl=(Q, N), dsot=(N, P), cb=(Q, Q), gx=(Q, Q), gr=(Q,), kk=(Q,), dcar=(Q,), rsuf=(Q,), dd=(Q,),
                dac=(Q,), rp=(P,), t1=(Q, W2), t2=(Q, W2), sc=(2,), dBa=(Q, N), dCa=(Q, N)), o, task, G, R))
            stage_group(o, w)
            for hh in range(w.per):
                h = T.meta_var(w.g * R + w.part * w.per + hh)
                r = T.meta_var(_reader(d, o, w, h))
                stage_head(o, w, h)
                rows_pass(o, w, r)
                dx_piece(o, w, r)
                dc_db_heads(o, w, r)
            intra(o, w, _reader(d, o, w, None))

    return body


def _reader(d: ScanBwdDims, o, w, h) -> SimpleNamespace:
    """The specs' reader (scan_bwd_spec.py) on task w's staged rows of head h (None: the part's gsum, B, C);
    K(l, s) and cbk(l, s) are row l's, staged by the row pass."""
    b, c = w.b, w.c
    return SimpleNamespace(
        h=h, g=lambda l, p: w.gl[l, p], x=lambda s, p: w.xl[s, p], xT=lambda p, s: w.xt[p, s],
        B=lambda s, n: w.bl[s, n], C=lambda l, n: w.cl[l, n], dso=lambda p, n: o.dso[b, c, h, p, n],
        dsoT=lambda n, p: w.dsot[n, p], sin=lambda p, n: o.sin[b, c, h, p, n], cb=lambda l, s: o.cbg[b, c, w.g, l, s],
        K=lambda l, s: w.kk[s], dt=lambda s: w.dtl[s], cbk=lambda l, s: w.cb[l, s],
        gsum=lambda l, s: o.gsum[b, c, w.gp, l, s], wst=lambda s: w.wst[s], e=lambda l: w.e[l],
        skip=lambda s, p, v: skip_at(d, o.Dm, b, h, c, s, p, v))


def _staged(d: ScanBwdDims, S: ChunkStrategy, p: spec.Product):
    """The macro ``run(r, init, store)``: Product ``p`` on reader r by mm.py's register-blocked matmul (knobs
    rows / cols / order), init(i, j) its start (``p.init`` or a running sum), store(i, j, v) the epilogue. Its
    causal range selects k per row (never 0 * a non-finite dy / x / B / C of another position)."""
    tri = {None: None, "ge": "gt" if d.diag_skip else "ge", "le": "lt" if d.diag_skip else "le"}[p.causal]
    mm = matmul(p.M, p.W, S.rows, S.cols, lower=p.lower, order=S.order, tri=tri,
                group=d.step_group if p.causal else 1)
    klo = (lambda lo, hi: lo) if p.causal == "ge" else (lambda lo, hi: 0)  # noqa: E731
    khi = (lambda lo, hi: hi) if p.causal == "le" else (lambda lo, hi: p.K)  # noqa: E731

    @T.macro
    def run(r, init, store):
        mm(klo, khi, lambda i, k: p.a(r, i, k), lambda k, j: p.b(r, k, j), init, store)

    return run


def _at_task(w, o, task, G: int, R: int):
    """w plus the indices of task (batch b, chunk c, group g, part gp of all gparts, part of its group) and
    the heads per part (per)."""
    hp = o.gparts // G  # parts per group
    w.b, w.c, w.g = task // (o.nchunks * o.gparts), task // o.gparts % o.nchunks, task % o.gparts // hp
    w.gp, w.part, w.per = task % o.gparts, task % o.gparts % hp, R // hp
    return w


def _stage(d: ScanBwdDims, S: ChunkStrategy):
    """Macros ``stage_group(o, w)`` (zero the part's gsum blocks, stage the group's B / C rows, zero the dB / dC
    sums) and ``stage_head(o, w, h)`` (head h's decays, masks, x, g = dy silu(z), dSo^T; zeros past seqlen)."""
    P, N, Q, m = d.headdim, d.dstate, d.chunk_size, S.math
    VB = vblock(Q)

    @T.macro
    def stage_group(o, w):
        b, c = T.meta_var(w.b), T.meta_var(w.c)
        for l in range(Q):
            for sb in range(lower_cols(l, Q, VB) // VB):
                for v in T.vectorized(VB):
                    o.gsum[b, c, w.gp, l, sb * VB + v] = T.float32(0)
        for l in range(Q):  # the group's B / C rows (zeros past seqlen), shared by the part's heads
            t = T.meta_var(T.min(c * Q + l, o.seqlen - 1))
            for n in T.vectorized(N):
                w.cl[l, n] = ld(o.Cm, (b, t, w.g, n), o.seqlen, c * Q + l)
                w.bl[l, n] = ld(o.Bm, (b, t, w.g, n), o.seqlen, c * Q + l)
                w.dBa[l, n] = T.float32(0)
                w.dCa[l, n] = T.float32(0)

    @T.macro
    def stage_head(o, w, h):
        b, c = T.meta_var(w.b), T.meta_var(w.c)
        for l in range(Q):
            w.acs[l] = o.dA_cs[b, h, c, l]
            w.dtl[l] = o.dt_out[b, h, c, l]
            w.dd[l] = T.float32(0)
            w.dac[l] = T.float32(0)
            w.dcar[l] = T.float32(0)
            w.rsuf[l] = T.float32(0)
        for l in range(Q):
            t = T.meta_var(T.min(c * Q + l, o.seqlen - 1))
            if d.has_seq_idx:
                w.sid[l] = o.seq_idx[b, t]
            sids = T.meta_var(batch_sids(o.seq_idx, b))
            w.e[l] = carried_decay(m, w.acs[l], o.seq_idx[b, t], sids, c, Q, d.has_seq_idx)
            w.wst[l] = state_decay(m, w.acs[Q - 1], w.acs[l], o.seq_idx[b, t], sids, c, Q, o.seqlen,
                                   d.has_seq_idx)
            for p in T.vectorized(P):
                w.xl[l, p] = ld(o.x, (b, t, h, p), o.seqlen, c * Q + l)
                w.gl[l, p] = gate(m, o.dy, o.z, (b, t, h, p), o.seqlen, c * Q + l, d.has_z)
            for p in range(P):
                w.xt[p, l] = w.xl[l, p]
        for p in range(P):
            for n in range(N):
                w.dsot[n, p] = o.dso[b, c, h, p, n]

    return stage_group, stage_head


def _head_pieces(d: ScanBwdDims, S: ChunkStrategy):
    """Macros ``rows_pass(o, w, r)`` and ``dx_piece(o, w, r)``: head h's g x^T, masks, gsum, d dt and d dA_step
    intra-chunk terms; its dx (spec.pieces' dx) and the chunk-state terms of d dt / d dA_step."""
    P, Q, m = d.headdim, d.chunk_size, S.math
    VB = vblock(Q)
    sp = spec.pieces(d)
    gx_mm, dx_main, dx_state = (_staged(d, S, p) for p in (sp.gx, sp.dx.main, sp.dx.state))

    @T.macro
    def rows_pass(o, w, r):
        """gx = g x^T (cb = C B^T comes from ssd_bmm_chunk, once per group); then the causal blocks only
        (s < lower_cols(l): gx and cb right of them are never read unmasked), rows from the last up (for the
        column suffix sums R of the crossing pairs): masks, decays, d dt, gsum, d dA_step's intra-chunk term."""
        b, c = T.meta_var(w.b), T.meta_var(w.c)
        gx_mm(r, lambda l, s: sp.gx.init(r, l, s), lambda l, s, v: T.buffer_store(w.gx, v, [l, s]))
        for lr in range(Q):
            l = T.meta_var(Q - 1 - lr)
            for sb in range(lower_cols(l, Q, VB) // VB):
                for v in T.vectorized(VB):
                    s = T.meta_var(sb * VB + v)
                    w.kk[s] = seg_exp(m, w.acs, w.sid, l, s, d.has_seq_idx)
                    # selected, not multiplied by kk = 0: gx[l, s > l] = g_l . x_s may be NaN / Inf
                    w.gr[s] = T.Select(causal(d, l, s), spec.ddt_term(r, l, s, w.gx[l, s]), T.float32(0))
                    w.dd[s] = w.dd[s] + w.gr[s]
                    w.cb[l, s] = spec.cbk(r, l, s)
                    o.gsum[b, c, w.gp, l, s] = o.gsum[b, c, w.gp, l, s] + T.Select(
                        causal(d, l, s), spec.gsum_term(r, l, s, w.gx[l, s]), T.float32(0))
                    w.rsuf[s] = w.rsuf[s] + spec.pair_term(r, s, w.gr[s])  # G[l, s] (0 off the causal pairs)
            # crossing pairs of step l: d dA_step[l] += sum_{k<l} sum_{l'>=l} G[l', k] (never a difference of
            # sums: G[l', k] reaches the steps k < l <= l' only)
            w.sc[0] = T.float32(0)
            for s in range(l):
                w.sc[0] = w.sc[0] + w.rsuf[s]
            w.dac[l] = w.dac[l] + w.sc[0]

    @T.macro
    def dx_piece(o, w, r):
        """dx (t1 = its main product, t2 its state product), and the chunk-state terms of d dt / d dA_step
        (prefix over k < s)."""
        b, c = T.meta_var(w.b), T.meta_var(w.c)
        dx_main(r, lambda s, p: sp.dx.main.init(r, s, p), lambda s, p, v: T.buffer_store(w.t1, v, [s, p]))
        dx_state(r, lambda s, p: sp.dx.state.init(r, s, p), lambda s, p, v: T.buffer_store(w.t2, v, [s, p]))
        w.sc[1] = T.float32(0)
        for s in range(Q):
            w.sc[0] = T.float32(0)
            for p in range(P):
                w.sc[0] = w.sc[0] + spec.xb_term(r, s, p, w.t2[s, p])
            w.dd[s] = w.dd[s] + spec.ddt_state(r, s, w.sc[0])
            w.dac[s] = w.dac[s] + w.sc[1]
            w.sc[1] = w.sc[1] + spec.prefix_term(r, s, w.sc[0])
            if c * Q + s < o.seqlen:
                for p in T.vectorized(P):
                    o.dx[b, c * Q + s, r.h, p] = sp.dx.out(r, s, w.t1[s, p], w.t2[s, p]).astype(d.x_dtype)

    return rows_pass, dx_piece


def _part_pieces(d: ScanBwdDims, S: ChunkStrategy):
    """Macros ``dc_db_heads(o, w, r)`` (head h's terms of the part's dB / dC, its dD, d dt and d dA_step) and
    ``intra(o, w, r)`` (the part's intra-chunk dB / dC, then its rows stored): spec.pieces' dB, dC, dD."""
    P, N, Q = d.headdim, d.dstate, d.chunk_size
    sp = spec.pieces(d)
    dC_head, dB_head, dC_intra, dB_intra = (_staged(d, S, p) for p in (sp.dC.head, sp.dB.head, sp.dC.intra,
                                                                       sp.dB.intra))

    @T.macro
    def dc_db_heads(o, w, r):
        """Head h's terms of the part's dC (carried state: e[l] g_l Sin) and dB (chunk state: w[s] dt[s] x_s dSo),
        its dD partial, and its d dt / d dA_step (the carried-state term reverse-cumsummed: d dA_cs[l] reaches
        the steps s <= l)."""
        b, c, h = T.meta_var(w.b), T.meta_var(w.c), T.meta_var(r.h)
        dC_head(r, lambda l, n: sp.dC.head.init(r, l, n), lambda l, n, v: T.buffer_store(w.t1, v, [l, n]))
        for l in range(T.min(Q, o.seqlen - c * Q)):
            w.sc[0] = T.float32(0)
            for n in range(N):
                w.sc[0] = w.sc[0] + spec.carried_term(r, l, n, w.t1[l, n])
            w.dcar[l] = sp.dC.scale(r, l) * w.sc[0]
            for n in T.vectorized(N):
                w.dCa[l, n] = w.dCa[l, n] + sp.dC.scale(r, l) * w.t1[l, n]
        dB_head(r, lambda s, n: sp.dB.head.init(r, s, n), lambda s, n, v: T.buffer_store(w.t2, v, [s, n]))
        for s in range(T.min(Q, o.seqlen - c * Q)):
            for n in T.vectorized(N):
                w.dBa[s, n] = w.dBa[s, n] + sp.dB.scale(r, s) * w.t2[s, n]
        if d.diag_skip:  # per position l: the sum over p
            for l in range(Q):
                w.sc[0] = T.float32(0)
                for p in range(P):
                    w.sc[0] = w.sc[0] + sp.dd.term(r, l, p)
                o.dD_part[b, h, c, l] = w.sc[0]
        elif d.has_D:  # per channel p: the sum over l, run as a vector of the channels
            for p in T.vectorized(P):
                w.rp[p] = T.float32(0)
            for l in range(Q):
                for p in T.vectorized(P):
                    w.rp[p] = w.rp[p] + sp.dd.term(r, p, l)
            for p in T.vectorized(P):
                o.dD_part[b, c, h, p] = w.rp[p]
        w.sc[0] = T.float32(0)
        for lr in range(Q):
            w.sc[0] = w.sc[0] + w.dcar[Q - 1 - lr]
            o.ddt_out[b, h, c, Q - 1 - lr] = w.dd[Q - 1 - lr]
            o.ddA_step[b, h, c, Q - 1 - lr] = w.dac[Q - 1 - lr] + w.sc[0]

    @T.macro
    def intra(o, w, r):
        """The intra-chunk dB / dC once per part (B, C are the group's), each from the part's head terms; then
        the part's rows are stored."""
        c = T.meta_var(w.c)
        dC_intra(r, lambda l, n: w.dCa[l, n], lambda l, n, v: T.buffer_store(w.dCa, v, [l, n]))
        dB_intra(r, lambda s, n: w.dBa[s, n], lambda s, n, v: T.buffer_store(w.dBa, v, [s, n]))
        for l in range(T.min(Q, o.seqlen - c * Q)):
            for n in T.vectorized(N):
                o.dBp[w.b, c * Q + l, w.gp, n] = w.dBa[l, n]
                o.dCp[w.b, c * Q + l, w.gp, n] = w.dCa[l, n]

    return dc_db_heads, intra
