"""ssd_chunk_scan_bwd laid out a task per output element, one launch per piece (scan_bwd.py; the CUDA strategy's
blockIdx x threadIdx, serial for tests). A later launch reads only what earlier ones finished (launches run in
order on the stream): the cross-position sums need no atomics.

Launch order: dx (per position); gsum = the part's sum of (g x^T) K dt (per (l, s) of a part, as the task
layout); dB and dC (per position and part, from gsum); XB[s] = <x_s, dSo B_s> into ddt_out as scratch; d dA_step
in three launches (the carried-state term per position, its reverse cumsum by one task per (batch, chunk, head),
then per position the crossing pairs and the chunk-state prefix, which read every XB of the chunk); d dt
(overwrites its own scratch entry); the dD partials (per position with diag_skip).

Every sum runs in the task form's order (scan_bwd_task.py), terms past seqlen (zeros there) left out: dx as
(D g + the causal sum over l ascending) + w dt <B, dSo>; d dt and the crossing pairs of d dA_step over l from the
last row up (the task form's row pass), the pairs' columns k ascending, then the chunk-state prefix, then the
carried-state term; g x as (dy silu(z)) x. (These three changed order to agree: their CUDA bits moved, CPU's
did not.)

Symbolic floordiv / mod of the flat index is computed once into an int32 scratch slot where a launch uses it
in its loops (recomputed per use it spilled on sm_80).
"""
from __future__ import annotations

from tvm.script import tirx as T

from .common import (F32, I32, Row, batch_sids, carried_decay, causal, causal_end, causal_start, gate, ld, seg_exp,
                     skip_at, state_decay)
from .dims import ScanBwdDims
from .strategy import Strategy


