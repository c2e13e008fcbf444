"""Backward of the complex-A selective scan (formulas in complex_fwd.py's docstring): one template, laid out
by a one-thread-per-lane ``Layout`` like the forward.

Stage 1: one lane per (batch, block of ``block`` channels) runs the reverse scan of each of its channels,
chunk by chunk (the chunk's states recomputed from its checkpoint into a lane-local (chunk+1, 2, dstate)
buffer), writing per-lane partials. Stage 2 sums the partials in a fixed order (deterministic, no atomics).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanBwdDims
from ._layout import Layout
from ._signature import scan_kernel
from .complex_fwd import _step_fns


def _env(dims: ScanBwdDims, L: Layout) -> tuple:
    """The names every piece of the complex backward uses (dims, layout loops, step functions)."""
    (dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk, u_dtype,
     B_dtype, C_dtype, block) = dims.static().values()
    N, V, BLK = dstate, L.V, block
    NV, NBLK = N // V, dim // BLK
    ACC = dims.acc
    m = L.math
    OUTER, INNER, TPB, SCOPE = L.block_loop, L.thread_loop, L.threads, L.scope
    VEC = L.vloop
    VARB, VARC = b_groups > 0, c_groups > 0
    BBPG = dim // b_groups // BLK if VARB else 1  # channel blocks per B group
    CBPG = dim // c_groups // BLK if VARC else 1
    BT, CT = (B_dtype if VARB else ACC), (C_dtype if VARC else ACC)
    bval, cval, pre_dt, dt_of, rot = _step_fns(dims, m)
    two = tirx.const(2.0, ACC)
    return (dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk, u_dtype,
     B_dtype, C_dtype, block, N, V, BLK, NV, NBLK, ACC, m, OUTER, INNER, TPB, SCOPE, VEC, VARB, VARC, BBPG, CBPG, BT,
     CT, bval, cval, pre_dt, dt_of, rot, two)


def _step_macros(dims: ScanBwdDims, L: Layout):
    """One reverse step of a channel, and the recompute of one chunk's states from its checkpoint."""
    (dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk, u_dtype,
     B_dtype, C_dtype, block, N, V, BLK, NV, NBLK, ACC, m, OUTER, INNER, TPB, SCOPE, VEC, VARB, VARC, BBPG, CBPG, BT,
     CT, bval, cval, pre_dt, dt_of, rot, two) = _env(dims, L)

    @T.macro
    def reverse_step(A, Bm, Cm, Dv, u, dout, z, delta, db, du, ddelta, dz, wsB, wsC, hs, g, gA, gB, gC, ex, rv, s,
                     b, blk, ci, d, c, i):
        t = T.meta_var(c * chunk + i)
        s[10] = pre_dt(delta, db, b, d, t)
        s[0] = dt_of(s[10])
        s[1] = m.cast(u[b, d, t])
        s[3] = m.cast(dout[b, d, t])
        if has_z:
            for ni in VEC(V):
                rv[0, ni] = m.zero
            for no in range(NV):
                for ni in VEC(V):
                    rv[0, ni] = rv[0, ni] + (cval(Cm, b, d, t, no * V + ni, 0) * hs[i + 1, 0, no * V + ni]
                                             - cval(Cm, b, d, t, no * V + ni, 1) * hs[i + 1, 1, no * V + ni])
            s[2] = (Dv[d] * s[1]) if has_D else m.zero  # y
            for ni in range(V):
                s[2] = s[2] + two * rv[0, ni]
            s[4] = m.cast(z[b, d, t])
            dz[b, d, t] = (s[3] * s[2] * m.silu_grad(s[4])).astype(u_dtype)
            s[3] = s[3] * m.silu(s[4])  # dy
        if has_D:
            s[8] = s[8] + s[3] * s[1]
        s[5] = s[0] * s[1]  # dt u
        for ni in VEC(V):
            rv[0, ni] = m.zero  # Re(conj(B) g)
            rv[1, ni] = m.zero  # Re(conj(A) p)
        for no in range(NV):
            for ni in VEC(V):
                n = T.meta_var(no * V + ni)
                g[0, n] = g[0, n] + two * s[3] * cval(Cm, b, d, t, n, 0)
                g[1, n] = g[1, n] - two * s[3] * cval(Cm, b, d, t, n, 1)
                if VARC:
                    wsC[b, blk, t, n, 0] = T.Select(ci == 0, m.zero, wsC[b, blk, t, n, 0]) + two * s[3] * hs[i + 1, 0, n]
                    wsC[b, blk, t, n, 1] = T.Select(ci == 0, m.zero, wsC[b, blk, t, n, 1]) - two * s[3] * hs[i + 1, 1, n]
                else:
                    gC[0, n] = gC[0, n] + two * s[3] * hs[i + 1, 0, n]
                    gC[1, n] = gC[1, n] - two * s[3] * hs[i + 1, 1, n]
                if VARB:
                    wsB[b, blk, t, n, 0] = T.Select(ci == 0, m.zero, wsB[b, blk, t, n, 0]) + s[5] * g[0, n]
                    wsB[b, blk, t, n, 1] = T.Select(ci == 0, m.zero, wsB[b, blk, t, n, 1]) + s[5] * g[1, n]
                else:
                    gB[0, n] = gB[0, n] + s[5] * g[0, n]
                    gB[1, n] = gB[1, n] + s[5] * g[1, n]
                rv[0, ni] = rv[0, ni] + bval(Bm, b, d, t, n, 0) * g[0, n] + bval(Bm, b, d, t, n, 1) * g[1, n]
                rot(ex, ni, A, d, n, s[0])
                # q = conj(h_{t-1}) g, p = conj(a) q
                ex[2, ni] = hs[i, 0, n] * g[0, n] + hs[i, 1, n] * g[1, n]
                ex[3, ni] = hs[i, 0, n] * g[1, n] - hs[i, 1, n] * g[0, n]
                ex[4, ni] = ex[0, ni] * ex[2, ni] + ex[1, ni] * ex[3, ni]
                ex[5, ni] = ex[0, ni] * ex[3, ni] - ex[1, ni] * ex[2, ni]
                gA[0, n] = gA[0, n] + s[0] * ex[4, ni]
                gA[1, n] = gA[1, n] + s[0] * ex[5, ni]
                rv[1, ni] = rv[1, ni] + A[d, n, 0] * ex[4, ni] + A[d, n, 1] * ex[5, ni]
                ex[2, ni] = ex[0, ni] * g[0, n] + ex[1, ni] * g[1, n]  # g <- conj(a) g
                g[1, n] = ex[0, ni] * g[1, n] - ex[1, ni] * g[0, n]
                g[0, n] = ex[2, ni]
        s[6] = m.zero
        s[7] = m.zero
        for ni in range(V):
            s[6] = s[6] + rv[0, ni]
            s[7] = s[7] + rv[1, ni]
        du[b, d, t] = ((s[3] * Dv[d] if has_D else m.zero) + s[0] * s[6]).astype(u_dtype)
        s[7] = s[1] * s[6] + s[7]  # d dt
        if delta_softplus:
            s[7] = s[7] * m.softplus_grad(s[10])
        ddelta[b, d, t] = s[7].astype(u_dtype)
        s[9] = s[9] + s[7]

    @T.macro
    def recompute(A, Bm, u, delta, db, ck, hs, ex, s, b, d, c, NT):
        for k in range(2):
            for no in range(NV):
                for ni in VEC(V):
                    hs[0, k, no * V + ni] = ck[b, d, c, no * V + ni, k]
        for i in range(NT):
            s[0] = dt_of(pre_dt(delta, db, b, d, c * chunk + i))
            s[1] = s[0] * m.cast(u[b, d, c * chunk + i])
            for no in range(NV):
                for ni in VEC(V):
                    rot(ex, ni, A, d, no * V + ni, s[0])
                    hs[i + 1, 0, no * V + ni] = (ex[0, ni] * hs[i, 0, no * V + ni] - ex[1, ni] * hs[i, 1, no * V + ni]
                                                 + s[1] * bval(Bm, b, d, c * chunk + i, no * V + ni, 0))
                    hs[i + 1, 1, no * V + ni] = (ex[0, ni] * hs[i, 1, no * V + ni] + ex[1, ni] * hs[i, 0, no * V + ni]
                                                 + s[1] * bval(Bm, b, d, c * chunk + i, no * V + ni, 1))

    return reverse_step, recompute


