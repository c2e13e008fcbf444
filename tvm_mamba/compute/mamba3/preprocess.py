"""The Mamba-3 SISO chunked forward's preprocess (mamba_ssm's ``mamba3_siso_combined`` before its chunk
kernels): everything the SSD pieces (compute/ssd/) need that SSD's chunk cumsum does not compute, as one template
laid out by the SSD strategies (compute/ssd/strategy.py: serial; schedules/<target>/ssd.py: CPU parallel tasks,
CUDA blockIdx x threadIdx). Five passes (five parallel loops on a CPU, five launches on CUDA, in order: the
rotate pass reads what the angles pass wrote), so that only the angle recurrence is serial over time:

1. angles, a task per (batch b, head h, block of angles i < headdim_angles: all of them as one vector loop on a
   CPU, one per CUDA thread), serial over time t:
       theta_t = (theta_{t-1} + pi tanh(Angles_t[i]) DT_t) mod 2 pi     (theta_{-1} = the angle state or 0)
   cos / sin theta_t into q's slots of pair i (read back by pass 2), the final theta into angle_out;
2. rotate, a task per (batch, block of STEPS steps, block of rotary pairs: all on a CPU, one per CUDA thread):
       q_t, k_t = R(theta_t) (Q_t[hq] + Q_bias[h]), R(theta_t) (K_t[hq] + K_bias[h])  (hq = h // (H / H_qk);
                                                                         theta = 0 for pairs past headdim_angles)
   q, k float32 per head (the biases are per head, so GQA heads do not share them): the task's Q / K pairs read
   once for every head of their group, each head's biases once per task;
3. chunk, a task per (batch, head, chunk c), serial over its positions l (s = c Q + l):
       dA_cs[l] = sum_{l' <= l} max(ADT_s', DA_MIN)                     (chunk-local; 0 past seqlen;
                                                                         NaN kept: clamped_adt)
       scale[l] = gamma_s + DT_{s+1} (1 - lam_{s+1})                     (lam = sigmoid(Trap), gamma = DT lam;
                                                                         0 past seqlen, the DT_{s+1} term 0 at
                                                                         s = seqlen - 1)
4. skip, a task per (batch, block of positions, block of heads of one Q / K head; ``skip_block``):
       skip[l]  = D[h] + gamma_s (Q_s[hq] + Q_bias[h]) . (K_s[hq] + K_bias[h])
   in the SSD pieces' (batch, nheads, nchunks, chunk_size) layout: scale is ssd_chunk_state's / chunk_scan's
   dt', skip chunk_scan's per-position D (``ScanDims.diag_skip``: the diagonal leaves the causal sum); on CUDA
   a register block of 8 positions x up to 8 heads, so Q / K are read once per block of heads and the biases
   once per block of positions (a thread per (batch, head, chunk) re-read both per head / per position);
5. init (with input states), a task per (batch, head, headdim_v row p), headdim_qk lanes:
       init[p, n] = ssm[p, n] + DT_0 (1 - lam_0) v_state[p] k_state[n]
   the state entering ssd_state_passing: the input K / V states' trapezoid term (its exp(ADT_0) comes from
   chunk 0's dA_cs).

Why the rotation left the angle recurrence: a thread per (batch, head, pair) serial over time ran 48 blocks of
128 threads at Mamba-3 130M's batch-4 shape and re-read the GQA-shared Q / K per head; the recurrence alone
is a thread per angle, and the rotation runs a thread per (batch, 16 steps, pair). The price: cos / sin of
every rotary pair written and read back once (docs/mamba3.md).

Packed sequences (``has_seq_idx``; seq_idx (batch, seqlen) int32, batch 1): theta restarts at 0 at each
sequence's first position, angle_out is (nseq, H, A), row seq_idx[t] written at each sequence's last position
t (batch row 0), and scale's DT_{s+1} term is 0 where s + 1 starts another sequence.

The diagonal uses the unrotated dot, as upstream (rotation preserves it). ADT is clamped below at the SSD
pieces' DA_MIN, so ADT = -inf gives a decay of 0 rather than NaN differences (issue #16's rule); a NaN in ADT,
Trap or Angles stays NaN (``clamped_adt``, ``trap_weight``, ``rate_tanh``), as the recurrence's (issue #41).
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .._math import is_nan
from ..ssd.common import DA_MIN, F32, I32, Z4
from ..ssd.strategy import ChunkStrategy, unravel
from .dims import PAIR_STEPS, PreDims


STEPS = PAIR_STEPS  # rotate pass: time steps per task (its Q / K pairs read once for every head of their group)
AHEAD = 4  # angle passes: steps whose loads are issued together, ahead of the recurrence (8 spilled 4 B on sm_80)
DOT_STEPS, DOT_HEADS = 8, 8  # skip pass on scalar lanes: a register block of positions x heads of one Q/K head


def step_blocks(seqlen):
    """The rotate / pairs passes' blocks of STEPS steps: ceil(seqlen / STEPS) (also the backward's bias parts)."""
    return (seqlen + STEPS - 1) // STEPS


def pair_tasks(d: PreDims, S: ChunkStrategy, seqlen) -> tuple:
    """The rotate / pairs passes' task radix (batch, step block, block of ``S.lanes`` pairs) for ``unravel``;
    the task count is batch times the product of the rest (``count``)."""
    NP = d.headdim_qk // 2
    return (None, step_blocks(seqlen), NP // S.lanes(NP))


def count(batch, radix: tuple):
    """The task count of an ``unravel`` radix whose first digit is the batch."""
    n = batch
    for e in radix[1:]:
        n = n * e
    return n


def dot_width(N: int, S: ChunkStrategy) -> int:
    """Vector partials of a dot over N: the largest of 16, 8, 4, 2, 1 dividing N on a vector strategy, else 1."""
    return max(w for w in (1, 2, 4, 8, 16) if N % w == 0) if S.vector else 1


def gamma_at(m, DT, Trap, b, h, t):
    """gamma_t = DT_t sigmoid(Trap_t): the trapezoid's right weight at step t of (b, h)."""
    return DT[b, h, t] * trap_weight(m, Trap[b, h, t])


