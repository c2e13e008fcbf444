"""Tensor-core (wmma m16n16k16) form of the tiled ``product`` (_tiled.py ``tiled_product``): ssd_chunk_scan_bwd's
launches with 16-bit x / B / C (its dx, gsum, dB and dC products).

The tile, its segments and their staging are ``tiled_product``'s; the operands of each k slice are copied into
shared memory rounded to the 16-bit dtype (a along its rows, column-major; b row-major), and each warp owns FR x
FC fragments of the tile. The sums leave the fragments through a per-warp shared tile (an accumulator
fragment's element layout is unspecified) into ``racc``: each computing thread's elements of its fragments in
registers (element q of fragment (r, c): row (q * 32 + lane) / 16, column lane % 16 of it, as
_tiled_tc.py's ``_through_shared``), where the init, every segment's sum and the weighted units' weights meet.

* A ranged segment (k in [lo(i), hi(i)): the causal sums) takes ``mma_sync`` for a 16 x 16 (rows, k) block
  wholly inside every row's range, sums a block partly inside per element with the range guard (a position
  outside it, even non-finite, is never multiplied in: 0 * NaN), and skips a block wholly outside; its
  fragments are added to ``racc`` at the segment's end.
* A weighted segment sums each unit into the fragments, then adds weigh(unit's value) per element (a head's
  decay mask or row scale); a row ``dot`` is summed from the same shared tile: a lane per row of each
  fragment, then a thread per row over the warps of the tile's width.

The products are the 16-bit roundings of the float operands (the decay-weighted C.B^T, g, dSo, gsum, as
upstream's Triton kernels cast before tl.dot), summed in float: not the serial layout's bits.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from ._tiled import (K_SLICE, _fill, _live_units, _stage_positions, _tile_of, _unit_pos, _values, largest_divisor,
                     segment_slots)
from ._tiled_tc import TC, TcTiling, _copy16, _mma_step

NQ = TC * TC // 32  # a thread's elements of one fragment


def _row(tl: TcTiling, tx, r, q):
    """Tile row of element q of the thread's fragment row r."""
    return (tx // 32 // tl.WC * tl.FR + r) * TC + (q * 32 + tx % 32) // TC


def _col(tl: TcTiling, tx, c, q):
    """Tile column of element q of the thread's fragment column c."""
    return (tx // 32 % tl.WC * tl.FC + c) * TC + (q * 32 + tx % 32) % TC


def tc_product(tl: TcTiling, units: tuple):
    """The strategy's ``product`` run (strategy.py) on tensor cores: a block per TM x TW tile (``TcTiling.of(
    full_width=True)`` where a segment has a row dot), each segment's k slices the largest multiple of 16
    dividing its unit up to K_SLICE."""
    KTs = [TC * largest_divisor(u // TC, K_SLICE // TC) for u in units]
    LA, LB, KX, warps = tl.TM + 8, tl.TW + 8, max(KTs), tl.WR * tl.WC
    runs = [_tc_segment(tl, u, kt) for u, kt in zip(units, KTs)]
    blocks = tl.M // tl.TM * (tl.W // tl.TW)
    out_fill = _fill(tl, warps * TC * TC)
    FR, FC = tl.FR, tl.FC

    @T.macro
    def run(extent, rows, segs, init, store):
        for bx in T.thread_binding(extent * blocks, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # (_tiled.py's MIN_BLOCKS)
            sa = T.alloc_buffer((KX * LA,), tl.dtype, scope="shared")
            sb = T.alloc_buffer((KX * LB,), tl.dtype, scope="shared")
            so = T.alloc_buffer((warps * TC * TC,), "float32", scope="shared")  # a fragment per warp, out
            red = T.alloc_buffer((tl.TM * (tl.WC + 1),), "float32", scope="shared")  # row dots' warp parts
            vr, vc, vw = T.meta_var(segment_slots(tl, segs, KX))
            for tx in T.thread_binding(tl.threads, thread="threadIdx.x"):
                t, i0, j0 = T.meta_var(_tile_of(tl, bx))
                fa = T.alloc_buffer((FR * TC, TC), tl.dtype, scope="wmma.matrix_a")
                fb = T.alloc_buffer((TC, FC * TC), tl.dtype, scope="wmma.matrix_b")
                acc = T.alloc_buffer((FR * TC, FC * TC), "float32", scope="wmma.accumulator")
                racc = T.alloc_buffer((FR * FC * NQ,), "float32", scope="local")
                part = T.alloc_buffer((FR + 1,), "float32", scope="local")
                ops = T.meta_var(SimpleNamespace(sa=sa, sb=sb, so=so, red=red, vr=vr, vc=vc, vw=vw, fa=fa, fb=fb,
                                                 acc=acc, racc=racc, part=part))
                # touched before the slices, so that TVM's storage rewrite does not give ``so`` the 16-bit
                # slices' memory (tc_matmul's reason)
                out_fill(so, 0, lambda q: T.float32(0), tx)
                # before any warp stores a fragment there: a tile with no slices (above the causal diagonal)
                # reaches that store with no barrier between (a write-write race the harness's checker reports)
                T.tvm_storage_sync("shared")
                if tx // 32 < warps:
                    for f in T.unroll(FR * FC * NQ):
                        racc[f] = init(t, i0 + _row(tl, tx, f // NQ // FC, f % NQ),
                                       j0 + _col(tl, tx, f // NQ % FC, f % NQ))
                runs[0](ops, segs[0], t, i0, j0, tx)
                if len(segs) > 1:
                    runs[1](ops, segs[1], t, i0, j0, tx)
                if tx // 32 < warps:
                    for f in T.unroll(FR * FC * NQ):
                        if i0 + _row(tl, tx, f // NQ // FC, f % NQ) < rows(t):
                            store(t, i0 + _row(tl, tx, f // NQ // FC, f % NQ),
                                  j0 + _col(tl, tx, f // NQ % FC, f % NQ), racc[f])

    return run


def _tc_segment(tl: TcTiling, unit: int, KT: int):
    """A macro ``run(ops, seg, t, i0, j0, tx)``: one segment of ``tc_product`` added into ``ops.racc`` (the same
    slice count for every thread of the block: its barriers)."""
    LA, LB, warps = tl.TM + 8, tl.TW + 8, tl.WR * tl.WC
    a_at, b_at = (lambda k, i: k * LA + i), (lambda k, j: k * LB + j)
    copy_a, copy_b = _copy16(tl, KT, tl.TM, False, a_at), _copy16(tl, KT, tl.TW, False, b_at)
    rows, cols, slice_ = (_stage_positions(_fill(tl, n)) for n in (tl.TM, tl.TW, KT))
    flush, dots = _flush(tl), _row_dot_sums(tl)
    ranged_step = _ranged_step(tl, LA, LB)

    def slices(seg, t, i0):  # the k slices from the tile's first row's lo to its last row's hi
        return T.max((seg.hi(t, i0 + tl.TM - 1) + KT - 1) // KT - seg.lo(t, i0) // KT, 0)

    @T.macro
    def zero(ops):
        for f in T.unroll(tl.FR * tl.FC):
            T.evaluate(T.tvm_fill_fragment(ops.acc.data, TC, TC, TC, f, T.float32(0)))

    @T.macro
    def weighted(ops, seg, t, i0, j0, tx):
        for u in range(_live_units(seg, t, i0 + tl.TM - 1, j0)):
            zero(ops)
            for ko in range(unit // KT):
                copy_a(ops.sa, lambda k, i: seg.a(t, i0 + i, u * unit + ko * KT + k), tx)
                copy_b(ops.sb, lambda k, j: seg.b(t, u * unit + ko * KT + k, j0 + j), tx)
                T.tvm_storage_sync("shared")
                if tx // 32 < warps:
                    for kk in range(KT // TC):
                        _mma_step(tl, ops.fa, ops.fb, ops.acc, ops.sa, ops.sb, tx // 32 // tl.WC, tx // 32 % tl.WC,
                                  kk, a_at, LA, "col_major", b_at, LB, "row_major", 0, 0)
                T.tvm_storage_sync("shared")
            if hasattr(seg, "pos"):
                rows(ops.vr, _unit_pos(seg.pos, u), t, i0, tx)
                cols(ops.vc, _unit_pos(seg.pos, u), t, j0, tx)
            elif hasattr(seg, "row_pos"):
                rows(ops.vw, _unit_pos(seg.row_pos, u), t, i0, tx)
            T.tvm_storage_sync("shared")
            flush(ops, seg, t, i0, j0, u, tx)
            if hasattr(seg, "dot"):
                dots(ops, seg, t, i0, u, tx)

    @T.macro
    def ranged(ops, seg, t, i0, j0, tx):
        k0 = T.meta_var(seg.lo(t, i0) // KT * KT)
        zero(ops)
        if hasattr(seg, "pos"):
            rows(ops.vr, _unit_pos(seg.pos, 0), t, i0, tx)  # read after the first slice's barrier
        for ko in range(slices(seg, t, i0)):
            if hasattr(seg, "pos"):
                slice_(ops.vc, _unit_pos(seg.pos, 0), t, k0 + ko * KT, tx)
                T.tvm_storage_sync("shared")
                copy_a(ops.sa, lambda k, i: seg.a(t, i0 + i, k0 + ko * KT + k, _values(ops.vr, i),
                                                  _values(ops.vc, k)), tx)
            else:
                copy_a(ops.sa, lambda k, i: seg.a(t, i0 + i, k0 + ko * KT + k), tx)
            copy_b(ops.sb, lambda k, j: seg.b(t, k0 + ko * KT + k, j0 + j), tx)
            T.tvm_storage_sync("shared")
            if tx // 32 < warps:
                for kk in range(KT // TC):
                    ranged_step(ops, seg, t, i0, k0 + ko * KT + kk * TC, kk, tx)
            T.tvm_storage_sync("shared")
        flush(ops, None, t, i0, j0, 0, tx)

    @T.macro
    def run(ops, seg, t, i0, j0, tx):
        if hasattr(seg, "weigh"):
            weighted(ops, seg, t, i0, j0, tx)
        else:
            ranged(ops, seg, t, i0, j0, tx)

    return run


def _ranged_step(tl: TcTiling, LA: int, LB: int):
    """A macro ``step(ops, seg, t, i0, kb, kk, tx)``: the 16 positions k from kb (the staged slice's kk-th step)
    into the warp's fragments: per fragment row, ``mma_sync`` where every k lies in every row's [lo, hi)
    (lo / hi non-decreasing in the row: the first row's hi and the last row's lo decide), per element with the
    guard into ``racc`` where the block is partly inside, nothing where it is wholly outside."""
    FR, FC = tl.FR, tl.FC

    @T.macro
    def step(ops, seg, t, i0, kb, kk, tx):
        wr, wc = T.meta_var((tx // 32 // tl.WC, tx // 32 % tl.WC))
        for c in T.unroll(FC):
            T.evaluate(T.tvm_load_matrix_sync(ops.fb.data, TC, TC, TC, c,
                                              ops.sb.access_ptr("r", offset=kk * TC * LB + (wc * FC + c) * TC), LB,
                                              "row_major"))
        for r in T.unroll(FR):
            ib = T.meta_var(i0 + (wr * FR + r) * TC)  # the fragment's first row
            if T.And(kb >= seg.lo(t, ib + TC - 1), kb + TC <= seg.hi(t, ib)):
                T.evaluate(T.tvm_load_matrix_sync(ops.fa.data, TC, TC, TC, r,
                                                  ops.sa.access_ptr("r", offset=kk * TC * LA + (wr * FR + r) * TC),
                                                  LA, "col_major"))
                for c in T.unroll(FC):
                    T.evaluate(T.tvm_mma_sync(ops.acc.data, r * FC + c, ops.fa.data, r, ops.fb.data, c,
                                              ops.acc.data, r * FC + c))
            elif T.And(kb + TC > seg.lo(t, ib), kb < seg.hi(t, ib + TC - 1)):
                for c in T.unroll(FC):
                    for q in T.unroll(NQ):
                        for s in range(TC):
                            if T.And(kb + s >= seg.lo(t, i0 + _row(tl, tx, r, q)),
                                     kb + s < seg.hi(t, i0 + _row(tl, tx, r, q))):
                                ops.racc[(r * FC + c) * NQ + q] = ops.racc[(r * FC + c) * NQ + q] + (
                                    ops.sa[(kk * TC + s) * LA + _row(tl, tx, r, q)].astype("float32")
                                    * ops.sb[(kk * TC + s) * LB + _col(tl, tx, c, q)].astype("float32"))

    return step


def _flush(tl: TcTiling):
    """A macro ``flush(ops, seg, t, i0, j0, u, tx)``: each fragment of the warp's accumulators through its shared
    tile into ``racc``: the value itself (``seg`` None: a ranged segment's sum), or a weighted segment's
    weigh(t, i, j, u, value, ...) (with ``pos``: the staged rows' and columns' values; ``row_pos``: the rows'
    weights); with a row ``dot``, each lane < 16 adds its fragment row's terms to ``ops.part[r]`` (zeroed
    here). Every thread at the barriers."""
    FR, FC, warps = tl.FR, tl.FC, tl.WR * tl.WC

    @T.macro
    def flush(ops, seg, t, i0, j0, u, tx):
        for r in T.unroll(FR):
            ops.part[r] = T.float32(0)
            for c in T.unroll(FC):
                if tx // 32 < warps:
                    T.evaluate(T.tvm_store_matrix_sync(ops.acc.data, TC, TC, TC, r * FC + c,
                                                       ops.so.access_ptr("w", offset=tx // 32 * TC * TC), TC,
                                                       "row_major"))
                T.tvm_storage_sync("shared")
                if tx // 32 < warps:
                    for q in T.unroll(NQ):
                        _add(ops, seg, t, i0, j0, u, (r * FC + c) * NQ + q, _row(tl, tx, r, q), _col(tl, tx, c, q),
                             ops.so[tx // 32 * TC * TC + q * 32 + tx % 32])
                    if seg is not None:
                        if hasattr(seg, "dot"):
                            if tx % 32 < TC:
                                for jj in range(TC):
                                    ops.part[r] = ops.part[r] + seg.dot.term(
                                        t, i0 + (tx // 32 // tl.WC * FR + r) * TC + tx % 32,
                                        j0 + (tx // 32 % tl.WC * FC + c) * TC + jj, u,
                                        ops.so[tx // 32 * TC * TC + tx % 32 * TC + jj])
                T.tvm_storage_sync("shared")

    return flush


@T.macro
def _add(ops, seg, t, i0, j0, u, f, i, j, v):
    """racc[f] += v (``seg`` None) or seg's weigh of unit u's value v at tile element (i, j)."""
    if seg is None:
        ops.racc[f] = ops.racc[f] + v
    elif hasattr(seg, "pos"):
        ops.racc[f] = ops.racc[f] + seg.weigh(t, i0 + i, j0 + j, u, v, _values(ops.vr, i), _values(ops.vc, j))
    elif hasattr(seg, "row_pos"):
        ops.racc[f] = ops.racc[f] + seg.weigh(t, i0 + i, j0 + j, u, v, _values(ops.vw, i))
    else:
        ops.racc[f] = ops.racc[f] + seg.weigh(t, i0 + i, j0 + j, u, v)


def _row_dot_sums(tl: TcTiling):
    """A macro ``dots(ops, seg, t, i0, u, tx)``: after ``_flush``, each lane < 16's fragment-row sums
    (``ops.part``) into ``ops.red`` (a slot per tile row and warp column), then a thread per row sums its
    warps in order and stores the row's dot (every row of the tile); barriers around ``red``."""
    FR, WC, warps, LR = tl.FR, tl.WC, tl.WR * tl.WC, tl.WC + 1

    @T.macro
    def dots(ops, seg, t, i0, u, tx):
        if tx // 32 < warps:
            if tx % 32 < TC:
                for r in T.unroll(FR):
                    ops.red[((tx // 32 // WC * FR + r) * TC + tx % 32) * LR + tx // 32 % WC] = ops.part[r]
        T.tvm_storage_sync("shared")
        for e in T.unroll((tl.TM + tl.threads - 1) // tl.threads):
            if e * tl.threads + tx < tl.TM:
                ops.part[FR] = T.float32(0)
                for w in range(WC):
                    ops.part[FR] = ops.part[FR] + ops.red[(e * tl.threads + tx) * LR + w]
                seg.dot.store(t, i0 + e * tl.threads + tx, u, ops.part[FR])
        T.tvm_storage_sync("shared")

    return dots
