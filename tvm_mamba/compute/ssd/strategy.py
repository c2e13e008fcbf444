"""How an SSD template is laid onto the machine: SSD's vocabulary on the strategy protocol (compute/strategy.py).

A template (compute/ssd/<kernel>.py) writes a kernel's math once, as independent *tasks* (an index range the
template decomposes into (batch, chunk, head, ...)), each optionally owning a run of contiguous *lanes* (the
innermost axis: dstate or headdim). The protocol's part is every strategy's: the task loops (``outer`` x
``inner``, ``index``: serial here, parallel on a CPU, blockIdx x threadIdx of ``threads`` on CUDA, from the
targets' mixins), ``vloop``, ``scope``, ``math``. ``ChunkStrategy`` adds:

* ``lanes(width)``: how many lanes of an elementwise-independent axis one task owns: the whole axis on a CPU
  (a vector), 1 on CUDA (a thread each). ``lane_loop(v)`` loops over them (vectorized / serial).
* ``scaled_matmul(M, W, K)``: a chunk matmul out[t, i, j] = sum_k lhs(t, i, k) (scale(t, k) rhs(t, k, j)) over
  ``extent`` tasks t, k ascending from 0 on every layout: the serial / CUDA layout runs a task per output
  element reading the operands where they are; the CPU layout stages the task's operands (scale once per k)
  and runs the register-blocked matmul of mm.py (knobs rows / cols / order). ``visits_lhs``: whether its lhs
  may carry an elementwise output of what it reads (CUDA's tiles: yes, their copies load each element once).
* ``matmul_rows(M, W, K, lower)``: the product of two row-major operands, out[t, i, j] = sum_k lhs(t, i, k)
  rhs(t, j, k) (C B^T), k ascending: ``scaled_matmul`` with scale 1; the CPU layout stages lhs rows and
  transposes rhs. ``lower``: only j <= i is kept (0 above the diagonal; CUDA skips the tiles above it).
* ``tasks()``: the task loop as a macro taking the task's body (``unravel`` splits the task index).
* ``causal_matmul(M, W, K, strict, group)``: a chunk's causal product, row i summing positions s <= i
  (``strict``: s < i, Mamba-3's diagonal goes elsewhere; ``group`` G > 1: s // G < i // G, Mamba-3 MIMO's
  same-step block goes elsewhere) with a per-(i, s) weight,
  on top of a carried M x W x K product (ssd_chunk_scan's y): a task per output element, or on a CPU the staged
  operands and two register-blocked matmuls (the causal one ``tri="le"``: no term of a later position is added).
* ``product(M, W, units, dots)``, ``crossing_pass(Q, P, start)``: the pieces of ssd_chunk_scan_bwd's launch
  form (compute/ssd/scan_bwd_launch.py): an M x W output per task summed over segments of k (causal ranges; a
  weighted segment per unit, optionally with a per-row dot of each unit's product), and the row pass of the
  causal pairs with running column sums. A task per output element here, a block per output tile or per task
  on CUDA (schedules/cuda/_tiled.py, _crossing.py).
* ``scratch(**shapes)``: a task's scratch buffers in the protocol's ``scope`` (the CPU's stack, CUDA registers).
* ``vector``: also which form a template with several chunk matmuls takes (ssd_chunk_scan_bwd): a task per
  chunk running them on staged operands (True: whole lane axes, mm.py's blocked matmuls), or a launch per
  piece with a task per output element.

Strategies never change the order in which a sum is taken, but for one: a ``product`` row dot's sum over the
columns is the layout's (a CUDA tile's columns are spread over threads). Otherwise the same template gives
bitwise-equal float32 results under every strategy that picks the same math.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from .._math import Math
from ..strategy import Strategy


class ChunkStrategy(Strategy):
    """SSD's vocabulary on the strategy protocol (compute/strategy.py): serial loops, a task per lane (as the CUDA
    strategy decomposes the work); ``native_math``: the target's exp / log1p (CUDA's arithmetic, run on the CPU
    by tests) instead of the CPU polynomials; ``libm``: the target has libm's log1p (CUDA; not WGSL). The layout
    of the unscheduled PrimFunc a builder returns. Subclasses: schedules/cpu/ssd.py, schedules/cuda/ssd.py."""

    def __init__(self, native_math: bool = False, threads: int = 1, scope: str = "global", libm: bool = True):
        super().__init__(Math("float32", native=native_math, libm=libm), threads, scope)

    def lanes(self, width: int) -> int:
        return width if self.vector else 1

    def lane_loop(self, v: int):
        return T.vectorized(v) if self.vector and v > 1 else T.serial(v)

    def scaled_matmul(self, M: int, W: int, K: int):
        """A macro ``run(extent, lhs, scale, rhs, store)``: a task per output (t, i, j), the sum over k in order
        into one scalar (module docstring; the CPU strategy overrides it)."""
        S = self

        @T.macro
        def run(extent, lhs, scale, rhs, store):
            for bx in S.outer(extent * M * W):
                for tx in S.inner():
                    acc = T.alloc_buffer((1,), "float32", scope=S.scope)
                    i = T.meta_var(S.index(bx, tx))
                    if i < extent * M * W:
                        acc[0] = T.float32(0)
                        for k in range(K):
                            acc[0] = acc[0] + lhs(i // (M * W), i // W % M, k) * (
                                scale(i // (M * W), k) * rhs(i // (M * W), k, i % W))
                        store(i // (M * W), i // W % M, i % W, acc[0])

        return run

    def visits_lhs(self, M: int, W: int, K: int) -> bool:
        """Whether ``scaled_matmul``'s run takes its lhs as a *visited* operand: a namespace of ``loads`` (one or
        two readers (t, i, k)), ``value(t, i, k, vals)`` (lhs(t, i, k) from the loads' values) and ``visit(t, i,
        k, vals)`` (a statement run once per (t, i, k): an elementwise output of what lhs reads, dstates' dz,
        then written without a pass that reads it all again). Here no: the template runs that pass itself."""
        return False

    def matmul_rows(self, M: int, W: int, K: int, lower: bool = False):
        """A macro ``run(extent, lhs, rhs, store)``: out[t, i, j] = sum_k lhs(t, i, k) rhs(t, j, k), both operands
        read as rows along k (C B^T); k ascending from 0. Here ``scaled_matmul`` with scale 1 (x * 1 is x, so
        the sum is lhs * rhs term by term); the CPU strategy stages the rows without the scale pass. ``lower``:
        the store keeps only j <= i (it stores 0 above the diagonal whatever it is given), so a layout may
        give it 0 there without the product (CUDA skips the tiles wholly above it)."""
        run = self.scaled_matmul(M, W, K)

        @T.macro
        def rows(extent, lhs, rhs, store):
            run(extent, lhs, lambda t, k: T.float32(1), lambda t, k, j: rhs(t, j, k), store)

        return rows

    def tasks(self):
        """A macro ``run(extent, body)``: ``body(i)`` (a macro call, or a lambda making one) for every task
        i < extent, as ``outer`` x ``inner`` loops with the bound check: the task loop of every template."""
        S = self

        @T.macro
        def run(extent, body):
            for bx in S.outer(extent):
                for tx in S.inner():
                    i = T.meta_var(S.index(bx, tx))
                    if i < extent:
                        body(i)

        return run

    def folds_diagonal(self, M: int, W: int, K: int, strict: bool = False, group: int = 1) -> bool:
        """Whether a per-row part of ``causal_matmul``'s carry (a value times xs(t, i, j): D x with D per row) is
        better given as a term of weight(t, i, i), the carry then leaving it out: a layout that stages xs per
        causal slice but would read xs(t, i, j) again per output for the carry. Not with ``strict`` / ``group``
        (the diagonal is outside the sum). Here no: xs(t, i, j) is read once per output either way."""
        return False

    def causal_matmul(self, M: int, W: int, K: int, strict: bool = False, group: int = 1):
        """A macro ``run(extent, rows, carried, lhs, rhs, carry, weight, xs, store, pos)``: per task t the M x W
        chunk product

            out[t, i, j] = carry(t, i, j, sum_k lhs(t, i, k) rhs(t, k, j), xs(t, i, j), v(i))
                           + sum_{s <= i} weight(t, i, s, v(i), v(s)) xs(t, s, j)      (``strict``: s < i)

        where v(q) is the tuple of the per-position values ``pos`` (a tuple of (reader(t, q), dtype)) at chunk
        position q: here read where they are, a tiled layout stages them once per tile.

        (``group`` G > 1, with strict: s < (i // G) G, the positions of strictly earlier groups of G)

        (k ascending over K, then s ascending from 0: row i of a chunk sees its positions s <= i only; ``carry``
        adds what does not depend on s, e.g. the carried state and D x), then store(t, i, j, v) for the rows
        i < rows(t) (a ragged last chunk). Where ``carried(t)`` is false the task's rhs is all zeros (no state
        enters the first chunk): the k sum is skipped and carry gets 0, the same bits as summing 0 * lhs for a
        finite lhs. A task per output element here, the sums in one scalar; the CPU strategy stages the
        operands and runs the register-blocked matmuls of mm.py in the same order."""
        S = self
        end = causal_end(strict, group)

        @T.macro
        def run(extent, rows, carried, lhs, rhs, carry, weight, xs, store, pos):
            for bx in S.outer(extent * M * W):
                for tx in S.inner():
                    acc = T.alloc_buffer((1,), "float32", scope=S.scope)
                    i = T.meta_var(S.index(bx, tx))
                    t = T.meta_var(i // (M * W))
                    r = T.meta_var(i // W % M)
                    j = T.meta_var(i % W)
                    if i < extent * M * W:
                        if r < rows(t):
                            acc[0] = T.float32(0)
                            if carried(t):
                                for k in range(K):
                                    acc[0] = acc[0] + lhs(t, r, k) * rhs(t, k, j)
                            acc[0] = carry(t, r, j, acc[0], xs(t, r, j), at(pos, t, r))
                            for s in range(end(r)):
                                acc[0] = acc[0] + weight(t, r, s, at(pos, t, r), at(pos, t, s)) * xs(t, s, j)
                            store(t, r, j, acc[0])

        return run

    def product(self, M: int, W: int, units: tuple, dots: bool = False):
        """A macro ``run(extent, rows, segs, init, store)``: per task t the M x W output

            out[t, i, j] = init(t, i, j) + sum over the segments in order of
                           sum_{k in [lo(t, i), hi(t, i))} a(t, i, k) b(t, k, j)      (k ascending)

        segment q (``segs[q]``: a namespace of a, b, lo, hi) spanning k < n units[q] (n symbolic: e.g. a head
        part's heads, each ``units[q]`` deep), lo and hi non-decreasing in i (a causal range); then
        store(t, i, j, v) for the rows i < rows(t) (a ragged last chunk). A *weighted* segment (a, b, n, weigh:
        no lo / hi) adds weigh(t, i, j, u, v) per unit u < n(t) in order, v = its own sum over the unit's k
        (a weight per output element and unit: a head's decay mask). A segment with ``pos`` (per-position
        readers (reader(t, u, q), dtype): i and k, or i and j, are chunk positions) gets their values as two
        more arguments: a(t, i, k, v(i), v(k)), weigh(t, i, j, u, v, v(i), v(j)) (read in place here, staged
        per tile on CUDA). A weighted segment with ``row_pos`` instead (readers of the rows i only: j is no
        position) gets weigh(t, i, j, u, v, v(i)): a per-row weight of each unit (a head's chunk-state scale)
        computed once per row. A weighted segment may say ``col_end(t, i)``: weigh is 0 for the columns j >=
        col_end(t, i), non-decreasing in i (the CUDA tiles past it skip the product). A weighted segment may
        say ``dot``, a namespace of term(t, i, j, u, v) and store(t, i, u, v): per unit u and row i < M (every row:
        past rows(t) too) store(t, i, u, sum_j term(t, i, j, u, v_u(i, j))), v_u the unit's own sum (a per-row dot
        of the unit's product: ssd_chunk_scan_bwd's XB and carried-state terms without a launch of their own);
        the sum over j is the one order a strategy may choose (here j ascending; CUDA's tiles sum each thread's
        columns, then the threads'), and ``dots`` must be True (a CUDA tile then spans the whole width W). At
        most two segments. A task per output element here; the CUDA strategy stages each segment's operands per
        output tile (_tiled.py)."""
        S = self
        tasks = self.tasks()
        segment = _serial_segment(units[0]), _serial_segment(units[-1])
        row_dots = _serial_row_dot(self, W, units[0]), _serial_row_dot(self, W, units[-1])

        @T.macro
        def one(rows, segs, init, store, t, r, j):
            if r < rows(t):
                w = T.meta_var(S.scratch(acc=(2,)))
                w.acc[0] = init(t, r, j)
                segment[0](w.acc, segs[0], t, r, j)
                if len(segs) > 1:
                    segment[1](w.acc, segs[1], t, r, j)
                store(t, r, j, w.acc[0])

        @T.macro
        def run(extent, rows, segs, init, store):
            tasks(extent * M * W, lambda i: one(rows, segs, init, store, i // (M * W), i // W % M, i % W))
            if hasattr(segs[0], "dot"):
                tasks(extent * M, lambda i: row_dots[0](segs[0], i // M, i % M))
            if len(segs) > 1:
                if hasattr(segs[1], "dot"):
                    tasks(extent * M, lambda i: row_dots[1](segs[1], i // M, i % M))

        return run

    def crossing_pass(self, Q: int, P: int, start):
        """A macro ``run(extent, ops)``: ssd_chunk_scan_bwd's pass over the causal pairs of each task t's chunk
        (scan_bwd_launch.py; ``ops`` holds the callables below). With gx(l, k) = sum_p g(t, l, p) x(t, k, p)
        (p ascending from 0) and, for the rows l >= start(k) of column k inside the sequence (l < end(t)),
        v(l, k) = weight(t, l, k, gx(l, k), v(l), v(k)) (v(q): the values of the per-position readers ``ops.pos``,
        (reader(t, q), dtype) pairs, at q: read in place here, staged on CUDA), rows l from the last up:

            col_store(t, k, sum_l v(l, k))                                           (l descending)
            row_store(t, q, sum_{k<q} R_q[k], sum_{k<q} pre(t, k), sum_{l>=q} after(t, l))
                                                              (k ascending; l descending: a reverse cumsum)
            R_q[k] = sum_{l>=q} pair(t, k, v(l, k), v(k))     (l descending: the crossing pairs k < q <= l)

        with pre(t, k) and after(t, l) read before any store of the task (the stores may overwrite what they
        read). ``ops.dd`` (optional: dD, spec.pieces' dd.term(l, p) = g x at (l, p)): ``dd.per_position``:
        dd.store(t, l, sum_p g(t, l, p) x(t, l, p)) (p ascending), else dd.store(t, p, sum_l g(t, l, p) x(t, l,
        p)) (l descending, every row: g and x are 0 past the sequence). Each gx and weight is computed once per
        pair and each R_q[k] is a running column sum (the task form's row pass, scan_bwd_task.py): O(Q^2 P) per
        task. Here a task runs serially; the CUDA strategy runs a block per task, a thread per column
        (schedules/cuda/_crossing.py), in the same order."""
        S = self
        tasks = self.tasks()

        @T.macro
        def one(ops, t):
            w = T.meta_var(S.scratch(dd=(Q,), rs=(Q,), pre=(Q,), after=(Q,), dc=(P,), acc=(5,)))
            for k in range(Q):
                w.dd[k] = T.float32(0)
                w.rs[k] = T.float32(0)
                w.pre[k] = ops.pre(t, k)
                w.after[k] = ops.after(t, k)
            for p in range(P):
                w.dc[p] = T.float32(0)
            w.acc[3] = T.float32(0)
            for lr in range(Q):
                l = T.meta_var(Q - 1 - lr)
                for k in range(Q):
                    if T.And(l >= start(k), l < ops.end(t)):
                        w.acc[0] = T.float32(0)
                        for p in range(P):
                            w.acc[0] = w.acc[0] + ops.g(t, l, p) * ops.x(t, k, p)
                        w.acc[0] = ops.weight(t, l, k, w.acc[0], at(ops.pos, t, l), at(ops.pos, t, k))
                        w.dd[k] = w.dd[k] + w.acc[0]
                        w.rs[k] = w.rs[k] + ops.pair(t, k, w.acc[0], at(ops.pos, t, k))
                w.acc[1] = T.float32(0)
                w.acc[2] = T.float32(0)
                for k in range(l):
                    w.acc[1] = w.acc[1] + w.rs[k]
                    w.acc[2] = w.acc[2] + w.pre[k]
                w.acc[3] = w.acc[3] + w.after[l]
                ops.row_store(t, l, w.acc[1], w.acc[2], w.acc[3])
                if hasattr(ops, "dd"):
                    _serial_dd_row(ops, w, t, l, P)
            for k in range(Q):
                ops.col_store(t, k, w.dd[k])
            if hasattr(ops, "dd"):
                if not ops.dd.per_position:
                    for p in range(P):
                        ops.dd.store(t, p, w.dc[p])

        @T.macro
        def run(extent, ops):
            tasks(extent, lambda t: one(ops, t))

        return run

    def scratch(self, **shapes) -> SimpleNamespace:
        """A task's scratch buffers in ``scope``, each named by its keyword: ``shape`` (float32) or
        ``(shape, dtype)``. Call inside the task's loop as ``w = T.meta_var(S.scratch(acc=(2,), ...))``, then
        read ``w.acc``: one table instead of a line per buffer."""
        def alloc(name, spec):
            shape, dtype = spec if isinstance(spec[0], tuple) else (spec, "float32")
            buf = T.alloc_buffer(shape, dtype, scope=self.scope)
            IRBuilder.name(name, buf)  # as the parser names ``name = T.alloc_buffer(...)``
            return buf

        return SimpleNamespace(**{name: alloc(name, spec) for name, spec in shapes.items()})


def _serial_segment(unit: int):
    """A macro ``run(acc, seg, t, i, j)``: acc[0] += one segment of ``ChunkStrategy.product`` at output (i, j) of task t
    (acc[1]: a weighted segment's unit sum)."""

    @T.macro
    def run(acc, seg, t, i, j):
        if hasattr(seg, "weigh"):
            for u in range(seg.n(t)):
                acc[1] = T.float32(0)
                for k in range(unit):
                    acc[1] = acc[1] + seg.a(t, i, u * unit + k) * seg.b(t, u * unit + k, j)
                if hasattr(seg, "pos"):
                    acc[0] = acc[0] + seg.weigh(t, i, j, u, acc[1], _pos_at(seg, t, u, i), _pos_at(seg, t, u, j))
                elif hasattr(seg, "row_pos"):
                    acc[0] = acc[0] + seg.weigh(t, i, j, u, acc[1], _pos_at(seg, t, u, i, "row_pos"))
                else:
                    acc[0] = acc[0] + seg.weigh(t, i, j, u, acc[1])
        elif hasattr(seg, "pos"):
            for k in range(seg.lo(t, i), seg.hi(t, i)):
                acc[0] = acc[0] + seg.a(t, i, k, _pos_at(seg, t, 0, i), _pos_at(seg, t, 0, k)) * seg.b(t, k, j)
        else:
            for k in range(seg.lo(t, i), seg.hi(t, i)):
                acc[0] = acc[0] + seg.a(t, i, k) * seg.b(t, k, j)

    return run


@T.macro
def _serial_dd_row(ops, w, t, l, P: int):
    """``crossing_pass``'s dD at row l: its own dot g_l . x_l (per position), else its terms added to the
    channels' sums ``w.dc``."""
    if ops.dd.per_position:
        w.acc[4] = T.float32(0)
        for p in range(P):
            w.acc[4] = w.acc[4] + ops.g(t, l, p) * ops.x(t, l, p)
        ops.dd.store(t, l, w.acc[4])
    else:
        for p in range(P):
            w.dc[p] = w.dc[p] + ops.g(t, l, p) * ops.x(t, l, p)


def _serial_row_dot(S: ChunkStrategy, W: int, unit: int):
    """A macro ``run(seg, t, i)``: a weighted ``ChunkStrategy.product`` segment's ``dot`` at row i of task t, per unit:
    the unit's sums recomputed per column j, j ascending."""

    @T.macro
    def run(seg, t, i):
        w = T.meta_var(S.scratch(acc=(2,)))
        for u in range(seg.n(t)):
            w.acc[0] = T.float32(0)
            for j in range(W):
                w.acc[1] = T.float32(0)
                for k in range(unit):
                    w.acc[1] = w.acc[1] + seg.a(t, i, u * unit + k) * seg.b(t, u * unit + k, j)
                w.acc[0] = w.acc[0] + seg.dot.term(t, i, j, u, w.acc[1])
            seg.dot.store(t, i, u, w.acc[0])

    return run


def _pos_at(seg, t, u, q, attr: str = "pos"):
    """A ``product`` segment's per-position values (``seg.pos`` or ``seg.row_pos``: (reader(t, u, q), dtype)
    pairs) at position q of task t, unit u, read in place."""
    return tuple(read(t, u, q) for read, _ in getattr(seg, attr))


def at(pos, t, q):
    """The per-position values ``pos`` ((reader, dtype) pairs) of task t at chunk position q, read in place."""
    return tuple(read(t, q) for read, _ in pos)


def causal_end(strict: bool, group: int):
    """Row i of a causal chunk product sums positions s < end(i): i + 1, i (``strict``) or the start of i's
    group of ``group`` positions (``causal_matmul``)."""
    if group > 1:
        return lambda r: r // group * group
    return (lambda r: r) if strict else (lambda r: r + 1)


def unravel(i, extents):
    """Task index ``i`` as the digits of the mixed radix ``extents`` (outermost first; the first extent bounds
    nothing): ``unravel(i, (batch, H, P))`` = (i // (H * P), i // P % H, i % P), each digit from i itself."""
    digits = []
    for k in range(len(extents)):
        inner = 1
        for e in extents[k + 1:]:
            inner = inner * e
        d = i // inner if k + 1 < len(extents) else i
        digits.append(d % extents[k] if k > 0 else d)
    return tuple(digits)


SERIAL = ChunkStrategy()
