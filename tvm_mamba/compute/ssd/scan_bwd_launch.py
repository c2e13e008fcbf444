"""ssd_chunk_scan_bwd laid out a task per output element, one launch per piece (scan_bwd.py; the CUDA strategy's
blockIdx x threadIdx, serial for tests). A later launch reads only what earlier ones finished (launches run in
order on the stream): the cross-position sums need no atomics.

Launch order: dx (per position); gsum = the part's sum of (g x^T) K dt (per (l, s) of a part, as the task
layout); dB and dC (per position and part, from gsum); XB[s] = <x_s, dSo B_s> into ddt_out as scratch; d dA_step's
carried-state term per position, then its reverse cumsum by one task per (batch, chunk, head); then d dt and the
rest of d dA_step by the strategy's ``crossing_pass`` (a task per (batch, chunk, head): the row pass of the task
form, running column sums of the causal pairs from the last row up; its rows add the crossing pairs and the
chunk-state prefix of every XB, its columns overwrite their XB with d dt); the dD partials (per position with
diag_skip).

The per-element launches execute the specs of scan_bwd_spec.py per output element (``_per_element``,
``_sum_dots``) in their order, terms past seqlen (zeros there) left out.

Symbolic floordiv / mod of the flat index is computed once into an int32 scratch slot where a launch uses it
in its loops (recomputed per use it spilled on sm_80).
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from . import scan_bwd_spec as spec
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

    def bc(self, buf, b, c, l, grp, n):  # B or C of group grp
        return ld(buf, (b, self._t(c, l), grp, n), self.o.seqlen, c * self.Q + l)

    def g(self, b, c, l, h, p):
        return gate(self.m, self.o.dy, self.o.z, (b, self._t(c, l), h, p), self.o.seqlen, c * self.Q + l,
                    self.d.has_z)

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


def _at(r: _Reads, b, c, grp, h=None, gp=None) -> SimpleNamespace:
    """The specs' reader (scan_bwd_spec.py) at batch b, chunk c, group grp: head h's operands (None: a part's
    reader, gsum of part gp; ``head(h)`` its head h's) read where they lie, 0 past seqlen. (Every read keeps its
    bound check: without them where the position is known inside, dx's and dB's launches took 8 more registers
    on sm_80 / sm_90.) ``end``: the chunk's positions inside the sequence."""
    o = r.o
    a = SimpleNamespace(
        h=h, end=T.min(r.Q, o.seqlen - c * r.Q), head=lambda hh: _at(r, b, c, grp, hh, gp),
        g=lambda l, p: r.g(b, c, l, h, p), x=lambda s, p: r.x(b, c, s, h, p), xT=lambda p, s: r.x(b, c, s, h, p),
        B=lambda s, n: r.bc(o.Bm, b, c, s, grp, n), C=lambda l, n: r.bc(o.Cm, b, c, l, grp, n),
        dso=lambda p, n: o.dso[b, c, h, p, n], dsoT=lambda n, p: o.dso[b, c, h, p, n],
        sin=lambda p, n: o.sin[b, c, h, p, n], cb=lambda l, s: o.cbg[b, c, grp, l, s],
        K=lambda l, s: r.seg(b, h, c, l, s), dt=lambda s: o.dt_out[b, h, c, s], gsum=lambda l, s: o.gsum[b, c, gp, l, s],
        wst=lambda s: r.w(b, h, c, s), e=lambda l: r.e(b, h, c, l),
        skip=lambda s, p, v: skip_at(r.d, o.Dm, b, h, c, s, p, v))
    a.cbk = lambda l, s: spec.cbk(a, l, s)
    return a


def launches(d: ScanBwdDims, S: Strategy):
    """The macro ``body(o)``: every launch in order."""
    dx, gsum, dB, dC = _position_pieces(d, S)
    xb, ddA_carried, ddA_cumsum, pairs, dD = _step_pieces(d, S)

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
        pairs(o, r)
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
def _sum_dots(out, jo, inner, ji, lo, hi, n_in, dot, weigh):
    """out[jo] += sum over j in [lo, hi) of weigh(j, inner[ji]), inner[ji] = sum over k in [0, n_in) of dot(j, k)
    (a sum of weighted dot products, j and k ascending; out[jo] holds its start)."""
    for j in range(lo, hi):
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


