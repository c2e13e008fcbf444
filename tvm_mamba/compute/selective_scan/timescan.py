"""The parallel-in-time forward: a lane's time split over ``L.time_threads`` threads, joined by a scan of
(decay, increment) pairs — mamba_ssm's selective_scan_fwd_kernel design.

Same signature and outputs as the sequential forward (out, last_state, the checkpoints = the state before
every ``dims.chunk`` steps, which the backward recomputes from). The recurrence h_t = a_t h_{t-1} + b_t
(a_t = exp(dt_t A), b_t = dt_t u_t B_t) is linear, so a run of steps is one affine map, a pair (a, b), and
two runs compose associatively: (a1, b1) then (a2, b2) = (a2 a1, a2 b1 + b2). Per lane (one batch row, one
channel), time goes in blocks of P x K steps, thread p holding the K consecutive steps p K .. p K + K - 1:

1. per block: each thread computes dt and dt u of its steps once (softplus once per step);
2. per state n: the thread's K pairs (one exp per step and state, kept in registers) composed into one,
   an exclusive scan of those over the P threads (``L.pair_scan``: warp shuffles on CUDA; the identity
   where P is 1) gives the map from the block's entry state to the thread's first step; applied to the
   carried state hc[n] it yields the thread's entry state, from which the K steps run again (two FMAs
   each: h, and y += C h), writing any checkpoint among them; the scan's total advances hc[n];
3. the block's outputs (y + D u) silu(z), one per step, by the thread that holds it.

Steps past seqlen (the last block's tail) are identity pairs (dt = 0: a = 1, b = 0), so the carried
state after the last block is last_state. No divisions by running decays (a product of decays may
underflow to 0, which is exact enough). With P = 1 (the serial layout) this is the sequential scan
blocked by K; its float64 build is what tests/compute checks against the reference.

The layout's choices: ``time_threads`` P and ``items`` K (CUDA: a warp, K a knob), ``block_chans`` G lanes
(channels of one batch row) per block, ``pair_scan``, loop kinds and the scope of lane-local buffers.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanDims
from ._layout import Layout
from ._signature import scan_kernel
from ._step import ScanMath


def vector_width(L: Layout, dtype: str) -> int:
    """Elements of ``dtype`` per vector load of ``L.vector_bytes`` (1 without, and for 64-bit types)."""
    bits = tvm.DataType(dtype).bits
    return max(1, L.vector_bytes * 8 // bits) if bits <= 32 else 1


def _staging(dims: ScanDims, L: Layout, sm: ScanMath):
    """B_t[n] / C_t[n] of a time block: from the group's staged slice (``L.stage_states`` NS > 0: the block's
    threads copy the slice (TC steps x NS states) of each time-varying B / C into shared memory, the steps
    skewed by one slot per 32 (t + t // 32: a thread's K consecutive steps at a stride of K fall in distinct
    banks for K in 4, 8, 16), read by all ``block_chans`` lanes), else from the inputs."""
    NS, P, K, G, ACC, m = L.stage_states, L.time_threads, L.items, L.block_chans, dims.acc, L.math
    TC = P * K
    SB, SC = bool(NS) and dims.varying_B, bool(NS) and dims.varying_C
    skew = lambda t: t + t // 32  # noqa: E731
    # states a thread copies at once: a vector load (128 bits: 4 float32, 8 bfloat16) where the slice is whole
    # vectors of every staged operand's width
    VB = min([vector_width(L, dt) for dt, on in ((dims.B_dtype, SB), (dims.C_dtype, SC)) if on] or [1])
    VB = VB if NS and NS % VB == 0 else 1
    NV = max(NS, 1) // VB  # vectors per step of the slice

    @T.macro
    def copy(M, dst, tmp, b, d, tt, n0, k, read):
        for v in T.vectorized(VB):
            tmp[v] = read(M, b, d, tt, n0 + v)
        for v in L.item_loop(VB):
            dst[k % NV * VB + v, skew(k // NV)] = tmp[v]

    @T.macro
    def stage(Bm, Cm, bs, cs, seqlen, b, d, c, no, th):
        tmp = T.alloc_buffer((VB,), ACC, scope=L.scope)
        for e in range((TC * NV + G * P - 1) // (G * P)):
            k = T.meta_var(e * G * P + th)
            if k < TC * NV:
                n0 = T.meta_var(no * NS + k % NV * VB)
                tt = T.meta_var(T.min(c * TC + k // NV, seqlen - 1))
                if SB:
                    copy(Bm, bs, tmp, b, d, tt, n0, k, sm.B)
                if SC:
                    copy(Cm, cs, tmp, b, d, tt, n0, k, sm.C)

    def bval(Bm, bs, b, d, t, ni, n, q):
        return bs[ni, skew(q)] if SB else sm.B(Bm, b, d, t, n)

    def cval(Cm, cs, b, d, t, ni, n, q):
        return cs[ni, skew(q)] if SC else sm.C(Cm, b, d, t, n)

    shape = (max(NS, 1), skew(TC) if NS else 1)
    return stage, bval, cval, shape, SB or SC


def step_loads(dims: ScanDims, L: Layout, K: int):
    """A macro ``load_steps(u, delta, z, ur, dr, zr, b, d, t0, seqlen)``: a thread's K steps t0 .. t0 + K - 1 of
    u, delta (and z) into ur / dr / zr[0, 0, :] in the accumulation dtype, steps past seqlen clamped to the last
    one. With ``L.vector_bytes`` (VW = that many bytes of the inputs' dtype, K a multiple of VW) a run of K
    steps inside seqlen loads VW at a time (128-bit loads: 4 float32 or 8 bfloat16, aligned when seqlen % VW ==
    0, the buffers being 64-byte aligned); else, and at the ragged end, one at a time."""
    VW = vector_width(L, dims.u_dtype)
    VW = VW if K % VW == 0 else 1
    m = L.math

    @T.macro
    def scalar(u, delta, z, ur, dr, zr, b, d, t0, seqlen):
        for i in L.item_loop(K):
            ur[0, 0, i] = m.cast(u[b, d, T.min(t0 + i, seqlen - 1)])
            dr[0, 0, i] = m.cast(delta[b, d, T.min(t0 + i, seqlen - 1)])
            if dims.has_z:
                zr[0, 0, i] = m.cast(z[b, d, T.min(t0 + i, seqlen - 1)])

    @T.macro
    def vectors(src, dst, b, d, t0, seqlen):
        # src seen as rows of VW (the same memory): a row index times VW is a provably aligned vector start
        rows = T.decl_buffer((src.shape[0] * src.shape[1] * (seqlen // VW), VW), src.dtype, data=src.data)
        for q in L.item_loop(K // VW):
            for e in T.vectorized(VW):
                dst[0, 0, q * VW + e] = m.cast(rows[(b * dims.dim + d) * (seqlen // VW) + (t0 // VW + q), e])

    @T.macro
    def load_steps(u, delta, z, ur, dr, zr, b, d, t0, seqlen):
        if VW > 1:
            if tirx.And(t0 + K <= seqlen, seqlen % VW == 0):
                vectors(u, ur, b, d, t0, seqlen)
                vectors(delta, dr, b, d, t0, seqlen)
                if dims.has_z:
                    vectors(z, zr, b, d, t0, seqlen)
            else:
                scalar(u, delta, z, ur, dr, zr, b, d, t0, seqlen)
        else:
            scalar(u, delta, z, ur, dr, zr, b, d, t0, seqlen)

    return load_steps


def fwd_timescan_template(dims: ScanDims, L: Layout) -> tirx.PrimFunc:
    """The parallel-in-time forward of ``dims`` laid out by ``L`` (shapes: ``selective_scan_fwd``)."""
    N, CK, ACC, dim = dims.dstate, dims.chunk, dims.acc, dims.dim
    P, K, G, SCOPE = L.time_threads, L.items, L.block_chans, L.scope
    NS = L.stage_states or N  # states per slice (staged together)
    assert N % NS == 0, "staged slices tile dstate"
    TC = P * K  # steps per time block
    NB = (dim + G - 1) // G  # blocks of G channels per batch row
    HR = L.held_regs(N)
    m = L.math
    sm = ScanMath(dims, m)
    stage, bval, cval, sshape, STAGED = _staging(dims, L, sm)
    load_steps = step_loads(dims, L, K)
    has_init = dims.has_init

    @T.macro
    def lane_scan(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, seqlen, b, d, th, ok):
        p = T.meta_var(th % P)
        hc = T.alloc_buffer((HR,), ACC, scope=SCOPE)  # the state before the time block (lane-held)
        av = T.alloc_buffer((HR,), ACC, scope=SCOPE)  # A[d, :] (lane-held)
        dt = T.alloc_buffer((K,), ACC, scope=SCOPE)
        dtu = T.alloc_buffer((K,), ACC, scope=SCOPE)
        y = T.alloc_buffer((K,), ACC, scope=SCOPE)
        a = T.alloc_buffer((K,), ACC, scope=SCOPE)  # exp(dt A[d, n]) of each step
        bb = T.alloc_buffer((K,), ACC, scope=SCOPE)  # dt u B[n] of each step
        pr = T.alloc_buffer((6,), ACC, scope=SCOPE)  # the thread's pair; after the scan: prefix, total; scratch
        hs = T.alloc_buffer((3,), ACC, scope=SCOPE)  # the running state; the carried one; A[d, n]
        # the thread's u, delta, z (one load per step) and the lane's D, delta_bias, as buffers the step
        # math indexes like its inputs: ScanMath reads them at (0, 0, i) and [0]
        ur = T.alloc_buffer((1, 1, K), ACC, scope=SCOPE)
        dr = T.alloc_buffer((1, 1, K), ACC, scope=SCOPE)
        zr = T.alloc_buffer((1, 1, K), ACC, scope=SCOPE)
        dvr = T.alloc_buffer((1,), ACC, scope=SCOPE)
        dbr = T.alloc_buffer((1,), ACC, scope=SCOPE)
        bs = T.alloc_buffer(sshape, ACC, scope=L.stage_scope)
        cs = T.alloc_buffer(sshape, ACC, scope=L.stage_scope)
        for k in range(HR):
            if L.held_state(k, p) < N:
                hc[k] = init[b, d, L.held_state(k, p)] if has_init else m.zero
                av[k] = A[d, L.held_state(k, p)]
        dvr[0] = Dv[d] if dims.has_D else m.zero
        dbr[0] = db[d] if dims.has_delta_bias else m.zero
        for c in range((seqlen + TC - 1) // TC):
            load_steps(u, delta, z, ur, dr, zr, b, d, c * TC + p * K, seqlen)
            for i in L.item_loop(K):
                t = T.meta_var(c * TC + p * K + i)
                pr[0] = sm.pre_dt(dr, dbr, 0, 0, i)
                dt[i] = T.if_then_else(t < seqlen, sm.dt(pr[0]), m.zero)
                dtu[i] = dt[i] * ur[0, 0, i]
                y[i] = m.zero
            for no in range((N + NS - 1) // NS):
                if STAGED:
                    stage(Bm, Cm, bs, cs, seqlen, b, d, c, no, th)
                for ni in range(NS):
                    n = T.meta_var(no * NS + ni)
                    pr[0] = m.one
                    pr[1] = m.zero
                    hs[2] = L.held_get(av, n)
                    for i in L.item_loop(K):
                        t = T.meta_var(c * TC + p * K + i)
                        a[i] = m.exp(dt[i] * hs[2])
                        bb[i] = dtu[i] * bval(Bm, bs, b, d, T.min(t, seqlen - 1), ni, n, p * K + i)
                        pr[0] = a[i] * pr[0]
                        pr[1] = a[i] * pr[1] + bb[i]
                    L.pair_scan(pr, p)
                    hs[1] = L.held_get(hc, n)
                    hs[0] = pr[0] * hs[1] + pr[1]
                    for i in L.item_loop(K):
                        t = T.meta_var(c * TC + p * K + i)
                        if ok:
                            if tirx.And(t < seqlen, t % CK == 0):
                                ck[b, d, t // CK, n] = hs[0]
                        hs[0] = a[i] * hs[0] + bb[i]  # sm.h_next with dt u B precomputed
                        y[i] = y[i] + cval(Cm, cs, b, d, T.min(t, seqlen - 1), ni, n, p * K + i) * hs[0]
                    hs[1] = pr[2] * hs[1] + pr[3]
                    L.held_set(hc, n, hs[1], p)
            for i in L.item_loop(K):
                t = T.meta_var(c * TC + p * K + i)
                if ok:
                    if t < seqlen:
                        out[b, d, t] = sm.finish(y[i], ur, dvr, zr, 0, 0, i)
        if ok:
            for k in range(HR):
                if L.held_state(k, p) < N:
                    last[b, d, L.held_state(k, p)] = hc[k]

    @T.macro
    def body(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, batch, seqlen, nchunk):
        for lo in L.block_loop(batch * NB):
            if L.min_blocks > 0:  # __launch_bounds__(threads, min_blocks): the register budget
                T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", L.min_blocks)
            for th in L.thread_loop(G * P):
                lane_scan(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, seqlen, lo // NB,
                          T.min(lo % NB * G + th // P, dim - 1), th, lo % NB * G + th // P < dim)

    return scan_kernel(dims, L, body)
