"""Shared-memory tiled chunk matmuls for the CUDA SSD strategy (schedules/cuda/ssd.py); their tensor-core forms
are in _tiled_tc.py.

A block computes one TM x TW tile of one task's M x W product; its ``threads`` threads first copy a K-slice
of both operands (KT rows of k) into shared memory cooperatively, wait, then each computing thread adds the
slice to its RM x RW register block (rows ``CM`` apart, columns ``CW`` apart: a warp's shared reads of the
right operand hit consecutive banks, of the left one a broadcast), wait, and the next slice. Each operand
element is requested from global memory once per tile instead of once per output (the task-per-output
layout re-read a row of K per output: 100-400x the minimum bytes), and per-k or per-(i, s) factors that
cost an exp (chunk_state's decay weight, chunk_scan's segment-sum mask) are computed once per tile.

Every output is still one register summed over k ascending, so the sums are in the order of the serial
strategy (strategy.py): the layout changes where operands come from, never the arithmetic.

Copies: ``k_fast`` operands (C / B rows along dstate, cb rows along s) put consecutive threads on
consecutive k (their contiguous axis: whole 128-byte lines per warp request); the others on consecutive
i / j. A k-fast copy writes shared memory at a stride of the tile row, so those tiles are padded by one
float (stride TM + 1: no bank conflict on the copy).

MIN_BLOCKS: the kernels say ``__launch_bounds__(threads, 1)``. With the thread count alone, CUDA 13's ptxas
capped the register-blocked kernels at 48 (256 threads) or 64 (128 threads) registers and spilled (chunk_scan
with seq_idx and bf16 states: 96 bytes); with a minimum of one block per SM it allocates what the register
block needs (72-96) without spilling.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

TILE_CAP = (32, 64, 128)  # largest output tile side (the ``tile`` knob)
K_SLICE = 32  # largest k-slice staged per round


def largest_divisor(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class Tile:
    """An M x W x K product's TM x TW output tile and KT-deep k slices: what the task mapping (``_tile_of``) and
    the copies read, shared by the FMA form (``Tiling``) and the tensor-core form (``_tiled_tc.TcTiling``)."""

    M: int
    W: int
    K: int
    TM: int
    TW: int
    KT: int


@dataclasses.dataclass(frozen=True)
class Tiling(Tile):
    """A ``Tile`` computed by CM x CW threads each owning an RM x RW register block; ``k_slice``: the deepest slice
    staged per round (K_SLICE; thinner where a block's shared memory is small: ``product_floats``)."""

    CM: int
    CW: int
    threads: int
    k_slice: int = K_SLICE

    @property
    def RM(self) -> int:
        return self.TM // self.CM

    @property
    def RW(self) -> int:
        return self.TW // self.CW

    @staticmethod
    def of(M: int, W: int, K: int, threads: int, cap: int = 64, full_width: bool = False,
           k_slice: int = K_SLICE) -> "Tiling":
        """The tile for an M x W x K product: sides the largest divisors <= ``cap``, as many computing threads
        as fit ``threads`` with the most square register block (fewest operand loads per multiply-add).
        ``full_width``: the tile spans all W columns (a block then holds whole rows: ``tiled_product``'s row
        dots), its rows at most cap^2 / W (the register block no larger than a cap x cap tile's). ``k_slice``:
        the slices' depth, at most (a thinner one stages less shared memory: 16 KB of WebGPU workgroup memory)."""
        TW = W if full_width else largest_divisor(W, cap)
        TM = largest_divisor(M, max(1, min(cap, cap * cap // W)) if full_width else cap)
        KT = largest_divisor(K, k_slice)
        best = None
        for cw in (d for d in range(1, TW + 1) if TW % d == 0):
            for cm in (d for d in range(1, TM + 1) if TM % d == 0):
                if cm * cw <= threads:
                    key = (-cm * cw, TM // cm + TW // cw, -cw)
                    best = min(best, (key, cm, cw)) if best else (key, cm, cw)
        _, cm, cw = best
        return Tiling(M, W, K, TM, TW, KT, cm, cw, threads, k_slice)


def _copy(tl, rows: int, cols: int, k_fast: bool, at=None, dtype: str | None = None):
    """A macro ``copy(dst, src, tx)``: dst[at(k, c)] = src(k, c) for the k x ``cols`` slice (k < ``rows``), the
    block's threads taking consecutive k (``k_fast``) or consecutive c. ``dst`` is flat; ``at`` by default row
    k at stride ``stride(cols, k_fast)``; ``dtype``: the value rounded to it (a 16-bit tensor-core slice).
    ``src`` may be a visited operand (strategy.py ``visits_lhs``; ``operand_at``): a namespace of loads (one
    or two readers (k, c)), value(k, c, vals) and visit(k, c, vals); each element's loads then go once into
    registers, then its value into dst and the visit (an elementwise output of the same loads)."""
    ld = stride(cols, k_fast)
    at = at or (lambda k, c: k * ld + c)
    cast = (lambda v: v.astype(dtype)) if dtype else (lambda v: v)  # noqa: E731
    n, rounds = rows * cols, (rows * cols + tl.threads - 1) // tl.threads

    @T.macro
    def plain(dst, src, tx):
        for e in T.unroll(rounds):
            if e * tl.threads + tx < n:
                idx = T.meta_var(e * tl.threads + tx)
                if k_fast:
                    dst[at(idx % rows, idx // rows)] = cast(src(idx % rows, idx // rows))
                else:
                    dst[at(idx // cols, idx % cols)] = cast(src(idx // cols, idx % cols))

    @T.macro
    def visiting(dst, src, tx):
        r = T.alloc_buffer((2,), "float32", scope="local")
        for e in T.unroll(rounds):
            if e * tl.threads + tx < n:
                idx = T.meta_var(e * tl.threads + tx)
                k, c = T.meta_var((idx % rows, idx // rows) if k_fast else (idx // cols, idx % cols))
                r[0] = src.loads[0](k, c)
                if len(src.loads) > 1:
                    r[1] = src.loads[1](k, c)
                dst[at(k, c)] = cast(src.value(k, c, r))
                src.visit(k, c, r)

    @T.macro
    def copy(dst, src, tx):
        if hasattr(src, "visit"):
            visiting(dst, src, tx)
        else:
            plain(dst, src, tx)

    return copy


@T.macro
def _visit_if(cond, visit, t, i, k, vals):
    if cond:
        visit(t, i, k, vals)


def _mapped(op, args):
    """An operand (a callable, or a visited namespace of loads / value / visit) read at (k, i) through
    args(k, i): its own arguments."""
    if not hasattr(op, "visit"):
        return lambda k, i: op(*args(k, i))
    return SimpleNamespace(loads=tuple((lambda k, i, rd=rd: rd(*args(k, i))) for rd in op.loads),
                           value=lambda k, i, v: op.value(*args(k, i), v),
                           visit=lambda k, i, v: op.visit(*args(k, i), v))


def operand_at(lhs, t, i0, j0, k0=0):
    """Task t's lhs at a tile's rows and a slice from k0: (k, i) -> lhs(t, i0 + i, k0 + k). A visited operand
    (a namespace: strategy.py ``visits_lhs``) stays one, its visit run by the task's first column tile only
    (j0 == 0: once per element)."""
    if hasattr(lhs, "visit"):
        lhs = SimpleNamespace(loads=lhs.loads, value=lhs.value,
                              visit=lambda t_, i, k, v, visit=lhs.visit: _visit_if(j0 == 0, visit, t_, i, k, v))
    at = (lambda k: k) if isinstance(k0, int) and k0 == 0 else (lambda k: k0 + k)  # noqa: E731
    return _mapped(lhs, lambda k, i: (t, i0 + i, at(k)))


def stride(cols: int, k_fast: bool) -> int:
    """Row stride of a staged slice: a k-fast copy writes down a column, so its rows are padded by one float
    (consecutive threads then hit consecutive banks). The slices are flat buffers: a 2-D one would be
    compacted back to the columns read."""
    return cols + 1 if k_fast else cols


def block_product(tl: Tiling, KT: int, a_fast: bool, b_fast: bool):
    """A macro ``product(acc, sh, nk, a, b, tx, ok, stage)``: for thread ``tx``'s RM x RW block of the tile,
    acc[r, c] += a(k, i) b(k, j) for k ascending over ``nk`` slices of ``KT`` (``a`` may be a visited operand,
    ``operand_at``), the term added only where
    ``ok(k, i)`` (the causal products' range of row i; i / j tile-relative). ``stage(ko)``: what slice ``ko``'s
    operands read from shared memory besides the slices (a per-k scale, per-position values), written
    before them behind a barrier; None: nothing. ``sh``: the block's shared slices (a, b) and the thread's
    operand registers (ar, br). ``nk`` must be the same for every thread of the block (the barriers)."""
    copy_a, copy_b = _copy(tl, KT, tl.TM, a_fast), _copy(tl, KT, tl.TW, b_fast)
    RM, RW, CM, CW = tl.RM, tl.RW, tl.CM, tl.CW
    LA, LB = stride(tl.TM, a_fast), stride(tl.TW, b_fast)

    @T.macro
    def product(acc, sh, nk, a, b, tx, ok, stage):
        for ko in range(nk):
            if stage is not None:
                stage(ko)
                T.tvm_storage_sync("shared")
            copy_b(sh.b, lambda k, j: b(ko * KT + k, j), tx)
            copy_a(sh.a, _mapped(a, lambda k, i: (ko * KT + k, i)), tx)
            T.tvm_storage_sync("shared")
            if tx < CM * CW:
                for k in range(KT):
                    for r in T.unroll(RM):
                        sh.ar[r] = sh.a[k * LA + tx // CW + r * CM]
                    for c in T.unroll(RW):
                        sh.br[c] = sh.b[k * LB + tx % CW + c * CW]
                    for r in T.unroll(RM):
                        for c in T.unroll(RW):
                            if ok(ko * KT + k, tx // CW + r * CM):
                                acc[r, c] = acc[r, c] + sh.ar[r] * sh.br[c]
            T.tvm_storage_sync("shared")

    return product


def _fill(tl: Tiling, n: int):
    """A macro ``fill(dst, base, value, tx)``: dst[base + q] = value(q) for q < n, the block's threads taking
    consecutive q."""

    @T.macro
    def fill(dst, base, value, tx):
        for e in T.unroll((n + tl.threads - 1) // tl.threads):
            if e * tl.threads + tx < n:
                dst[base + e * tl.threads + tx] = value(e * tl.threads + tx)

    return fill


def _buffers(scope: str, **shapes) -> SimpleNamespace:
    """float32 buffers in ``scope``, named by keyword (call inside the macro at the level that owns them)."""
    def alloc(name, shape):
        buf = T.alloc_buffer(shape, "float32", scope=scope)
        IRBuilder.name(name, buf)
        return buf

    return SimpleNamespace(**{name: alloc(name, shape) for name, shape in shapes.items()})


def _tile_of(tl: Tile, bx):
    """Block ``bx`` -> (task, first row, first column) of its tile."""
    ti, tj = tl.M // tl.TM, tl.W // tl.TW
    return bx // (ti * tj), bx // tj % ti * tl.TM, bx % tj * tl.TW


def tiled_matmul(tl: Tiling, k_fast: bool, scaled: bool, lower: bool = False):
    """The strategy's ``run(extent, lhs, scale, rhs, store)`` (strategy.py ``scaled_matmul``; ``scaled``
    False: ``run(extent, lhs, rhs, store)`` of ``matmul_rows``, rhs(t, j, k) read along k), a block per tile;
    ``lower``: the tiles wholly above the diagonal (j > i everywhere) store 0 without their product."""
    product = block_product(tl, tl.KT, k_fast, k_fast)
    fill = _fill(tl, tl.KT)
    blocks = tl.M // tl.TM * (tl.W // tl.TW)
    RM, RW, CM, CW = tl.RM, tl.RW, tl.CM, tl.CW
    SA, SB = tl.KT * stride(tl.TM, k_fast), tl.KT * stride(tl.TW, k_fast)

    @T.macro
    def run_any(extent, lhs, scale, rhs, store):
        for bx in T.thread_binding(extent * blocks, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # see MIN_BLOCKS
            sh = T.meta_var(_buffers("shared", a=(SA,), b=(SB,), s=(tl.KT,)))
            for tx in T.thread_binding(tl.threads, thread="threadIdx.x"):
                t, i0, j0 = T.meta_var(_tile_of(tl, bx))
                reg = T.meta_var(_buffers("local", acc=(RM, RW), ar=(RM,), br=(RW,)))
                for r in T.unroll(RM):
                    for c in T.unroll(RW):
                        reg.acc[r, c] = T.float32(0)
                ops = T.meta_var(SimpleNamespace(a=sh.a, b=sh.b, ar=reg.ar, br=reg.br))
                if scaled:  # the k factor (chunk_state's decay weight: an exp) once per slice
                    product(reg.acc, ops, tl.K // tl.KT, operand_at(lhs, t, i0, j0),
                            lambda k, j: sh.s[k % tl.KT] * rhs(t, k, j0 + j), tx, lambda k, i: True,
                            lambda ko: fill(sh.s, 0, lambda k: scale(t, ko * tl.KT + k), tx))
                else:
                    product(reg.acc, ops, upper_skip(lower, tl, i0, j0, tl.K // tl.KT), lambda k, i: lhs(t, i0 + i, k),
                            lambda k, j: rhs(t, j0 + j, k), tx, lambda k, i: True, None)
                if tx < CM * CW:
                    for r in T.unroll(RM):
                        for c in T.unroll(RW):
                            store(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW, reg.acc[r, c])

    return _entry(run_any, scaled)


def upper_skip(lower: bool, tl: Tile, i0, j0, slices):
    """The k slices of the tile at (i0, j0): ``slices``, or with ``lower`` 0 for a tile wholly above the diagonal
    (its first column past its last row; the same for the whole block: its barriers)."""
    return T.Select(j0 >= i0 + tl.TM, 0, slices) if lower else slices


def _entry(run_any, scaled: bool):
    """``run_any`` as ``scaled_matmul``'s run, or ``matmul_rows``' ``run(extent, lhs, rhs, store)`` (scale 1)."""
    if scaled:
        return run_any

    @T.macro
    def run_rows(extent, lhs, rhs, store):
        run_any(extent, lhs, lambda t, k: T.float32(1), rhs, store)

    return run_rows


def tiled_causal(tl: Tiling, end):
    """The strategy's ``causal_matmul`` run (strategy.py): a block per TM x TW tile of a task's chunk; the
    carried product over K = dstate in slices, ``carry``, then the causal sum over the positions s < end(i)
    in slices of KS, its weights staged once per tile (the exp of the segment sum once per (i, s)); slices
    past the tile's last row (or the chunk's rows) are not visited. The per-position values (``pos``) are
    staged too: the tile's rows once, each slice's positions with the slice."""
    KS = largest_divisor(tl.M, tl.k_slice)
    carried_product = block_product(tl, tl.KT, True, True)
    causal_product = block_product(tl, KS, True, False)
    fill_rows, fill_cols = _fill(tl, tl.TM), _fill(tl, KS)
    blocks = tl.M // tl.TM * (tl.W // tl.TW)
    RM, RW, CM, CW, KX = tl.RM, tl.RW, tl.CM, tl.CW, max(tl.KT, KS)
    SA, SB = KX * stride(tl.TM, True), KX * stride(tl.TW, True)

    stage_rows, stage_cols = _stage_positions(fill_rows), _stage_positions(fill_cols)
    store_rows = _store_rows(tl)

    @T.macro
    def run(extent, rows, carried, lhs, rhs, carry, weight, xs, store, pos):
        for bx in T.thread_binding(extent * blocks, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # see MIN_BLOCKS
            sh = T.meta_var(_buffers("shared", a=(SA,), b=(SB,)))
            vr = T.meta_var(_typed("shared", "vr", tl.TM, pos))  # the tile's rows
            vc = T.meta_var(_typed("shared", "vc", KS, pos))  # the slice's positions
            for tx in T.thread_binding(tl.threads, thread="threadIdx.x"):
                t, i0, j0 = T.meta_var(_tile_of(tl, bx))
                reg = T.meta_var(_buffers("local", acc=(RM, RW), ar=(RM,), br=(RW,)))
                ops = T.meta_var(SimpleNamespace(a=sh.a, b=sh.b, ar=reg.ar, br=reg.br))
                for r in T.unroll(RM):
                    for c in T.unroll(RW):
                        reg.acc[r, c] = T.float32(0)
                stage_rows(vr, pos, t, i0, tx)
                if carried(t):  # the same for the whole block: its barriers are reached by every thread
                    carried_product(reg.acc, ops, tl.K // tl.KT, lambda k, i: lhs(t, i0 + i, k),
                                    lambda k, j: rhs(t, k, j0 + j), tx, lambda k, i: True, None)
                else:
                    T.tvm_storage_sync("shared")
                if tx < CM * CW:
                    for r in T.unroll(RM):
                        for c in T.unroll(RW):
                            reg.acc[r, c] = carry(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW, reg.acc[r, c],
                                                  xs(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW),
                                                  _values(vr, tx // CW + r * CM))
                causal_product(reg.acc, ops, (T.min(end(i0 + tl.TM - 1), rows(t)) + KS - 1) // KS,
                               lambda s, i: weight(t, i0 + i, s, _values(vr, i), _values(vc, s % KS)),
                               lambda s, j: xs(t, s, j0 + j), tx, lambda s, i: s < end(i0 + i),
                               lambda ko: stage_cols(vc, pos, t, ko * KS, tx))
                store_rows(reg.acc, t, i0, j0, tx, rows, store)

    return run


def _store_rows(tl: Tiling):
    """A macro ``store_rows(acc, t, i0, j0, tx, rows, store)``: thread tx's register block of the tile at (i0, j0)
    through ``store``, the rows i < rows(t) only (a ragged last chunk)."""
    RM, RW, CM, CW = tl.RM, tl.RW, tl.CM, tl.CW

    @T.macro
    def store_rows(acc, t, i0, j0, tx, rows, store):
        if tx < CM * CW:
            for r in T.unroll(RM):
                for c in T.unroll(RW):
                    if i0 + tx // CW + r * CM < rows(t):
                        store(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW, acc[r, c])

    return store_rows


def _stage_positions(fill):
    """A macro ``stage(slots, pos, t, q0, tx)``: every per-position reader p of ``pos`` (at most 4: dA_cs, dt_out,
    the sequence id, D) at positions q0 + q of task t into its slot (``_typed``), by ``fill``."""

    @T.macro
    def stage(slots, pos, t, q0, tx):
        fill(slots[0][0], slots[0][1], lambda q: pos[0][0](t, q0 + q), tx)
        if len(pos) > 1:
            fill(slots[1][0], slots[1][1], lambda q: pos[1][0](t, q0 + q), tx)
        if len(pos) > 2:
            fill(slots[2][0], slots[2][1], lambda q: pos[2][0](t, q0 + q), tx)
        if len(pos) > 3:
            fill(slots[3][0], slots[3][1], lambda q: pos[3][0](t, q0 + q), tx)

    return stage


def _values(slots, q):
    """The staged per-position values at slot position q (a tuple, in ``pos`` order)."""
    return tuple(buf[base + q] for buf, base in slots)


def _typed(scope: str, name: str, n: int, pos) -> list:
    """The staged per-position values of ``pos`` in ``scope``: a (buffer, offset) slot of n values per reader,
    the readers of one dtype sharing one flat buffer (name_float32, name_int32). One buffer per reader let
    TVM's storage rewrite give an unread one's memory to a slice buffer while both were still written: a
    race (the rows' dt_out is staged but only the columns' is read)."""
    assert 1 <= len(pos) <= 4, len(pos)
    dtypes = sorted({dtype for _, dtype in pos})
    bufs = {}
    for dtype in dtypes:
        bufs[dtype] = T.alloc_buffer((n * sum(1 for _, dt in pos if dt == dtype),), dtype, scope=scope)
        IRBuilder.name(f"{name}_{dtype}", bufs[dtype])
    used = {dtype: 0 for dtype in dtypes}
    slots = []
    for _, dtype in pos:
        slots.append((bufs[dtype], used[dtype] * n))
        used[dtype] += 1
    return slots


def tiled_product(tl: Tiling, units: tuple, a_fast: bool = False, b_fast: bool = False):
    """The strategy's ``product`` run (strategy.py): a block per TM x TW tile of a task's output, the init in
    the register block, then each segment's k range over the tile's rows (from its first row's lo to its last
    row's hi, in whole slices of the largest divisor of its unit <= tl.k_slice: the reads stay inside the
    segment) staged slice by slice, each row's own range selected per term. A segment's per-position values
    (``pos``) are staged too: the tile's rows once, each slice's (or, weighted, the tile's columns') with it.
    A weighted segment's row ``dot`` (the tile spans the width: ``Tiling.of(full_width=True)``): each thread
    sums its columns' terms per row into shared memory, then a thread per row sums the row's threads (in
    column-thread order) and stores it."""
    KTs, SA, SB = _product_slices(tl, units, a_fast, b_fast)
    runs = [_segment(tl, u, kt, a_fast, b_fast) for u, kt in zip(units, KTs)]
    blocks = tl.M // tl.TM * (tl.W // tl.TW)
    RM, RW, CM, CW, KX = tl.RM, tl.RW, tl.CM, tl.CW, max(KTs)
    store_rows = _store_rows(tl)

    @T.macro
    def run(extent, rows, segs, init, store):
        for bx in T.thread_binding(extent * blocks, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # see MIN_BLOCKS
            sh = T.meta_var(_buffers("shared", a=(SA,), b=(SB,)))
            vr, vc, vw = T.meta_var(segment_slots(tl, segs, KX))
            for tx in T.thread_binding(tl.threads, thread="threadIdx.x"):
                t, i0, j0 = T.meta_var(_tile_of(tl, bx))
                reg = T.meta_var(_buffers("local", acc=(RM, RW), unit=(RM, RW), ar=(RM,), br=(RW,), part=(1,)))
                ops = T.meta_var(SimpleNamespace(a=sh.a, b=sh.b, ar=reg.ar, br=reg.br, unit=reg.unit, vr=vr, vc=vc,
                                                 vw=vw, red=_row_parts(tl, segs, sh.b), part=reg.part))
                if tx < CM * CW:
                    for r in T.unroll(RM):
                        for c in T.unroll(RW):
                            reg.acc[r, c] = init(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW)
                runs[0](reg.acc, ops, segs[0], t, i0, j0, tx)
                if len(segs) > 1:
                    runs[1](reg.acc, ops, segs[1], t, i0, j0, tx)
                store_rows(reg.acc, t, i0, j0, tx, rows, store)

    return run


def _product_slices(tl: Tiling, units: tuple, a_fast: bool = False, b_fast: bool = False) -> tuple:
    """``tiled_product``'s slice depths (per unit: the largest divisor <= tl.k_slice) and its two slice buffers'
    floats (a: KX x TM; b: KX x TW, or a row dot's TM x (CW + 1) partial sums where larger)."""
    KTs = [largest_divisor(u, tl.k_slice) for u in units]
    KX = max(KTs)
    return KTs, KX * stride(tl.TM, a_fast), max(KX * stride(tl.TW, b_fast), tl.TM * (tl.CW + 1))


def product_floats(tl: Tiling, units: tuple, readers: int = 4) -> int:
    """At most how many 4-byte words of shared memory ``tiled_product`` on ``tl`` allocates: the slices, and the
    per-position slots (``segment_slots``) of at most ``readers`` readers (``_typed``: 4) over the tile's rows
    (vr, vw) and a slice's or the tile's columns (vc). For the rule to pick a ``k_slice`` within a budget."""
    KTs, SA, SB = _product_slices(tl, units)
    return SA + SB + readers * (2 * tl.TM + max(max(KTs), tl.TW))


def _row_parts(tl: Tiling, segs, slices):
    """Where a segment's row ``dot`` keeps its per-(row, column thread) partial sums (rows CW + 1 apart: the
    row sums' reads hit distinct banks): the right operand's slice buffer ``slices`` (sized for both; between
    a unit's product and the next one's copies, behind barriers), or None without a dot."""
    if not any(hasattr(seg, "dot") for seg in segs):
        return None
    assert tl.TW == tl.W, "a row dot needs tiles spanning the width (Tiling.of(full_width=True))"
    return slices


def _row_dots(tl: Tiling):
    """Macros ``parts(ops, seg, t, i0, u, tx)`` and ``sums(ops, seg, t, i0, u, tx)``: a weighted segment's row
    ``dot`` of unit u's sums (``ops.unit``): each computing thread's terms of its columns per row into
    ``ops.red``; after a barrier, a thread per row sums them and stores the row's dot (every row of the tile),
    and a barrier before the next copy into ``ops.red``'s memory (the slices)."""
    RM, RW, CM, CW, LR = tl.RM, tl.RW, tl.CM, tl.CW, tl.CW + 1

    @T.macro
    def parts(ops, seg, t, i0, u, tx):
        if tx < CM * CW:
            for r in T.unroll(RM):
                ops.part[0] = T.float32(0)
                for c in T.unroll(RW):
                    ops.part[0] = ops.part[0] + seg.dot.term(t, i0 + tx // CW + r * CM, tx % CW + c * CW, u,
                                                             ops.unit[r, c])
                ops.red[(tx // CW + r * CM) * LR + tx % CW] = ops.part[0]

    @T.macro
    def sums(ops, seg, t, i0, u, tx):
        for e in T.unroll((tl.TM + tl.threads - 1) // tl.threads):
            if e * tl.threads + tx < tl.TM:
                ops.part[0] = T.float32(0)
                for w in range(CW):
                    ops.part[0] = ops.part[0] + ops.red[(e * tl.threads + tx) * LR + w]
                seg.dot.store(t, i0 + e * tl.threads + tx, u, ops.part[0])
        T.tvm_storage_sync("shared")

    return parts, sums


def segment_slots(tl: Tile, segs, KX: int) -> tuple:
    """The shared slots of a product's per-position values (``_typed``; None where no segment has them): the
    tile's rows (``pos``), a KX-deep slice's or the tile's columns (``pos``), a unit's row weights
    (``row_pos``). Allocated in that order: call inside the macro at the level that owns them."""
    pos = _first_pos(segs)
    return (_typed_or_none("vr", tl.TM, pos), _typed_or_none("vc", max(KX, tl.TW), pos),
            _typed_or_none("vw", tl.TM, _first_pos(segs, "row_pos")))


def _first_pos(segs, attr: str = "pos"):
    """The per-position readers (``pos``, or a weighted segment's ``row_pos``) of the first segment that has them
    (the staged slots' layout), or None."""
    return next((getattr(seg, attr) for seg in segs if hasattr(seg, attr)), None)


def _typed_or_none(name: str, n: int, pos):
    """``_typed`` shared slots for ``pos``, or None without per-position values."""
    return _typed("shared", name, n, pos) if pos is not None else None


def _unit_pos(pos, u):
    """A segment's per-position readers (t, u, q) as ``_stage_positions``' (t, q), for unit u."""
    return tuple((lambda t, q, rd=rd: rd(t, u, q), dtype) for rd, dtype in pos)


def _live_units(seg, t, last_row, j0):
    """A weighted segment's unit count for the tile whose last row is ``last_row`` and first column ``j0``: 0
    where every weight of the tile is 0 (its first column at or past the last row's ``col_end``: above the
    causal diagonal), so the block skips the product and stores its init."""
    if not hasattr(seg, "col_end"):
        return seg.n(t)
    return T.Select(j0 < seg.col_end(t, last_row), seg.n(t), 0)


def _segment(tl: Tiling, unit: int, KT: int, a_fast: bool, b_fast: bool):
    """A macro ``run(acc, ops, seg, t, i0, j0, tx)``: one segment of ``tiled_product`` into the register block
    (the same slice count for every thread of the block: its barriers); a weighted segment unit by unit, each
    unit's sum in ``ops.unit`` added through its weight (with ``pos``: the unit's values at the tile's rows and
    columns staged after its product, behind a barrier; with ``row_pos``: its rows' weights, once per row)."""
    product = block_product(tl, KT, a_fast, b_fast)
    RM, RW, CM, CW = tl.RM, tl.RW, tl.CM, tl.CW
    rows, cols, slice_ = (_stage_positions(_fill(tl, n)) for n in (tl.TM, tl.TW, KT))
    dot_parts, dot_sums = _row_dots(tl)

    def slices(seg, t, i0):  # the k slices from the tile's first row's lo to its last row's hi
        return T.max((seg.hi(t, i0 + tl.TM - 1) + KT - 1) // KT - seg.lo(t, i0) // KT, 0)

    def inside(seg, t, i, k):  # k in row i's range
        return T.And(k >= seg.lo(t, i), k < seg.hi(t, i))

    @T.macro
    def weighted(acc, ops, seg, t, i0, j0, tx):
        for u in range(_live_units(seg, t, i0 + tl.TM - 1, j0)):
            for r in T.unroll(RM):
                for c in T.unroll(RW):
                    ops.unit[r, c] = T.float32(0)
            product(ops.unit, ops, unit // KT, lambda k, i: seg.a(t, i0 + i, u * unit + k),
                    lambda k, j: seg.b(t, u * unit + k, j0 + j), tx, lambda k, i: True, None)
            if hasattr(seg, "dot"):
                dot_parts(ops, seg, t, i0, u, tx)
            if hasattr(seg, "pos"):
                rows(ops.vr, _unit_pos(seg.pos, u), t, i0, tx)
                cols(ops.vc, _unit_pos(seg.pos, u), t, j0, tx)
                T.tvm_storage_sync("shared")
            elif hasattr(seg, "row_pos"):
                rows(ops.vw, _unit_pos(seg.row_pos, u), t, i0, tx)
                T.tvm_storage_sync("shared")
            elif hasattr(seg, "dot"):
                T.tvm_storage_sync("shared")
            if hasattr(seg, "dot"):
                dot_sums(ops, seg, t, i0, u, tx)
            if tx < CM * CW:
                for r in T.unroll(RM):
                    for c in T.unroll(RW):
                        if hasattr(seg, "pos"):
                            acc[r, c] = acc[r, c] + seg.weigh(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW, u,
                                                              ops.unit[r, c], _values(ops.vr, tx // CW + r * CM),
                                                              _values(ops.vc, tx % CW + c * CW))
                        elif hasattr(seg, "row_pos"):
                            acc[r, c] = acc[r, c] + seg.weigh(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW, u,
                                                              ops.unit[r, c], _values(ops.vw, tx // CW + r * CM))
                        else:
                            acc[r, c] = acc[r, c] + seg.weigh(t, i0 + tx // CW + r * CM, j0 + tx % CW + c * CW, u,
                                                              ops.unit[r, c])

    @T.macro
    def run(acc, ops, seg, t, i0, j0, tx):
        if hasattr(seg, "weigh"):
            weighted(acc, ops, seg, t, i0, j0, tx)
        elif hasattr(seg, "pos"):
            k0 = T.meta_var(seg.lo(t, i0) // KT * KT)
            rows(ops.vr, _unit_pos(seg.pos, 0), t, i0, tx)  # read after the first slice's barrier
            product(acc, ops, slices(seg, t, i0),
                    lambda k, i: seg.a(t, i0 + i, k0 + k, _values(ops.vr, i), _values(ops.vc, k % KT)),
                    lambda k, j: seg.b(t, k0 + k, j0 + j), tx, lambda k, i: inside(seg, t, i0 + i, k0 + k),
                    lambda ko: slice_(ops.vc, _unit_pos(seg.pos, 0), t, k0 + ko * KT, tx))
        else:
            k0 = T.meta_var(seg.lo(t, i0) // KT * KT)
            product(acc, ops, slices(seg, t, i0), lambda k, i: seg.a(t, i0 + i, k0 + k),
                    lambda k, j: seg.b(t, k0 + k, j0 + j), tx, lambda k, i: inside(seg, t, i0 + i, k0 + k), None)

    return run
