"""The Mamba-3 decode step, SISO (mamba_ssm's ``mamba3_siso_step``) and MIMO (``Mamba3.step`` with ``is_mimo``:
``apply_rotary_qk_inference_fwd`` then CuTe ``mamba3_step_fn``), as one template laid out by the selective
scan's one-thread-per-lane ``Layout`` (serial, CPU parallel lanes with dstate vectors, a CUDA thread per lane).
SISO is the template at rank R = 1 with interleaved rotary pairs and no MIMO projections (StepDims); MIMO
(MimoStepDims) has R ranks r of Q / K / biases / K states, halved pairs and MIMO_V / MIMO_Z / MIMO_Out.

Two passes (two parallel loops on a CPU, two kernel launches on CUDA: the second reads what the first wrote):

1. rotate, a lane per (batch b, rank r, head h, rotary pair i < headdim_qk / 2):
       theta_i = (theta_i + pi tanh(Angles_i) DT) mod 2 pi          (pairs i < headdim_angles; others: theta = 0)
       q_r, k_r = R(theta) (Q_r[hq] + Q_bias[h, r]), R(theta) (K_r[hq] + K_bias[h, r])   (hq = h // (nheads /
   nheads_qk); pair i is (2i, 2i+1) for SISO, (i, i + headdim_qk / 2) for MIMO), the new angle state (by rank
   0), k_r (the new K state, an output) and q_r (a workspace) written once per (b, r, h);
2. update, a lane per (batch, head, headdim_v row p), its headdim_qk states in the layout's dstate vectors,
   the R rank terms summed into each state and the R outputs accumulated side by side (x_r = V MIMO_V[r]):
       h'[p, n] = exp(ADT) h[p, n] + exp(ADT) DT (1 - sigmoid(Trap)) sum_r v_state[p] MIMO_V[r, p] k_state_r[n]
                  + DT sigmoid(Trap) sum_r x_r[p] k_r[n]
       y_r[p] = (sum_n h'[p, n] q_r[n] + D x_r[p]) * silu(Z[p] MIMO_Z[r, p]);  out[p] = sum_r MIMO_Out[r, p] y_r[p]
   (SISO, or MIMO without MIMO_Out: out_r = y_r).

(One pass that rotated q / k in every lane repeated each cos / sin / tanh headdim_v times: 11 ms per step on
the CPU at upstream's shape, batch 1.) The new states go to separate outputs, as upstream's. Math in the
accumulation dtype; rotated q / k are not rounded to the input dtype (upstream's Triton kernels round them to
bf16 and take h' q as a bf16 dot: this kernel is closer to the float64 reference).

Each pass is also a kernel of its own (``passes``: directions ``step_rotate`` and ``step_update``, upstream's
``apply_rotary_qk_inference_fwd`` and ``mamba3_step_fn``, MimoStepDims' flags): the rotate kernel writes q / k
in Q's dtype (upstream's outputs), the update kernel reads them (B, C) in that dtype; same macros, same math.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .dims import StepDims
from .preprocess import rate_tanh, trap_weight


class _Ix:
    """Where the template's per-rank values live: the SISO layouts (no rank axis, interleaved rotary pairs) or
    the MIMO ones (rank axis r, halved pairs (i, i + headdim_qk / 2)); Python-level, so each kernel indexes its
    own tensors directly. ``mv`` / ``mz`` scale V / Z by MIMO_V / MIMO_Z (SISO: unscaled)."""

    def __init__(self, dims: StepDims):
        self.mimo, self.half, self.split = dims.mimo, dims.headdim_qk // 2, dims.mimo and not dims.has_outproj
        self.pairwise, self.rank_major = dims.pairwise, dims.rank_major

    def qk(self, b, r, hq, n):  # Q, K: (batch, R, nheads_qk, N) | (batch, nheads_qk, N)
        return (b, r, hq, n) if self.mimo else (b, hq, n)

    def bias(self, h, r, n):  # Q_bias, K_bias: (nheads, R, N) | (R, nheads, N) rank-major | (nheads, N)
        return ((r, h, n) if self.rank_major else (h, r, n)) if self.mimo else (h, n)

    def proj(self, M, h, r, p):  # MIMO_V, MIMO_Z, MIMO_Out: (nheads, R, P) | (R, nheads, P) rank-major
        return M[r, h, p] if self.rank_major else M[h, r, p]

    def kr(self, b, r, h, n):  # K states, rotated q: (batch, R, nheads, N) | (batch, nheads, N)
        return (b, r, h, n) if self.mimo else (b, h, n)

    def out(self, b, r, h, p):  # out: (batch, R, nheads, P) without MIMO_Out | (batch, nheads, P)
        return (b, r, h, p) if self.split else (b, h, p)

    def lo(self, i):  # rotary pair i's first and second element
        return 2 * i if self.pairwise else i

    def hi(self, i):
        return 2 * i + 1 if self.pairwise else i + self.half

    def mv(self, MV, x, h, r, p):
        return x * self.proj(MV, h, r, p) if self.mimo else x

    def mz(self, MZ, z, h, r, p):
        return z * self.proj(MZ, h, r, p) if self.mimo else z


def _rotate_macro(dims: StepDims, L, rot: str):
    """Pass 1, one rotary pair i of (b, rank r, h): the new angle (written by rank 0), the rotated q pair
    (workspace, or the rotate kernel's output) and k pair (output), stored in ``rot``."""
    HPQ, S, ACC, m, SCOPE, ix = dims.heads_per_qk, dims.headdim_angles, dims.acc, L.math, L.scope, _Ix(dims)
    PI, TWO_PI, MOD = m.const(math.pi), m.const(2.0 * math.pi), dims.angle_mod
    first = (lambda r: True) if dims.rank == 1 else (lambda r: r == 0)  # noqa: E731
    sin = (lambda a: -T.sin(a)) if dims.conjugate else T.sin  # noqa: E731  (conjugate: rotate by -theta)
    st = (lambda x: x) if rot == ACC else (lambda x: x.astype(rot))  # noqa: E731

    def biased(X, Xb, on, b, r, hh, n):  # X[hq] + its bias (absent: no term)
        x = m.cast(X[ix.qk(b, r, hh // HPQ, n)])
        return x + Xb[ix.bias(hh, r, n)] if on else x

    @T.macro
    def pair(Q, K, DT, Qb, Kb, Ang, ast, aout, qrot, kout, b, r, hh, i):
        t = T.alloc_buffer((7,), ACC, scope=SCOPE)  # cos, sin, theta, q pair, k pair
        if i < S:
            t[2] = rate_tanh(m, Ang[b, hh, i]) * PI * DT[b, hh] + ast[b, hh, i]
            if MOD:
                t[2] = t[2] - TWO_PI * T.floor(t[2] / TWO_PI)
            if first(r):
                aout[b, hh, i] = t[2]
            t[0] = T.cos(t[2])
            t[1] = sin(t[2])
        else:
            t[0] = m.one
            t[1] = m.zero
        t[3] = biased(Q, Qb, dims.has_qbias, b, r, hh, ix.lo(i))
        t[4] = biased(Q, Qb, dims.has_qbias, b, r, hh, ix.hi(i))
        t[5] = biased(K, Kb, dims.has_kbias, b, r, hh, ix.lo(i))
        t[6] = biased(K, Kb, dims.has_kbias, b, r, hh, ix.hi(i))
        qrot[ix.kr(b, r, hh, ix.lo(i))] = st(t[3] * t[0] - t[4] * t[1])
        qrot[ix.kr(b, r, hh, ix.hi(i))] = st(t[3] * t[1] + t[4] * t[0])
        kout[ix.kr(b, r, hh, ix.lo(i))] = st(t[5] * t[0] - t[6] * t[1])
        kout[ix.kr(b, r, hh, ix.hi(i))] = st(t[5] * t[1] + t[6] * t[0])

    return pair


def _row_macro(dims: StepDims, L):
    """Pass 2, one (b, h, p) row: its headdim_qk new states (the R rank terms summed) and its R outputs
    (gated, then summed by MIMO_Out when given), on lane thread ``j`` (its states n = L.state(ko, ki, j)),
    stores only where ``ok``, out by the lane's leader. With the layout's ``stage_bc`` the K states, new k and
    rotated q come from ``stg`` (stg[0 / 1 / 2, r, L.reg(ko, ki)], loaded once per lane, _rows_macro)."""
    N, V, R, ACC, m, SCOPE, ix = dims.headdim_qk, L.V, dims.rank, dims.acc, L.math, L.scope, _Ix(dims)
    STAGE = L.stage_bc
    OUT, SD = dims.v_dtype, dims.state_dtype or dims.acc
    to_state = (lambda x: x) if SD == ACC else (lambda x: x.astype(SD))  # noqa: E731
    alpha = (lambda a, dt: m.exp(a * dt)) if dims.raw_a else (lambda a, dt: m.exp(a))  # noqa: E731
    lam = (lambda x: trap_weight(m, x)) if dims.trap_logit else (lambda p: p)  # noqa: E731  (a logit, or lam)

    @T.macro
    def row(V_, ADT, DT, Trap, MV, MZ, MO, Dv, Z, h_in, kst, vst, qrot, kout, out, h_out, b, hh, p, stg, j, ok):
        s = T.alloc_buffer((4,), ACC, scope=SCOPE)  # alpha, lambda, beta v_state[p], gamma V[p]
        c = T.alloc_buffer((2 * R,), ACC, scope=SCOPE)  # per rank: beta x_prev[p], gamma x[p]
        y = T.alloc_buffer((R + 1,), ACC, scope=SCOPE)  # per rank: h' . q + D x; [R]: the MIMO_Out sum
        yv = T.alloc_buffer((R, V), ACC, scope=SCOPE)  # the dstate vector's partials of h' . q
        hv = T.alloc_buffer((V,), ACC, scope=SCOPE)
        L.uniform(s, 0, alpha(ADT[b, hh], DT[b, hh]), j)  # a row's scalars: requested once per lane
        L.uniform(s, 1, lam(Trap[b, hh]), j)
        L.uniform(s, 2, s[0] * DT[b, hh] * (m.one - s[1]) * m.cast(vst[b, hh, p]), j)
        L.uniform(s, 3, DT[b, hh] * s[1] * m.cast(V_[b, hh, p]), j)
        for r in T.unroll(R):
            L.uniform(c, r, ix.mv(MV, s[2], hh, r, p), j)
            L.uniform(c, R + r, ix.mv(MV, s[3], hh, r, p), j)
            for ki in L.st_inner():
                yv[r, ki] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                hv[ki] = s[0] * m.cast(h_in[b, hh, p, L.state(ko, ki, j)])
            for r in T.unroll(R):
                for ki in L.st_inner():
                    hv[ki] = (hv[ki] + c[r] * (stg[0, r, L.reg(ko, ki)] if STAGE
                                               else m.cast(kst[ix.kr(b, r, hh, L.state(ko, ki, j))]))
                              + c[R + r] * (stg[1, r, L.reg(ko, ki)] if STAGE
                                            else m.cast(kout[ix.kr(b, r, hh, L.state(ko, ki, j))])))
            if ok:
                for ki in L.st_inner():
                    h_out[b, hh, p, L.state(ko, ki, j)] = to_state(hv[ki])
            for r in T.unroll(R):
                for ki in L.st_inner():
                    yv[r, ki] = yv[r, ki] + hv[ki] * (stg[2, r, L.reg(ko, ki)] if STAGE
                                                      else m.cast(qrot[ix.kr(b, r, hh, L.state(ko, ki, j))]))
        for r in T.unroll(R):  # the lane's first thread adds D x, gates, projects and stores
            L.reduce_plus_lead(y, r, yv, r, ix.mv(MV, Dv[hh] * m.cast(V_[b, hh, p]), hh, r, p) if dims.has_D
                               else m.zero, L.leader(ok, j))
            if dims.has_z:
                if L.leader(ok, j):
                    y[r] = y[r] * m.silu(ix.mz(MZ, m.cast(Z[b, hh, p]), hh, r, p))
        if L.leader(ok, j):
            if dims.has_outproj:
                y[R] = m.zero
                for r in T.unroll(R):
                    y[R] = y[R] + ix.proj(MO, hh, r, p) * y[r]
                out[b, hh, p] = y[R].astype(OUT)
            else:
                for r in T.unroll(R):
                    out[ix.out(b, r, hh, p)] = y[r].astype(OUT)

    return row


def _rows_macro(dims: StepDims, L):
    """Pass 2, one lane: ``L.head_rows`` (None: 1) consecutive rows p = pb RR + i of head (b, h), sharing the
    head's K states, new k and rotated q (loaded once into lane-local ``stg`` with the layout's
    ``stage_bc``: a CUDA warp lane's registers), each row by _row_macro."""
    N, R, ACC, m, SCOPE, ix, RR = dims.headdim_qk, dims.rank, dims.acc, L.math, L.scope, _Ix(dims), rows_per_lane(dims, L)
    row = _row_macro(dims, L)

    @T.macro
    def rows(V_, ADT, DT, Trap, MV, MZ, MO, Dv, Z, h_in, kst, vst, qrot, kout, out, h_out, b, hh, pb, j, ok):
        if L.stage_bc:
            stg = T.alloc_buffer((3, R, L.regs(N)), ACC, scope=SCOPE)
            for r in T.unroll(R):
                for ko in L.st_outer(N):
                    for ki in L.st_inner():
                        stg[0, r, L.reg(ko, ki)] = m.cast(kst[ix.kr(b, r, hh, L.state(ko, ki, j))])
                        stg[1, r, L.reg(ko, ki)] = m.cast(kout[ix.kr(b, r, hh, L.state(ko, ki, j))])
                        stg[2, r, L.reg(ko, ki)] = m.cast(qrot[ix.kr(b, r, hh, L.state(ko, ki, j))])
            for i in T.serial(RR):
                row(V_, ADT, DT, Trap, MV, MZ, MO, Dv, Z, h_in, kst, vst, qrot, kout, out, h_out, b, hh,
                    pb * RR + i, stg, j, ok)
        elif RR == 1:
            row(V_, ADT, DT, Trap, MV, MZ, MO, Dv, Z, h_in, kst, vst, qrot, kout, out, h_out, b, hh, pb, kst, j, ok)
        else:
            for i in T.serial(RR):
                row(V_, ADT, DT, Trap, MV, MZ, MO, Dv, Z, h_in, kst, vst, qrot, kout, out, h_out, b, hh,
                    pb * RR + i, kst, j, ok)

    return rows


def rows_per_lane(dims: StepDims, L) -> int:
    """Rows (headdim_v entries) of one head a pass-2 lane runs: the layout's ``head_rows`` (None: 1)."""
    RR = L.head_rows or 1
    if dims.headdim_v % RR:
        raise ValueError(f"head_rows: {RR} must divide headdim_v={dims.headdim_v}")
    return RR


def _lanes(L, total, body):
    """A macro running ``body(lane, j, ok)`` for every lane < ``total`` (an expression of the kernel's batch) as
    the layout lays lanes out (j: the thread within the lane, ok: whether it stores); on a CPU work up to
    ``serial_work`` runs on the calling thread (``work``)."""
    serial_work = L.serial_work

    @T.macro
    def group(lo, batch):
        for li in L.inner():
            if L.lane_guard(lo, li, total(batch)):
                body(L.lane_of(lo, li, total(batch)), L.thread(li), L.lane_ok(lo, li, total(batch)))

    @T.macro
    def run(batch, work):
        if serial_work is not None:
            if work <= serial_work:  # decode size: on the calling thread, no thread-pool launch
                for lo in T.serial(L.blocks(total(batch))):
                    group(lo, batch)
            else:
                for lo in L.outer(total(batch)):
                    group(lo, batch)
        else:
            for lo in L.outer(total(batch)):
                group(lo, batch)

    return run


def _drop_params(func: tirx.PrimFunc, names: tuple) -> tirx.PrimFunc:
    """``func`` without the buffer parameters ``names`` (unread): SISO's signature, as before MIMO."""
    return tirx.PrimFunc([v for v in func.params if v.name not in names], func.body, func.ret_type, func.attrs)


# the parameters each pass alone does not touch (dropped from its kernel's signature)
_ROTATE_ONLY = ("Q", "K", "Qb", "Kb", "Ang", "ast", "aout")
_UPDATE_ONLY = ("V", "ADT", "Trap", "MV", "MZ", "MO", "Dv", "Z", "h_in", "kst", "vst", "out", "h_out")


def step_template(dims: StepDims, L, passes: str = "both") -> tirx.PrimFunc:
    """The decode step's two passes (module docstring); qrot: an acc workspace shaped as the K state. SISO
    (StepDims) has no MIMO_V / MIMO_Z / MIMO_Out parameters; MIMO (MimoStepDims) takes them after K_bias,
    (1, 1, 1) placeholders for MIMO_Z without Z and MIMO_Out without has_outproj (and for an absent bias).
    ``passes``: "both" (the fused step), "rotate" (pass 1: qrot, kout its outputs, in Q's dtype) or "update"
    (pass 2: qrot, kout its inputs C, B in Q's dtype; h_out dropped with ``inplace``, h_in rewritten)."""
    H, HQ, N, P, S, R, ACC = (dims.nheads, dims.nheads_qk, dims.headdim_qk, dims.headdim_v, dims.headdim_angles,
                              dims.rank, dims.acc)
    ZT, KT, VT = dims.z_dtype or dims.v_dtype, dims.kstate_dtype or ACC, dims.vstate_dtype or dims.v_dtype
    SD, ROT = dims.state_dtype or ACC, ACC if passes == "both" else dims.qk_dtype
    ROTATE, UPDATE, INPLACE = passes in ("both", "rotate"), passes in ("both", "update"), dims.inplace
    LR = getattr(L, "rotate_layout", None) or L  # pass 1's lanes (a CUDA warp layout's pass 2 keeps a thread a pair)
    rotate, rows, PB = _rotate_macro(dims, LR, ROT), _rows_macro(dims, L), dims.headdim_v // rows_per_lane(dims, L)
    RK = (R,) if dims.mimo else ()  # the rank axis of Q, K, the biases and the K states
    OUTR = (R,) if dims.mimo and not dims.has_outproj else ()
    BIAS = (R, H, N) if dims.rank_major else (H, *RK, N)
    BQ, BK = (BIAS if on else (1,) * len(BIAS) for on in (dims.has_qbias, dims.has_kbias))
    PROJ = lambda on: ((R, H, P) if dims.rank_major else (H, R, P)) if on else (1, 1, 1)  # noqa: E731
    NP = N // 2

    @T.prim_func
    def step(Q_h: T.handle, K_h: T.handle, V_h: T.handle, ADT_h: T.handle, DT_h: T.handle, Trap_h: T.handle,
             Qb_h: T.handle, Kb_h: T.handle, MV_h: T.handle, MZ_h: T.handle, MO_h: T.handle, Ang_h: T.handle,
             D_h: T.handle, Z_h: T.handle, ast_h: T.handle, h_in_h: T.handle, kst_h: T.handle, vst_h: T.handle,
             out_h: T.handle, aout_h: T.handle, h_out_h: T.handle, kout_h: T.handle, qrot_h: T.handle):
        batch = T.int32()
        Q = T.match_buffer(Q_h, (batch, *RK, HQ, N), dims.qk_dtype)
        K = T.match_buffer(K_h, (batch, *RK, HQ, N), dims.qk_dtype)
        V = T.match_buffer(V_h, (batch, H, P), dims.v_dtype)
        ADT = T.match_buffer(ADT_h, (batch, H), ACC)
        DT = T.match_buffer(DT_h, (batch, H), ACC)
        Trap = T.match_buffer(Trap_h, (batch, H), ACC)
        Qb = T.match_buffer(Qb_h, BQ, ACC)
        Kb = T.match_buffer(Kb_h, BK, ACC)
        MV = T.match_buffer(MV_h, PROJ(dims.mimo), ACC)
        MZ = T.match_buffer(MZ_h, PROJ(dims.mimo and dims.has_z), ACC)
        MO = T.match_buffer(MO_h, PROJ(dims.has_outproj), ACC)
        Ang = T.match_buffer(Ang_h, (batch, H, S), ACC)
        Dv = T.match_buffer(D_h, (H,) if dims.has_D else (1,), ACC)
        Z = T.match_buffer(Z_h, (batch, H, P) if dims.has_z else (1, 1, 1), ZT)
        ast = T.match_buffer(ast_h, (batch, H, S), ACC)
        h_in = T.match_buffer(h_in_h, (batch, H, P, N), SD)
        kst = T.match_buffer(kst_h, (batch, *RK, H, N), KT)
        vst = T.match_buffer(vst_h, (batch, H, P), VT)
        out = T.match_buffer(out_h, (batch, *OUTR, H, P), dims.v_dtype)
        aout = T.match_buffer(aout_h, (batch, H, S), ACC)
        h_out = T.match_buffer(h_out_h, (batch, H, P, N), SD)
        kout = T.match_buffer(kout_h, (batch, *RK, H, N), ROT)
        qrot = T.match_buffer(qrot_h, (batch, *RK, H, N), ROT)
        if ROTATE:
            _lanes(LR, lambda bt: bt * R * H * NP,
                   lambda lane, j, ok: rotate(Q, K, DT, Qb, Kb, Ang, ast, aout, qrot, kout, lane // (R * H * NP),
                                              lane // (H * NP) % R, lane // NP % H, lane % NP)
                   )(batch, batch * R * H * N * 8)
        if UPDATE:
            _lanes(L, lambda bt: bt * H * PB,
                   lambda lane, j, ok: rows(V, ADT, DT, Trap, MV, MZ, MO, Dv, Z, h_in, kst, vst, qrot, kout, out,
                                            h_in if INPLACE else h_out, lane // (H * PB), lane // PB % H,
                                            lane % PB, j, ok))(batch, batch * H * P * N * R)

    drop = (() if dims.mimo else ("MV", "MZ", "MO")) + (("h_out",) if INPLACE else ())
    drop += {"both": (), "rotate": _UPDATE_ONLY, "update": _ROTATE_ONLY}[passes]
    return _drop_params(step, drop) if drop else step
