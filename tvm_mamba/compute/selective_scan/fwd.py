"""The forward scan: one template, laid out by a ``Layout`` (serial, CPU vector lanes, CUDA warp lanes).

One lane = one (batch, channel); its state h lives in lane-local buffers (the layout splits dstate over
a vector or over warp threads); time runs serially, chunk by chunk, writing the checkpoint (the state
before each chunk) that the backward recomputes from.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._dims import ScanDims
from ._layout import Layout
from ._step import ScanMath


def _chunk_macros(dims: ScanDims, L: Layout, sm: ScanMath):
    """The time-batched halves of a chunk (CPU): dt of every step before the scan, outputs after it, both
    vectorized over ``tvec`` steps (softplus and SiLU cost two exps each: vector work, not the scan's)."""
    chunk, TV = dims.chunk, L.tvec

    @T.macro
    def chunk_dt(delta, db, dtb, b, d, c, NT):
        for io in range(NT // TV):
            for ii in L.vec_loop(TV):
                dtb[io * TV + ii] = sm.dt_at(delta, db, b, d, c * chunk + io * TV + ii)
        for i in range(NT // TV * TV, NT):
            dtb[i] = sm.dt_at(delta, db, b, d, c * chunk + i)

    @T.macro
    def chunk_out(u, Dv, z, out, yb, b, d, c, NT):
        for io in range(NT // TV):
            for ii in L.vec_loop(TV):
                out[b, d, c * chunk + io * TV + ii] = sm.finish(yb[io * TV + ii], u, Dv, z, b, d,
                                                                c * chunk + (io * TV + ii))
        for i in range(NT // TV * TV, NT):
            out[b, d, c * chunk + i] = sm.finish(yb[i], u, Dv, z, b, d, c * chunk + i)

    return chunk_dt, chunk_out


def step_macro(dims: ScanDims, L: Layout, sm: ScanMath):
    """One forward step of a lane (s[0] = dt on entry): h <- exp(dt A) h + dt u B over the lane's states,
    s[2] = C . h (vector or per-thread partials in yv, then the layout's sum)."""
    N, m = dims.dstate, sm.m

    @T.macro
    def step(u, A, Bm, Cm, h, yv, s, b, d, t, j):
        s[1] = s[0] * m.cast(u[b, d, t])
        for ki in L.st_inner():
            yv[0, ki] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                n = T.meta_var(L.state(ko, ki, j))
                r = T.meta_var(L.reg(ko, ki))
                h[r] = sm.h_next(m.exp(s[0] * A[d, n]), h[r], s[1], sm.B(Bm, b, d, t, n))
                yv[0, ki] = yv[0, ki] + sm.C(Cm, b, d, t, n) * h[r]
        L.reduce(s, 2, yv, 0)

    return step


def fwd_template(dims: ScanDims, L: Layout) -> tirx.PrimFunc:
    """The forward loop nest of ``dims`` laid out by ``L`` (shapes: ``selective_scan_fwd``)."""
    N, chunk, ACC, UT = dims.dstate, dims.chunk, dims.acc, dims.u_dtype
    m, TB, SCOPE = L.math, L.time_batched, L.scope
    sm = ScanMath(dims, m)
    chunk_dt, chunk_out = _chunk_macros(dims, L, sm)
    step = step_macro(dims, L, sm)
    VARB, VARC, has_init = dims.varying_B, dims.varying_C, dims.has_init

    @T.macro
    def lane_scan(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, seqlen, nchunk, b, d, j, ok):
        h = T.alloc_buffer((L.regs(N),), ACC, scope=SCOPE)
        yv = T.alloc_buffer((1, L.V), ACC, scope=SCOPE)  # partials of C . h
        s = T.alloc_buffer((4,), ACC, scope=SCOPE)  # dt, dt*u, y
        if TB:
            dtb = T.alloc_buffer((chunk,), ACC, scope=SCOPE)  # dt of each step of the chunk
            yb = T.alloc_buffer((chunk,), ACC, scope=SCOPE)  # C.h of each step of the chunk
            # pin the full extent: otherwise buffer compaction sizes these by the (symbolic) chunk length,
            # which CUDA codegen rejects ("Can only handle constant size stack allocation")
            dtb[chunk - 1] = m.zero
            yb[chunk - 1] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                h[L.reg(ko, ki)] = init[b, d, L.state(ko, ki, j)] if has_init else m.zero
        for c in range(nchunk):
            NT = T.meta_var(T.min(seqlen - c * chunk, chunk))  # steps in this chunk
            if ok:
                for ko in L.st_outer(N):
                    for ki in L.st_inner():
                        ck[b, d, c, L.state(ko, ki, j)] = h[L.reg(ko, ki)]
            if TB:
                chunk_dt(delta, db, dtb, b, d, c, NT)
            for i in range(NT):
                if TB:
                    s[0] = dtb[i]
                else:
                    s[0] = sm.dt_at(delta, db, b, d, c * chunk + i)
                step(u, A, Bm, Cm, h, yv, s, b, d, c * chunk + i, j)
                if TB:
                    yb[i] = s[2]
                else:
                    if L.leader(ok, j):
                        out[b, d, c * chunk + i] = sm.finish(s[2], u, Dv, z, b, d, c * chunk + i)
            if TB:
                chunk_out(u, Dv, z, out, yb, b, d, c, NT)
        if ok:
            for ko in L.st_outer(N):
                for ki in L.st_inner():
                    last[b, d, L.state(ko, ki, j)] = h[L.reg(ko, ki)]

    @T.prim_func
    def fwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, out_h: T.handle, last_h: T.handle, ck_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunk = T.meta_var(L.nchunk(seqlen, chunk))  # checkpoints: the state before each chunk
        u = T.match_buffer(u_h, (batch, dims.dim, seqlen), UT)
        delta = T.match_buffer(delta_h, (batch, dims.dim, seqlen), UT)
        A = T.match_buffer(A_h, (dims.dim, N), ACC)
        Bm = T.match_buffer(B_h, (batch, dims.b_groups, seqlen, N) if VARB else (dims.dim, N), dims.B_dtype)
        Cm = T.match_buffer(C_h, (batch, dims.c_groups, seqlen, N) if VARC else (dims.dim, N), dims.C_dtype)
        Dv = T.match_buffer(D_h, (dims.dim,) if dims.has_D else (1,), ACC)
        z = T.match_buffer(z_h, (batch, dims.dim, seqlen) if dims.has_z else (1, 1, 1), UT)
        db = T.match_buffer(db_h, (dims.dim,) if dims.has_delta_bias else (1,), ACC)
        init = T.match_buffer(init_h, (batch, dims.dim, N) if has_init else (1, 1, 1), ACC)
        out = T.match_buffer(out_h, (batch, dims.dim, seqlen), UT)
        last = T.match_buffer(last_h, (batch, dims.dim, N), ACC)
        ck = T.match_buffer(ck_h, (batch, dims.dim, nchunk, N), ACC)
        for lo in L.lane_outer(batch * dims.dim):
            for li in L.lane_inner():
                if L.lane_guard(lo, li, batch * dims.dim):
                    lane = T.meta_var(L.lane_of(lo, li, batch * dims.dim))
                    lane_scan(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, seqlen, nchunk,
                              lane // dims.dim, lane % dims.dim, L.thread(li), L.lane_ok(lo, li, batch * dims.dim))

    return fwd
