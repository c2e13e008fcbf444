"""The backward scan: one template, laid out by a ``Layout`` like the forward.

Stage 1: one lane per (batch, block of ``block`` channels) runs the reverse scan of each of its channels,
chunk by chunk: the chunk's states are recomputed from its checkpoint into a lane-local (chunk+1, dstate)
buffer, then the adjoint runs backwards over them (``_step.adjoint_state``), writing per-lane partials.
Stage 2 sums the partials in a fixed order (deterministic; no atomics): one lane per output row, its
dstate laid out like a scan lane's.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanBwdDims
from ._layout import Layout
from ._signature import scan_kernel
from ._step import ScanMath, adjoint_state


def _chunk_macros(dims: ScanBwdDims, L: Layout, sm: ScanMath):
    """Per chunk: its per-step scalars (time-batched layouts: dt, softplus', silu(z), silu'(z) into pb,
    vectorized over time) and the recompute of its states hs[i + 1] from the checkpoint hs[0]."""
    N, chunk, TV, TB, m = dims.dstate, dims.chunk, L.tvec, L.time_batched, sm.m

    @T.macro
    def scalars_at(delta, db, z, pb, b, d, t, i):
        pb[0, i] = sm.dt(sm.pre_dt(delta, db, b, d, t))
        pb[1, i] = sm.dt_grad(sm.pre_dt(delta, db, b, d, t))
        pb[2, i] = sm.gate(sm.z_at(z, b, d, t)) if dims.has_z else m.one
        pb[3, i] = sm.gate_grad(sm.z_at(z, b, d, t)) if dims.has_z else m.one

    @T.macro
    def scalars(delta, db, z, pb, b, d, c, NT):
        for io in range(NT // TV):
            for ii in L.vloop(TV):
                scalars_at(delta, db, z, pb, b, d, c * chunk + io * TV + ii, io * TV + ii)
        for i in range(NT // TV * TV, NT):
            scalars_at(delta, db, z, pb, b, d, c * chunk + i, i)

    @T.macro
    def recompute(u, delta, db, z, A, Bm, ck, hs, pb, s, b, d, c, NT, j):
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                hs[0, L.reg(ko, ki)] = ck[b, d, c, L.state(ko, ki, j)]
        if TB:
            scalars(delta, db, z, pb, b, d, c, NT)
        for i in range(NT):
            if TB:
                s[0] = pb[0, i]
            else:
                s[0] = sm.dt_at(delta, db, b, d, c * chunk + i)
            s[1] = s[0] * m.cast(u[b, d, c * chunk + i])
            for ko in L.st_outer(N):
                for ki in L.st_inner():
                    hs[i + 1, L.reg(ko, ki)] = sm.h_next(m.exp(s[0] * A[d, L.state(ko, ki, j)]), hs[i, L.reg(ko, ki)],
                                                          s[1], sm.B(Bm, b, d, c * chunk + i, L.state(ko, ki, j)))

    return recompute


def _reverse_step(dims: ScanBwdDims, L: Layout, sm: ScanMath):
    """One reverse step t = c * chunk + i of channel d: dz, du, d delta and the partials of the rest."""
    N, TB, m = dims.dstate, L.time_batched, sm.m
    adjoint = adjoint_state(sm, L)

    @T.macro
    def gated_dy(u, Dv, z, Cm, dz, hs, pb, rv, s, b, d, t, i, j, ok):
        """s[3]: dout -> dy = dout silu(z); dz = dout (y + D u) silu'(z) (y recomputed from the state)."""
        for ki in L.st_inner():
            rv[0, ki] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                rv[0, ki] = rv[0, ki] + sm.C(Cm, b, d, t, L.state(ko, ki, j)) * hs[i + 1, L.reg(ko, ki)]
        L.reduce_plus(s, 2, rv, 0, (Dv[d] * s[1]) if dims.has_D else m.zero)  # y
        if TB:
            dz[b, d, t] = (s[3] * s[2] * pb[3, i]).astype(dims.u_dtype)
            s[3] = s[3] * pb[2, i]
        else:
            s[4] = sm.z_at(z, b, d, t)
            if L.leader(ok, j):
                dz[b, d, t] = (s[3] * s[2] * sm.gate_grad(s[4])).astype(dims.u_dtype)
            s[3] = s[3] * sm.gate(s[4])

    @T.macro
    def step(u, delta, db, A, Bm, Cm, Dv, z, dout, du, ddelta, dz, wsB, wsC, hs, g, gA, gB, gC, ex, rv, pb, s,
             b, blk, ci, d, t, i, j, ok):
        if TB:
            s[0] = pb[0, i]
        else:
            s[10] = sm.pre_dt(delta, db, b, d, t)
            s[0] = sm.dt(s[10])
        s[1] = m.cast(u[b, d, t])
        s[3] = m.cast(dout[b, d, t])
        if dims.has_z:
            gated_dy(u, Dv, z, Cm, dz, hs, pb, rv, s, b, d, t, i, j, ok)
        if dims.has_D:
            s[8] = s[8] + s[3] * s[1]
        for ki in L.st_inner():
            rv[0, ki] = m.zero
            rv[1, ki] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                adjoint(A, Bm, Cm, wsB, wsC, hs, g, gA, gB, gC, ex, rv, s, b, blk, ci, d, t, i,
                        L.state(ko, ki, j), L.reg(ko, ki), ki, ok)
        L.reduce2(s, 5, 6, rv)  # sum_n g B, sum_n g h_{t-1} exp(dt A) A
        if TB:  # (statement order as the CPU kernel always had it: the same machine code)
            du[b, d, t] = ((s[3] * Dv[d] if dims.has_D else m.zero) + s[0] * s[5]).astype(dims.u_dtype)
        s[7] = s[1] * s[5] + s[6]  # d dt
        if dims.delta_softplus:
            if TB:
                s[7] = s[7] * pb[1, i]
            else:
                s[7] = s[7] * sm.dt_grad(s[10])
        if TB:
            ddelta[b, d, t] = s[7].astype(dims.u_dtype)
            s[9] = s[9] + s[7]
        else:
            s[9] = s[9] + s[7]
            if L.leader(ok, j):
                du[b, d, t] = ((s[3] * Dv[d] if dims.has_D else m.zero) + s[0] * s[5]).astype(dims.u_dtype)
                ddelta[b, d, t] = s[7].astype(dims.u_dtype)

    return step


