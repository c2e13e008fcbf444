"""The parallel-in-time backward: the reverse of timescan.py's forward, with recomputation.

Same signature and outputs as the sequential backward (bwd.py): the gradients, stage-1 partials in the
same workspaces and the same fixed-order stage 2 (``bwd._stage2_macros``). A group of lanes is one channel
block (``dims.block`` channels of one batch row, ``L.block_chans`` == block), each lane (channel) time-split
over ``L.time_threads`` P threads of ``L.items`` K consecutive steps; time blocks of P K steps run from the
last to the first, each starting at a checkpoint (P K a multiple of ``dims.chunk``). Per time block:

1. each thread loads its steps' u, delta, z, dout once: dt, dt u, dy = dout silu(z);
2. per state n: (a) the forward pairs (a_t = exp(dt A), b_t = dt u B), their exclusive scan over the
   threads from the block's checkpoint gives h_{t-1} of every step (kept), y += C h_t;
   (b) the adjoint: with R_t = a_t G_t (G_t = dL/dh_t = R_{t+1} + dy_t C_t, R at the sequence end = dlast),
   R_t = a_t R_{t+1} + a_t dy_t C_t is again an affine recurrence, run from the block's end to its start:
   each thread composes its steps backwards, a reverse exclusive scan over the threads (``pair_scan_rev``)
   applied to the carried R gives the R entering its last step, and the thread walks its steps back:
   dB_t = G_t dt u, dC_t = dy_t h_t, dA += G_t dt a_t h_{t-1}, and per step the dstate sums
   sum_n G B and sum_n G h_{t-1} a A of du and d dt; the scan's total advances the carried R;
   (c) the partial sums of this state: dA (and a time-invariant dB / dC) summed over the lane's threads
   (``time_sum``) into lane-held accumulators; a time-varying dB / dC summed over the block's channels
   in a fixed order through a ``stage_scope`` buffer into the workspace row (batch, block, t, n);
3. the block's du, d delta, dz (dz from y + D u recomputed in 2a), and the dD / d delta_bias partials.

After the first time block the carried R is dinit. Steps past seqlen are identities (dt = 0, dy = 0).
Deterministic: every sum has a fixed order, no atomics.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanBwdDims
from ._layout import Layout
from ._signature import scan_kernel
from ._step import ScanMath
from .bwd import _stage2_macros
from .timescan import _staging, step_loads


def _per_step(dims: ScanBwdDims, L: Layout, sm: ScanMath):
    """The per-step values of a thread's K steps (load) and its outputs (finish)."""
    m, K, P = sm.m, L.items, L.time_threads
    TC = P * K

    loads = step_loads(dims, L, K)

    @T.macro
    def load(u, delta, z, dout, ur, dr, zr, v, dbr, b, d, c, p, seqlen):
        """ur, zr: u, z; dr: the pre-dt (delta + bias); v[0..6]: dt, dt u, dout, dy, y, sum G B, sum G h a A
        (one column per step)."""
        loads(u, delta, z, ur, dr, zr, b, d, c * TC + p * K, seqlen)
        for i in L.item_loop(K):
            t = T.meta_var(c * TC + p * K + i)
            dr[0, 0, i] = sm.pre_dt(dr, dbr, 0, 0, i)
            v[0, i] = T.if_then_else(t < seqlen, sm.dt(dr[0, 0, i]), m.zero)
            v[1, i] = v[0, i] * ur[0, 0, i]
            v[2, i] = T.if_then_else(t < seqlen, m.cast(dout[b, d, T.min(t, seqlen - 1)]), m.zero)
            v[3, i] = v[2, i] * sm.gate(zr[0, 0, i]) if dims.has_z else v[2, i]
            v[4, i] = m.zero
            v[5, i] = m.zero
            v[6, i] = m.zero

    @T.macro
    def finish(du, ddelta, dz, ur, dr, zr, v, dvr, sc, b, d, c, p, seqlen, ok):
        """du = D dy + dt sum G B; d delta = (u sum G B + sum G h a A) softplus'; dz = dout (y + D u) silu'(z);
        sc[0] += dy u (dD), sc[1] += d delta (d delta_bias)."""
        for i in L.item_loop(K):
            t = T.meta_var(c * TC + p * K + i)
            if t < seqlen:
                sc[2] = v[5, i] * ur[0, 0, i] + v[6, i]
                if dims.delta_softplus:
                    sc[2] = sc[2] * sm.dt_grad(dr[0, 0, i])
                sc[1] = sc[1] + sc[2]
                if dims.has_D:
                    sc[0] = sc[0] + v[3, i] * ur[0, 0, i]
                if ok:
                    du[b, d, t] = ((v[3, i] * dvr[0] if dims.has_D else m.zero)
                                   + v[0, i] * v[5, i]).astype(dims.u_dtype)
                    ddelta[b, d, t] = sc[2].astype(dims.u_dtype)
                    if dims.has_z:
                        dz[b, d, t] = (v[2, i] * (v[4, i] + sm.skip(dvr, ur, 0, 0, i))
                                       * sm.gate_grad(zr[0, 0, i])).astype(dims.u_dtype)

    return load, finish


