"""The backward of the Mamba-3 SISO chunked forward's preprocess (preprocess.py): from the gradients of its
outputs (q, k, dA_cs, scale, skip, the final angle, init) to those of its inputs, as one template laid out by
the SSD strategies (compute/ssd/strategy.py; schedules/<target>/ssd.py). Per (batch b, head h; hq = h // (H /
H_qk)), X_t = Q_t[hq] + Q_bias[h], Y_t = K_t[hq] + K_bias[h], lam = sigmoid(Trap), gamma = DT lam, nu = DT (1 -
lam); dscale / ddA_step / dskip of position t at chunk t // Q, slot t % Q. Six passes, each reading what the
previous ones wrote (six parallel loops on a CPU, six launches on CUDA); only the angle recurrences (passes 3
and 5, a task per angle) are serial over time:

1. init (with input states), a task per (b, h): the trapezoid term nu_0 v_state k_state^T of init,
       c0 = sum_{p,n} dinit[p, n] v_state[p] k_state[n]         (d init / d nu_0, workspace c0[b, h])
       dk_state[n] = nu_0 sum_p dinit[p, n] v_state[p];  dv_state[p] = nu_0 sum_n dinit[p, n] k_state[n]
2. dots, the forward's skip-dot blocks (preprocess.py ``qk_dots_macro``): X_t . Y_t into dDT[b, h, t] and
   dskip_t gamma_t into dTrap[b, h, t] (both overwritten by pass 6);
3. angles, the forward's pass 1 (``angles_macro``, the forward's own expression step for step): cos / sin of
   theta_t into dQh's slots of each rotary pair (overwritten by pass 4);
4. pairs, a task per (b, block of STEPS steps, block of rotary pairs: all on a CPU, one per CUDA thread), each
   Q / K pair read once for every head of its Q / K group:
       dX_t = R(theta_t)^T dq_t + dskip_t gamma_t Y_t;  dY_t = R(theta_t)^T dk_t + dskip_t gamma_t X_t
       g_t = dq1 q0 - dq0 q1 + dk1 k0 - dk0 k1        (d/dtheta of the rotated pair; q, k = R(theta_t) X, Y again)
   -> dQh, dKh (per head: the caller sums each Q/K group's heads), g into the workspace gdt (batch, seqlen,
   nheads, headdim_angles), and the block's time sums of dX / dY into dQb_part / dKb_part[b, block] (the bias
   gradients in parts per (batch, block of STEPS steps): the caller sums them). Pairs past headdim_angles have
   theta = 0: dX = dq + dskip gamma Y, and no g (on a CPU a second vector loop over them);
5. reverse, a task per (b, h, block of angles), time reversed:
       G_t = daout + sum_{t' >= t} g_t'                (wrap(x) = x mod 2 pi has derivative 1)
       dAngles_t = G_t pi (1 - tanh^2 Angles_t) DT_t;  gdt_t = G_t pi tanh(Angles_t)   (overwrites g_t)
   and dangle_state = G_0;
6. chunk, a task per (b, h, chunk c), serial over its positions s = c Q + l < seqlen:
       dgamma = dscale_s + dskip_s X_s . Y_s;  dnu = dscale_{s-1} (s >= 1), c0 (s = 0, input states), else 0
       dDT = dgamma lam + dnu (1 - lam) + sum_i gdt_s,i;  dTrap = DT (dgamma - dnu) lam (1 - lam)
       dADT = ddA_step_s + ddecay_c where ADT_s >= DA_MIN or NaN, else 0 (the forward's clamp passes none)

Packed sequences (``has_seq_idx``, no input states): theta restarts as the forward's, G restarts at each
sequence's last position t from daout[seq_idx[t]] (daout (nseq, H, A)), and dnu is 0 at a sequence's first
position.

Why theta is recomputed forward rather than run backwards (theta_{t-1} = theta_t - pi tanh(Angles_t) DT_t): the
reverse recurrence drifts from the forward's angles by a rounding per step and its wrap can land on the other
side of 2 pi; pass 3 is the forward's own sequence. Why six passes: a thread per (b, h, pair) running both
sweeps over time (three passes) ran 48 blocks of 128 threads at Mamba-3 130M's batch-4 shape and re-read the
GQA-shared Q / K per head and DT / Trap / dskip per pair.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from ..ssd.common import F32, I32, Z4
from ..ssd.strategy import ChunkStrategy, unravel
from .dims import PreDims
from .preprocess import (AHEAD, STEPS, adt_passes, angles_macro, count, dot_macro, dot_tasks, gamma_at,
                         load_pairs_macro, pair_tasks, qk_dots_macro, rate_tanh, rotated, seq_ends, step_blocks,
                         trap_weight)


def _init_macro(d: PreDims, S: ChunkStrategy):
    """Pass 1, task (b, h): c0, dk_state, dv_state (module docstring). The dk_state column sums accumulate in
    the output row itself (headdim_qk vectorized on a CPU; a thread's serial loop on CUDA, no register array)."""
    H, P, N, m = d.nheads, d.headdim_v, d.headdim_qk, S.math
    dot = dot_macro(N, S)

    @T.macro
    def init(i, io):
        w = T.meta_var(S.scratch(r=(3,)))  # nu_0, c0, the row's dinit . k_state
        b, h = T.meta_var(unravel(i, (None, H)))
        w.r[0] = io.DT[b, h, 0] * (m.one - trap_weight(m, io.Trap[b, h, 0]))
        w.r[1] = m.zero
        for n in S.vloop(N):
            io.dkst[b, h, n] = m.zero
        for p in range(P):
            dot(w.r, 2, lambda n: io.dinit[b, h, p, n] * m.cast(io.kst[b, h, n]))
            io.dvst[b, h, p] = w.r[0] * w.r[2]
            w.r[1] = w.r[1] + m.cast(io.vst[b, h, p]) * w.r[2]
            for n in S.vloop(N):
                io.dkst[b, h, n] = io.dkst[b, h, n] + io.dinit[b, h, p, n] * m.cast(io.vst[b, h, p])
        for n in S.vloop(N):
            io.dkst[b, h, n] = w.r[0] * io.dkst[b, h, n]
        io.c0[b, h] = w.r[1]

    return init


def _pair_grads(io, w, b, t, h, s, p, v, turn: bool):
    """Pair p of head h at step t (the task's step s): dX, dY (R(theta)^T of dq, dk where ``turn``, cos / sin in
    w.cs / w.sn[v]; plus the skip's dskip gamma Y, X, that product in w.sg[0]) stored in dQh / dKh and added to
    the bias sums w.acc[0..3, v]; where ``turn``, g (d/dtheta of the rotated pair) into gdt. X / Y: the task's
    pair w.x / w.y[:, s, v] plus the head's biases w.bias[:, v]; dq / dk read once into w.dg (each is used
    twice: g and R^T)."""
    x0, x1 = w.x[0, s, v] + w.bias[0, v], w.x[1, s, v] + w.bias[1, v]
    y0, y1 = w.y[0, s, v] + w.bias[2, v], w.y[1, s, v] + w.bias[3, v]
    for e in range(2):
        T.buffer_store(w.dg, io.dq[b, t, h, 2 * p + e], [e, v])
        T.buffer_store(w.dg, io.dk[b, t, h, 2 * p + e], [2 + e, v])
    grads = dq0, dq1, dk0, dk1 = w.dg[0, v], w.dg[1, v], w.dg[2, v], w.dg[3, v]
    if turn:
        q0, q1 = rotated(x0, x1, w.cs[v], w.sn[v])
        k0, k1 = rotated(y0, y1, w.cs[v], w.sn[v])
        T.buffer_store(io.gdt, (dq1 * q0 - dq0 * q1) + (dk1 * k0 - dk0 * k1), [b, t, h, p])
        grads = (*rotated(dq0, dq1, w.cs[v], -w.sn[v]), *rotated(dk0, dk1, w.cs[v], -w.sn[v]))
    sg = w.sg[0]
    for j, (out, lane, g, other) in enumerate(((io.dQh, 0, grads[0], y0), (io.dQh, 1, grads[1], y1),
                                               (io.dKh, 0, grads[2], x0), (io.dKh, 1, grads[3], x1))):
        T.buffer_store(w.e, g + sg * other, [j, v])
        T.buffer_store(out, w.e[j, v], [b, t, h, 2 * p + lane])
        T.buffer_store(w.acc, w.acc[j, v] + w.e[j, v], [j, v])


def _sweep_macro(d: PreDims, S: ChunkStrategy, V: int, turn: bool):
    """Pass 4 over ``V`` pairs p0 .. p0 + V - 1 of the task's (b, STEPS steps): rotary pairs (``turn``: all below
    headdim_angles; cos / sin from dQh's slots, where pass 3 put them) or pass-through ones (theta = 0). For each
    Q / K head its pairs are read once (``load_pairs_macro``), then for each of its heads: the pair gradients
    (``_pair_grads``) and the block's bias sums into dQb / dKb[b, block]."""
    HQ, HPQ, m = d.nheads_qk, d.heads_per_qk, S.math
    load = load_pairs_macro(d, S, V)

    @T.macro
    def sweep(b, tb, p0, io):
        w = T.meta_var(S.scratch(x=(2, STEPS, V), y=(2, STEPS, V), bias=(4, V), cs=(V,), sn=(V,), dg=(4, V),
                                 e=(4, V), acc=(4, V), sg=(1,)))
        for hq in range(HQ):
            load(w, io.Qm, io.Km, b, tb, hq, p0, io.seqlen)
            for hh in range(HPQ):
                for v in S.lane_loop(V):  # the pairs' Q / K biases, read once per task and head
                    for e in range(2):
                        w.bias[e, v] = io.Qb[hq * HPQ + hh, 2 * (p0 + v) + e]
                        w.bias[2 + e, v] = io.Kb[hq * HPQ + hh, 2 * (p0 + v) + e]
                for j in range(4):
                    for v in S.lane_loop(V):
                        w.acc[j, v] = m.zero
                for s in T.unroll(STEPS):
                    if tb * STEPS + s < io.seqlen:
                        w.sg[0] = io.dTrap[b, hq * HPQ + hh, tb * STEPS + s]  # dskip gamma, from the dots pass
                        for v in S.lane_loop(V):
                            if turn:
                                w.cs[v] = io.dQh[b, tb * STEPS + s, hq * HPQ + hh, 2 * (p0 + v)]
                                w.sn[v] = io.dQh[b, tb * STEPS + s, hq * HPQ + hh, 2 * (p0 + v) + 1]
                            _pair_grads(io, w, b, tb * STEPS + s, hq * HPQ + hh, s, p0 + v, v, turn)
                for v in S.lane_loop(V):
                    for j in range(2):
                        io.dQb[b, tb, hq * HPQ + hh, 2 * (p0 + v) + j] = w.acc[j, v]
                        io.dKb[b, tb, hq * HPQ + hh, 2 * (p0 + v) + j] = w.acc[2 + j, v]

    return sweep


def _pairs_macro(d: PreDims, S: ChunkStrategy):
    """Pass 4, task (b, block of STEPS steps, block of ``S.lanes`` pairs): on a CPU (the whole pair axis) a vector
    sweep over the headdim_angles rotary pairs, then one over the rest; on CUDA (a pair per thread) the pair's
    own sweep."""
    NP, A = d.headdim_qk // 2, d.headdim_angles
    V = S.lanes(NP)
    if S.vector:
        turn, rest = _sweep_macro(d, S, A, True), _sweep_macro(d, S, NP - A, False) if NP > A else None
    else:
        turn, rest = _sweep_macro(d, S, 1, True), _sweep_macro(d, S, 1, False)

    @T.macro
    def task(i, io):
        b, tb, pb = T.meta_var(unravel(i, pair_tasks(d, S, io.seqlen)))
        if S.vector:
            turn(b, tb, 0, io)
            if rest is not None:
                rest(b, tb, A, io)
        else:
            if pb < A:
                turn(b, tb, pb, io)
            else:
                rest(b, tb, pb, io)

    return task


def _reverse_macro(d: PreDims, S: ChunkStrategy):
    """Pass 5, task (b, h, block of ``S.lanes`` angles), time reversed: G_t = daout + sum_{t' >= t} g_t' (g from
    gdt; packed: restarting at each sequence's last step from its daout row), dAngles = G pi (1 - tanh^2) DT, gdt
    = G pi tanh(Angles) (overwriting g), and with input states dangle_state = G_0. Blocks of AHEAD steps, each
    block's loads first (as the forward's angles pass: a thread per angle walks the whole sequence)."""
    H, A, m = d.nheads, d.headdim_angles, S.math
    V, PI = S.lanes(A), m.const(math.pi)

    @T.macro
    def reverse(i, io):
        w = T.meta_var(S.scratch(G=(V,), g=(AHEAD, V), ta=(AHEAD, V), dt=(AHEAD,)))
        b, h, ab = T.meta_var(unravel(i, (None, H, A // V)))
        for v in S.lane_loop(V):
            w.G[v] = m.zero
        if not d.has_seq_idx:
            for v in S.lane_loop(V):
                w.G[v] = io.daout[b, h, ab * V + v]
        for tb in range((io.seqlen + AHEAD - 1) // AHEAD):  # blocks of AHEAD steps from the end, loads first
            for s in T.unroll(AHEAD):
                if tb * AHEAD + s < io.seqlen:
                    w.dt[s] = io.DT[b, h, io.seqlen - 1 - tb * AHEAD - s]
                    for v in S.lane_loop(V):
                        w.g[s, v] = io.gdt[b, io.seqlen - 1 - tb * AHEAD - s, h, ab * V + v]
                        w.ta[s, v] = rate_tanh(m, io.Ang[b, io.seqlen - 1 - tb * AHEAD - s, h, ab * V + v])
            for s in T.unroll(AHEAD):
                if tb * AHEAD + s < io.seqlen:
                    t = T.meta_var(io.seqlen - 1 - tb * AHEAD - s)
                    for v in S.lane_loop(V):
                        if d.has_seq_idx:  # a sequence's last step: G restarts from that sequence's daout row
                            w.G[v] = T.Select(seq_ends(io.seq, b, t, io.seqlen), io.daout[io.seq[b, t], h, ab * V + v],
                                              w.G[v])
                        w.G[v] = w.G[v] + w.g[s, v]
                        io.dAng[b, t, h, ab * V + v] = w.G[v] * PI * (m.one - w.ta[s, v] * w.ta[s, v]) * w.dt[s]
                        io.gdt[b, t, h, ab * V + v] = w.G[v] * PI * w.ta[s, v]
        if d.has_init:
            for v in S.lane_loop(V):
                io.dast[b, h, ab * V + v] = w.G[v]

    return reverse


def _chunk_macro(d: PreDims, S: ChunkStrategy):
    """Pass 6, task (b, h, c): dDT, dTrap, dADT of the chunk's positions (module docstring)."""
    H, A, Q, m = d.nheads, d.headdim_angles, d.chunk_size, S.math
    dot_g = dot_macro(A, S)

    @T.macro
    def chunk(i, io):
        w = T.meta_var(S.scratch(r=(5,)))  # lam, X . Y, sum_i gdt, dgamma, dnu
        b, h, c = T.meta_var(unravel(i, (None, H, io.nchunks)))
        for l in range(Q):
            if c * Q + l < io.seqlen:
                w.r[0] = trap_weight(m, io.Trap[b, h, c * Q + l])
                w.r[1] = io.dDT[b, h, c * Q + l]  # X . Y, stored there by the dots pass
                dot_g(w.r, 2, lambda n: io.gdt[b, c * Q + l, h, n])
                w.r[3] = io.dscale[b, h, c, l] + io.dskip[b, h, c, l] * w.r[1]
                w.r[4] = m.zero
                if c * Q + l >= 1:
                    w.r[4] = io.dscale[b, h, (c * Q + l - 1) // Q, (c * Q + l - 1) % Q]
                    if d.has_seq_idx:
                        if io.seq[b, c * Q + l - 1] != io.seq[b, c * Q + l]:
                            w.r[4] = m.zero
                if d.has_init:
                    if c * Q + l == 0:
                        w.r[4] = io.c0[b, h]
                io.dDT[b, h, c * Q + l] = w.r[3] * w.r[0] + w.r[4] * (m.one - w.r[0]) + w.r[2]
                io.dTrap[b, h, c * Q + l] = io.DT[b, h, c * Q + l] * (w.r[3] - w.r[4]) * w.r[0] * (m.one - w.r[0])
                io.dADT[b, h, c * Q + l] = T.Select(adt_passes(m, io.ADT[b, h, c * Q + l]),
                                                    io.ddA[b, h, c, l] + io.ddecay[b, h, c], m.zero)

    return chunk


def _put_dot(d: PreDims, m, io, b, h, t, dot):
    """The dots pass's X_t . Y_t into dDT[b, h, t] and dskip_t gamma_t into dTrap[b, h, t]: the pairs pass reads
    the latter, the chunk pass both, and overwrites them with dDT / dTrap (the same elements, the same task)."""
    Q = d.chunk_size
    T.buffer_store(io.dDT, dot, [b, h, t])
    T.buffer_store(io.dTrap, io.dskip[b, h, t // Q, t % Q] * gamma_at(m, io.DT, io.Trap, b, h, t), [b, h, t])


def _bind(**specs) -> SimpleNamespace:
    """The kernel's buffers as one namespace (the macros take it whole): each keyword (handle, shape[, dtype
    (default float32)]) matched with T.match_buffer and named after the keyword; other values as they are."""
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, tuple):
            buf = T.match_buffer(spec[0], spec[1], spec[2] if len(spec) > 2 else F32)
            IRBuilder.name(name, buf)
            spec = buf
        out[name] = spec
    return SimpleNamespace(**out)


def preprocess_bwd_template(d: PreDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The preprocess backward's six passes laid out by ``S`` (module docstring). Parameters in order: inputs
    Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, angle_state, k_state, v_state; gradients dq, dk, dscale,
    ddA_step, dskip, ddecay, daout, dinit; outputs dQh, dKh, dADT, dDT, dTrap, dQb_part, dKb_part, dAngles,
    dangle_state, dk_state, dv_state; workspaces gdt, c0 (absent states / their gradients: placeholders); last
    seq_idx (batch, seqlen) int32 (a (1, 1) placeholder without has_seq_idx; with it daout is (nseq, H, A),
    one row per packed sequence, read at each sequence's last position)."""
    H, HQ, N, P, A, Q = d.nheads, d.nheads_qk, d.headdim_qk, d.headdim_v, d.headdim_angles, d.chunk_size
    KT = d.kstate_dtype or F32
    init, pairs, chunk, tasks = _init_macro(d, S), _pairs_macro(d, S), _chunk_macro(d, S), S.tasks()
    dots, angles, reverse = qk_dots_macro(d, S), angles_macro(d, S, final=False), _reverse_macro(d, S)
    V = S.lanes(A)
    st = lambda *shape: shape if d.has_init else (1,) * len(shape)  # noqa: E731

    @T.prim_func
    def func(Q_h: T.handle, K_h: T.handle, ADT_h: T.handle, DT_h: T.handle, Trap_h: T.handle, Qb_h: T.handle,
             Kb_h: T.handle, Ang_h: T.handle, ast_h: T.handle, kst_h: T.handle, vst_h: T.handle, dq_h: T.handle,
             dk_h: T.handle, dsc_h: T.handle, dda_h: T.handle, dsk_h: T.handle, ddec_h: T.handle,
             daout_h: T.handle, dinit_h: T.handle, dQh_h: T.handle, dKh_h: T.handle, dADT_h: T.handle,
             dDT_h: T.handle, dTrap_h: T.handle, dQb_h: T.handle, dKb_h: T.handle, dAng_h: T.handle,
             dast_h: T.handle, dkst_h: T.handle, dvst_h: T.handle, gdt_h: T.handle, c0_h: T.handle,
             seq_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        nseq = T.int32()
        io = T.meta_var(_bind(
            seqlen=seqlen, nchunks=nchunks,
            Qm=(Q_h, (batch, seqlen, HQ, N), d.qk_dtype), Km=(K_h, (batch, seqlen, HQ, N), d.qk_dtype),
            ADT=(ADT_h, (batch, H, seqlen)), DT=(DT_h, (batch, H, seqlen)), Trap=(Trap_h, (batch, H, seqlen)),
            Qb=(Qb_h, (H, N)), Kb=(Kb_h, (H, N)), Ang=(Ang_h, (batch, seqlen, H, A)),
            ast=(ast_h, st(batch, H, A)), kst=(kst_h, st(batch, H, N), KT),
            vst=(vst_h, st(batch, H, P), d.vstate_dtype),
            dq=(dq_h, (batch, seqlen, H, N)), dk=(dk_h, (batch, seqlen, H, N)), dscale=(dsc_h, (batch, H, nchunks, Q)),
            ddA=(dda_h, (batch, H, nchunks, Q)), dskip=(dsk_h, (batch, H, nchunks, Q)),
            ddecay=(ddec_h, (batch, H, nchunks)), daout=(daout_h, (nseq if d.has_seq_idx else batch, H, A)),
            dinit=(dinit_h, (batch, H, P, N) if d.has_init else Z4),
            dQh=(dQh_h, (batch, seqlen, H, N)), dKh=(dKh_h, (batch, seqlen, H, N)), dADT=(dADT_h, (batch, H, seqlen)),
            dDT=(dDT_h, (batch, H, seqlen)), dTrap=(dTrap_h, (batch, H, seqlen)),
            dQb=(dQb_h, (batch, step_blocks(seqlen), H, N)),
            dKb=(dKb_h, (batch, step_blocks(seqlen), H, N)), dAng=(dAng_h, (batch, seqlen, H, A)),
            dast=(dast_h, st(batch, H, A)),
            dkst=(dkst_h, st(batch, H, N)), dvst=(dvst_h, st(batch, H, P)), gdt=(gdt_h, (batch, seqlen, H, A)),
            c0=(c0_h, (batch, H)), seq=(seq_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)))
        if d.has_init:
            tasks(batch * H, lambda i: init(i, io))
        tasks(count(batch, dot_tasks(d, S, seqlen)),
              lambda i: dots(i, io.Qm, io.Km, io.Qb, io.Kb, lambda b, h, t, dot: _put_dot(d, S.math, io, b, h, t, dot),
                             seqlen))
        tasks(batch * H * (A // V), lambda i: angles(i, io.DT, io.Ang, io.ast, io.dQh, io.dast, io.seq, seqlen))
        tasks(count(batch, pair_tasks(d, S, seqlen)), lambda i: pairs(i, io))
        tasks(batch * H * (A // V), lambda i: reverse(i, io))
        tasks(batch * H * nchunks, lambda i: chunk(i, io))

    return func