def _lane_macro(dims: ScanBwdDims, L: Layout, sm: ScanMath):
    """Stage 1 for one lane (batch b, channel block blk): every channel of the block in turn."""
    N, chunk, ACC, SCOPE, TB, m = dims.dstate, dims.chunk, dims.acc, L.scope, L.time_batched, sm.m
    R, VARB, VARC = L.regs(dims.dstate), dims.varying_B, dims.varying_C
    recompute = _chunk_macros(dims, L, sm)
    step = _reverse_step(dims, L, sm)

    @T.macro
    def lane(u, delta, A, Bm, Cm, Dv, z, db, ck, dout, dlast, du, ddelta, dz, dinit, wsA, wsB, wsC, wsS,
             seqlen, nchunk, b, blk, j, ok):
        hs = T.alloc_buffer((chunk + 1, R), ACC, scope=SCOPE)  # states of one chunk: hs[i] = h before step i
        g = T.alloc_buffer((R,), ACC, scope=SCOPE)  # adjoint of h
        gA = T.alloc_buffer((R,), ACC, scope=SCOPE)  # partial dA of this channel
        gB = T.alloc_buffer((R,), ACC, scope=SCOPE)  # partial dB / dC of this channel (time-invariant kinds)
        gC = T.alloc_buffer((R,), ACC, scope=SCOPE)
        rv = T.alloc_buffer((2, L.V), ACC, scope=SCOPE)  # vector / per-thread partials of the dstate sums
        ex = T.alloc_buffer((2, L.V), ACC, scope=SCOPE)  # exp(dt A) and g h_{t-1} exp(dt A) of one state
        s = T.alloc_buffer((12,), ACC, scope=SCOPE)  # scalars of one step
        hs[chunk, R - 1] = m.zero  # pin the full extents (buffer compaction would make them symbolic)
        if TB:
            pb = T.alloc_buffer((4, chunk), ACC, scope=SCOPE)  # per step: dt, softplus'(.), silu(z), silu'(z)
            pb[3, chunk - 1] = m.zero
        else:
            pb = T.meta_var(None)
        for ci in range(dims.block):
            d = T.meta_var(blk * dims.block + ci)
            s[8] = m.zero  # dD partial
            s[9] = m.zero  # ddelta_bias partial
            for ko in L.st_outer(N):
                for ki in L.st_inner():
                    g[L.reg(ko, ki)] = dlast[b, d, L.state(ko, ki, j)]
                    gA[L.reg(ko, ki)] = m.zero
                    gB[L.reg(ko, ki)] = m.zero
                    gC[L.reg(ko, ki)] = m.zero
            for cr in range(nchunk):
                c = T.meta_var(nchunk - 1 - cr)
                NT = T.meta_var(T.min(seqlen - c * chunk, chunk))  # steps in this chunk
                recompute(u, delta, db, z, A, Bm, ck, hs, pb, s, b, d, c, NT, j)
                for ir in range(NT):
                    step(u, delta, db, A, Bm, Cm, Dv, z, dout, du, ddelta, dz, wsB, wsC, hs, g, gA, gB, gC, ex, rv,
                         pb, s, b, blk, ci, d, c * chunk + (NT - 1 - ir), NT - 1 - ir, j, ok)
            if ok:
                for ko in L.st_outer(N):
                    for ki in L.st_inner():
                        wsA[b, d, L.state(ko, ki, j)] = gA[L.reg(ko, ki)]
                        if dims.has_init:
                            dinit[b, d, L.state(ko, ki, j)] = g[L.reg(ko, ki)]
                        if not VARB:
                            wsB[b, d, L.state(ko, ki, j)] = gB[L.reg(ko, ki)]
                        if not VARC:
                            wsC[b, d, L.state(ko, ki, j)] = gC[L.reg(ko, ki)]
            if L.leader(ok, j):
                wsS[b, d, 0] = s[8]
                wsS[b, d, 1] = s[9]

    return lane


