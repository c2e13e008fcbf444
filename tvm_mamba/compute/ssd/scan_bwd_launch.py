"""ssd_chunk_scan_bwd laid out as launches, one per piece (scan_bwd.py; the CUDA strategy's blocks and threads,
serial for tests). A later launch reads only what earlier ones finished (launches run in order on the stream):
the cross-position sums need no atomics.

Launch order, each piece by a strategy method (strategy.py) fed the specs of scan_bwd_spec.py:
  dx          ``product`` per (batch, chunk, head): D g (or D on the causal main product's diagonal), the causal
              main product, the scaled state product;
              its state product's row dot XB[s] = <x_s, dSo B_s> into ddt_out as scratch;
  gsum        ``product`` per (batch, chunk, part): the part's heads' g x^T, each weighted by its K dt on the
              causal pairs (a weighted segment);
  dB, dC      ``product`` per (batch, chunk, part): the part's heads (each weighted per row by its scale),
              then the intra-chunk causal product on gsum; dC's head products' row dots are each head's
              carried-state term e[q] <g_q, C_q Sin> of d dA_step;
  crossing    ``crossing_pass`` per (batch, chunk, head): the task form's row pass, running column sums of the
              causal pairs from the last row up; its rows add the crossing pairs, the chunk-state prefix of
              every XB and the reverse cumsum of the carried-state terms to d dA_step, its columns overwrite
              their XB with d dt; with D, dD on the way (per channel: the staged rows of g against x; per
              position with diag_skip: the diagonal g_l . x_l).

On CUDA each method stages its operands per block (shared-memory tiles, registers: schedules/cuda/_tiled.py,
_crossing.py); the serial strategy runs a task per output element in the same order, terms past
seqlen (zeros there) left out of the causal ranges.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from . import scan_bwd_spec as spec
from .common import (F32, I32, Row, batch_sids, carried_decay, causal, causal_end, causal_start, gate, ld, seg_exp,
                     seg_exp_of, skip_at, state_decay)
from .dims import ScanBwdDims
from .strategy import ChunkStrategy


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
        wst=lambda s: r.w(b, h, c, s), e=lambda l: r.e(b, h, c, l), acs=lambda q: o.dA_cs[b, h, c, q],
        sid=lambda q: r.sid(b, c, q),
        skip=lambda s, p, v: skip_at(r.d, o.Dm, b, h, c, s, p, v))
    a.cbk = lambda l, s: spec.cbk(a, l, s)
    return a


def launches(d: ScanBwdDims, S: ChunkStrategy):
    """The macro ``body(o)``: every launch in order."""
    dx, gsum, dB, dC = _position_pieces(d, S)
    pairs = _step_pieces(d, S)

    @T.macro
    def body(o):
        r = T.meta_var(_Reads(d, S.math, o))
        dx(o, r)
        gsum(o, r)
        dB(o, r)
        dC(o, r)
        pairs(o, r)

    return body


def _part_heads(o, gp, G: int, R: int):
    """(first head, heads) of head part gp (gparts // G parts of the R heads of each group)."""
    hp = o.gparts // G
    return gp // hp * R + gp % hp * (R // hp), R // hp


def _bcn(o, t, n):
    """(batch, chunk, x) of task t of a launch over (batch, chunk, n): n heads or head parts."""
    return t // (o.nchunks * n), t // n % o.nchunks, t % n


def _row_index(o, t, n, Q: int, q, j):
    """(batch, position, x, j) of chunk position q of task t = (batch, chunk, x), x < n: dx's / dB's / dC's."""
    b, c, x = _bcn(o, t, n)
    return (b, c * Q + q, x, j)


def _step_index(o, t, H: int, q):
    """(batch, head, chunk, q) of chunk position q of task t = (batch, chunk, head): ddt_out's / ddA_step's."""
    b, c, h = _bcn(o, t, H)
    return (b, h, c, q)


def _carried_index(o, t, h, q):
    """(batch, head, chunk, q) of head h at chunk position q of task t = (batch, chunk, part): ddA_step's."""
    b, c, _ = _bcn(o, t, o.gparts)
    return (b, h, c, q)


def _head_at(o, r: _Reads, t, H: int, R: int) -> SimpleNamespace:
    """The specs' reader of task t = (batch, chunk, head) of a launch over (batch, chunk, head)."""
    b, c, h = _bcn(o, t, H)
    return _at(r, b, c, h // R, h)


def _positions(d: ScanBwdDims, head, skip: bool = False) -> tuple:
    """The per-position values a segment's decays read, as the strategy's ``pos`` ((reader(t, u, q), dtype)
    pairs; head(t, u): the reader of unit u of task t): dA_cs, dt' and, with seq_idx, the sequence id; with
    ``skip`` D last (the head's skip of 1: D[h], or D at q with diag_skip; staged with them on CUDA)."""
    pos = ((lambda t, u, q: head(t, u).acs(q), F32), (lambda t, u, q: head(t, u).dt(q), F32))
    pos = pos + ((lambda t, u, q: head(t, u).sid(q), I32),) if d.has_seq_idx else pos
    return pos + ((lambda t, u, q: head(t, u).skip(q, 0, T.float32(1)), F32),) if skip else pos


def _unit_free(pos: tuple) -> tuple:
    """``_positions`` readers (t, u, q) of a task's one head as (t, q) readers."""
    return tuple((lambda t, q, rd=rd: rd(t, 0, q), dtype) for rd, dtype in pos)


def _staged(d: ScanBwdDims, r: _Reads, a: SimpleNamespace, l, vl: tuple, s, vs: tuple) -> SimpleNamespace:
    """Reader ``a`` whose K (at (l, s)) and dt (at s) come from the ``_positions`` values vl / vs at l / s (staged
    per tile on CUDA) instead of global memory."""
    sids = (vl[2], vs[2]) if d.has_seq_idx else None
    return SimpleNamespace(**{**vars(a), "K": lambda l_, s_: seg_exp_of(r.m, vl[0], vs[0], sids, l, s),
                              "dt": lambda s_: vs[1]})


def _dx_segments(d: ScanBwdDims, o, r: _Reads) -> tuple:
    """dx's two segments for the strategy's ``product`` (spec.pieces' dx): the main product over the causal
    positions l >= s inside the sequence (where spec.folds_skip, the skip D g[s] as its diagonal term:
    spec.cbk_skip, D staged with the positions' values), then the state product over dstate, one weighted
    unit: its row sum times the row's scale w[s] dt[s] (``row_pos``: computed once per row, staged per tile on
    CUDA), and the row dot XB[s] = x_s . (the unit's row) into ddt_out."""
    H, R = d.nheads, d.nheads // d.ngroups
    sp = spec.pieces(d)
    at = lambda t: _head_at(o, r, t, H, R)  # noqa: E731
    if spec.folds_skip(d):
        weight = lambda t, s, l, vs, vl: spec.cbk_skip(  # noqa: E731
            d, _staged(d, r, at(t), l, vl, s, vs), l, s, vs[-1])
        lo = lambda t, s: s  # noqa: E731  (from the diagonal, strict or not: spec.cbk_skip)
    else:
        weight = lambda t, s, l, vs, vl: spec.cbk(_staged(d, r, at(t), l, vl, s, vs), l, s)  # noqa: E731
        lo = lambda t, s: causal_start(d, s)  # noqa: E731
    main = SimpleNamespace(a=weight, b=lambda t, l, p: sp.dx.main.b(at(t), l, p), lo=lo, hi=lambda t, s: at(t).end,
                           pos=_positions(d, lambda t, u: at(t), spec.folds_skip(d)))
    state = SimpleNamespace(a=lambda t, s, n: sp.dx.state.a(at(t), s, n), b=lambda t, n, p: sp.dx.state.b(at(t), n, p),
                            n=lambda t: 1, weigh=lambda t, s, p, u, v, vs: vs[0] * v,
                            row_pos=((lambda t, u, q: sp.dx.scale(at(t), q), F32),),
                            dot=SimpleNamespace(term=lambda t, s, p, u, v: spec.xb_term(at(t), s, p, v),
                                                store=lambda t, s, u, v: T.buffer_store(o.ddt_out, v,
                                                                                        _step_index(o, t, H, s))))
    return main, state


def _dx_init(d: ScanBwdDims, o, r: _Reads):
    """dx's init for the strategy's ``product``: the skip D g[s, p] (spec.pieces' dx.main.init), or 0 where it is
    the main product's diagonal term (spec.folds_skip)."""
    if spec.folds_skip(d):
        return lambda t, s, p: T.float32(0)
    return lambda t, s, p: spec.pieces(d).dx.main.init(_head_at(o, r, t, d.nheads, d.nheads // d.ngroups), s, p)


def _part_at(o, r: _Reads, t, G: int) -> SimpleNamespace:
    """The specs' part reader (gsum of part gp, ``head(h)`` its heads') of task t = (batch, chunk, part)."""
    b, c, gp = _bcn(o, t, o.gparts)
    return _at(r, b, c, gp // (o.gparts // G), None, gp)


def _part_segments(d: ScanBwdDims, o, r: _Reads, piece, carried: bool) -> tuple:
    """dB's or dC's two segments for the strategy's ``product`` (``piece``: spec.pieces' dB or dC): the part's
    heads, a weighted segment (unit u the part's u-th head, k = u x headdim + p: its row sum times the head's
    scale at the row, ``row_pos``; ``carried``: with the dot that stores each head's carried-state term of
    d dA_step, spec.carried_term over the row, into ddA_step), then the intra-chunk product's causal range ("ge":
    positions inside the sequence; "le": row q's)."""
    G, P, R = d.ngroups, d.headdim, d.nheads // d.ngroups
    at = lambda t: _part_at(o, r, t, G)  # noqa: E731
    first = lambda t: _part_heads(o, t % o.gparts, G, R)[0]  # noqa: E731
    head = lambda t, k: at(t).head(first(t) + k // P)  # noqa: E731
    heads = SimpleNamespace(
        a=lambda t, q, k: piece.head.a(head(t, k), q, k % P), b=lambda t, k, n: piece.head.b(head(t, k), k % P, n),
        n=lambda t: _part_heads(o, t % o.gparts, G, R)[1], weigh=lambda t, q, n, u, v, vq: vq[0] * v,
        row_pos=((lambda t, u, q: piece.scale(at(t).head(first(t) + u), q), F32),))
    if carried:  # dC's: each head's carried-state term of d dA_step, C_q . (its product's row q)
        heads.dot = SimpleNamespace(
            term=lambda t, q, n, u, v: spec.carried_term(at(t), q, n, v),
            store=lambda t, q, u, v: T.buffer_store(o.ddA_step, T.Select(
                _bcn(o, t, o.gparts)[1] * d.chunk_size + q < o.seqlen,
                piece.scale(at(t).head(first(t) + u), q) * v, T.float32(0)), _carried_index(o, t, first(t) + u, q)))
    ge = piece.intra.causal == "ge"
    intra = SimpleNamespace(a=lambda t, q, k: piece.intra.a(at(t), q, k), b=lambda t, k, n: piece.intra.b(at(t), k, n),
                            lo=(lambda t, q: causal_start(d, q)) if ge else (lambda t, q: 0),
                            hi=(lambda t, q: at(t).end) if ge else (lambda t, q: causal_end(d, q)))
    return heads, intra


def _gsum_segment(d: ScanBwdDims, o, r: _Reads) -> SimpleNamespace:
    """gsum's weighted segment for the strategy's ``product``: unit u the part's u-th head, its g x^T (spec.pieces'
    gx) weighted by spec.gsum_term on the causal pairs; selected, not multiplied by 0 elsewhere (g_l . x_s of a
    later position s may be non-finite). ``col_end``: row l's weights are 0 from column causal_end(l) on."""
    G, P, R = d.ngroups, d.headdim, d.nheads // d.ngroups
    sp = spec.pieces(d)
    at = lambda t: _part_at(o, r, t, G)  # noqa: E731
    first = lambda t: _part_heads(o, t % o.gparts, G, R)[0]  # noqa: E731
    head = lambda t, k: at(t).head(first(t) + k // P)  # noqa: E731
    return SimpleNamespace(
        a=lambda t, l, k: sp.gx.a(head(t, k), l, k % P), b=lambda t, k, s: sp.gx.b(head(t, k), k % P, s),
        n=lambda t: _part_heads(o, t % o.gparts, G, R)[1], col_end=lambda t, l: causal_end(d, l),
        weigh=lambda t, l, s, u, v, vl, vs: T.Select(
            causal(d, l, s), spec.gsum_term(_staged(d, r, at(t).head(first(t) + u), l, vl, s, vs), l, s, v),
            T.float32(0)),
        pos=_positions(d, lambda t, u: at(t).head(first(t) + u)))


def _position_pieces(d: ScanBwdDims, S: ChunkStrategy):
    """dx (a task per (batch, chunk, head)), gsum, dB and dC (per (batch, chunk, part)): macros ``run(o, r)``
    executing scan_bwd_spec.pieces' specs by the strategy's ``product``."""
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    R = H // G
    sp = spec.pieces(d)

    dx_run = S.product(Q, P, (Q, N), dots=True)

    @T.macro
    def dx(o, r):
        """dx per (batch, chunk, head) task by the strategy's ``product``: the init D g (or 0, D on the main
        product's diagonal), the main product's causal range, then the state product weighted per row by the
        chunk-state scale w[s] dt[s]"""
        dx_run(o.batch * o.nchunks * H, lambda t: _head_at(o, r, t, H, R).end, _dx_segments(d, o, r),
               _dx_init(d, o, r),
               lambda t, s, p, v: T.buffer_store(o.dx, v.astype(d.x_dtype), _row_index(o, t, H, Q, s, p)))

    gsum_run = S.product(Q, Q, (P,))

    @T.macro
    def gsum(o, r):
        """gsum per (batch, chunk, part) task by the strategy's ``product``: a weighted segment over the part's
        heads in order, each head's g x^T (l, s) weighted by its K[l, s] dt[s] on the causal pairs (0 elsewhere)"""
        gsum_run(o.batch * o.nchunks * o.gparts, lambda t: Q, (_gsum_segment(d, o, r),), lambda t, l, s: T.float32(0),
                 lambda t, l, s, v: T.buffer_store(o.gsum, v, _bcn(o, t, o.gparts) + (l, s)))

    def part_rows(piece, out: str, carried: bool):
        """dB / dC (spec.pieces' dB, dC) per (batch, chunk, part) task by the strategy's ``product``: the part's
        heads in order (each head's sum weighted per row by its scale; dC's also dotted with C_q per row: the
        carried-state terms), then the intra-chunk product on gsum."""
        run = S.product(Q, N, (P, Q), dots=carried)

        @T.macro
        def at(o, r):
            run(o.batch * o.nchunks * o.gparts, lambda t: _part_at(o, r, t, G).end,
                _part_segments(d, o, r, piece, carried),
                lambda t, q, n: T.float32(0),
                lambda t, q, n, v: T.buffer_store(getattr(o, out), v, _row_index(o, t, o.gparts, Q, q, n)))

        return at

    return (dx,
            gsum,
            part_rows(sp.dB, "dBp", False), part_rows(sp.dC, "dCp", True))


def _step_pieces(d: ScanBwdDims, S: ChunkStrategy):
    """The per-step gradients and dD: the macro ``run(o, r)`` of ``crossing_pass`` (scan_bwd_spec.py's
    crossing-pairs form; XB and the carried-state terms are dx's and dC's row dots, read here): d dt, d dA_step
    (its carried-state part reverse-cumsummed on the way) and dD."""
    crossing = S.crossing_pass(d.chunk_size, d.headdim, lambda k: causal_start(d, k))

    @T.macro
    def pairs(o, r):
        crossing(o.batch * o.nchunks * d.nheads, _crossing_ops(d, o, r))

    return pairs


def _crossing_ops(d: ScanBwdDims, o, r: _Reads) -> SimpleNamespace:
    """The strategy's ``crossing_pass`` (strategy.py) on task t = (batch, chunk, head): v(l, k) = row l's d dt
    term of step k (spec.ddt_term), its pair term G[l, k] (spec.pair_term); per column k d dt[k] = the column
    sum + the chunk-state term of XB[k] (in ddt_out since dx's launch: read by ``pre`` and ``col_store``
    before it is overwritten), per row q d dA_step[q] = the crossing pairs + the chunk-state prefix
    sum_{k<q} w[k] dt[k] XB[k] + the reverse cumsum of the carried-state terms (``after``: in ddA_step since
    dC's launch); with D, dD (``dd``: per channel, per position with diag_skip, in D's layout)."""
    H, Q, R = d.nheads, d.chunk_size, d.nheads // d.ngroups

    def at(t):
        return _head_at(o, r, t, H, R)

    def idx(t, q):  # (batch, head, chunk, q)
        return _step_index(o, t, H, q)

    ops = SimpleNamespace(
        g=lambda t, l, p: at(t).g(l, p), x=lambda t, k, p: at(t).x(k, p),
        weight=lambda t, l, k, gx, vl, vk: spec.ddt_term(_staged(d, r, at(t), l, vl, k, vk), l, k, gx),
        pair=lambda t, k, v, vk: spec.pair_term(_staged(d, r, at(t), k, vk, k, vk), k, v),
        pos=_unit_free(_positions(d, lambda t, u: at(t))),
        pre=lambda t, k: spec.prefix_term(at(t), k, o.ddt_out[idx(t, k)]), end=lambda t: at(t).end,
        after=lambda t, q: o.ddA_step[idx(t, q)],
        col_store=lambda t, k, v: T.buffer_store(o.ddt_out, v + spec.ddt_state(at(t), k, o.ddt_out[idx(t, k)]),
                                                 idx(t, k)),
        row_store=lambda t, q, pairs, pre, tail: T.buffer_store(o.ddA_step, pairs + pre + tail, idx(t, q)))
    if d.has_D:  # D's layout: per position (batch, head, chunk, l), else per channel (batch, chunk, head, p)
        ops.dd = SimpleNamespace(per_position=d.diag_skip, store=lambda t, j, v: T.buffer_store(
            o.dD_part, v, idx(t, j) if d.diag_skip else _bcn(o, t, H) + (j,)))
    return ops