def _state_pass(dims: ScanBwdDims, L: Layout, sm: ScanMath):
    """Step 2 for one state n of a time block: forward pairs, the reverse scan, the state's partials."""
    m, K, P = sm.m, L.items, L.time_threads
    TC = P * K
    _, bval, cval, _, _ = _staging(dims, L, sm)
    VARB, VARC = dims.varying_B, dims.varying_C

    @T.macro
    def run(Bm, Cm, bs, cs, rb, rc, v, a, bb, hp, pr, hs, hA, hK, hR, hdA, hdB, hdC, b, d, w, c, p, ni, n,
            seqlen):
        # (a) forward: h_{t-1} of every step from the block's checkpoint (held[1])
        hs[2] = L.held_get(hA, n)  # A[d, n]
        pr[0] = m.one
        pr[1] = m.zero
        for i in L.item_loop(K):
            t = T.meta_var(T.min(c * TC + p * K + i, seqlen - 1))
            a[i] = m.exp(v[0, i] * hs[2])
            bb[i] = v[1, i] * bval(Bm, bs, b, d, t, ni, n, p * K + i)
            pr[0] = a[i] * pr[0]
            pr[1] = a[i] * pr[1] + bb[i]
        L.pair_scan(pr, p)
        hs[0] = pr[0] * L.held_get(hK, n) + pr[1]
        for i in L.item_loop(K):
            t = T.meta_var(T.min(c * TC + p * K + i, seqlen - 1))
            hp[i] = hs[0]
            hs[0] = a[i] * hs[0] + bb[i]
            v[4, i] = v[4, i] + cval(Cm, cs, b, d, t, ni, n, p * K + i) * hs[0]
        # (b) adjoint: R_t = a_t (R_{t+1} + dy_t C_t), the thread's steps composed backwards
        pr[0] = m.one
        pr[1] = m.zero
        for ir in L.item_loop(K):
            i = T.meta_var(K - 1 - ir)
            t = T.meta_var(T.min(c * TC + p * K + i, seqlen - 1))
            pr[1] = a[i] * (pr[1] + v[3, i] * cval(Cm, cs, b, d, t, ni, n, p * K + i))
            pr[0] = a[i] * pr[0]
        L.pair_scan_rev(pr, p)
        hs[1] = L.held_get(hR, n)  # R at the block's end
        hs[0] = pr[0] * hs[1] + pr[1]  # R entering this thread's last step
        hs[3] = m.zero  # dA partial; time-invariant dB, dC partials
        hs[4] = m.zero
        hs[5] = m.zero
        for ir in L.item_loop(K):
            i = T.meta_var(K - 1 - ir)
            t = T.meta_var(T.min(c * TC + p * K + i, seqlen - 1))
            hs[6] = hs[0] + v[3, i] * cval(Cm, cs, b, d, t, ni, n, p * K + i)  # G_t
            hs[7] = v[3, i] * (a[i] * hp[i] + bb[i])  # dC_t = dy h_t
            if VARC:
                rc[w, p * K + i] = hs[7]
            else:
                hs[5] = hs[5] + hs[7]
            if VARB:
                rb[w, p * K + i] = hs[6] * v[1, i]
            else:
                hs[4] = hs[4] + hs[6] * v[1, i]
            v[5, i] = v[5, i] + hs[6] * bval(Bm, bs, b, d, t, ni, n, p * K + i)
            hs[7] = hs[6] * hp[i] * a[i]  # G h_{t-1} exp(dt A)
            v[6, i] = v[6, i] + hs[7] * hs[2]
            hs[3] = hs[3] + v[0, i] * hs[7]
            hs[0] = a[i] * hs[6]
        hs[1] = pr[2] * hs[1] + pr[3]
        L.held_set(hR, n, hs[1], p)
        # (c) the lane's partials of this state
        L.time_sum(hs, 3)
        L.held_add(hdA, n, hs[3], p)
        if not VARB:
            L.time_sum(hs, 4)
            L.held_add(hdB, n, hs[4], p)
        if not VARC:
            L.time_sum(hs, 5)
            L.held_add(hdC, n, hs[5], p)

    return run