def _head_at(o, r: _Reads, t, H: int, R: int) -> SimpleNamespace:
    """The specs' reader of task t = (batch, chunk, head) of a launch over (batch, chunk, head)."""
    return _at(r, t // (o.nchunks * H), t // H % o.nchunks, t % H // R, t % H)


def _dx_segments(d: ScanBwdDims, o, r: _Reads) -> tuple:
    """dx's two segments for the strategy's ``product`` (spec.pieces' dx): the main product over the causal
    positions l >= s inside the sequence, then the state product over dstate, scaled per row."""
    H, R = d.nheads, d.nheads // d.ngroups
    sp = spec.pieces(d)
    at = lambda t: _head_at(o, r, t, H, R)  # noqa: E731
    main = SimpleNamespace(a=lambda t, s, l: sp.dx.main.a(at(t), s, l), b=lambda t, l, p: sp.dx.main.b(at(t), l, p),
                           lo=lambda t, s: causal_start(d, s), hi=lambda t, s: at(t).end)
    state = SimpleNamespace(a=lambda t, s, n: sp.dx.scale(at(t), s) * sp.dx.state.a(at(t), s, n),
                            b=lambda t, n, p: sp.dx.state.b(at(t), n, p), lo=lambda t, s: 0,
                            hi=lambda t, s: d.dstate)
    return main, state


def _part_at(o, r: _Reads, t, G: int) -> SimpleNamespace:
    """The specs' part reader (gsum of part gp, ``head(h)`` its heads') of task t = (batch, chunk, part)."""
    gp = t % o.gparts
    return _at(r, t // (o.nchunks * o.gparts), t // o.gparts % o.nchunks, gp // (o.gparts // G), None, gp)


def _part_segments(d: ScanBwdDims, o, r: _Reads, piece) -> tuple:
    """dB's or dC's two segments for the strategy's ``product`` (``piece``: spec.pieces' dB or dC): the part's
    heads (k = the head's index in the part x headdim + p, the head's scale folded into its row), then the
    intra-chunk product's causal range ("ge": positions inside the sequence; "le": row q's)."""
    G, P, R = d.ngroups, d.headdim, d.nheads // d.ngroups
    at = lambda t: _part_at(o, r, t, G)  # noqa: E731
    head = lambda t, k: at(t).head(_part_heads(o, t % o.gparts, G, R)[0] + k // P)  # noqa: E731
    heads = SimpleNamespace(
        a=lambda t, q, k: piece.scale(head(t, k), q) * piece.head.a(head(t, k), q, k % P),
        b=lambda t, k, n: piece.head.b(head(t, k), k % P, n), lo=lambda t, q: 0,
        hi=lambda t, q: _part_heads(o, t % o.gparts, G, R)[1] * P)
    ge = piece.intra.causal == "ge"
    intra = SimpleNamespace(a=lambda t, q, k: piece.intra.a(at(t), q, k), b=lambda t, k, n: piece.intra.b(at(t), k, n),
                            lo=(lambda t, q: causal_start(d, q)) if ge else (lambda t, q: 0),
                            hi=(lambda t, q: at(t).end) if ge else (lambda t, q: causal_end(d, q)))
    return heads, intra


def _position_pieces(d: ScanBwdDims, S: Strategy):
    """dx (a task per (batch, position, head, p)), gsum (per (batch, chunk, part, l, s)), dB and dC (per
    (batch, position, part, n)): macros ``run(o, r)`` executing scan_bwd_spec.pieces' specs per output element."""
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    R = H // G
    sp = spec.pieces(d)

    dx_run = S.product(Q, P, (Q, N))

    @T.macro
    def dx(o, r):
        """dx per (batch, chunk, head) task by the strategy's ``product``: the init D g, the main product's
        causal range, then the state product with the chunk-state scale folded into its rows (B_s w[s] dt[s])"""
        dx_run(o.batch * o.nchunks * H, lambda t: _head_at(o, r, t, H, R).end, _dx_segments(d, o, r),
               lambda t, s, p: sp.dx.main.init(_head_at(o, r, t, H, R), s, p),
               lambda t, s, p, v: T.buffer_store(o.dx, v.astype(d.x_dtype),
                                                 (t // (o.nchunks * H), t // H % o.nchunks * Q + s, t % H, p)))

    @T.macro
    def gsum_at(o, r, i):
        """gsum[l, s] (causal pairs): the part's heads in order, g x^T once per part"""
        v = T.meta_var(S.scratch(a0=(1,), a1=(1,), ib=((1,), I32)))  # ib: the part's first head
        b, c = T.meta_var(i // (o.nchunks * o.gparts * Q * Q)), T.meta_var(i // (o.gparts * Q * Q) % o.nchunks)
        gp, l, s = T.meta_var(i // (Q * Q) % o.gparts), T.meta_var(i // Q % Q), T.meta_var(i % Q)
        h0, per = T.meta_var(_part_heads(o, gp, G, R))
        a = T.meta_var(_at(r, b, c, gp // (o.gparts // G), None, gp))
        v.a0[0] = T.float32(0)
        if causal(d, l, s):
            v.ib[0] = h0
            _sum_dots(v.a0, 0, v.a1, 0, v.ib[0], v.ib[0] + per, P, lambda h, p: sp.gx.term(a.head(h), l, p, s),
                      lambda h, gx: spec.gsum_term(a.head(h), l, s, gx))
        o.gsum[b, c, gp, l, s] = v.a0[0]

    def part_rows(piece, out: str):
        """dB / dC (spec.pieces' dB, dC) per (batch, chunk, part) task by the strategy's ``product``: the part's
        heads in order (each head's scale folded into its rows), then the intra-chunk product on gsum."""
        run = S.product(Q, N, (P, Q))

        @T.macro
        def at(o, r):
            run(o.batch * o.nchunks * o.gparts, lambda t: _part_at(o, r, t, G).end, _part_segments(d, o, r, piece),
                lambda t, q, n: T.float32(0),
                lambda t, q, n, v: T.buffer_store(getattr(o, out), v, (t // (o.nchunks * o.gparts),
                                                                       t // o.gparts % o.nchunks * Q + q,
                                                                       t % o.gparts, n)))

        return at

    return (dx,
            _launch(S, gsum_at, lambda o: o.batch * o.nchunks * o.gparts * Q * Q),
            part_rows(sp.dB, "dBp"), part_rows(sp.dC, "dCp"))


def _bchq(o, i, H: int, Q: int):
    """(batch, chunk, head, position) of task i of a launch over (batch, chunk, head, position)."""
    return i // (o.nchunks * H * Q), i // (H * Q) % o.nchunks, i // Q % H, i % Q


def _head_task(S: Strategy, r: _Reads, o, i, H: int, Q: int, R: int, nacc: int):
    """(scratch with ``nacc`` accumulators, batch, chunk, head, position, head reader) of task i of a launch
    over (batch, chunk, head, position); R heads per group."""
    v = S.scratch(acc=(nacc,))
    b, c, h, q = _bchq(o, i, H, Q)
    return v, b, c, h, q, _at(r, b, c, h // R, h)


def _step_pieces(d: ScanBwdDims, S: Strategy):
    """The per-step gradients, a task per (batch, chunk, head, position) (the reverse cumsum: per (batch, chunk,
    head)): macros ``run(o, r)``, the summands and ranges of scan_bwd_spec.py (the crossing-pairs form)."""
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    R = H // G
    sp = spec.pieces(d)

    @T.macro
    def xb_at(o, r, i):
        """XB[s] = <x_s, dSo B_s> -> ddt_out (scratch until d dt)"""
        v, b, c, h, s, a = T.meta_var(_head_task(S, r, o, i, H, Q, R, 2))
        v.acc[0] = T.float32(0)
        _sum_dots(v.acc, 0, v.acc, 1, 0, P, N, lambda p, n: sp.dx.state.term(a, s, n, p),
                  lambda p, st: spec.xb_term(a, s, p, st))
        o.ddt_out[b, h, c, s] = v.acc[0]

    @T.macro
    def carried_at(o, r, i):
        """the carried-state term e[q] <g_q, C_q Sin> of d dA_cs[q] -> ddA_step"""
        v, b, c, h, q, a = T.meta_var(_head_task(S, r, o, i, H, Q, R, 3))
        v.acc[0] = T.float32(0)
        if c * Q + q < o.seqlen:  # g is 0 past seqlen
            v.acc[1] = T.float32(0)
            _sum_dots(v.acc, 1, v.acc, 2, 0, N, P, lambda n, p: sp.dC.head.term(a, q, p, n),
                      lambda n, gs: spec.carried_term(a, q, n, gs))
            v.acc[0] = sp.dC.scale(a, q) * v.acc[1]
        o.ddA_step[b, h, c, q] = v.acc[0]

    @T.macro
    def cumsum_at(o, r, i):
        """its reverse cumsum in place, a task per (batch, chunk, head): d dA_cs[l] reaches the steps q <= l"""
        v = T.meta_var(S.scratch(acc=(1,)))
        v.acc[0] = T.float32(0)
        for qr in range(Q):
            v.acc[0] = v.acc[0] + o.ddA_step[i // (o.nchunks * H), i % H, i // H % o.nchunks, Q - 1 - qr]
            o.ddA_step[i // (o.nchunks * H), i % H, i // H % o.nchunks, Q - 1 - qr] = v.acc[0]

    J, K = sp.dd.sizes  # dD per position: a task per l summing over p; else the reverse

    def dd_index(b, c, h, j):  # D's layout per position, else (batch, chunk, head, p)
        return (b, h, c, j) if d.diag_skip else (b, c, h, j)

    @T.macro
    def dd_at(o, r, i):
        """dD partial[j] (spec.pieces' dD), a task per (batch, chunk, head, j), stored in D's layout"""
        v = T.meta_var(S.scratch(acc=(1,)))
        b, c, h, j = T.meta_var(_bchq(o, i, H, J))
        a = T.meta_var(_at(r, b, c, h // R, h))
        _sum(v.acc, 0, 0, K, lambda k: sp.dd.term(a, j, k))
        o.dD_part[dd_index(b, c, h, j)] = v.acc[0]

    crossing = S.crossing_pass(Q, P, lambda k: causal_start(d, k))

    @T.macro
    def pairs(o, r):
        crossing(o.batch * o.nchunks * H, _crossing_ops(d, o, r))

    steps = lambda o: o.batch * o.nchunks * H * Q  # noqa: E731
    return (_launch(S, xb_at, steps), _launch(S, carried_at, steps),
            _launch(S, cumsum_at, lambda o: o.batch * o.nchunks * H), pairs,
            _launch(S, dd_at, lambda o: o.batch * o.nchunks * H * J))


def _crossing_ops(d: ScanBwdDims, o, r: _Reads) -> SimpleNamespace:
    """The strategy's ``crossing_pass`` (strategy.py) on task t = (batch, chunk, head): v(l, k) = row l's d dt
    term of step k (spec.ddt_term), its pair term G[l, k] (spec.pair_term); per column k d dt[k] = the column
    sum + the chunk-state term of XB[k] (in ddt_out since the XB launch: read by ``pre`` and ``col_store``
    before it is overwritten), per row q d dA_step[q] = the crossing pairs + the chunk-state prefix
    sum_{k<q} w[k] dt[k] XB[k] + the carried-state term (in ddA_step since the reverse cumsum)."""
    H, Q, R = d.nheads, d.chunk_size, d.nheads // d.ngroups

    def at(t):
        return _head_at(o, r, t, H, R)

    def idx(t, q):  # (batch, head, chunk, q)
        return (t // (o.nchunks * H), t % H, t // H % o.nchunks, q)

    return SimpleNamespace(
        g=lambda t, l, p: at(t).g(l, p), x=lambda t, k, p: at(t).x(k, p),
        weight=lambda t, l, k, gx: spec.ddt_term(at(t), l, k, gx), pair=lambda t, k, v: spec.pair_term(at(t), k, v),
        pre=lambda t, k: spec.prefix_term(at(t), k, o.ddt_out[idx(t, k)]), end=lambda t: at(t).end,
        col_store=lambda t, k, v: T.buffer_store(o.ddt_out, v + spec.ddt_state(at(t), k, o.ddt_out[idx(t, k)]),
                                                 idx(t, k)),
        row_store=lambda t, q, pairs, pre: T.buffer_store(o.ddA_step, pairs + pre + o.ddA_step[idx(t, q)],
                                                          idx(t, q)))