def _stage2_macros(dims: ScanBwdDims, L: Layout, m):
    """Fixed-order sums of the stage-1 partials; a row's dstate is laid out like a scan lane's."""
    N, ACC, SCOPE = dims.dstate, dims.acc, L.scope
    VARB, VARC = dims.varying_B, dims.varying_C

    @T.macro
    def per_channel(wsA, wsB, wsC, wsS, dA, dB, dC, dD, ddb, batch, d, j, ok):
        """dA, time-invariant dB / dC: sums over batch; dD, d delta_bias likewise."""
        rs = T.alloc_buffer((3, L.V), ACC, scope=SCOPE)
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                rs[0, ki] = m.zero
                rs[1, ki] = m.zero
                rs[2, ki] = m.zero
                for bb in range(batch):
                    rs[0, ki] = rs[0, ki] + wsA[bb, d, L.state(ko, ki, j)]
                    if not VARB:
                        rs[1, ki] = rs[1, ki] + wsB[bb, d, L.state(ko, ki, j)]
                    if not VARC:
                        rs[2, ki] = rs[2, ki] + wsC[bb, d, L.state(ko, ki, j)]
                if ok:
                    dA[d, L.state(ko, ki, j)] = rs[0, ki]
                    if not VARB:
                        dB[d, L.state(ko, ki, j)] = rs[1, ki].astype(dims.B_dtype)
                    if not VARC:
                        dC[d, L.state(ko, ki, j)] = rs[2, ki].astype(dims.C_dtype)
        rs[0, 0] = m.zero
        rs[1, 0] = m.zero
        for bb in range(batch):
            rs[0, 0] = rs[0, 0] + wsS[bb, d, 0]
            rs[1, 0] = rs[1, 0] + wsS[bb, d, 1]
        if L.leader(ok, j):
            if dims.has_D:
                dD[d] = rs[0, 0]
            if dims.has_delta_bias:
                ddb[d] = rs[1, 0]

    @T.macro
    def per_row(ws, dM, groups, seqlen, row, j, ok):
        """Varying dB / dC of row (batch, group, t): the sum over the group's channel blocks."""
        bpg = T.meta_var(dims.blocks_per_group(groups))
        rb = T.alloc_buffer((1, L.V), ACC, scope=SCOPE)
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                rb[0, ki] = m.zero
            for k in range(bpg):
                for ki in L.st_inner():
                    rb[0, ki] = rb[0, ki] + ws[row // (groups * seqlen), (row // seqlen) % groups * bpg + k,
                                               row % seqlen, L.state(ko, ki, j)]
            for ki in L.st_inner():
                if ok:
                    dM[row // (groups * seqlen), (row // seqlen) % groups, row % seqlen,
                       L.state(ko, ki, j)] = rb[0, ki].astype(dM.dtype)

    @T.macro
    def group_rows(ws, dM, groups, batch, seqlen):
        for lo in L.outer(batch * groups * seqlen):
            for li in L.inner():
                if L.lane_guard(lo, li, batch * groups * seqlen):
                    per_row(ws, dM, groups, seqlen, L.lane_of(lo, li, batch * groups * seqlen), L.thread(li),
                            L.lane_ok(lo, li, batch * groups * seqlen))

    return per_channel, group_rows


