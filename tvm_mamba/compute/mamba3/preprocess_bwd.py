"""The backward of the Mamba-3 SISO chunked forward's preprocess (preprocess.py): from the gradients of its
outputs (q, k, dA_cs, scale, skip, the final angle, init) to those of its inputs, as one template laid out by
the SSD strategies (compute/ssd/strategy.py; schedules/<target>/ssd.py). Per (batch b, head h; hq = h // (H /
H_qk)), X_t = Q_t[hq] + Q_bias[h], Y_t = K_t[hq] + K_bias[h], lam = sigmoid(Trap), gamma = DT lam, nu = DT (1 -
lam); dscale / ddA_step / dskip of position t at chunk t // Q, slot t % Q. Three passes, each reading what the
previous ones wrote (three parallel loops on a CPU, three launches on CUDA):

1. init (with input states), a task per (b, h): the trapezoid term nu_0 v_state k_state^T of init,
       c0 = sum_{p,n} dinit[p, n] v_state[p] k_state[n]         (d init / d nu_0, workspace c0[b, h])
       dk_state[n] = nu_0 sum_p dinit[p, n] v_state[p];  dv_state[p] = nu_0 sum_n dinit[p, n] k_state[n]
2. rotate, a task per (b, h, block of rotary pairs: all of them on a CPU, one per CUDA thread): first the
   forward's theta_t again (the forward's own expression, step for step), stored in the workspace gdt (the shape of
   theta: (batch, seqlen, nheads, headdim_angles)); then time reversed, pair i:
       g_t = dq1 q0 - dq0 q1 + dk1 k0 - dk0 k1        (d/dtheta of the rotated pair; q, k = R(theta_t) X, Y again)
       G_t = daout + sum_{t' >= t} g_t'                (wrap(x) = x mod 2 pi has derivative 1)
       dAngles_t = G_t pi (1 - tanh^2 Angles_t) DT_t;  gdt_t = G_t pi tanh(Angles_t)   (overwrites theta_t)
       dX_t = R(theta_t)^T dq_t + dskip_t gamma_t Y_t;  dY_t = R(theta_t)^T dk_t + dskip_t gamma_t X_t
   -> dQh, dKh (per head: the caller sums each Q/K group's heads), their time sums dQb_part, dKb_part (the
   bias gradients before the batch sum) and dangle_state = G_0. Pairs past headdim_angles have theta = 0:
   dX = dq + dskip gamma Y, and no angle work (on a CPU a second vector loop over them).
3. chunk, a task per (b, h, chunk c), serial over its positions s = c Q + l < seqlen:
       dgamma = dscale_s + dskip_s X_s . Y_s;  dnu = dscale_{s-1} (s >= 1), c0 (s = 0, input states), else 0
       dDT = dgamma lam + dnu (1 - lam) + sum_i gdt_s,i;  dTrap = DT (dgamma - dnu) lam (1 - lam)
       dADT = ddA_step_s + ddecay_c where ADT_s >= DA_MIN, else 0 (the forward's clamp passes no gradient)

Packed sequences (``has_seq_idx``, no input states): theta restarts as the forward's, G restarts at each
sequence's last position t from daout[seq_idx[t]] (daout (nseq, H, A)), and dnu is 0 at a sequence's first
position.

Why theta is stored rather than run backwards (theta_{t-1} = theta_t - pi tanh(Angles_t) DT_t): the reverse
recurrence drifts from the forward's angles by a rounding per step and its wrap can land on the other side of
2 pi; the stored angles are the forward's own sequence, at no memory cost (gdt is needed anyway, same shape). The
extra forward sweep reads Angles / DT once more (a tanh per pair and step).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from ..ssd.common import DA_MIN, F32, I32, Z4
from ..ssd.strategy import Strategy, unravel
from ._dims import PreDims
from .preprocess import angle_step, biased, carried, dot_macro, qk_dots_macro, rotated, seq_ends, skip_block


def _init_macro(d: PreDims, S: Strategy):
    """Pass 1, task (b, h): c0, dk_state, dv_state (module docstring). The dk_state column sums accumulate in
    the output row itself (headdim_qk vectorized on a CPU; a thread's serial loop on CUDA, no register array)."""
    H, P, N, m = d.nheads, d.headdim_v, d.headdim_qk, S.math
    dot = dot_macro(N, S)

    @T.macro
    def init(i, io):
        w = T.meta_var(S.scratch(r=(3,)))  # nu_0, c0, the row's dinit . k_state
        b, h = T.meta_var(unravel(i, (None, H)))
        w.r[0] = io.DT[b, h, 0] * (m.one - m.sigmoid(io.Trap[b, h, 0]))
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


def _pair_grads(io, w, b, t, h, hq, p, v, m, turn: bool):
    """Pair p at step t: dX, dY (R(theta)^T of dq, dk where ``turn``, with cos / sin in w.cs / w.sn[v]; plus
    the skip's dskip gamma Y, X, gamma's product in w.sg[0]) stored in dQh / dKh and added to the bias sums
    w.acc[0..3, v]; where ``turn``, g (d/dtheta) added to w.G[v]. The pair's biases come from w.bias[:, v]; its
    biased X / Y and dq / dk are read once into w.xy / w.dg (each is used twice: g and R^T)."""
    for e in range(2):  # the biased pairs, read once into w.xy[:, v]
        T.buffer_store(w.xy, biased(io.Qm, w.bias, 0, b, t, hq, p, e, v, m), [e, v])
        T.buffer_store(w.xy, biased(io.Km, w.bias, 2, b, t, hq, p, e, v, m), [2 + e, v])
    x0, x1, y0, y1 = w.xy[0, v], w.xy[1, v], w.xy[2, v], w.xy[3, v]
    for e in range(2):  # dq, dk of the pair, read once into w.dg[:, v]
        T.buffer_store(w.dg, io.dq[b, t, h, 2 * p + e], [e, v])
        T.buffer_store(w.dg, io.dk[b, t, h, 2 * p + e], [2 + e, v])
    grads = dq0, dq1, dk0, dk1 = w.dg[0, v], w.dg[1, v], w.dg[2, v], w.dg[3, v]
    if turn:
        q0, q1 = rotated(x0, x1, w.cs[v], w.sn[v])
        k0, k1 = rotated(y0, y1, w.cs[v], w.sn[v])
        T.buffer_store(w.G, w.G[v] + ((dq1 * q0 - dq0 * q1) + (dk1 * k0 - dk0 * k1)), [v])
        grads = (*rotated(dq0, dq1, w.cs[v], -w.sn[v]), *rotated(dk0, dk1, w.cs[v], -w.sn[v]))
    sg = w.sg[0]
    for j, (out, lane, g, other) in enumerate(((io.dQh, 0, grads[0], y0), (io.dQh, 1, grads[1], y1),
                                               (io.dKh, 0, grads[2], x0), (io.dKh, 1, grads[3], x1))):
        T.buffer_store(w.e, g + sg * other, [j, v])
        T.buffer_store(out, w.e[j, v], [b, t, h, 2 * p + lane])
        T.buffer_store(w.acc, w.acc[j, v] + w.e[j, v], [j, v])


def _sweep_macro(d: PreDims, S: Strategy, V: int, turn: bool):
    """Pass 2 over ``V`` pairs p0 .. p0 + V - 1 of (b, h): rotary pairs (``turn``: all below headdim_angles) or
    pass-through ones (theta = 0). Rotary: the forward's theta_t into gdt, then time reversed the pair
    gradients, G, dAngles and gdt; both: the bias sums and, rotary with input states, dangle_state."""
    HPQ, Q, m = d.heads_per_qk, d.chunk_size, S.math
    PI = m.const(math.pi)

    @T.macro
    def sweep(b, h, p0, io):
        w = T.meta_var(S.scratch(th=(V,), cs=(V,), sn=(V,), ta=(V,), G=(V,), e=(4, V), acc=(4, V), sg=(2,),
                                 bias=(4, V), xy=(4, V), dg=(4, V)))
        hq = T.meta_var(h // HPQ)
        for v in S.lane_loop(V):  # the pairs' Q / K biases, read once per task
            for e in range(2):
                w.bias[e, v] = io.Qb[h, 2 * (p0 + v) + e]
                w.bias[2 + e, v] = io.Kb[h, 2 * (p0 + v) + e]
        if turn:
            for v in S.lane_loop(V):
                w.th[v] = io.ast[b, h, p0 + v] if d.has_init else m.zero
                w.G[v] = m.zero if d.has_seq_idx else io.daout[b, h, p0 + v]  # (packed: set at each end)
            for t in range(io.seqlen):
                for v in S.lane_loop(V):
                    w.th[v] = angle_step(carried(w.th[v], io.seq, b, t, d.has_seq_idx, m),
                                         m.tanh(io.Ang[b, t, h, p0 + v]), io.DT[b, h, t], m)
                    io.gdt[b, t, h, p0 + v] = w.th[v]
        for j in range(4):
            for v in S.lane_loop(V):
                w.acc[j, v] = m.zero
        for tr in range(io.seqlen):
            t = T.meta_var(io.seqlen - 1 - tr)
            w.sg[1] = io.DT[b, h, t]
            w.sg[0] = io.dskip[b, h, t // Q, t % Q] * (w.sg[1] * m.sigmoid(io.Trap[b, h, t]))
            for v in S.lane_loop(V):
                if turn:
                    if d.has_seq_idx:  # a sequence's last step: G restarts from that sequence's daout row
                        w.G[v] = T.Select(seq_ends(io.seq, b, t, io.seqlen), io.daout[io.seq[b, t], h, p0 + v],
                                          w.G[v])
                    w.th[v] = io.gdt[b, t, h, p0 + v]
                    w.cs[v] = T.cos(w.th[v])
                    w.sn[v] = T.sin(w.th[v])
                _pair_grads(io, w, b, t, h, hq, p0 + v, v, m, turn)
                if turn:
                    w.ta[v] = m.tanh(io.Ang[b, t, h, p0 + v])
                    io.dAng[b, t, h, p0 + v] = w.G[v] * PI * (m.one - w.ta[v] * w.ta[v]) * w.sg[1]
                    io.gdt[b, t, h, p0 + v] = w.G[v] * PI * w.ta[v]
        for v in S.lane_loop(V):
            io.dQb[b, h, 2 * (p0 + v)] = w.acc[0, v]
            io.dQb[b, h, 2 * (p0 + v) + 1] = w.acc[1, v]
            io.dKb[b, h, 2 * (p0 + v)] = w.acc[2, v]
            io.dKb[b, h, 2 * (p0 + v) + 1] = w.acc[3, v]
        if turn and d.has_init:
            for v in S.lane_loop(V):
                io.dast[b, h, p0 + v] = w.G[v]

    return sweep


def _rotate_macro(d: PreDims, S: Strategy):
    """Pass 2, task (b, h, block of ``S.lanes`` pairs): on a CPU (the whole pair axis) a vector sweep over the
    headdim_angles rotary pairs, then one over the rest; on CUDA (a pair per thread) the pair's own sweep."""
    H, NP, A = d.nheads, d.headdim_qk // 2, d.headdim_angles
    V = S.lanes(NP)
    if S.vector:
        turn, rest = _sweep_macro(d, S, A, True), _sweep_macro(d, S, NP - A, False) if NP > A else None
    else:
        turn, rest = _sweep_macro(d, S, 1, True), _sweep_macro(d, S, 1, False)

    @T.macro
    def task(i, io):
        b, h, pb = T.meta_var(unravel(i, (None, H, NP // V)))
        if S.vector:
            turn(b, h, 0, io)
            if rest is not None:
                rest(b, h, A, io)
        else:
            if pb < A:
                turn(b, h, pb, io)
            else:
                rest(b, h, pb, io)

    return task


def _chunk_macro(d: PreDims, S: Strategy):
    """Pass 3, task (b, h, c): dDT, dTrap, dADT of the chunk's positions (module docstring)."""
    H, A, Q, m = d.nheads, d.headdim_angles, d.chunk_size, S.math
    dot_g = dot_macro(A, S)

    @T.macro
    def chunk(i, io):
        w = T.meta_var(S.scratch(r=(5,)))  # lam, X . Y, sum_i gdt, dgamma, dnu
        b, h, c = T.meta_var(unravel(i, (None, H, io.nchunks)))
        for l in range(Q):
            if c * Q + l < io.seqlen:
                w.r[0] = m.sigmoid(io.Trap[b, h, c * Q + l])
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
                io.dADT[b, h, c * Q + l] = T.Select(io.ADT[b, h, c * Q + l] >= tirx.const(DA_MIN, F32),
                                                    io.ddA[b, h, c, l] + io.ddecay[b, h, c], m.zero)

    return chunk


def _put_dot(io, b, h, t, dot):
    """The dots pass's X_t . Y_t into dDT[b, h, t]: the chunk pass reads it there and overwrites it with dDT (the
    same element, the same task)."""
    T.buffer_store(io.dDT, dot, [b, h, t])


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


def preprocess_bwd_template(d: PreDims, S: Strategy) -> tirx.PrimFunc:
    """The preprocess backward's three passes laid out by ``S`` (module docstring). Parameters in order: inputs
    Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, angle_state, k_state, v_state; gradients dq, dk, dscale,
    ddA_step, dskip, ddecay, daout, dinit; outputs dQh, dKh, dADT, dDT, dTrap, dQb_part, dKb_part, dAngles,
    dangle_state, dk_state, dv_state; workspaces gdt, c0 (absent states / their gradients: placeholders); last
    seq_idx (batch, seqlen) int32 (a (1, 1) placeholder without has_seq_idx; with it daout is (nseq, H, A),
    one row per packed sequence, read at each sequence's last position)."""
    H, HQ, N, P, A, Q = d.nheads, d.nheads_qk, d.headdim_qk, d.headdim_v, d.headdim_angles, d.chunk_size
    KT, NP = d.kstate_dtype or F32, N // 2
    init, pairs, chunk, tasks = _init_macro(d, S), _rotate_macro(d, S), _chunk_macro(d, S), S.tasks()
    dots, (TS, HB) = qk_dots_macro(d, S), skip_block(d, S)
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
            dDT=(dDT_h, (batch, H, seqlen)), dTrap=(dTrap_h, (batch, H, seqlen)), dQb=(dQb_h, (batch, H, N)),
            dKb=(dKb_h, (batch, H, N)), dAng=(dAng_h, (batch, seqlen, H, A)), dast=(dast_h, st(batch, H, A)),
            dkst=(dkst_h, st(batch, H, N)), dvst=(dvst_h, st(batch, H, P)), gdt=(gdt_h, (batch, seqlen, H, A)),
            c0=(c0_h, (batch, H)), seq=(seq_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)))
        if d.has_init:
            tasks(batch * H, lambda i: init(i, io))
        tasks(batch * H * (NP // S.lanes(NP)), lambda i: pairs(i, io))
        tasks(batch * ((seqlen + TS - 1) // TS) * (H // HB),
              lambda i: dots(i, io.Qm, io.Km, io.Qb, io.Kb, lambda b, h, t, dot: _put_dot(io, b, h, t, dot), seqlen))
        tasks(batch * H * nchunks, lambda i: chunk(i, io))

    return func
