"""The Mamba-3 SISO chunked forward's preprocess (mamba_ssm's ``mamba3_siso_combined`` before its chunk
kernels): everything the SSD pieces (compute/ssd/) need that SSD's chunk cumsum does not compute, as one template
laid out by the SSD strategies (compute/ssd/strategy.py: serial; schedules/<target>/ssd.py: CPU parallel tasks,
CUDA blockIdx x threadIdx). Three passes (three parallel loops on a CPU, three launches on CUDA; none reads
what another writes):

1. rotate, a task per (batch b, head h, block of rotary pairs i < headdim_qk / 2: every pair as one vector
   loop on a CPU, one pair per CUDA thread), time t outer (each step reads / writes contiguous rows):
       theta_t = (theta_{t-1} + pi tanh(Angles_t[i]) DT_t) mod 2 pi     (pairs i < headdim_angles, theta_{-1}
                                                                         = the angle state or 0; others: 0)
       q_t, k_t = R(theta_t) (Q_t[hq] + Q_bias[h]), R(theta_t) (K_t[hq] + K_bias[h])  (hq = h // (H / H_qk))
   q, k float32 per head (the biases are per head, so GQA heads do not share them), and the final theta;
2. chunk, a task per (batch, head, chunk c), serial over its positions l (s = c Q + l):
       dA_cs[l] = sum_{l' <= l} max(ADT_s', DA_MIN)                     (chunk-local; 0 past seqlen)
       scale[l] = gamma_s + DT_{s+1} (1 - lam_{s+1})                     (lam = sigmoid(Trap); 0 past seqlen,
                                                                         the DT_{s+1} term 0 at s = seqlen - 1)
       skip[l]  = D[h] + gamma_s (Q_s[hq] + Q_bias[h]) . (K_s[hq] + K_bias[h])   (gamma = DT lam)
   in the SSD pieces' (batch, nheads, nchunks, chunk_size) layout: scale is ssd_chunk_state's / chunk_scan's
   dt', skip chunk_scan's per-position D (``ScanDims.diag_skip``: the diagonal leaves the causal sum);
3. init (with input states), a task per (batch, head, headdim_v row p), headdim_qk lanes:
       init[p, n] = ssm[p, n] + DT_0 (1 - lam_0) v_state[p] k_state[n]
   the state entering ssd_state_passing: the input K / V states' trapezoid term (its exp(ADT_0) comes from
   chunk 0's dA_cs).

Packed sequences (``has_seq_idx``; seq_idx (batch, seqlen) int32, batch 1): theta restarts at 0 at each
sequence's first position, angle_out is (nseq, H, A), row seq_idx[t] written at each sequence's last position
t (batch row 0), and scale's DT_{s+1} term is 0 where s + 1 starts another sequence.

The diagonal uses the unrotated dot, as upstream (rotation preserves it). ADT is clamped below at the SSD
pieces' DA_MIN, so ADT = -inf gives a decay of 0 rather than NaN differences (issue #16's rule).
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ..ssd.common import DA_MIN, F32, I32, Z4
from ..ssd.strategy import Strategy, unravel
from ._dims import PreDims


def _rotate_macro(d: PreDims, S: Strategy):
    """Pass 1, task (b, h, block of ``S.lanes`` rotary pairs: all of them on a CPU, one on CUDA): the angle
    cumsum over time and the rotated q / k pairs, time outer so each step reads and writes contiguous rows.
    Pairs past headdim_angles keep theta = 0 (cos 1, sin 0: q, k = Q + Q_bias, K + K_bias) without a branch,
    so the CPU's pair loop stays one vector loop."""
    H, HPQ, NP, A, m = d.nheads, d.heads_per_qk, d.headdim_qk // 2, d.headdim_angles, S.math
    V = S.lanes(NP)

    @T.macro
    def pairs(i, Qm, Km, DT, Qb, Kb, Ang, ast, q, k, aout, seq, seqlen):
        w = T.meta_var(S.scratch(th=(V,), cs=(V,), sn=(V,), qb=(2, V), kb=(2, V), xy=(2, V)))
        b, h, pb = T.meta_var(unravel(i, (None, H, NP // V)))
        hq = T.meta_var(h // HPQ)
        for v in S.lane_loop(V):
            w.th[v] = m.zero
            for e in range(2):  # the pairs' biases, read once per task
                w.qb[e, v] = Qb[h, 2 * (pb * V + v) + e]
                w.kb[e, v] = Kb[h, 2 * (pb * V + v) + e]
        if d.has_init:
            for v in range(V):
                if pb * V + v < A:
                    w.th[v] = ast[b, h, pb * V + v]
        for t in range(seqlen):
            for v in S.lane_loop(V):
                w.th[v] = T.Select(pb * V + v < A, angle_step(
                    carried(w.th[v], seq, b, t, d.has_seq_idx, m), m.tanh(Ang[b, t, h, T.min(pb * V + v, A - 1)]),
                    DT[b, h, t], m), m.zero)
                w.cs[v] = T.cos(w.th[v])
                w.sn[v] = T.sin(w.th[v])
                _rotate(q, Qm, w.qb, w, b, t, h, hq, pb * V + v, v, m)
                _rotate(k, Km, w.kb, w, b, t, h, hq, pb * V + v, v, m)
            if d.has_seq_idx:
                if b == 0 and seq_ends(seq, b, t, seqlen):
                    for v in range(V):
                        if pb * V + v < A:
                            aout[seq[b, t], h, pb * V + v] = w.th[v]
        if not d.has_seq_idx:
            for v in range(V):
                if pb * V + v < A:
                    aout[b, h, pb * V + v] = w.th[v]

    return pairs


def seq_continues(seq, b, t):
    """Position t > 0 is in the same packed sequence as t - 1 (seq: the (batch, seqlen) sequence ids)."""
    return tirx.all(t > 0, seq[b, tirx.max(t - 1, 0)] == seq[b, t])


def seq_ends(seq, b, t, seqlen):
    """Position t is its packed sequence's last one (the last position, or the next one's id differs)."""
    return tirx.any(t + 1 >= seqlen, seq[b, tirx.min(t + 1, seqlen - 1)] != seq[b, t])


def carried(theta, seq, b, t, has_seq_idx: bool, m):
    """The angle a step starts from: theta_{t-1}, or with packed sequences 0 at a sequence's first position."""
    return tirx.Select(seq_continues(seq, b, t), theta, m.zero) if has_seq_idx else theta


def angle_step(theta, tanh_angle, dt, m):
    """(theta + pi tanh(Angles) DT) mod 2 pi, in [0, 2 pi): one step of the angle cumsum (``tanh_angle``: the
    rate's tanh, already taken; the backward needs it again)."""
    TWO_PI = m.const(2.0 * math.pi)
    x = theta + tanh_angle * m.const(math.pi) * dt
    return x - TWO_PI * T.floor(x / TWO_PI)


def biased(X, xb, row, b, t, hq, p, e, v, m):
    """Element e of rotary pair p of X[b, t, hq] plus its bias xb[row + e, v] (the task's biases, read once
    per task), float32: the per-head biased Q or K, unrotated."""
    return m.cast(X[b, t, hq, 2 * p + e]) + xb[row + e, v]


def rotated(x0, x1, cs, sn):
    """R(theta) (x0, x1) with cos / sin of theta (pass -sin for R(theta)^T)."""
    return x0 * cs - x1 * sn, x0 * sn + x1 * cs


def _rotate(out, X, xb, w, b, t, h, hq, p, v, m):
    """out[b, t, h, pair p] = R(theta) (X[b, t, hq, pair p] + the pair's bias xb[:, v]), cos / sin in w.cs /
    w.sn[v]: the biased pair (``biased``) read once into w.xy[:, v], then rotated."""
    for e in range(2):
        T.buffer_store(w.xy, biased(X, xb, 0, b, t, hq, p, e, v, m), [e, v])
    r0, r1 = rotated(w.xy[0, v], w.xy[1, v], w.cs[v], w.sn[v])
    T.buffer_store(out, r0, [b, t, h, 2 * p])
    T.buffer_store(out, r1, [b, t, h, 2 * p + 1])


def _chunk_macro(d: PreDims, S: Strategy):
    """Pass 2, task (b, h, c): dA_cs, scale and skip of the chunk's positions."""
    H, HPQ, N, Q, m = d.nheads, d.heads_per_qk, d.headdim_qk, d.chunk_size, S.math
    dot = dot_macro(N, S)

    @T.macro
    def chunk(i, Qm, Km, ADT, DT, Trap, Qb, Kb, Dv, dA_cs, scale, skip, seq, seqlen, nchunks):
        r = T.alloc_buffer((4,), F32, scope=S.scope)  # cumsum, gamma, next step's left weight, q . k
        b, h, c = T.meta_var(unravel(i, (None, H, nchunks)))
        r[0] = m.zero
        for l in range(Q):
            if c * Q + l < seqlen:
                r[0] = r[0] + T.max(ADT[b, h, c * Q + l], T.float32(DA_MIN))
                r[1] = DT[b, h, c * Q + l] * m.sigmoid(Trap[b, h, c * Q + l])
                r[2] = m.zero
                if c * Q + l + 1 < seqlen:
                    r[2] = DT[b, h, c * Q + l + 1] * (m.one - m.sigmoid(Trap[b, h, c * Q + l + 1]))
                    if d.has_seq_idx:
                        if seq[b, c * Q + l + 1] != seq[b, c * Q + l]:
                            r[2] = m.zero
                dot(r, 3, qk_dot_term(Qm, Km, Qb, Kb, b, c * Q + l, h // HPQ, h, m))
                scale[b, h, c, l] = r[1] + r[2]
                skip[b, h, c, l] = (Dv[h] if d.has_D else m.zero) + r[1] * r[3]
            else:
                scale[b, h, c, l] = m.zero
                skip[b, h, c, l] = m.zero
            dA_cs[b, h, c, l] = r[0]

    return chunk


def qk_dot_term(Qm, Km, Qb, Kb, b, s, hq, h, m):
    """n -> (Q[b, s, hq, n] + Q_bias[h, n]) (K[b, s, hq, n] + K_bias[h, n]): the terms of the unrotated diagonal
    dot X_s . Y_s (for ``dot_macro``)."""
    return lambda n: (m.cast(Qm[b, s, hq, n]) + Qb[h, n]) * (m.cast(Km[b, s, hq, n]) + Kb[h, n])


def dot_macro(N: int, S: Strategy):
    """A macro ``dot(r, slot, term)``: r[slot] = sum_n term(n) over n < N. A thread's serial sum where the
    strategy has no vector lanes (CUDA); on a CPU ``VW`` vector partial sums (lane vi sums n = vi mod VW, an
    explicit per-lane accumulator), then their sum: the serial scalar chain cost 40 of the kernel's 110 ms at
    upstream's shape, seqlen 2048 (2 threads)."""
    VW = max(w for w in (1, 2, 4, 8, 16) if N % w == 0) if S.vector else 1

    @T.macro
    def dot(r, slot, term):
        part = T.alloc_buffer((VW,), F32, scope=S.scope)
        for vi in S.lane_loop(VW):
            part[vi] = S.math.zero
        for no in range(N // VW):
            for vi in S.lane_loop(VW):
                part[vi] = part[vi] + term(no * VW + vi)
        r[slot] = S.math.zero
        for vi in range(VW):
            r[slot] = r[slot] + part[vi]

    return dot


def _init_macro(d: PreDims, S: Strategy):
    """Pass 3, task (b, h, p): the initial ssm state row with the K / V states' trapezoid term."""
    H, P, N = d.nheads, d.headdim_v, d.headdim_qk
    V = S.lanes(N)
    m = S.math

    @T.macro
    def row(i, DT, Trap, ssm, kst, vst, init):
        w = T.alloc_buffer((1,), F32, scope=S.scope)
        b, h, p, nb = T.meta_var(unravel(i, (None, H, P, N // V)))
        w[0] = DT[b, h, 0] * (m.one - m.sigmoid(Trap[b, h, 0])) * m.cast(vst[b, h, p])
        for v in S.lane_loop(V):
            init[b, h, p, nb * V + v] = ssm[b, h, p, nb * V + v] + w[0] * m.cast(kst[b, h, nb * V + v])

    return row


def preprocess_template(d: PreDims, S: Strategy) -> tirx.PrimFunc:
    """The preprocess's three passes laid out by ``S`` (module docstring). Parameters in order: Q, K, ADT, DT,
    Trap, Q_bias, K_bias, Angles, D, angle_state, ssm_state, k_state, v_state (absent ones: placeholders of
    ones), then the outputs q, k, dA_cs, scale, skip, angle_out, init, and last seq_idx (batch, seqlen) int32
    (a (1, 1) placeholder without has_seq_idx). With has_seq_idx angle_out is (nseq, H, A): row sid written
    at sequence sid's last position from batch row 0 only (packed sequences have batch 1); rows of sequences
    without positions are left as they are (the caller zero-fills)."""
    H, HQ, N, P, A, Q = d.nheads, d.nheads_qk, d.headdim_qk, d.headdim_v, d.headdim_angles, d.chunk_size
    KT = d.kstate_dtype or F32
    pair, chunk, row, tasks = _rotate_macro(d, S), _chunk_macro(d, S), _init_macro(d, S), S.tasks()
    I3 = (1, 1, 1)

    @T.prim_func
    def func(Q_h: T.handle, K_h: T.handle, ADT_h: T.handle, DT_h: T.handle, Trap_h: T.handle, Qb_h: T.handle,
             Kb_h: T.handle, Ang_h: T.handle, D_h: T.handle, ast_h: T.handle, ssm_h: T.handle, kst_h: T.handle,
             vst_h: T.handle, q_h: T.handle, k_h: T.handle, dac_h: T.handle, sc_h: T.handle, sk_h: T.handle,
             aout_h: T.handle, init_h: T.handle, seq_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        nseq = T.int32()
        Qm = T.match_buffer(Q_h, (batch, seqlen, HQ, N), d.qk_dtype)
        Km = T.match_buffer(K_h, (batch, seqlen, HQ, N), d.qk_dtype)
        ADT = T.match_buffer(ADT_h, (batch, H, seqlen), F32)
        DT = T.match_buffer(DT_h, (batch, H, seqlen), F32)
        Trap = T.match_buffer(Trap_h, (batch, H, seqlen), F32)
        Qb = T.match_buffer(Qb_h, (H, N), F32)
        Kb = T.match_buffer(Kb_h, (H, N), F32)
        Ang = T.match_buffer(Ang_h, (batch, seqlen, H, A), F32)
        Dv = T.match_buffer(D_h, (H,) if d.has_D else (1,), F32)
        ast = T.match_buffer(ast_h, (batch, H, A) if d.has_init else I3, F32)
        ssm = T.match_buffer(ssm_h, (batch, H, P, N) if d.has_init else Z4, F32)
        kst = T.match_buffer(kst_h, (batch, H, N) if d.has_init else I3, KT)
        vst = T.match_buffer(vst_h, (batch, H, P) if d.has_init else I3, d.vstate_dtype)
        q = T.match_buffer(q_h, (batch, seqlen, H, N), F32)
        k = T.match_buffer(k_h, (batch, seqlen, H, N), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        scale = T.match_buffer(sc_h, (batch, H, nchunks, Q), F32)
        skip = T.match_buffer(sk_h, (batch, H, nchunks, Q), F32)
        aout = T.match_buffer(aout_h, (nseq if d.has_seq_idx else batch, H, A), F32)
        init = T.match_buffer(init_h, (batch, H, P, N) if d.has_init else Z4, F32)
        seq = T.match_buffer(seq_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        tasks(batch * H * (N // 2 // S.lanes(N // 2)),
              lambda i: pair(i, Qm, Km, DT, Qb, Kb, Ang, ast, q, k, aout, seq, seqlen))
        tasks(batch * H * nchunks, lambda i: chunk(i, Qm, Km, ADT, DT, Trap, Qb, Kb, Dv, dA_cs, scale, skip, seq,
                                                   seqlen, nchunks))
        if d.has_init:
            tasks(batch * H * P * (N // S.lanes(N)), lambda i: row(i, DT, Trap, ssm, kst, vst, init))

    return func
