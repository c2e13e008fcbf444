"""The Mamba-3 SISO decode step (mamba_ssm's ``mamba3_siso_step``) as one template laid out by the selective
scan's one-thread-per-lane ``Layout`` (serial, CPU parallel lanes, a CUDA thread per lane).

One lane is one (batch b, head h, headdim_v row p) of the state; it walks the headdim_qk / 2 rotary pairs:

    theta_i = (theta_i + pi tanh(Angles_i) DT) mod 2 pi      (pairs i < headdim_angles; others: theta = 0)
    q, k = R(theta) (Q[hq] + Q_bias[h]), R(theta) (K[hq] + K_bias[h])     (hq = h // (nheads / nheads_qk))
    h'[p, n] = exp(ADT) h[p, n] + exp(ADT) DT (1 - sigmoid(Trap)) v_state[p] k_state[n]
               + DT sigmoid(Trap) V[p] k[n]
    out[p] = (sum_n h'[p, n] q[n] + D V[p]) * silu(Z[p])

The new angle and K states are written once per (b, h), by its lane p = 0 (every lane rotates q and k itself:
headdim_qk values, cheaper than a barrier or a second kernel at decode sizes). The new states go to separate
outputs, as upstream's (an in-place k_state would race: lane 0 writes k while other lanes read k_state).
Math in the accumulation dtype; rotated q / k are not rounded to the input dtype (upstream's Triton kernel
rounds them to bf16 and takes h' q as a bf16 dot: this kernel is closer to the float64 reference).
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ._dims import StepDims


def _pair_macro(dims: StepDims, L):
    """One rotary pair i of one lane: s[5], s[6] hold cos / sin of its angle; updates h' and y (s[4])."""
    HPQ, m = dims.heads_per_qk, L.math

    @T.macro
    def pair(Q, K, Qb, Kb, h_in, kst, h_out, kout, s, r, b, hh, p, i):
        r[0] = m.cast(Q[b, hh // HPQ, 2 * i]) + Qb[hh, 2 * i]
        r[1] = m.cast(Q[b, hh // HPQ, 2 * i + 1]) + Qb[hh, 2 * i + 1]
        r[2] = m.cast(K[b, hh // HPQ, 2 * i]) + Kb[hh, 2 * i]
        r[3] = m.cast(K[b, hh // HPQ, 2 * i + 1]) + Kb[hh, 2 * i + 1]
        r[4] = r[0] * s[5] - r[1] * s[6]  # rotated q
        r[5] = r[0] * s[6] + r[1] * s[5]
        r[6] = r[2] * s[5] - r[3] * s[6]  # rotated k
        r[7] = r[2] * s[6] + r[3] * s[5]
        if p == 0:
            kout[b, hh, 2 * i] = r[6]
            kout[b, hh, 2 * i + 1] = r[7]
        for j in T.unroll(2):
            r[8] = s[1] * h_in[b, hh, p, 2 * i + j] + s[2] * m.cast(kst[b, hh, 2 * i + j]) + s[3] * r[6 + j]
            h_out[b, hh, p, 2 * i + j] = r[8]
            s[4] = s[4] + r[8] * r[4 + j]

    return pair


def _row_macro(dims: StepDims, L):
    NP, S, ACC, m, SCOPE = dims.headdim_qk // 2, dims.headdim_angles, dims.acc, L.math, L.scope
    PI, TWO_PI = m.const(math.pi), m.const(2.0 * math.pi)
    pair = _pair_macro(dims, L)

    @T.macro
    def row(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, Dv, Z, ast, h_in, kst, vst, out, aout, h_out, kout, b, hh, p):
        # s: dt, alpha, beta v_state[p], gamma V[p], y, cos, sin, theta
        s = T.alloc_buffer((8,), ACC, scope=SCOPE)
        r = T.alloc_buffer((9,), ACC, scope=SCOPE)  # q pair, k pair, rotated q, rotated k, h'
        s[0] = DT[b, hh]
        s[1] = m.exp(ADT[b, hh])
        s[5] = m.sigmoid(Trap[b, hh])  # lambda (s[5] is cos once the pairs start)
        s[2] = s[1] * s[0] * (m.one - s[5]) * m.cast(vst[b, hh, p])
        s[3] = s[0] * s[5] * m.cast(V[b, hh, p])
        s[4] = m.zero
        for i in T.serial(NP):
            if i < S:
                s[7] = m.tanh(Ang[b, hh, i]) * PI * s[0] + ast[b, hh, i]
                s[7] = s[7] - TWO_PI * T.floor(s[7] / TWO_PI)
                if p == 0:
                    aout[b, hh, i] = s[7]
                s[5] = T.cos(s[7])
                s[6] = T.sin(s[7])
            else:
                s[5] = m.one
                s[6] = m.zero
            pair(Q, K, Qb, Kb, h_in, kst, h_out, kout, s, r, b, hh, p, i)
        if dims.has_D:
            s[4] = s[4] + Dv[hh] * m.cast(V[b, hh, p])
        if dims.has_z:
            out[b, hh, p] = (s[4] * m.silu(m.cast(Z[b, hh, p]))).astype(dims.v_dtype)
        else:
            out[b, hh, p] = s[4].astype(dims.v_dtype)

    return row


def step_template(dims: StepDims, L) -> tirx.PrimFunc:
    """The decode step's loop nest: one lane per (batch, head, headdim_v row); see the module docstring."""
    H, HQ, N, P, S, ACC = (dims.nheads, dims.nheads_qk, dims.headdim_qk, dims.headdim_v, dims.headdim_angles,
                           dims.acc)
    ZT, KT, VT = dims.z_dtype or dims.v_dtype, dims.kstate_dtype or ACC, dims.vstate_dtype or dims.v_dtype
    serial_work = getattr(L, "serial_work", None)
    row = _row_macro(dims, L)

    @T.macro
    def lanes(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, Dv, Z, ast, h_in, kst, vst, out, aout, h_out, kout, batch, lo):
        for li in L.lane_inner():
            if L.lane_guard(lo, li, batch * H * P):
                lane = T.meta_var(L.lane_of(lo, li, batch * H * P))
                row(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, Dv, Z, ast, h_in, kst, vst, out, aout, h_out, kout,
                    lane // (H * P), lane // P % H, lane % P)

    @T.prim_func
    def step(Q_h: T.handle, K_h: T.handle, V_h: T.handle, ADT_h: T.handle, DT_h: T.handle, Trap_h: T.handle,
             Qb_h: T.handle, Kb_h: T.handle, Ang_h: T.handle, D_h: T.handle, Z_h: T.handle, ast_h: T.handle,
             h_in_h: T.handle, kst_h: T.handle, vst_h: T.handle, out_h: T.handle, aout_h: T.handle,
             h_out_h: T.handle, kout_h: T.handle):
        batch = T.int32()
        Q = T.match_buffer(Q_h, (batch, HQ, N), dims.qk_dtype)
        K = T.match_buffer(K_h, (batch, HQ, N), dims.qk_dtype)
        V = T.match_buffer(V_h, (batch, H, P), dims.v_dtype)
        ADT = T.match_buffer(ADT_h, (batch, H), ACC)
        DT = T.match_buffer(DT_h, (batch, H), ACC)
        Trap = T.match_buffer(Trap_h, (batch, H), ACC)
        Qb = T.match_buffer(Qb_h, (H, N), ACC)
        Kb = T.match_buffer(Kb_h, (H, N), ACC)
        Ang = T.match_buffer(Ang_h, (batch, H, S), ACC)
        Dv = T.match_buffer(D_h, (H,) if dims.has_D else (1,), ACC)
        Z = T.match_buffer(Z_h, (batch, H, P) if dims.has_z else (1, 1, 1), ZT)
        ast = T.match_buffer(ast_h, (batch, H, S), ACC)
        h_in = T.match_buffer(h_in_h, (batch, H, P, N), ACC)
        kst = T.match_buffer(kst_h, (batch, H, N), KT)
        vst = T.match_buffer(vst_h, (batch, H, P), VT)
        out = T.match_buffer(out_h, (batch, H, P), dims.v_dtype)
        aout = T.match_buffer(aout_h, (batch, H, S), ACC)
        h_out = T.match_buffer(h_out_h, (batch, H, P, N), ACC)
        kout = T.match_buffer(kout_h, (batch, H, N), ACC)
        if serial_work is not None:
            if batch * H * P * N <= serial_work:  # decode size: on the calling thread, no thread-pool launch
                for lo in T.serial((batch * H * P + L.TPB - 1) // L.TPB):
                    lanes(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, Dv, Z, ast, h_in, kst, vst, out, aout, h_out, kout,
                          batch, lo)
            else:
                for lo in L.lane_outer(batch * H * P):
                    lanes(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, Dv, Z, ast, h_in, kst, vst, out, aout, h_out, kout,
                          batch, lo)
        else:
            for lo in L.lane_outer(batch * H * P):
                lanes(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, Dv, Z, ast, h_in, kst, vst, out, aout, h_out, kout,
                      batch, lo)

    return step