def bwd_template(dims: ScanBwdDims, L: Layout) -> tirx.PrimFunc:
    """The backward loop nest of ``dims`` laid out by ``L`` (shapes: ``selective_scan_bwd``)."""
    dim, NBLK, VARB, VARC = dims.dim, dims.nblocks, dims.varying_B, dims.varying_C
    sm = ScanMath(dims, L.math)
    lane = _lane_macro(dims, L, sm)
    per_channel, group_rows = _stage2_macros(dims, L, L.math)
    bg, cg = dims.b_groups, dims.c_groups

    @T.macro
    def body(u, delta, A, Bm, Cm, Dv, z, db, init, ck, dout, dlast, du, ddelta, dA, dB, dC, dD, ddb, dz, dinit,
             wsA, wsB, wsC, wsS, batch, seqlen, nchunk):
        for lo in L.outer(batch * NBLK):
            for li in L.inner():
                if L.lane_guard(lo, li, batch * NBLK):
                    lane_i = T.meta_var(L.lane_of(lo, li, batch * NBLK))
                    lane(u, delta, A, Bm, Cm, Dv, z, db, ck, dout, dlast, du, ddelta, dz, dinit, wsA, wsB, wsC, wsS,
                         seqlen, nchunk, lane_i // NBLK, lane_i % NBLK, L.thread(li), L.lane_ok(lo, li, batch * NBLK))
        # stage 2: fixed-order sums over batch (and over the channel blocks of a group)
        for lo in L.outer(dim):
            for li in L.inner():
                if L.lane_guard(lo, li, dim):
                    per_channel(wsA, wsB, wsC, wsS, dA, dB, dC, dD, ddb, batch, L.lane_of(lo, li, dim),
                                L.thread(li), L.lane_ok(lo, li, dim))
        if VARB:
            group_rows(wsB, dB, bg, batch, seqlen)
        if VARC:
            group_rows(wsC, dC, cg, batch, seqlen)

    return scan_kernel(dims, L, body, backward=True)