def bwd_timescan_template(dims: ScanBwdDims, L: Layout) -> tirx.PrimFunc:
    """The parallel-in-time backward of ``dims`` laid out by ``L`` (shapes: ``selective_scan_bwd``)."""
    N, CK, ACC, G = dims.dstate, dims.chunk, dims.acc, dims.block
    P, K, SCOPE = L.time_threads, L.items, L.scope
    TC = P * K
    assert TC % CK == 0 and L.block_chans == G, "a time block starts at a checkpoint; a group is a channel block"
    NS, HR, NBLK = L.stage_states or N, L.held_regs(N), dims.nblocks
    assert N % NS == 0, "staged slices tile dstate"
    VARB, VARC = dims.varying_B, dims.varying_C
    NR = VARB + VARC  # time-varying dB / dC rows reduced over the block's channels
    m = L.math
    sm = ScanMath(dims, m)
    stage, _, _, sshape, STAGED = _staging(dims, L, sm)
    load, finish = _per_step(dims, L, sm)
    run = _state_pass(dims, L, sm)
    R = L.reduce_layout or L  # the stage-2 sums' layout
    per_channel, group_rows = _stage2_macros(dims, R, m)

    @T.macro
    def reduce_rows(wsB, wsC, rb, rc, rsum, b, blk, c, n, th, seqlen):
        """ws[b, blk, t, n] = the block's channels' r[:, t] summed in channel order (varying B: the first TC
        threads, varying C: the next TC, in one pass)."""
        for e in range((NR * TC + G * P - 1) // (G * P)):
            k = T.meta_var(e * G * P + th)
            if VARB:
                if tirx.And(k < TC, c * TC + k < seqlen):
                    rsum[0] = rb[0, k]
                    for w in L.item_loop(G - 1):
                        rsum[0] = rsum[0] + rb[w + 1, k]
                    wsB[b, blk, c * TC + k, n] = rsum[0]
            if VARC:
                kc = T.meta_var(k - (TC if VARB else 0))
                if tirx.And(tirx.And(kc >= 0, kc < TC), c * TC + kc < seqlen):
                    rsum[0] = rc[0, kc]
                    for w in L.item_loop(G - 1):
                        rsum[0] = rsum[0] + rc[w + 1, kc]
                    wsC[b, blk, c * TC + kc, n] = rsum[0]

    @T.macro
    def lane(u, delta, A, Bm, Cm, Dv, z, db, ck, dout, dlast, du, ddelta, dz, dinit, wsA, wsB, wsC, wsS,
             seqlen, b, blk, th):
        w = T.meta_var(th // P)
        p = T.meta_var(th % P)
        d = T.meta_var(blk * G + w)
        # lane-held: A, the time block's checkpoint, R, the dA / time-invariant dB / dC partials
        hA = T.alloc_buffer((HR,), ACC, scope=SCOPE)
        hK = T.alloc_buffer((HR,), ACC, scope=SCOPE)
        hR = T.alloc_buffer((HR,), ACC, scope=SCOPE)
        hdA = T.alloc_buffer((HR,), ACC, scope=SCOPE)
        hdB = T.alloc_buffer((HR,), ACC, scope=SCOPE)
        hdC = T.alloc_buffer((HR,), ACC, scope=SCOPE)
        rsum = T.alloc_buffer((1,), ACC, scope=SCOPE)
        v = T.alloc_buffer((7, K), ACC, scope=SCOPE)  # per step (``_per_step``)
        ur = T.alloc_buffer((1, 1, K), ACC, scope=SCOPE)
        dr = T.alloc_buffer((1, 1, K), ACC, scope=SCOPE)
        zr = T.alloc_buffer((1, 1, K), ACC, scope=SCOPE)
        a = T.alloc_buffer((K,), ACC, scope=SCOPE)
        bb = T.alloc_buffer((K,), ACC, scope=SCOPE)
        hp = T.alloc_buffer((K,), ACC, scope=SCOPE)  # h_{t-1}
        pr = T.alloc_buffer((6,), ACC, scope=SCOPE)
        hs = T.alloc_buffer((8,), ACC, scope=SCOPE)
        sc = T.alloc_buffer((3,), ACC, scope=SCOPE)  # dD, d delta_bias partials; d delta of a step
        dvr = T.alloc_buffer((1,), ACC, scope=SCOPE)
        dbr = T.alloc_buffer((1,), ACC, scope=SCOPE)
        bs = T.alloc_buffer(sshape, ACC, scope=L.stage_scope)
        cs = T.alloc_buffer(sshape, ACC, scope=L.stage_scope)
        rb = T.alloc_buffer((G, TC) if VARB else (1, 1), ACC, scope=L.stage_scope)
        rc = T.alloc_buffer((G, TC) if VARC else (1, 1), ACC, scope=L.stage_scope)
        dvr[0] = Dv[d] if dims.has_D else m.zero
        dbr[0] = db[d] if dims.has_delta_bias else m.zero
        sc[0] = m.zero
        sc[1] = m.zero
        for k in range(HR):
            if L.held_state(k, p) < N:
                hA[k] = A[d, L.held_state(k, p)]
                hR[k] = dlast[b, d, L.held_state(k, p)]
                hdA[k] = m.zero
                hdB[k] = m.zero
                hdC[k] = m.zero
        for cr in range((seqlen + TC - 1) // TC):
            c = T.meta_var((seqlen + TC - 1) // TC - 1 - cr)
            load(u, delta, z, dout, ur, dr, zr, v, dbr, b, d, c, p, seqlen)
            for k in range(HR):
                if L.held_state(k, p) < N:
                    hK[k] = ck[b, d, c * (TC // CK), L.held_state(k, p)]
            for no in range((N + NS - 1) // NS):
                if STAGED:
                    stage(Bm, Cm, bs, cs, seqlen, b, d, c, no, th)
                for ni in range(NS):
                    run(Bm, Cm, bs, cs, rb, rc, v, a, bb, hp, pr, hs, hA, hK, hR, hdA, hdB, hdC, b, d, w, c, p,
                        ni, no * NS + ni, seqlen)
                    if VARB or VARC:
                        reduce_rows(wsB, wsC, rb, rc, rsum, b, blk, c, no * NS + ni, th, seqlen)
            finish(du, ddelta, dz, ur, dr, zr, v, dvr, sc, b, d, c, p, seqlen, True)
        for k in range(HR):
            if L.held_state(k, p) < N:
                wsA[b, d, L.held_state(k, p)] = hdA[k]
                if dims.has_init:
                    dinit[b, d, L.held_state(k, p)] = hR[k]
                if not VARB:
                    wsB[b, d, L.held_state(k, p)] = hdB[k]
                if not VARC:
                    wsC[b, d, L.held_state(k, p)] = hdC[k]
        L.time_sum(sc, 0)
        L.time_sum(sc, 1)
        if L.leader(True, p):
            wsS[b, d, 0] = sc[0]
            wsS[b, d, 1] = sc[1]

    @T.macro
    def body(u, delta, A, Bm, Cm, Dv, z, db, init, ck, dout, dlast, du, ddelta, dA, dB, dC, dD, ddb, dz, dinit,
             wsA, wsB, wsC, wsS, batch, seqlen, nchunk):
        for lo in L.block_loop(batch * NBLK):
            if L.min_blocks > 0:
                T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", L.min_blocks)
            for th in L.thread_loop(G * P):
                lane(u, delta, A, Bm, Cm, Dv, z, db, ck, dout, dlast, du, ddelta, dz, dinit, wsA, wsB, wsC, wsS,
                     seqlen, lo // NBLK, lo % NBLK, th)
        # stage 2: fixed-order sums over batch (and over the channel blocks of a group)
        for lo in R.outer(dims.dim):
            for li in R.inner():
                if R.lane_guard(lo, li, dims.dim):
                    per_channel(wsA, wsB, wsC, wsS, dA, dB, dC, dD, ddb, batch, R.lane_of(lo, li, dims.dim),
                                R.thread(li), R.lane_ok(lo, li, dims.dim))
        if VARB:
            group_rows(wsB, dB, dims.b_groups, batch, seqlen)
        if VARC:
            group_rows(wsC, dC, dims.c_groups, batch, seqlen)

    return scan_kernel(dims, L, body, backward=True)
