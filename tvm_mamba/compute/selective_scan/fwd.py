"""The forward scan: one template, laid out by a ``Layout`` (serial, CPU vectors over dstate or over
channels, CUDA warp lanes).

One lane = one batch row and ``L.chans`` consecutive channels (1, or a vector of channels: the CPU's
channels layout); its state h lives in lane-local buffers h[reg, e] (the layout splits dstate over a vector
or over warp threads; e is the lane's channel slot); time runs serially, chunk by chunk, writing the
checkpoint (the state before each chunk) that the backward recomputes from. Every per-step value (dt,
dt*u, y) is one per channel slot: a scalar where a lane is one channel, a vector over channels otherwise.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanDims
from ._layout import Layout
from ._signature import scan_kernel
from ._step import ScanMath


def _chunk_macros(dims: ScanDims, L: Layout, sm: ScanMath):
    """The time-batched halves of a chunk (CPU, one channel per lane): dt of every step before the scan,
    outputs after it, both vectorized over ``tvec`` steps (softplus and SiLU cost two exps each: vector work,
    not the scan's)."""
    chunk, TV = dims.chunk, L.tvec

    @T.macro
    def chunk_dt(delta, db, dtb, b, d, c, NT):
        for io in range(NT // TV):
            for ii in L.vloop(TV):
                dtb[io * TV + ii] = sm.dt_at(delta, db, b, d, c * chunk + io * TV + ii)
        for i in range(NT // TV * TV, NT):
            dtb[i] = sm.dt_at(delta, db, b, d, c * chunk + i)

    @T.macro
    def chunk_out(u, Dv, z, out, yb, b, d, c, NT):
        for io in range(NT // TV):
            for ii in L.vloop(TV):
                out[b, d, c * chunk + io * TV + ii] = sm.finish(yb[io * TV + ii], u, Dv, z, b, d,
                                                                c * chunk + (io * TV + ii))
        for i in range(NT // TV * TV, NT):
            out[b, d, c * chunk + i] = sm.finish(yb[i], u, Dv, z, b, d, c * chunk + i)

    return chunk_dt, chunk_out


def _params(dims: ScanDims, L: Layout, sm: ScanMath):
    """Reads of A[d, n], B_t[n], C_t[n] for channel slot e of the lane at channel d0: from the lane's copies
    (``L.stage_params``: A and a time-invariant B / C transposed into the lane once, so a vector over
    channels loads contiguous values) or from the inputs. ``ap``/``bp``/``cp`` are those copies (or, when
    not staged, the inputs themselves, unused)."""
    ST = L.stage_params
    SB, SC = ST and not dims.varying_B, ST and not dims.varying_C

    def a(A, ap, d0, e, n):
        return ap[n, e] if ST else A[d0 + e, n]

    def bv(Bm, bp, b, d0, e, t, n):
        return bp[n, e] if SB else sm.B(Bm, b, d0 + e, t, n)

    def cv(Cm, cp, b, d0, e, t, n):
        return cp[n, e] if SC else sm.C(Cm, b, d0 + e, t, n)

    return a, bv, cv


def step_macro(dims: ScanDims, L: Layout, sm: ScanMath):
    """One forward step of a lane (s[e] = dt of channel slot e on entry; s[k * chans + e]: dt, dt*u, y):
    h <- exp(dt A) h + dt u B over the lane's states, y = C . h (vector or per-thread partials in
    yv[e, :], then the layout's sum; y starts from D u on layouts with ``y_from_skip``)."""
    N, m, G = dims.dstate, sm.m, L.chans
    a, bv, cv = _params(dims, L, sm)

    @T.macro
    def step(u, A, Bm, Cm, Dv, ap, bp, cp, h, yv, s, b, d0, t, j):
        for e in L.chan_loop():
            s[G + e] = s[e] * m.cast(u[b, d0 + e, t])
        for ki in L.st_inner():
            for e in L.chan_loop():
                yv[e, ki] = sm.skip(Dv, u, b, d0 + e, t) if L.y_from_skip else m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                for e in L.chan_loop():
                    n = T.meta_var(L.state(ko, ki, j))
                    r = T.meta_var(L.reg(ko, ki))
                    h[r, e] = sm.h_next(m.exp(s[e] * a(A, ap, d0, e, n)), h[r, e], s[G + e],
                                        bv(Bm, bp, b, d0, e, t, n))
                    yv[e, ki] = yv[e, ki] + cv(Cm, cp, b, d0, e, t, n) * h[r, e]
        for e in L.chan_loop():
            L.reduce(s, 2 * G + e, yv, e)

    return step


def fwd_template(dims: ScanDims, L: Layout) -> tirx.PrimFunc:
    """The forward loop nest of ``dims`` laid out by ``L`` (shapes: ``selective_scan_fwd``)."""
    N, chunk, ACC, G = dims.dstate, dims.chunk, dims.acc, L.chans
    m, TB, SCOPE, ST = L.math, L.time_batched, L.scope, L.stage_params
    assert dims.dim % G == 0 and not (TB and G > 1), "a lane of several channels computes per-step math inline"
    sm = ScanMath(dims, m)
    chunk_dt, chunk_out = _chunk_macros(dims, L, sm)
    step = step_macro(dims, L, sm)
    VARB, VARC, has_init = dims.varying_B, dims.varying_C, dims.has_init
    NL = dims.dim // G  # lanes per batch row

    @T.macro
    def lane_scan(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, seqlen, nchunk, b, d0, j, ok):
        h = T.alloc_buffer((L.regs(N), G), ACC, scope=SCOPE)
        yv = T.alloc_buffer((G, L.V), ACC, scope=SCOPE)  # partials of C . h
        s = T.alloc_buffer((4 * G,), ACC, scope=SCOPE)  # dt, dt*u, y of each channel slot
        if ST:  # A and a time-invariant B / C of the lane's channels, [n, e] (``_params``)
            ap = T.alloc_buffer((N, G), ACC, scope=SCOPE)
            bp = T.alloc_buffer((1 if VARB else N, G), ACC, scope=SCOPE)
            cp = T.alloc_buffer((1 if VARC else N, G), ACC, scope=SCOPE)
        if TB:
            dtb = T.alloc_buffer((chunk,), ACC, scope=SCOPE)  # dt of each step of the chunk
            yb = T.alloc_buffer((chunk,), ACC, scope=SCOPE)  # C.h of each step of the chunk
            # pin the full extent: otherwise buffer compaction sizes these by the (symbolic) chunk length,
            # which CUDA codegen rejects ("Can only handle constant size stack allocation")
            dtb[chunk - 1] = m.zero
            yb[chunk - 1] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                for e in L.chan_loop():
                    h[L.reg(ko, ki), e] = init[b, d0 + e, L.state(ko, ki, j)] if has_init else m.zero
                    if ST:
                        ap[L.state(ko, ki, j), e] = A[d0 + e, L.state(ko, ki, j)]
                        if not VARB:
                            bp[L.state(ko, ki, j), e] = m.cast(Bm[d0 + e, L.state(ko, ki, j)])
                        if not VARC:
                            cp[L.state(ko, ki, j), e] = m.cast(Cm[d0 + e, L.state(ko, ki, j)])
        for c in range(nchunk):
            NT = T.meta_var(T.min(seqlen - c * chunk, chunk))  # steps in this chunk
            if ok:
                for ko in L.st_outer(N):
                    for ki in L.st_inner():
                        for e in L.chan_loop():
                            ck[b, d0 + e, c, L.state(ko, ki, j)] = h[L.reg(ko, ki), e]
            if TB:
                chunk_dt(delta, db, dtb, b, d0, c, NT)
            for i in range(NT):
                for e in L.chan_loop():
                    s[e] = dtb[i] if TB else sm.dt_at(delta, db, b, d0 + e, c * chunk + i)
                step(u, A, Bm, Cm, Dv, ap if ST else A, bp if ST else Bm, cp if ST else Cm, h, yv, s, b, d0,
                     c * chunk + i, j)
                if TB:
                    yb[i] = s[2]
                else:
                    if L.leader(ok, j):
                        for e in L.chan_loop():
                            out[b, d0 + e, c * chunk + i] = sm.finish(s[2 * G + e], u, Dv, z, b, d0 + e,
                                                                      c * chunk + i, skip=not L.y_from_skip)
            if TB:
                chunk_out(u, Dv, z, out, yb, b, d0, c, NT)
        if ok:
            for ko in L.st_outer(N):
                for ki in L.st_inner():
                    for e in L.chan_loop():
                        last[b, d0 + e, L.state(ko, ki, j)] = h[L.reg(ko, ki), e]

    @T.macro
    def body(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, batch, seqlen, nchunk):
        for lo in L.outer(batch * NL):
            for li in L.inner():
                if L.lane_guard(lo, li, batch * NL):
                    lane = T.meta_var(L.lane_of(lo, li, batch * NL))
                    lane_scan(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, seqlen, nchunk,
                              lane // NL, lane % NL * G if G > 1 else lane % NL, L.thread(li),
                              L.lane_ok(lo, li, batch * NL))

    return scan_kernel(dims, L, body)
