"""CUDA schedules for the selective scan: warp-cooperative loop nests (same parameter lists as the compute
templates in tvm_mamba/compute/selective_scan.py).

Scan kernels: a lane (one (batch, channel) pair; backward: one (batch, block of channels)) is W = the
largest power of two <= 32 dividing dstate consecutive threads of a warp; thread j holds the S = dstate/W
states n = k*W + j (k < S, unrolled: registers; coalesced loads of A/B/C/checkpoints). Time runs serially;
each step's dstate sums (y = C.h; in the backward sum g*B and sum g*h*A*e^{dt A}) are butterfly warp
shuffles (``__shfl_xor_sync``) over the W threads, so every thread holds the total. The backward keeps the
recomputed states of one chunk per thread ((chunk+1) x S, local memory) and its stage-2 reductions are
separate kernels in a fixed order: deterministic, no atomics.
Decode step: the compute template with one thread per (batch, head, headdim) row.
Complex A (selective_scan_complex templates): one thread per lane, the dstate pairs serial.

``nchunk`` is a free var here (the compute templates use the expression ceil(seqlen/chunk)): with the
expression, ptxas spilled 4 bytes in the fp32 dstate-16 backward; ptxas's spilling at 40-56 registers is
fragile, so re-run ``build-check`` after any change to these templates.

Knobs: ``threads`` per block (64, 128, 256; default 128).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...compute import selective_scan as compute
from ...compute import selective_scan_complex as complex_scan
from ...compute.selective_scan import _Math, acc_dtype
from ..rule import Decisions, kernel_attrs, schedule_of

MASK = tirx.const(0xFFFFFFFF, "uint32")
_COMPLEX = {"selective_scan_fwd_complex": complex_scan.selective_scan_fwd_complex_template,
            "selective_scan_bwd_complex": complex_scan.selective_scan_bwd_complex_template}


def warp_width(dstate: int) -> int:
    w = 1
    while w * 2 <= 32 and dstate % (w * 2) == 0:
        w *= 2
    return w


def _helpers(m, dim, b_groups, c_groups, has_delta_bias, delta_softplus):
    BPG = dim // b_groups if b_groups else 1
    CPG = dim // c_groups if c_groups else 1

    def bval(Bm, b, d, t, n):
        return m.cast(Bm[b, d // BPG, t, n]) if b_groups else m.cast(Bm[d, n])

    def cval(Cm, b, d, t, n):
        return m.cast(Cm[b, d // CPG, t, n]) if c_groups else m.cast(Cm[d, n])

    def pre_dt(delta, db, b, d, t):
        return m.cast(delta[b, d, t]) + (db[d] if has_delta_bias else m.zero)

    def dt_of(x):
        return m.softplus(x) if delta_softplus else x

    return bval, cval, pre_dt, dt_of


def fwd_template(dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk,
                 u_dtype, B_dtype, C_dtype, threads=128):
    N, W = dstate, warp_width(dstate)
    S, LPB = N // W, max(1, threads // W)
    TPB, LOG = LPB * W, W.bit_length() - 1
    ACC = acc_dtype(u_dtype)
    m = _Math(ACC, native=True)
    VARB, VARC = b_groups > 0, c_groups > 0
    bval, cval, pre_dt, dt_of = _helpers(m, dim, b_groups, c_groups, has_delta_bias, delta_softplus)

    @T.prim_func
    def fwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, out_h: T.handle, last_h: T.handle, ck_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunk = T.int32()
        u = T.match_buffer(u_h, (batch, dim, seqlen), u_dtype)
        delta = T.match_buffer(delta_h, (batch, dim, seqlen), u_dtype)
        A = T.match_buffer(A_h, (dim, N), ACC)
        Bm = T.match_buffer(B_h, (batch, b_groups, seqlen, N) if VARB else (dim, N), B_dtype)
        Cm = T.match_buffer(C_h, (batch, c_groups, seqlen, N) if VARC else (dim, N), C_dtype)
        Dv = T.match_buffer(D_h, (dim,) if has_D else (1,), ACC)
        z = T.match_buffer(z_h, (batch, dim, seqlen) if has_z else (1, 1, 1), u_dtype)
        db = T.match_buffer(db_h, (dim,) if has_delta_bias else (1,), ACC)
        init = T.match_buffer(init_h, (batch, dim, N) if has_init else (1, 1, 1), ACC)
        out = T.match_buffer(out_h, (batch, dim, seqlen), u_dtype)
        last = T.match_buffer(last_h, (batch, dim, N), ACC)
        ck = T.match_buffer(ck_h, (batch, dim, nchunk, N), ACC)
        for bx in T.thread_binding((batch * dim + LPB - 1) // LPB, thread="blockIdx.x"):
            for tx in T.thread_binding(TPB, thread="threadIdx.x"):
                h = T.alloc_buffer((S,), ACC, scope="local")
                s = T.alloc_buffer((4,), ACC, scope="local")
                ok = T.meta_var(bx * LPB + tx // W < batch * dim)
                lane = T.meta_var(T.min(bx * LPB + tx // W, batch * dim - 1))  # clamped: reads stay in bounds
                j = T.meta_var(tx % W)
                b = T.meta_var(lane // dim)
                d = T.meta_var(lane % dim)
                for k in T.unroll(S):
                    h[k] = init[b, d, k * W + j] if has_init else m.zero
                for c in range(nchunk):
                    if ok:
                        for k in T.unroll(S):
                            ck[b, d, c, k * W + j] = h[k]
                    for t in range(c * chunk, T.min(seqlen, c * chunk + chunk)):
                        s[0] = dt_of(pre_dt(delta, db, b, d, t))
                        s[1] = s[0] * m.cast(u[b, d, t])
                        s[2] = m.zero
                        for k in T.unroll(S):
                            h[k] = m.exp(s[0] * A[d, k * W + j]) * h[k] + s[1] * bval(Bm, b, d, t, k * W + j)
                            s[2] = s[2] + cval(Cm, b, d, t, k * W + j) * h[k]
                        for r in T.unroll(LOG):
                            s[2] = s[2] + T.tvm_warp_shuffle_xor(MASK, s[2], 1 << r, W, 32)
                        if ok and j == 0:
                            s[2] = s[2] + (Dv[d] * m.cast(u[b, d, t]) if has_D else m.zero)
                            if has_z:
                                out[b, d, t] = (s[2] * m.silu(m.cast(z[b, d, t]))).astype(u_dtype)
                            else:
                                out[b, d, t] = s[2].astype(u_dtype)
                if ok:
                    for k in T.unroll(S):
                        last[b, d, k * W + j] = h[k]

    return fwd


def bwd_template(dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk,
                 u_dtype, B_dtype, C_dtype, block=1, threads=128):
    N, W, BLK = dstate, warp_width(dstate), block
    S, LPB = N // W, max(1, threads // W)
    TPB, LOG = LPB * W, W.bit_length() - 1
    NBLK = dim // BLK
    ACC = acc_dtype(u_dtype)
    m = _Math(ACC, native=True)
    VARB, VARC = b_groups > 0, c_groups > 0
    BBPG = (dim // b_groups) // BLK if VARB else 1
    CBPG = (dim // c_groups) // BLK if VARC else 1
    bval, cval, pre_dt, dt_of = _helpers(m, dim, b_groups, c_groups, has_delta_bias, delta_softplus)
    T2 = 128  # threads per block of the stage-2 kernels

    @T.prim_func
    def bwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, ck_h: T.handle, dout_h: T.handle, dlast_h: T.handle,
            du_h: T.handle, ddelta_h: T.handle, dA_h: T.handle, dB_h: T.handle, dC_h: T.handle, dD_h: T.handle,
            ddb_h: T.handle, dz_h: T.handle, dinit_h: T.handle,
            wsA_h: T.handle, wsB_h: T.handle, wsC_h: T.handle, wsS_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunk = T.int32()
        u = T.match_buffer(u_h, (batch, dim, seqlen), u_dtype)
        delta = T.match_buffer(delta_h, (batch, dim, seqlen), u_dtype)
        A = T.match_buffer(A_h, (dim, N), ACC)
        Bm = T.match_buffer(B_h, (batch, b_groups, seqlen, N) if VARB else (dim, N), B_dtype)
        Cm = T.match_buffer(C_h, (batch, c_groups, seqlen, N) if VARC else (dim, N), C_dtype)
        Dv = T.match_buffer(D_h, (dim,) if has_D else (1,), ACC)
        z = T.match_buffer(z_h, (batch, dim, seqlen) if has_z else (1, 1, 1), u_dtype)
        db = T.match_buffer(db_h, (dim,) if has_delta_bias else (1,), ACC)
        init = T.match_buffer(init_h, (batch, dim, N) if has_init else (1, 1, 1), ACC)
        ck = T.match_buffer(ck_h, (batch, dim, nchunk, N), ACC)
        dout = T.match_buffer(dout_h, (batch, dim, seqlen), u_dtype)
        dlast = T.match_buffer(dlast_h, (batch, dim, N), ACC)
        du = T.match_buffer(du_h, (batch, dim, seqlen), u_dtype)
        ddelta = T.match_buffer(ddelta_h, (batch, dim, seqlen), u_dtype)
        dA = T.match_buffer(dA_h, (dim, N), ACC)
        dB = T.match_buffer(dB_h, (batch, b_groups, seqlen, N) if VARB else (dim, N), B_dtype)
        dC = T.match_buffer(dC_h, (batch, c_groups, seqlen, N) if VARC else (dim, N), C_dtype)
        dD = T.match_buffer(dD_h, (dim,) if has_D else (1,), ACC)
        ddb = T.match_buffer(ddb_h, (dim,) if has_delta_bias else (1,), ACC)
        dz = T.match_buffer(dz_h, (batch, dim, seqlen) if has_z else (1, 1, 1), u_dtype)
        dinit = T.match_buffer(dinit_h, (batch, dim, N) if has_init else (1, 1, 1), ACC)
        wsA = T.match_buffer(wsA_h, (batch, dim, N), ACC)
        wsB = T.match_buffer(wsB_h, (batch, NBLK, seqlen, N) if VARB else (batch, dim, N), ACC)
        wsC = T.match_buffer(wsC_h, (batch, NBLK, seqlen, N) if VARC else (batch, dim, N), ACC)
        wsS = T.match_buffer(wsS_h, (batch, dim, 2), ACC)
        for bx in T.thread_binding((batch * NBLK + LPB - 1) // LPB, thread="blockIdx.x"):
            for tx in T.thread_binding(TPB, thread="threadIdx.x"):
                hs = T.alloc_buffer((chunk + 1, S), ACC, scope="local")
                g = T.alloc_buffer((S,), ACC, scope="local")
                gA = T.alloc_buffer((S,), ACC, scope="local")
                gB = T.alloc_buffer((S,), ACC, scope="local")
                gC = T.alloc_buffer((S,), ACC, scope="local")
                s = T.alloc_buffer((12,), ACC, scope="local")
                ok = T.meta_var(bx * LPB + tx // W < batch * NBLK)
                lane = T.meta_var(T.min(bx * LPB + tx // W, batch * NBLK - 1))
                j = T.meta_var(tx % W)
                b = T.meta_var(lane // NBLK)
                blk = T.meta_var(lane % NBLK)
                hs[chunk, S - 1] = m.zero  # pin the full extent (buffer compaction would make it symbolic)
                for ci in range(BLK):
                    d = T.meta_var(blk * BLK + ci)
                    s[8] = m.zero
                    s[9] = m.zero
                    for k in T.unroll(S):
                        g[k] = dlast[b, d, k * W + j]
                        gA[k] = m.zero
                        gB[k] = m.zero
                        gC[k] = m.zero
                    for cr in range(nchunk):
                        c = T.meta_var(nchunk - 1 - cr)
                        NT = T.meta_var(T.min(seqlen - c * chunk, chunk))
                        for k in T.unroll(S):
                            hs[0, k] = ck[b, d, c, k * W + j]
                        for i in range(NT):
                            s[0] = dt_of(pre_dt(delta, db, b, d, c * chunk + i))
                            s[1] = s[0] * m.cast(u[b, d, c * chunk + i])
                            for k in T.unroll(S):
                                hs[i + 1, k] = (m.exp(s[0] * A[d, k * W + j]) * hs[i, k]
                                                + s[1] * bval(Bm, b, d, c * chunk + i, k * W + j))
                        for ir in range(NT):
                            i = T.meta_var(NT - 1 - ir)
                            t = T.meta_var(c * chunk + i)
                            s[10] = pre_dt(delta, db, b, d, t)
                            s[0] = dt_of(s[10])
                            s[1] = m.cast(u[b, d, t])
                            s[3] = m.cast(dout[b, d, t])
                            if has_z:
                                s[2] = m.zero
                                for k in T.unroll(S):
                                    s[2] = s[2] + cval(Cm, b, d, t, k * W + j) * hs[i + 1, k]
                                for r in T.unroll(LOG):
                                    s[2] = s[2] + T.tvm_warp_shuffle_xor(MASK, s[2], 1 << r, W, 32)
                                s[2] = s[2] + (Dv[d] * s[1] if has_D else m.zero)
                                s[4] = m.cast(z[b, d, t])
                                if ok and j == 0:
                                    dz[b, d, t] = (s[3] * s[2] * m.silu_grad(s[4])).astype(u_dtype)
                                s[3] = s[3] * m.silu(s[4])
                            if has_D:
                                s[8] = s[8] + s[3] * s[1]
                            s[5] = m.zero
                            s[6] = m.zero
                            for k in T.unroll(S):
                                gC[k] = gC[k] + s[3] * hs[i + 1, k]
                                if VARC:
                                    if ok:
                                        wsC[b, blk, t, k * W + j] = T.Select(
                                            ci == 0, m.zero, wsC[b, blk, t, k * W + j]) + s[3] * hs[i + 1, k]
                                g[k] = g[k] + s[3] * cval(Cm, b, d, t, k * W + j)
                                gB[k] = gB[k] + g[k] * s[0] * s[1]
                                if VARB:
                                    if ok:
                                        wsB[b, blk, t, k * W + j] = T.Select(
                                            ci == 0, m.zero, wsB[b, blk, t, k * W + j]) + g[k] * s[0] * s[1]
                                s[5] = s[5] + g[k] * bval(Bm, b, d, t, k * W + j)
                                s[7] = m.exp(s[0] * A[d, k * W + j])
                                s[11] = g[k] * hs[i, k] * s[7]
                                s[6] = s[6] + s[11] * A[d, k * W + j]
                                gA[k] = gA[k] + s[0] * s[11]
                                g[k] = g[k] * s[7]
                            for r in T.unroll(LOG):
                                s[5] = s[5] + T.tvm_warp_shuffle_xor(MASK, s[5], 1 << r, W, 32)
                                s[6] = s[6] + T.tvm_warp_shuffle_xor(MASK, s[6], 1 << r, W, 32)
                            s[7] = s[1] * s[5] + s[6]
                            if delta_softplus:
                                s[7] = s[7] * m.softplus_grad(s[10])
                            s[9] = s[9] + s[7]
                            if ok and j == 0:
                                du[b, d, t] = ((s[3] * Dv[d] if has_D else m.zero) + s[0] * s[5]).astype(u_dtype)
                                ddelta[b, d, t] = s[7].astype(u_dtype)
                    if ok:
                        for k in T.unroll(S):
                            wsA[b, d, k * W + j] = gA[k]
                            if has_init:
                                dinit[b, d, k * W + j] = g[k]
                            if not VARB:
                                wsB[b, d, k * W + j] = gB[k]
                            if not VARC:
                                wsC[b, d, k * W + j] = gC[k]
                        if j == 0:
                            wsS[b, d, 0] = s[8]
                            wsS[b, d, 1] = s[9]
        # stage 2 (separate kernels): fixed-order sums over batch / the channel blocks of a group
        for bx in T.thread_binding((dim * N + T2 - 1) // T2, thread="blockIdx.x"):
            for tx in T.thread_binding(T2, thread="threadIdx.x"):
                rs = T.alloc_buffer((3,), ACC, scope="local")
                e = T.meta_var(T.min(bx * T2 + tx, dim * N - 1))
                rs[0] = m.zero
                rs[1] = m.zero
                rs[2] = m.zero
                for bb in range(batch):
                    rs[0] = rs[0] + wsA[bb, e // N, e % N]
                    if not VARB:
                        rs[1] = rs[1] + wsB[bb, e // N, e % N]
                    if not VARC:
                        rs[2] = rs[2] + wsC[bb, e // N, e % N]
                if bx * T2 + tx < dim * N:
                    dA[e // N, e % N] = rs[0]
                    if not VARB:
                        dB[e // N, e % N] = rs[1].astype(B_dtype)
                    if not VARC:
                        dC[e // N, e % N] = rs[2].astype(C_dtype)
        for bx in T.thread_binding((dim + T2 - 1) // T2, thread="blockIdx.x"):
            for tx in T.thread_binding(T2, thread="threadIdx.x"):
                rs2 = T.alloc_buffer((2,), ACC, scope="local")
                e2 = T.meta_var(T.min(bx * T2 + tx, dim - 1))
                rs2[0] = m.zero
                rs2[1] = m.zero
                for bb in range(batch):
                    rs2[0] = rs2[0] + wsS[bb, e2, 0]
                    rs2[1] = rs2[1] + wsS[bb, e2, 1]
                if bx * T2 + tx < dim:
                    if has_D:
                        dD[e2] = rs2[0]
                    if has_delta_bias:
                        ddb[e2] = rs2[1]
        if VARB:
            for bx in T.thread_binding((batch * b_groups * seqlen * N + T2 - 1) // T2, thread="blockIdx.x"):
                for tx in T.thread_binding(T2, thread="threadIdx.x"):
                    rb = T.alloc_buffer((1,), ACC, scope="local")
                    e3 = T.meta_var(T.min(bx * T2 + tx, batch * b_groups * seqlen * N - 1))
                    rb[0] = m.zero
                    for kb in range(BBPG):
                        rb[0] = rb[0] + wsB[e3 // (b_groups * seqlen * N), e3 // (seqlen * N) % b_groups * BBPG + kb,
                                            e3 // N % seqlen, e3 % N]
                    if bx * T2 + tx < batch * b_groups * seqlen * N:
                        dB[e3 // (b_groups * seqlen * N), e3 // (seqlen * N) % b_groups, e3 // N % seqlen,
                           e3 % N] = rb[0].astype(B_dtype)
        if VARC:
            for bx in T.thread_binding((batch * c_groups * seqlen * N + T2 - 1) // T2, thread="blockIdx.x"):
                for tx in T.thread_binding(T2, thread="threadIdx.x"):
                    rc = T.alloc_buffer((1,), ACC, scope="local")
                    e4 = T.meta_var(T.min(bx * T2 + tx, batch * c_groups * seqlen * N - 1))
                    rc[0] = m.zero
                    for kc in range(CBPG):
                        rc[0] = rc[0] + wsC[e4 // (c_groups * seqlen * N), e4 // (seqlen * N) % c_groups * CBPG + kc,
                                            e4 // N % seqlen, e4 % N]
                    if bx * T2 + tx < batch * c_groups * seqlen * N:
                        dC[e4 // (c_groups * seqlen * N), e4 // (seqlen * N) % c_groups, e4 // N % seqlen,
                           e4 % N] = rc[0].astype(C_dtype)

    return bwd


def apply(func, target, decisions: Decisions):
    name, static = kernel_attrs(func)
    if target.kind.name != "cuda" or name not in ("selective_scan_fwd", "selective_scan_bwd",
                                                  "selective_scan_update", *_COMPLEX):
        return None
    threads = decisions.pick("threads", (64, 128, 256), 128)
    if name in _COMPLEX:  # one thread per lane, dstate pairs serial in registers / local memory
        loop = _COMPLEX[name](**static, mode="cuda", vec=1, threads=threads)
    elif name == "selective_scan_fwd":
        loop = fwd_template(**static, threads=threads)
    elif name == "selective_scan_bwd":
        loop = bwd_template(**static, threads=threads)
    else:
        loop = compute.selective_scan_update_template(**static, mode="cuda", vec=1, threads=threads)
    return schedule_of(compute.stamp(loop, name, static), name=name)