def trap_weight(m, trap):
    """lam = sigmoid(Trap), NaN for a NaN Trap (the recurrence's rule for every input: a NaN reaches everything
    after it). The CPU's polynomial sigmoid clamps its input and would give 0; native exp keeps NaN."""
    return m.keep_nan(trap, m.sigmoid(trap)) if m.poly else m.sigmoid(trap)


def rate_tanh(m, angle):
    """tanh(Angles), NaN for a NaN angle rate (the CPU's polynomial tanh clamps its input to +-9)."""
    return m.keep_nan(angle, m.tanh(angle)) if m.poly else m.tanh(angle)


def clamped_adt(m, adt):
    """max(ADT, DA_MIN), the decay step the SSD pieces take: ADT = -inf is a decay of 0 (issue #16), a NaN stays
    NaN (max / fmaxf return the bound for it, which erased the state history as -inf does: issue #41)."""
    return m.keep_nan(adt, T.max(adt, T.float32(DA_MIN)))


def adt_passes(m, adt):
    """Whether ``clamped_adt`` passes ADT's gradient: ADT >= DA_MIN, or NaN (a clamped step passes none)."""
    return tirx.any(is_nan(adt, m.acc), adt >= T.float32(DA_MIN))


def angles_macro(d: PreDims, S: ChunkStrategy, final: bool = True):
    """Pass 1, task (b, h, block of ``S.lanes`` angles: all of them on a CPU, one on CUDA): the angle cumsum over
    time, cos / sin of theta_t stored in q[b, t, h, 2 i] / q[b, t, h, 2 i + 1] (the slots of pair i: the rotate
    pass reads them and overwrites the pair; the cos / sin calls here, off the rotate pass, whose register block
    spilled around their slow-path calls) and, with ``final``, the final theta to angle_out (the backward's
    pass 3 is this macro without it, ``q`` its dQh). Time runs in blocks of AHEAD steps, each block's rates
    (tanh(Angles) DT: loads and a tanh each, independent of theta) first: on CUDA a thread per angle walks the
    whole sequence with a few warps per SM, and one load in flight per step would wait out the memory latency
    at every step."""
    H, A, m = d.nheads, d.headdim_angles, S.math
    V = S.lanes(A)

    @T.macro
    def angles(i, DT, Ang, ast, q, aout, seq, seqlen):
        w = T.meta_var(S.scratch(th=(V,), inc=(AHEAD, V)))
        b, h, ab = T.meta_var(unravel(i, (None, H, A // V)))
        for v in S.lane_loop(V):
            w.th[v] = m.zero
        if d.has_init:
            for v in S.lane_loop(V):
                w.th[v] = ast[b, h, ab * V + v]
        for tb in range((seqlen + AHEAD - 1) // AHEAD):
            for s in T.unroll(AHEAD):  # the block's rates first: their loads in flight together
                if tb * AHEAD + s < seqlen:
                    for v in S.lane_loop(V):
                        w.inc[s, v] = angle_rate(rate_tanh(m, Ang[b, tb * AHEAD + s, h, ab * V + v]),
                                                 DT[b, h, tb * AHEAD + s], m)
            for s in T.unroll(AHEAD):
                if tb * AHEAD + s < seqlen:
                    for v in S.lane_loop(V):
                        w.th[v] = angle_step(carried(w.th[v], seq, b, tb * AHEAD + s, d.has_seq_idx, m), w.inc[s, v],
                                             m)
                        q[b, tb * AHEAD + s, h, 2 * (ab * V + v)] = T.cos(w.th[v])
                        q[b, tb * AHEAD + s, h, 2 * (ab * V + v) + 1] = T.sin(w.th[v])
                    if final and d.has_seq_idx:
                        if b == 0 and seq_ends(seq, b, tb * AHEAD + s, seqlen):
                            for v in range(V):
                                aout[seq[b, tb * AHEAD + s], h, ab * V + v] = w.th[v]
        if final and not d.has_seq_idx:
            for v in S.lane_loop(V):
                aout[b, h, ab * V + v] = w.th[v]

    return angles


def _turn_macro(d: PreDims, S: ChunkStrategy):
    """A macro ``turn(w, q, b, t, h, p, v)``: w.cs / w.sn[v] = cos / sin of pair p's angle at step t, stored by
    the angles pass in q's slots 2 p / 2 p + 1; 1 / 0 for pairs past headdim_angles. Vector lanes read the slots
    of min(p, A - 1) and select (one vector load, before the lanes' pairs are overwritten); a scalar lane reads
    its own slots only where it has an angle (no read of a slot another thread rewrites)."""
    A, m = d.headdim_angles, S.math

    @T.macro
    def turn(w, q, b, t, h, p, v):
        if S.vector:
            w.cs[v] = T.Select(p < A, q[b, t, h, 2 * T.min(p, A - 1)], m.one)
            w.sn[v] = T.Select(p < A, q[b, t, h, 2 * T.min(p, A - 1) + 1], m.zero)
        else:
            w.cs[v] = m.one
            w.sn[v] = m.zero
            if p < A:
                w.cs[v] = q[b, t, h, 2 * p]
                w.sn[v] = q[b, t, h, 2 * p + 1]

    return turn


def load_pairs_macro(d: PreDims, S: ChunkStrategy, V: int):
    """A macro ``load(w, Qm, Km, b, tb, hq, p0, seqlen)``: w.x[e, s, v] / w.y[e, s, v] = element e of pair p0 + v
    of Q / K[b, tb STEPS + s, hq] (float32) for the task's STEPS steps before seqlen: what the forward's rotate
    pass and the backward's pairs pass reuse for every head of the Q / K head. The step loop is unrolled: w.x /
    w.y stay in registers on CUDA (indexed by a loop variable they went to the stack)."""
    m = S.math

    @T.macro
    def load(w, Qm, Km, b, tb, hq, p0, seqlen):
        for s in T.unroll(STEPS):
            if tb * STEPS + s < seqlen:
                for v in S.lane_loop(V):
                    for e in T.unroll(2):
                        w.x[e, s, v] = m.cast(Qm[b, tb * STEPS + s, hq, 2 * (p0 + v) + e])
                        w.y[e, s, v] = m.cast(Km[b, tb * STEPS + s, hq, 2 * (p0 + v) + e])

    return load


def _rotate_macro(d: PreDims, S: ChunkStrategy):
    """Pass 2, task (b, block of STEPS steps, block of ``S.lanes`` rotary pairs: all on a CPU, one on CUDA):
    q, k = R(theta) (Q + Q_bias[h]), R(theta) (K + K_bias[h]) for every head, each Q / K head's pairs read once
    per task into w.x / w.y (``load_pairs_macro``) and rotated for each of its heads (GQA), the head's biases once
    per task."""
    HQ, HPQ, NP = d.nheads_qk, d.heads_per_qk, d.headdim_qk // 2
    V = S.lanes(NP)
    turn, load = _turn_macro(d, S), load_pairs_macro(d, S, V)

    @T.macro
    def rotate(i, Qm, Km, Qb, Kb, q, k, seqlen):
        w = T.meta_var(S.scratch(x=(2, STEPS, V), y=(2, STEPS, V), qb=(2, V), kb=(2, V), cs=(V,), sn=(V,)))
        b, tb, pb = T.meta_var(unravel(i, pair_tasks(d, S, seqlen)))
        for hq in range(HQ):
            load(w, Qm, Km, b, tb, hq, pb * V, seqlen)
            for hh in range(HPQ):
                for v in S.lane_loop(V):
                    for e in T.unroll(2):
                        w.qb[e, v] = Qb[hq * HPQ + hh, 2 * (pb * V + v) + e]
                        w.kb[e, v] = Kb[hq * HPQ + hh, 2 * (pb * V + v) + e]
                for s in T.unroll(STEPS):
                    if tb * STEPS + s < seqlen:
                        for v in S.lane_loop(V):
                            turn(w, q, b, tb * STEPS + s, hq * HPQ + hh, pb * V + v, v)
                            _rotate(q, w.x, w.qb, w, b, tb * STEPS + s, hq * HPQ + hh, s, pb * V + v, v)
                            _rotate(k, w.y, w.kb, w, b, tb * STEPS + s, hq * HPQ + hh, s, pb * V + v, v)

    return rotate


def seq_continues(seq, b, t):
    """Position t > 0 is in the same packed sequence as t - 1 (seq: the (batch, seqlen) sequence ids)."""
    return tirx.all(t > 0, seq[b, tirx.max(t - 1, 0)] == seq[b, t])


def seq_ends(seq, b, t, seqlen):
    """Position t is its packed sequence's last one (the last position, or the next one's id differs)."""
    return tirx.any(t + 1 >= seqlen, seq[b, tirx.min(t + 1, seqlen - 1)] != seq[b, t])


def carried(theta, seq, b, t, has_seq_idx: bool, m):
    """The angle a step starts from: theta_{t-1}, or with packed sequences 0 at a sequence's first position."""
    return tirx.Select(seq_continues(seq, b, t), theta, m.zero) if has_seq_idx else theta


def angle_rate(tanh_angle, dt, m):
    """pi tanh(Angles) DT: one step's angle increment (``tanh_angle``: the rate's tanh, already taken; the
    backward needs it again)."""
    return tanh_angle * m.const(math.pi) * dt


def angle_step(theta, inc, m):
    """(theta + inc) mod 2 pi, in [0, 2 pi): one step of the angle cumsum (inc: ``angle_rate``)."""
    TWO_PI = m.const(2.0 * math.pi)
    x = theta + inc
    return x - TWO_PI * T.floor(x / TWO_PI)


def rotated(x0, x1, cs, sn):
    """R(theta) (x0, x1) with cos / sin of theta (pass -sin for R(theta)^T)."""
    return x0 * cs - x1 * sn, x0 * sn + x1 * cs


def _rotate(out, xs, xb, w, b, t, h, s, p, v):
    """out[b, t, h, pair p] = R(theta) (the pair xs[:, s, v] + its bias xb[:, v]), cos / sin in w.cs / w.sn[v]."""
    r0, r1 = rotated(xs[0, s, v] + xb[0, v], xs[1, s, v] + xb[1, v], w.cs[v], w.sn[v])
    T.buffer_store(out, r0, [b, t, h, 2 * p])
    T.buffer_store(out, r1, [b, t, h, 2 * p + 1])


def _chunk_macro(d: PreDims, S: ChunkStrategy):
    """Pass 3, task (b, h, c): dA_cs and scale of the chunk's positions."""
    H, Q, m = d.nheads, d.chunk_size, S.math

    @T.macro
    def chunk(i, ADT, DT, Trap, dA_cs, scale, seq, seqlen, nchunks):
        r = T.alloc_buffer((3,), F32, scope=S.scope)  # cumsum, gamma, next step's left weight
        b, h, c = T.meta_var(unravel(i, (None, H, nchunks)))
        r[0] = m.zero
        for l in range(Q):
            if c * Q + l < seqlen:
                r[0] = r[0] + clamped_adt(m, ADT[b, h, c * Q + l])
                r[1] = gamma_at(m, DT, Trap, b, h, c * Q + l)
                r[2] = m.zero
                if c * Q + l + 1 < seqlen:
                    r[2] = DT[b, h, c * Q + l + 1] * (m.one - trap_weight(m, Trap[b, h, c * Q + l + 1]))
                    if d.has_seq_idx:
                        if seq[b, c * Q + l + 1] != seq[b, c * Q + l]:
                            r[2] = m.zero
                scale[b, h, c, l] = r[1] + r[2]
            else:
                scale[b, h, c, l] = m.zero
            dA_cs[b, h, c, l] = r[0]

    return chunk


def skip_block(d: PreDims, S: ChunkStrategy) -> tuple[int, int]:
    """The skip pass's (positions, heads) per task: one of each where the strategy has vector lanes (the dot's
    lanes run along headdim_qk), else a DOT_STEPS x DOT_HEADS register block, its heads sharing a Q / K head,
    so each Q / K element is read once per block of heads and each bias once per block of positions."""
    if S.vector:
        return 1, 1
    return DOT_STEPS, max(h for h in range(1, DOT_HEADS + 1) if d.heads_per_qk % h == 0)


def dot_tasks(d: PreDims, S: ChunkStrategy, positions) -> tuple:
    """The dots' task radix (batch, block of TS positions, block of HB heads; ``skip_block``)."""
    TS, HB = skip_block(d, S)
    return (None, (positions + TS - 1) // TS, d.nheads // HB)


def qk_dots_macro(d: PreDims, S: ChunkStrategy):
    """A macro ``dots(i, Qm, Km, Qb, Kb, put, positions)``, task i = (b, block of TS positions, block of HB heads
    of one Q / K head; ``skip_block``): put(b, h, t, X_t . Y_t) for each position t < ``positions`` and head h
    of the block (X = Q[hq] + Q_bias[h], Y = K[hq] + K_bias[h]: the unrotated diagonal dot), summed over n
    ascending (on a CPU in ``VW`` vector partials, then their sum). The forward's skip pass (``put``: the
    skip) and the backward's dots (preprocess_bwd.py); positions past seqlen read the last row (``put`` masks
    them)."""
    H, HPQ, N, m = d.nheads, d.heads_per_qk, d.headdim_qk, S.math
    TS, HB = skip_block(d, S)
    VW = dot_width(N, S)

    @T.macro
    def dots(i, Qm, Km, Qb, Kb, put, positions):
        w = T.meta_var(S.scratch(part=(TS, HB, VW), x=(TS, VW), y=(TS, VW), qb=(HB, VW), kb=(HB, VW), r=(1,)))
        b, sb, hb = T.meta_var(unravel(i, dot_tasks(d, S, positions)))
        hq = T.meta_var(hb * HB // HPQ)
        last = T.meta_var(Qm.shape[1] - 1)
        for s in T.unroll(TS):
            for j in T.unroll(HB):
                for vi in S.lane_loop(VW):
                    w.part[s, j, vi] = m.zero
        for no in range(N // VW):
            for s in T.unroll(TS):
                for vi in S.lane_loop(VW):
                    w.x[s, vi] = m.cast(Qm[b, T.min(sb * TS + s, last), hq, no * VW + vi])
                    w.y[s, vi] = m.cast(Km[b, T.min(sb * TS + s, last), hq, no * VW + vi])
            for j in T.unroll(HB):
                for vi in S.lane_loop(VW):
                    w.qb[j, vi] = Qb[hb * HB + j, no * VW + vi]
                    w.kb[j, vi] = Kb[hb * HB + j, no * VW + vi]
            for s in T.unroll(TS):
                for j in T.unroll(HB):
                    for vi in S.lane_loop(VW):
                        w.part[s, j, vi] = w.part[s, j, vi] + (w.x[s, vi] + w.qb[j, vi]) * (w.y[s, vi] + w.kb[j, vi])
        for s in T.unroll(TS):
            if sb * TS + s < positions:
                for j in T.unroll(HB):
                    w.r[0] = m.zero
                    for vi in range(VW):
                        w.r[0] = w.r[0] + w.part[s, j, vi]
                    put(b, hb * HB + j, sb * TS + s, w.r[0])

    return dots


def _put_skip(d: PreDims, m, out, Dv, DT, Trap, b, h, t, dot, seqlen):
    """skip[b, h, t // Q, t % Q] = D[h] + gamma_t dot (gamma = DT sigmoid(Trap)), 0 past seqlen."""
    Q = d.chunk_size
    gamma = gamma_at(m, DT, Trap, b, h, tirx.min(t, seqlen - 1))
    val = (Dv[h] if d.has_D else m.zero) + gamma * dot
    T.buffer_store(out, tirx.Select(t < seqlen, val, m.zero), [b, h, t // Q, t % Q])


def dot_macro(N: int, S: ChunkStrategy):
    """A macro ``dot(r, slot, term)``: r[slot] = sum_n term(n) over n < N. A thread's serial sum where the
    strategy has no vector lanes (CUDA); on a CPU ``VW`` vector partial sums (lane vi sums n = vi mod VW, an
    explicit per-lane accumulator), then their sum: the serial scalar chain cost 40 of the kernel's 110 ms at
    upstream's shape, seqlen 2048 (2 threads)."""
    VW = dot_width(N, S)

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


def _init_macro(d: PreDims, S: ChunkStrategy):
    """Pass 3, task (b, h, p): the initial ssm state row with the K / V states' trapezoid term."""
    H, P, N = d.nheads, d.headdim_v, d.headdim_qk
    V = S.lanes(N)
    m = S.math

    @T.macro
    def row(i, DT, Trap, ssm, kst, vst, init):
        w = T.alloc_buffer((1,), F32, scope=S.scope)
        b, h, p, nb = T.meta_var(unravel(i, (None, H, P, N // V)))
        w[0] = DT[b, h, 0] * (m.one - trap_weight(m, Trap[b, h, 0])) * m.cast(vst[b, h, p])
        for v in S.lane_loop(V):
            init[b, h, p, nb * V + v] = ssm[b, h, p, nb * V + v] + w[0] * m.cast(kst[b, h, nb * V + v])

    return row


def preprocess_template(d: PreDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The preprocess's five passes laid out by ``S`` (module docstring). Parameters in order: Q, K, ADT, DT,
    Trap, Q_bias, K_bias, Angles, D, angle_state, ssm_state, k_state, v_state (absent ones: placeholders of
    ones), then the outputs q, k, dA_cs, scale, skip, angle_out, init, and last seq_idx (batch, seqlen) int32
    (a (1, 1) placeholder without has_seq_idx). With has_seq_idx angle_out is (nseq, H, A): row sid written
    at sequence sid's last position from batch row 0 only (packed sequences have batch 1); rows of sequences
    without positions are left as they are (the caller zero-fills)."""
    H, HQ, N, P, A, Q = d.nheads, d.nheads_qk, d.headdim_qk, d.headdim_v, d.headdim_angles, d.chunk_size
    KT = d.kstate_dtype or F32
    angles, rotate, chunk, dots, row = (angles_macro(d, S), _rotate_macro(d, S), _chunk_macro(d, S),
                                        qk_dots_macro(d, S), _init_macro(d, S))
    tasks = S.tasks()
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
        tasks(batch * H * (A // S.lanes(A)), lambda i: angles(i, DT, Ang, ast, q, aout, seq, seqlen))
        tasks(count(batch, pair_tasks(d, S, seqlen)), lambda i: rotate(i, Qm, Km, Qb, Kb, q, k, seqlen))
        tasks(batch * H * nchunks, lambda i: chunk(i, ADT, DT, Trap, dA_cs, scale, seq, seqlen, nchunks))
        tasks(count(batch, dot_tasks(d, S, nchunks * Q)),
              lambda i: dots(i, Qm, Km, Qb, Kb, lambda b, h, t, dot: _put_skip(d, S.math, skip, Dv, DT, Trap, b,
                                                                                 h, t, dot, seqlen), nchunks * Q))
        if d.has_init:
            tasks(batch * H * P * (N // S.lanes(N)), lambda i: row(i, DT, Trap, ssm, kst, vst, init))

    return func