class _Reads:
    """The operands at chunk position l of chunk c, read where they are (0 past seqlen), and the decays."""

    def __init__(self, d: ScanBwdDims, m, o):
        self.d, self.m, self.o, self.Q, self.R = d, m, o, d.chunk_size, d.nheads // d.ngroups

    def _t(self, c, l):
        return T.min(c * self.Q + l, self.o.seqlen - 1)

    def x(self, b, c, l, h, p):
        return ld(self.o.x, (b, self._t(c, l), h, p), self.o.seqlen, c * self.Q + l)

    def bc(self, buf, b, c, l, h, n):  # B or C of head h's group
        return ld(buf, (b, self._t(c, l), h // self.R, n), self.o.seqlen, c * self.Q + l)

    def g(self, b, c, l, h, p):
        return gate(self.m, self.o.dy, self.o.z, (b, self._t(c, l), h, p), self.o.seqlen, c * self.Q + l,
                    self.d.has_z)

    def gx_in(self, b, c, l, j, h, p):
        """g_l[p] x_j[p], l and j inside the sequence: no bound checks (with them, the crossing-pairs and d dt
        launches spilled 8-16 B on sm_80 / sm_90)."""
        o, Q = self.o, self.Q
        g = o.dy[b, c * Q + l, h, p].astype(F32)
        if self.d.has_z:  # (dy silu(z)) x: the task form's g x
            g = g * self.m.silu(o.z[b, c * Q + l, h, p].astype(F32))
        return g * o.x[b, c * Q + j, h, p].astype(F32)

    def sid(self, b, c, l):
        return self.o.seq_idx[b, self._t(c, l)]

    def sids(self, b):
        return batch_sids(self.o.seq_idx, b)

    def seg(self, b, h, c, l, s):  # K[l, s]
        return seg_exp(self.m, Row(lambda i: self.o.dA_cs[b, h, c, i]), Row(lambda i: self.sid(b, c, i)), l, s,
                       self.d.has_seq_idx)

    def e(self, b, h, c, l):
        return carried_decay(self.m, self.o.dA_cs[b, h, c, l], self.sid(b, c, l), self.sids(b), c, self.Q,
                             self.d.has_seq_idx)

    def w(self, b, h, c, s):
        a = self.o.dA_cs
        return state_decay(self.m, a[b, h, c, self.Q - 1], a[b, h, c, s], self.sid(b, c, s), self.sids(b), c,
                           self.Q, self.o.seqlen, self.d.has_seq_idx)


def launches(d: ScanBwdDims, S: Strategy):
    """The macro ``body(o)``: every launch in order."""
    dx, gsum, dB, dC = _position_pieces(d, S)
    xb, ddA_carried, ddA_cumsum, ddA_pairs, ddt, dD = _step_pieces(d, S)

    @T.macro
    def body(o):
        r = T.meta_var(_Reads(d, S.math, o))
        dx(o, r)
        gsum(o, r)
        dB(o, r)
        dC(o, r)
        xb(o, r)
        ddA_carried(o, r)
        ddA_cumsum(o, r)
        ddA_pairs(o, r)
        ddt(o, r)
        if d.has_D:
            dD(o, r)

    return body


@T.macro
def _sum(acc, j, lo, hi, term):
    """acc[j] = sum of term(k) over k in [lo, hi), ascending from 0 (a task's scalar reduction)."""
    acc[j] = T.float32(0)
    for k in range(lo, hi):
        acc[j] = acc[j] + term(k)


@T.macro
def _sum_dots(out, jo, inner, ji, lo, hi, n_in, dot, weigh, rev):
    """out[jo] += sum over j in [lo, hi) of weigh(j, inner[ji]), inner[ji] = sum over k in [0, n_in) of dot(j, k)
    (a sum of weighted dot products, k ascending, j ascending or descending with ``rev``, the task form's row
    order from the last up; out[jo] holds its start)."""
    for jj in range(lo, hi):
        j = T.meta_var(lo + hi - 1 - jj if rev else jj)
        _sum(inner, ji, 0, n_in, lambda k: dot(j, k))
        out[jo] = out[jo] + weigh(j, inner[ji])


def _launch(S: Strategy, piece, extent):
    """The macro ``run(o, r)``: ``piece(o, r, i)`` for every task i < extent(o) (blockIdx x threadIdx on CUDA;
    the piece allocates its scratch in the thread's scope)."""

    @T.macro
    def run(o, r):
        n = T.meta_var(extent(o))
        for bx in S.outer(n):
            for tx in S.inner():
                i = T.meta_var(S.index(bx, tx))
                if i < n:
                    piece(o, r, i)

    return run


def _part_heads(o, gp, G: int, R: int):
    """(first head, heads) of head part gp (gparts // G parts of the R heads of each group)."""
    hp = o.gparts // G
    return gp // hp * R + gp % hp * (R // hp), R // hp


def _position_pieces(d: ScanBwdDims, S: Strategy):
    """dx (a task per (batch, position, head, p)), gsum (per (batch, chunk, part, l, s)), dB and dC (per
    (batch, position, part, n)): macros ``run(o, r)``. With diag_skip the sums over l >= s / s <= l start one
    past the diagonal (strict), with step_group past the step group (common.causal_start / causal_end)."""
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    R = H // G

    @T.macro
    def dx_at(o, r, i):
        """dx[s, p] = (D g[s, p] + sum_{l>=s} (C_l.B_s) K dt[s] g[l, p]) + w[s] dt[s] sum_n B[s, n] dSo[p, n]
        (D[b, h, c, s] and l > s with diag_skip), in the task form's order (its t1 + w dt t2)"""
        v = T.meta_var(S.scratch(acc=(2,), ib=((1,), I32), it=((1,), I32)))
        b, t = T.meta_var(v.ib[0]), T.meta_var(v.it[0])
        h, p = T.meta_var(i // P % H), T.meta_var(i % P)
        c, s = T.meta_var(t // Q), T.meta_var(t % Q)
        v.ib[0] = i // (o.seqlen * H * P)
        v.it[0] = i // (H * P) % o.seqlen
        v.acc[0] = skip_at(d, o.Dm, b, h, c, s, p, r.g(b, c, s, h, p))  # 0 without D
        for l in range(causal_start(d, s), T.min(Q, o.seqlen - c * Q)):
            v.acc[0] = v.acc[0] + o.cbg[b, c, h // R, l, s] * r.seg(b, h, c, l, s) * o.dt_out[b, h, c, s] * r.g(
                b, c, l, h, p)
        _sum(v.acc, 1, 0, N, lambda k: o.Bm[b, t, h // R, k].astype(F32) * o.dso[b, c, h, p, k])
        o.dx[b, t, h, p] = (v.acc[0] + r.w(b, h, c, s) * o.dt_out[b, h, c, s] * v.acc[1]).astype(d.x_dtype)

    @T.macro
    def gsum_at(o, r, i):
        """gsum[l, s] = sum over the part's heads of (g_l.x_s) K[l, s] dt[s] (s <= l; s < l with diag_skip), g x^T
        once per part"""
        v = T.meta_var(S.scratch(a0=(1,), a1=(1,), ib=((1,), I32)))  # ib: the part's first head
        b, c = T.meta_var(i // (o.nchunks * o.gparts * Q * Q)), T.meta_var(i // (o.gparts * Q * Q) % o.nchunks)
        gp, l, s = T.meta_var(i // (Q * Q) % o.gparts), T.meta_var(i // Q % Q), T.meta_var(i % Q)
        h0, per = T.meta_var(_part_heads(o, gp, G, R))
        v.a0[0] = T.float32(0)
        if causal(d, l, s):
            v.ib[0] = h0
            _sum_dots(v.a0, 0, v.a1, 0, v.ib[0], v.ib[0] + per, P, lambda h, p: r.g(b, c, l, h, p) * r.x(
                b, c, s, h, p), lambda h, gx: gx * r.seg(b, h, c, l, s) * o.dt_out[b, h, c, s], False)
        o.gsum[b, c, gp, l, s] = v.a0[0]

    def part_rows(is_dB: bool):
        """dB[s, k] = sum_h w[s] dt[s] (x_s dSo)[k] + sum_{l>=s} gsum[l, s] C[l, k];
        dC[l, k] = sum_h e[l] (g_l Sin)[k] + sum_{s<=l} gsum[l, s] B[s, k]  (the task layout's order):
        a task per (batch, position, part, k)."""
        state, other, out = ("dso", "Cm", "dBp") if is_dB else ("sin", "Bm", "dCp")

        def head_term(o, r, b, c, t, q, h, p, k):  # x_s dSo  /  g_l Sin
            u = o.x[b, t, h, p].astype(F32) if is_dB else r.g(b, c, q, h, p)
            return u * getattr(o, state)[b, c, h, p, k]

        def scale(o, r, b, c, q, h):  # w[s] dt[s]  /  e[l]
            return r.w(b, h, c, q) * o.dt_out[b, h, c, q] if is_dB else r.e(b, h, c, q)

        def k_range(o, c, q):  # l >= s inside the sequence  /  s <= l (strict with diag_skip)
            return (causal_start(d, q), T.min(Q, o.seqlen - c * Q)) if is_dB else (0, causal_end(d, q))

        def g_at(q, j):  # gsum[l, s] at (q, j)
            return (j, q) if is_dB else (q, j)

        @T.macro
        def at(o, r, i):
            v = T.meta_var(S.scratch(acc=(2,), ib=((1,), I32), it=((1,), I32), ih=((1,), I32)))
            b, t = T.meta_var(v.ib[0]), T.meta_var(v.it[0])
            gp, k = T.meta_var(i // N % o.gparts), T.meta_var(i % N)
            c, q = T.meta_var(t // Q), T.meta_var(t % Q)
            h0, per = T.meta_var(_part_heads(o, gp, G, R))
            lo, hi = T.meta_var(k_range(o, c, q))
            v.ib[0] = i // (o.seqlen * o.gparts * N)
            v.it[0] = i // (o.gparts * N) % o.seqlen
            v.acc[0] = T.float32(0)
            v.ih[0] = h0
            _sum_dots(v.acc, 0, v.acc, 1, v.ih[0], v.ih[0] + per, P,
                      lambda h, p: head_term(o, r, b, c, t, q, h, p, k), lambda h, hd: scale(o, r, b, c, q, h) * hd,
                      False)
            for j in range(lo, hi):
                v.acc[0] = v.acc[0] + o.gsum[(b, c, gp) + g_at(q, j)] * getattr(o, other)[
                    b, c * Q + j, gp // (o.gparts // G), k].astype(F32)
            getattr(o, out)[b, t, gp, k] = v.acc[0]

        return at

    return (_launch(S, dx_at, lambda o: o.batch * o.seqlen * H * P),
            _launch(S, gsum_at, lambda o: o.batch * o.nchunks * o.gparts * Q * Q),
            _launch(S, part_rows(True), lambda o: o.batch * o.seqlen * o.gparts * N),
            _launch(S, part_rows(False), lambda o: o.batch * o.seqlen * o.gparts * N))


def _bchq(o, i, H: int, Q: int):
    """(batch, chunk, head, position) of task i of a launch over (batch, chunk, head, position)."""
    return i // (o.nchunks * H * Q), i // (H * Q) % o.nchunks, i // Q % H, i % Q


def _step_pieces(d: ScanBwdDims, S: Strategy):
    """The per-step gradients, a task per (batch, chunk, head, position) (the reverse cumsum: per (batch, chunk,
    head)): macros ``run(o, r)``. d dA_step never subtracts sums (crossing-pairs form, scan_bwd.py); its pairs
    k < q <= l never hold the diagonal, so diag_skip changes only d dt's sum (l > q) and dD (per position); with
    step_group the pairs are those of different step groups (k < causal_end(l)), d dt's sum runs from
    causal_start(q)."""
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    R = H // G
    # the crossing pairs' l range for column k: l >= q (k < q <= l never holds the diagonal), and l past k's step
    # group (causal: k // G < l // G)
    l_start = (lambda q, k: T.max(q, causal_start(d, k))) if d.step_group > 1 else (lambda q, k: q)  # noqa: E731

    @T.macro
    def xb_at(o, r, i):
        """XB[s] = <x_s, dSo B_s> -> ddt_out (scratch until d dt)"""
        v = T.meta_var(S.scratch(acc=(2,)))
        b, c, h, s = T.meta_var(_bchq(o, i, H, Q))
        v.acc[0] = T.float32(0)
        _sum_dots(v.acc, 0, v.acc, 1, 0, P, N, lambda p, k: r.bc(o.Bm, b, c, s, h, k) * o.dso[b, c, h, p, k],
                  lambda p, bd: r.x(b, c, s, h, p) * bd, False)
        o.ddt_out[b, h, c, s] = v.acc[0]

    @T.macro
    def carried_at(o, r, i):
        """the carried-state term e[q] <g_q, C_q Sin> of d dA_cs[q] -> ddA_step"""
        v = T.meta_var(S.scratch(acc=(3,)))
        b, c, h, q = T.meta_var(_bchq(o, i, H, Q))
        v.acc[0] = T.float32(0)
        if c * Q + q < o.seqlen:  # g is 0 past seqlen
            v.acc[1] = T.float32(0)
            _sum_dots(v.acc, 1, v.acc, 2, 0, N, P, lambda k, p: r.g(b, c, q, h, p) * o.sin[b, c, h, p, k],
                      lambda k, gs: r.bc(o.Cm, b, c, q, h, k) * gs, False)
            v.acc[0] = r.e(b, h, c, q) * v.acc[1]
        o.ddA_step[b, h, c, q] = v.acc[0]

    @T.macro
    def cumsum_at(o, r, i):
        """its reverse cumsum in place, a task per (batch, chunk, head): d dA_cs[l] reaches the steps q <= l"""
        v = T.meta_var(S.scratch(acc=(1,)))
        v.acc[0] = T.float32(0)
        for qr in range(Q):
            v.acc[0] = v.acc[0] + o.ddA_step[i // (o.nchunks * H), i % H, i // H % o.nchunks, Q - 1 - qr]
            o.ddA_step[i // (o.nchunks * H), i % H, i // H % o.nchunks, Q - 1 - qr] = v.acc[0]

    @T.macro
    def pairs_at(o, r, i):
        """(the crossing pairs sum_{k<q} sum_{l>=q} G[l, k] + the chunk-state prefix sum_{k<q} w[k] dt[k] XB[k])
        + the carried-state term, G = (g_l.x_k)(C_l.B_k) K dt[k] (x_k reaches steps q > k only, g_l steps q <= l
        only), in the task form's order: l from the last up (its column suffix sums), k ascending"""
        # one-element buffers, not one array of 3 (kept in registers)
        v = T.meta_var(S.scratch(a0=(1,), a1=(1,), a2=(1,), ib=((1,), I32), ic=((1,), I32)))
        b, c = T.meta_var(v.ib[0]), T.meta_var(v.ic[0])
        h, q = T.meta_var(i // Q % H), T.meta_var(i % Q)
        v.ib[0] = i // (o.nchunks * H * Q)
        v.ic[0] = i // (H * Q) % o.nchunks
        v.a0[0] = T.float32(0)
        for k in range(q):
            v.a1[0] = T.float32(0)  # sum_{l>=q} G[l, k], g is 0 past seqlen
            _sum_dots(v.a1, 0, v.a2, 0, l_start(q, k), T.min(Q, o.seqlen - c * Q), P,
                      lambda l, p: r.gx_in(b, c, l, k, h, p),
                      lambda l, gx: gx * o.cbg[b, c, h // R, l, k] * r.seg(b, h, c, l, k) * o.dt_out[b, h, c, k], True)
            v.a0[0] = v.a0[0] + v.a1[0]
        v.a1[0] = T.float32(0)
        for j in range(q):
            v.a1[0] = v.a1[0] + r.w(b, h, c, j) * o.dt_out[b, h, c, j] * o.ddt_out[b, h, c, j]
        o.ddA_step[b, h, c, q] = v.a0[0] + v.a1[0] + o.ddA_step[b, h, c, q]

    @T.macro
    def ddt_at(o, r, i):
        """d dt[q] = sum_{l>=q} (g_l.x_q)(C_l.B_q) K + exp(dA_cs[Q-1]-dA_cs[q]) XB[q] (l > q with diag_skip), l from
        the last up (the task form's order)"""
        v = T.meta_var(S.scratch(acc=(2,)))
        b, c, h, q = T.meta_var(_bchq(o, i, H, Q))
        v.acc[0] = T.float32(0)
        # q <= l (q < l with diag_skip) inside the sequence (g is 0 past it): gx_in, no bound checks (with them,
        # Mamba-3's bf16 + z configuration spilled 8 B on sm_90, 12 B on sm_80)
        _sum_dots(v.acc, 0, v.acc, 1, causal_start(d, q), T.min(Q, o.seqlen - c * Q), P,
                  lambda l, p: r.gx_in(b, c, l, q, h, p),
                  lambda l, gx: gx * o.cbg[b, c, h // R, l, q] * r.seg(b, h, c, l, q), True)
        o.ddt_out[b, h, c, q] = v.acc[0] + r.w(b, h, c, q) * o.ddt_out[b, h, c, q]

    J, K = (Q, P) if d.diag_skip else (P, Q)  # dD per position: a task per l summing over p; else the reverse

    def dd_term(r, b, c, h, j, k):  # g[l, p] x[l, p] of task j, term k
        l, p = (j, k) if d.diag_skip else (k, j)
        return r.g(b, c, l, h, p) * r.x(b, c, l, h, p)

    def dd_index(b, c, h, j):  # D's layout per position, else (batch, chunk, head, p)
        return (b, h, c, j) if d.diag_skip else (b, c, h, j)

    @T.macro
    def dd_at(o, r, i):
        """dD partial[p] = sum_l g[l, p] x[l, p], a task per (batch, chunk, head, p); with diag_skip (D per
        position) dD[l] = sum_p g[l, p] x[l, p], a task per (batch, chunk, head, l), stored in D's layout"""
        v = T.meta_var(S.scratch(acc=(1,)))
        b, c, h, j = T.meta_var(_bchq(o, i, H, J))
        _sum(v.acc, 0, 0, K, lambda k: dd_term(r, b, c, h, j, k))
        o.dD_part[dd_index(b, c, h, j)] = v.acc[0]

    steps = lambda o: o.batch * o.nchunks * H * Q  # noqa: E731
    return (_launch(S, xb_at, steps), _launch(S, carried_at, steps),
            _launch(S, cumsum_at, lambda o: o.batch * o.nchunks * H), _launch(S, pairs_at, steps),
            _launch(S, ddt_at, steps), _launch(S, dd_at, lambda o: o.batch * o.nchunks * H * J))