def _lane_macro(dims: ScanBwdDims, L: Layout):
    """Stage 1 of one lane (batch, block of channels): the reverse scan of each channel, chunk by chunk."""
    (dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk, u_dtype,
     B_dtype, C_dtype, block, N, V, BLK, NV, NBLK, ACC, m, OUTER, INNER, TPB, SCOPE, VEC, VARB, VARC, BBPG, CBPG, BT,
     CT, bval, cval, pre_dt, dt_of, rot, two) = _env(dims, L)
    reverse_step, recompute = _step_macros(dims, L)

    @T.macro
    def lane_scan(u, delta, A, Bm, Cm, Dv, z, db, ck, dout, dlast, du, ddelta, dz, dinit, wsA, wsB, wsC, wsS,
                  seqlen, nchunk, lane):
        hs = T.alloc_buffer((chunk + 1, 2, N), ACC, scope=SCOPE)  # hs[i] = h before step i of the chunk
        g = T.alloc_buffer((2, N), ACC, scope=SCOPE)  # adjoint of h (re, im)
        gA = T.alloc_buffer((2, N), ACC, scope=SCOPE)
        gB = T.alloc_buffer((2, N), ACC, scope=SCOPE)  # time-invariant B / C partials
        gC = T.alloc_buffer((2, N), ACC, scope=SCOPE)
        ex = T.alloc_buffer((6, V), ACC, scope=SCOPE)
        rv = T.alloc_buffer((2, V), ACC, scope=SCOPE)
        s = T.alloc_buffer((12,), ACC, scope=SCOPE)
        hs[chunk, 1, N - 1] = m.zero  # pin the full extent (buffer compaction would make it symbolic)
        b = T.meta_var(lane // NBLK)
        blk = T.meta_var(lane % NBLK)
        for ci in range(BLK):
            d = T.meta_var(blk * BLK + ci)
            s[8] = m.zero  # dD partial
            s[9] = m.zero  # ddelta_bias partial
            for k in range(2):
                for no in range(NV):
                    for ni in VEC(V):
                        g[k, no * V + ni] = dlast[b, d, no * V + ni, k]
                        gA[k, no * V + ni] = m.zero
                        gB[k, no * V + ni] = m.zero
                        gC[k, no * V + ni] = m.zero
            for cr in range(nchunk):
                c = T.meta_var(nchunk - 1 - cr)
                NT = T.meta_var(T.min(seqlen - c * chunk, chunk))
                recompute(A, Bm, u, delta, db, ck, hs, ex, s, b, d, c, NT)
                for ir in range(NT):
                    reverse_step(A, Bm, Cm, Dv, u, dout, z, delta, db, du, ddelta, dz, wsB, wsC, hs, g,
                                 gA, gB, gC, ex, rv, s, b, blk, ci, d, c, NT - 1 - ir)
            for k in range(2):
                for no in range(NV):
                    for ni in VEC(V):
                        wsA[b, d, no * V + ni, k] = gA[k, no * V + ni]
                        if has_init:
                            dinit[b, d, no * V + ni, k] = g[k, no * V + ni]
                        if not VARB:
                            wsB[b, d, no * V + ni, k] = gB[k, no * V + ni]
                        if not VARC:
                            wsC[b, d, no * V + ni, k] = gC[k, no * V + ni]
            wsS[b, d, 0] = s[8]
            wsS[b, d, 1] = s[9]

    return lane_scan


def _stage2_macro(dims: ScanBwdDims, L: Layout):
    """Stage 2: fixed-order sums of the stage-1 partials over batch (and over the channel blocks of a group)."""
    (dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk, u_dtype,
     B_dtype, C_dtype, block, N, V, BLK, NV, NBLK, ACC, m, OUTER, INNER, TPB, SCOPE, VEC, VARB, VARC, BBPG, CBPG, BT,
     CT, bval, cval, pre_dt, dt_of, rot, two) = _env(dims, L)

    @T.macro
    def group_rows(ws, dM, groups, bpg, dtype, batch, seqlen):
        """Varying dB / dC of each row (batch, group, t): the sum over the group's channel blocks."""
        for row_o in OUTER((batch * groups * seqlen + TPB - 1) // TPB):
            for row_i in INNER(TPB):
                if row_o * TPB + row_i < batch * groups * seqlen:
                    row = T.meta_var(row_o * TPB + row_i)
                    rb = T.alloc_buffer((1,), ACC, scope=SCOPE)
                    for n in range(N):
                        for k in range(2):
                            rb[0] = m.zero
                            for kb in range(bpg):
                                rb[0] = rb[0] + ws[row // (groups * seqlen), (row // seqlen) % groups * bpg + kb,
                                                   row % seqlen, n, k]
                            dM[row // (groups * seqlen), (row // seqlen) % groups, row % seqlen, n, k] = \
                                rb[0].astype(dtype)

    @T.macro
    def stage2(wsA, wsB, wsC, wsS, dA, dB, dC, dD, ddb, batch, seqlen):
        # stage 2: fixed-order sums over batch (and over the channel blocks of a group)
        for d_o in OUTER((dim + TPB - 1) // TPB):
            for d_i in INNER(TPB):
                if d_o * TPB + d_i < dim:
                    e = T.meta_var(d_o * TPB + d_i)
                    rs = T.alloc_buffer((3,), ACC, scope=SCOPE)
                    for n in range(N):
                        for k in range(2):
                            rs[0] = m.zero
                            rs[1] = m.zero
                            rs[2] = m.zero
                            for bb in range(batch):
                                rs[0] = rs[0] + wsA[bb, e, n, k]
                                if not VARB:
                                    rs[1] = rs[1] + wsB[bb, e, n, k]
                                if not VARC:
                                    rs[2] = rs[2] + wsC[bb, e, n, k]
                            dA[e, n, k] = rs[0]
                            if not VARB:
                                dB[e, n, k] = rs[1]
                            if not VARC:
                                dC[e, n, k] = rs[2]
                    rs[0] = m.zero
                    rs[1] = m.zero
                    for bb in range(batch):
                        rs[0] = rs[0] + wsS[bb, e, 0]
                        rs[1] = rs[1] + wsS[bb, e, 1]
                    if has_D:
                        dD[e] = rs[0]
                    if has_delta_bias:
                        ddb[e] = rs[1]
        if VARB:
            group_rows(wsB, dB, b_groups, BBPG, BT, batch, seqlen)
        if VARC:
            group_rows(wsC, dC, c_groups, CBPG, CT, batch, seqlen)

    return stage2


def bwd_complex_template(dims: ScanBwdDims, L: Layout) -> tirx.PrimFunc:
    """The backward loop nest (module docstring) laid out by ``L`` (one thread per lane)."""
    (dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk, u_dtype,
     B_dtype, C_dtype, block, N, V, BLK, NV, NBLK, ACC, m, OUTER, INNER, TPB, SCOPE, VEC, VARB, VARC, BBPG, CBPG, BT,
     CT, bval, cval, pre_dt, dt_of, rot, two) = _env(dims, L)
    lane_scan = _lane_macro(dims, L)
    stage2 = _stage2_macro(dims, L)

    @T.macro
    def body(u, delta, A, Bm, Cm, Dv, z, db, init, ck, dout, dlast, du, ddelta, dA, dB, dC, dD, ddb, dz, dinit,
             wsA, wsB, wsC, wsS, batch, seqlen, nchunk):
        for lane_o in OUTER((batch * NBLK + TPB - 1) // TPB):
            for lane_i in INNER(TPB):
                if lane_o * TPB + lane_i < batch * NBLK:
                    lane_scan(u, delta, A, Bm, Cm, Dv, z, db, ck, dout, dlast, du, ddelta, dz, dinit, wsA, wsB, wsC,
                              wsS, seqlen, nchunk, lane_o * TPB + lane_i)
        stage2(wsA, wsB, wsC, wsS, dA, dB, dC, dD, ddb, batch, seqlen)

    return scan_kernel(dims, L, body, backward=True, pair=(2,))
