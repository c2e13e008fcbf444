"""The Mamba-3 SISO decode step (mamba_ssm's ``mamba3_siso_step``) as one template laid out by the selective
scan's one-thread-per-lane ``Layout`` (serial, CPU parallel lanes with dstate vectors, a CUDA thread per lane).

Two passes (two parallel loops on a CPU, two kernel launches on CUDA: the second reads what the first wrote):

1. rotate, a lane per (batch b, head h, rotary pair i < headdim_qk / 2):
       theta_i = (theta_i + pi tanh(Angles_i) DT) mod 2 pi          (pairs i < headdim_angles; others: theta = 0)
       q, k = R(theta) (Q[hq] + Q_bias[h]), R(theta) (K[hq] + K_bias[h])   (hq = h // (nheads / nheads_qk))
   the new angle state, k (the new K state, an output) and q (a workspace) written once per (b, h);
2. update, a lane per (batch, head, headdim_v row p), its headdim_qk states in the layout's dstate vectors:
       h'[p, n] = exp(ADT) h[p, n] + exp(ADT) DT (1 - sigmoid(Trap)) v_state[p] k_state[n]
                  + DT sigmoid(Trap) V[p] k[n]
       out[p] = (sum_n h'[p, n] q[n] + D V[p]) * silu(Z[p])

(One pass that rotated q / k in every lane repeated each cos / sin / tanh headdim_v times: 11 ms per step on
the CPU at upstream's shape, batch 1.) The new states go to separate outputs, as upstream's. Math in the
accumulation dtype; rotated q / k are not rounded to the input dtype (upstream's Triton kernel rounds them to
bf16 and takes h' q as a bf16 dot: this kernel is closer to the float64 reference).
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ._dims import StepDims


def _rotate_macro(dims: StepDims, L):
    """Pass 1, one rotary pair i of (b, h): the new angle, the rotated q pair (workspace) and k pair (output)."""
    HPQ, S, ACC, m, SCOPE = dims.heads_per_qk, dims.headdim_angles, dims.acc, L.math, L.scope
    PI, TWO_PI = m.const(math.pi), m.const(2.0 * math.pi)

    @T.macro
    def pair(Q, K, DT, Qb, Kb, Ang, ast, aout, qrot, kout, b, hh, i):
        r = T.alloc_buffer((7,), ACC, scope=SCOPE)  # cos, sin, theta, q pair, k pair
        if i < S:
            r[2] = m.tanh(Ang[b, hh, i]) * PI * DT[b, hh] + ast[b, hh, i]
            r[2] = r[2] - TWO_PI * T.floor(r[2] / TWO_PI)
            aout[b, hh, i] = r[2]
            r[0] = T.cos(r[2])
            r[1] = T.sin(r[2])
        else:
            r[0] = m.one
            r[1] = m.zero
        r[3] = m.cast(Q[b, hh // HPQ, 2 * i]) + Qb[hh, 2 * i]
        r[4] = m.cast(Q[b, hh // HPQ, 2 * i + 1]) + Qb[hh, 2 * i + 1]
        r[5] = m.cast(K[b, hh // HPQ, 2 * i]) + Kb[hh, 2 * i]
        r[6] = m.cast(K[b, hh // HPQ, 2 * i + 1]) + Kb[hh, 2 * i + 1]
        qrot[b, hh, 2 * i] = r[3] * r[0] - r[4] * r[1]
        qrot[b, hh, 2 * i + 1] = r[3] * r[1] + r[4] * r[0]
        kout[b, hh, 2 * i] = r[5] * r[0] - r[6] * r[1]
        kout[b, hh, 2 * i + 1] = r[5] * r[1] + r[6] * r[0]

    return pair


def _row_macro(dims: StepDims, L):
    """Pass 2, one (b, h, p) row: its headdim_qk new states and output."""
    N, V, ACC, m, SCOPE = dims.headdim_qk, L.V, dims.acc, L.math, L.scope

    @T.macro
    def row(V_, ADT, DT, Trap, Dv, Z, h_in, kst, vst, qrot, kout, out, h_out, b, hh, p):
        s = T.alloc_buffer((5,), ACC, scope=SCOPE)  # alpha, beta v_state[p], gamma V[p], y, lambda
        yv = T.alloc_buffer((1, V), ACC, scope=SCOPE)  # the dstate vector's partials of h' . q
        hv = T.alloc_buffer((V,), ACC, scope=SCOPE)
        s[0] = m.exp(ADT[b, hh])
        s[4] = m.sigmoid(Trap[b, hh])
        s[1] = s[0] * DT[b, hh] * (m.one - s[4]) * m.cast(vst[b, hh, p])
        s[2] = DT[b, hh] * s[4] * m.cast(V_[b, hh, p])
        for ki in L.st_inner():
            yv[0, ki] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                hv[ki] = (s[0] * h_in[b, hh, p, L.state(ko, ki, 0)]
                          + s[1] * m.cast(kst[b, hh, L.state(ko, ki, 0)]) + s[2] * kout[b, hh, L.state(ko, ki, 0)])
                h_out[b, hh, p, L.state(ko, ki, 0)] = hv[ki]
                yv[0, ki] = yv[0, ki] + hv[ki] * qrot[b, hh, L.state(ko, ki, 0)]
        L.reduce_plus(s, 3, yv, 0, (Dv[hh] * m.cast(V_[b, hh, p])) if dims.has_D else m.zero)
        if dims.has_z:
            out[b, hh, p] = (s[3] * m.silu(m.cast(Z[b, hh, p]))).astype(dims.v_dtype)
        else:
            out[b, hh, p] = s[3].astype(dims.v_dtype)

    return row


def _lanes(L, total, body):
    """A macro running ``body(lane)`` for every lane < ``total`` (an expression of the kernel's batch) as the
    layout lays lanes out; on a CPU work up to ``serial_work`` runs on the calling thread (``work``)."""
    serial_work = getattr(L, "serial_work", None)

    @T.macro
    def group(lo, batch):
        for li in L.lane_inner():
            if L.lane_guard(lo, li, total(batch)):
                body(L.lane_of(lo, li, total(batch)))

    @T.macro
    def run(batch, work):
        if serial_work is not None:
            if work <= serial_work:  # decode size: on the calling thread, no thread-pool launch
                for lo in T.serial((total(batch) + L.TPB - 1) // L.TPB):
                    group(lo, batch)
            else:
                for lo in L.lane_outer(total(batch)):
                    group(lo, batch)
        else:
            for lo in L.lane_outer(total(batch)):
                group(lo, batch)

    return run


def step_template(dims: StepDims, L) -> tirx.PrimFunc:
    """The decode step's two passes (module docstring); qrot: a (batch, nheads, headdim_qk) acc workspace."""
    H, HQ, N, P, S, ACC = (dims.nheads, dims.nheads_qk, dims.headdim_qk, dims.headdim_v, dims.headdim_angles,
                           dims.acc)
    ZT, KT, VT = dims.z_dtype or dims.v_dtype, dims.kstate_dtype or ACC, dims.vstate_dtype or dims.v_dtype
    rotate, row = _rotate_macro(dims, L), _row_macro(dims, L)

    @T.prim_func
    def step(Q_h: T.handle, K_h: T.handle, V_h: T.handle, ADT_h: T.handle, DT_h: T.handle, Trap_h: T.handle,
             Qb_h: T.handle, Kb_h: T.handle, Ang_h: T.handle, D_h: T.handle, Z_h: T.handle, ast_h: T.handle,
             h_in_h: T.handle, kst_h: T.handle, vst_h: T.handle, out_h: T.handle, aout_h: T.handle,
             h_out_h: T.handle, kout_h: T.handle, qrot_h: T.handle):
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
        qrot = T.match_buffer(qrot_h, (batch, H, N), ACC)
        _lanes(L, lambda bt: bt * H * (N // 2),
               lambda lane: rotate(Q, K, DT, Qb, Kb, Ang, ast, aout, qrot, kout, lane // (H * (N // 2)),
                                   lane // (N // 2) % H, lane % (N // 2)))(batch, batch * H * N * 8)
        _lanes(L, lambda bt: bt * H * P,
               lambda lane: row(V, ADT, DT, Trap, Dv, Z, h_in, kst, vst, qrot, kout, out, h_out,
                                lane // (H * P), lane // P % H, lane % P))(batch, batch * H * P * N)

    return step
