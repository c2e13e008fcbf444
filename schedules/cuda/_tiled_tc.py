"""Tensor-core (wmma m16n16k16) forms of the tiled chunk matmuls (_tiled.py): 16-bit operands with float32
accumulators (the SSD chunk products), int8 operands with int32 accumulators (int8_dot's matmul).

The tiles, copies and task mapping are _tiled.py's; here each warp owns FR x FC accumulator fragments of the
block's output tile, the staged k slices are loaded into fragments and multiplied by ``mma_sync``, and the
results leave through a per-warp shared tile (an accumulator fragment's element layout is unspecified).
"""
from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

from ._tiled import (K_SLICE, Tile, _copy, _entry, _fill, _stage_positions, _tile_of, _typed, _values,
                     largest_divisor, operand_at, upper_skip)

TC = 16  # the wmma fragment side (m16n16k16)


@dataclasses.dataclass(frozen=True)
class TcTiling(Tile):
    """A ``Tile`` of 16 x 16 fragments, WR x WC warps each owning FR x FC of them (the block's other warps only
    copy), KT a multiple of 16; the operands staged in ``dtype`` (bfloat16 / float16, accumulated in float32;
    int8, accumulated in ``acc`` int32)."""

    WR: int
    WC: int
    threads: int
    dtype: str
    acc: str = "float32"

    @property
    def blocked(self) -> bool:
        """8-bit operands are staged fragment by fragment (16 x 16 contiguous bytes, ld 16): a fragment load
        needs a 32-byte aligned pointer and a 16-byte multiple ld, which 16-byte k steps in a padded row-major
        slice do not give."""
        return self.dtype in ("int8", "uint8")

    @property
    def FR(self) -> int:
        return self.TM // TC // self.WR

    @property
    def FC(self) -> int:
        return self.TW // TC // self.WC

    @staticmethod
    def fits(M: int, W: int, K: int) -> bool:
        return M % TC == 0 and W % TC == 0 and K % TC == 0

    @staticmethod
    def of(M: int, W: int, K: int, threads: int, cap: int, dtype: str, acc: str = "float32",
           full_width: bool = False) -> "TcTiling":
        """Sides: the largest multiples of 16 dividing M / W up to ``cap``; as many of the threads / 32 warps
        as divide the tile's fragment grid, each owning as square a block of fragments as they allow.
        ``full_width``: the tile spans all W columns, its rows at most cap^2 / W (as ``Tiling.of``)."""
        TM = TC * largest_divisor(M // TC, max(1, (min(cap, cap * cap // W) if full_width else cap) // TC))
        TW = W if full_width else TC * largest_divisor(W // TC, max(1, cap // TC))
        KT = TC * largest_divisor(K // TC, K_SLICE // TC)
        warps = max(1, threads // 32)
        best = None
        for wr in (d for d in range(1, TM // TC + 1) if (TM // TC) % d == 0):
            for wc in (d for d in range(1, TW // TC + 1) if (TW // TC) % d == 0):
                if wr * wc <= warps:
                    key = (-wr * wc, abs((TM // TC // wr) - (TW // TC // wc)))
                    best = min(best, (key, wr, wc)) if best else (key, wr, wc)
        return TcTiling(M, W, K, TM, TW, KT, best[1], best[2], threads, dtype, acc)


def tc_matmul(tl: TcTiling, a_fast: bool, b_fast: bool, scaled: bool, split: str = "", slices=None,
              lower: bool = False):
    """The tiled ``run`` of ``tiled_matmul`` on tensor cores: each k slice of both operands copied into shared
    memory in ``tl.dtype`` (a k-fast operand stored along k, the others along i / j: the fragment loads take
    either layout), each warp's FR x FC accumulator fragments updated by ``mma_sync`` per 16-deep step; then a
    fragment at a time through a per-warp shared tile to ``store``. The products are the 16-bit roundings of the
    float operands (scale * rhs rounded after the product, as upstream's Triton kernels cast before tl.dot),
    summed in float: not the serial layout's bits.

    ``split`` "a" or "b": that operand is a float32 staged as three bfloat16 parts whose sum is the value
    exactly (``_copy_split``), each multiplied by the other operand (which must be exact in bfloat16, e.g. int8
    codes): float32-accurate products on bf16 tensor cores, three mma per step. ``slices``: the number of k
    slices as a function of the task (a symbolic contraction: lhs / rhs must be zero or harmless past its end),
    by default ``tl.K // tl.KT``. ``lower``: tiles wholly above the diagonal store 0 without their product."""
    TM, TW, KT, FR, FC = tl.TM, tl.TW, tl.KT, tl.FR, tl.FC
    assert not split or (tl.dtype == "bfloat16" and not scaled), "a split operand is bf16 parts, unscaled"
    # a (i, k): row-major [i][k] when k-fast, else column-major [k][i]; b (k, j): column-major [j][k] when
    # k-fast, else row-major [k][j]. Leading dimensions padded by 8 elements (16 bytes, as wmma requires).
    LA = KT + 8 if a_fast else TM + 8
    LB = KT + 8 if b_fast else TW + 8
    a_at = (lambda k, i: i * LA + k) if a_fast else (lambda k, i: k * LA + i)  # noqa: E731
    b_at = (lambda k, j: j * LB + k) if b_fast else (lambda k, j: k * LB + j)  # noqa: E731
    a_lay, b_lay = ("row_major" if a_fast else "col_major"), ("col_major" if b_fast else "row_major")
    if tl.blocked:  # k-fast operands only: fragment (i // 16, k // 16) at 256 (i // 16 * KT / 16 + k // 16)
        assert a_fast and b_fast, "8-bit operands are staged along k"
        LA = LB = TC
        a_at = b_at = lambda k, i: (i // TC * (KT // TC) + k // TC) * TC * TC + i % TC * TC + k % TC  # noqa: E731
    zero = tirx.const(0, tl.acc)
    size_a, size_b = TM * KT if tl.blocked else (TM if a_fast else KT) * LA, \
        TW * KT if tl.blocked else (TW if b_fast else KT) * LB
    parts_a, parts_b = (PARTS if split == "a" else 1), (PARTS if split == "b" else 1)
    if tl.blocked:
        copy_a, copy_b = _copy_blocked(tl, KT, TM, a_at), _copy_blocked(tl, KT, TW, b_at)
    else:
        copy_a = _copy_split(tl, KT, TM, a_fast, a_at, size_a) if parts_a > 1 else _copy16(tl, KT, TM, a_fast, a_at)
        copy_b = _copy_split(tl, KT, TW, b_fast, b_at, size_b) if parts_b > 1 else _copy16(tl, KT, TW, b_fast, b_at)
    n_slices = slices or (lambda t: tl.K // KT)  # noqa: E731
    fill = _fill(tl, KT)
    blocks, warps = tl.M // TM * (tl.W // TW), tl.WR * tl.WC
    out_fill = _fill(tl, warps * TC * TC)

    @T.macro
    def run_any(extent, lhs, scale, rhs, store):
        for bx in T.thread_binding(extent * blocks, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # see MIN_BLOCKS
            sa = T.alloc_buffer((size_a * parts_a,), tl.dtype, scope="shared")
            sb = T.alloc_buffer((size_b * parts_b,), tl.dtype, scope="shared")
            ss = T.alloc_buffer((KT,), "float32", scope="shared")
            so = T.alloc_buffer((warps * TC * TC,), tl.acc, scope="shared")  # a fragment per warp, out
            for tx in T.thread_binding(tl.threads, thread="threadIdx.x"):
                t, i0, j0 = T.meta_var(_tile_of(tl, bx))
                wr, wc = T.meta_var((tx // 32 // tl.WC, tx // 32 % tl.WC))
                fa = T.alloc_buffer((FR * TC, TC), tl.dtype, scope="wmma.matrix_a")
                fb = T.alloc_buffer((TC, FC * TC), tl.dtype, scope="wmma.matrix_b")
                acc = T.alloc_buffer((FR * TC, FC * TC), tl.acc, scope="wmma.accumulator")
                for f in T.unroll(FR * FC):
                    T.evaluate(T.tvm_fill_fragment(acc.data, TC, TC, TC, f, zero))
                # touched before the slices, so that TVM's storage rewrite does not give ``so`` the 16-bit
                # slices' memory (its float access_ptr into a bfloat16 buffer fails to lower)
                out_fill(so, 0, lambda q: zero, tx)
                # before any warp stores a fragment there: a tile with no slices (above the causal diagonal)
                # reaches that store with no barrier between (a write-write race the harness's checker reports)
                T.tvm_storage_sync("shared")
                for ko in range(upper_skip(lower, tl, i0, j0, n_slices(t))):
                    if scaled:
                        fill(ss, 0, lambda k: scale(t, ko * KT + k), tx)
                        T.tvm_storage_sync("shared")
                        copy_b(sb, lambda k, j: ss[k] * rhs(t, ko * KT + k, j0 + j), tx)
                    else:
                        copy_b(sb, lambda k, j: rhs(t, j0 + j, ko * KT + k), tx)
                    copy_a(sa, operand_at(lhs, t, i0, j0, ko * KT), tx)  # (a visited lhs: by _copy16 only)
                    T.tvm_storage_sync("shared")
                    for kk in range(KT // TC):
                        if tx // 32 < tl.WR * tl.WC:
                            _mma_step(tl, fa, fb, acc, sa, sb, wr, wc, kk, a_at, LA, a_lay, b_at, LB, b_lay,
                                      size_a if parts_a > 1 else 0, size_b if parts_b > 1 else 0)
                    T.tvm_storage_sync("shared")
                for r in T.unroll(FR):
                    for c in T.unroll(FC):
                        _through_shared(tl, (acc,), so, r, c, tx,
                                        lambda q, l, j, e: store(t, i0 + l, j0 + j, so[e]))

    return _entry(run_any, scaled)


def _copy_blocked(tl, rows: int, cols: int, at):
    """``_copy`` of a k-fast 8-bit slice into the fragment-blocked layout: each thread moves 16 consecutive k
    of one row / column at once (one 128-bit load and store: K and the slice start are multiples of 16)."""
    n = cols * (rows // TC)

    @T.macro
    def copy(dst, src, tx):
        for e in T.unroll((n + tl.threads - 1) // tl.threads):
            if e * tl.threads + tx < n:
                u = T.meta_var(e * tl.threads + tx)
                for v in T.vectorized(TC):
                    dst[at(u % (rows // TC) * TC + v, u // (rows // TC))] = src(u % (rows // TC) * TC + v,
                                                                              u // (rows // TC))

    return copy


PARTS = 3  # bfloat16 parts of a split float32 operand (8 significand bits each: 24, all of float32's)


def _copy_split(tl, rows: int, cols: int, k_fast: bool, at, size: int):
    """``_copy`` of a float32 operand as three bfloat16 slices ``size`` apart: hi = bf16(v), mid = bf16(v - hi),
    lo = bf16(v - hi - mid). Each rounding leaves a remainder with 8 fewer significand bits, exact in float32,
    so hi + mid + lo = v (up to bfloat16 subnormals below 1e-38): with an operand exact in bfloat16 (int8
    codes), hi*b + mid*b + lo*b is v*b with float32 products (cuBLAS's bf16x9 float32 emulation, with one
    side exact: 3 products instead of 9). The value and remainder live in a thread's registers (one load)."""
    n, rounds = rows * cols, (rows * cols + tl.threads - 1) // tl.threads
    ld = cols if not k_fast else rows  # index split of a flat element number: consecutive k (k-fast) or c
    f32, b16 = "float32", tl.dtype

    @T.macro
    def copy(dst, src, tx):
        r = T.alloc_buffer((2,), f32, scope="local")
        for e in T.unroll(rounds):
            if e * tl.threads + tx < n:
                idx = T.meta_var(e * tl.threads + tx)
                k, c = T.meta_var((idx % ld, idx // ld) if k_fast else (idx // ld, idx % ld))
                r[0] = src(k, c)
                dst[at(k, c)] = r[0].astype(b16)
                r[1] = r[0] - r[0].astype(b16).astype(f32)
                dst[size + at(k, c)] = r[1].astype(b16)
                dst[2 * size + at(k, c)] = (r[1] - r[1].astype(b16).astype(f32)).astype(b16)

    return copy


def _copy16(tl, rows: int, cols: int, k_fast: bool, at):
    """``_copy`` into a 16-bit slice at element ``at(k, c)`` (the fragment layout), the value rounded to it."""
    return _copy(tl, rows, cols, k_fast, at, tl.dtype)


@T.macro
def _mma_step(tl, fa, fb, acc, sa, sb, wr, wc, kk, a_at, LA, a_lay, b_at, LB, b_lay, part_a, part_b):
    """One 16-deep step (the slice's kk-th) of the warp's FR x FC fragments: load its a / b fragments from the
    staged slices (element (k, i) of a at ``a_at(k, i)``, row stride LA, layout ``a_lay``; b likewise), mma
    each pair. ``part_a`` / ``part_b`` > 0: that operand is split (``_copy_split``) into PARTS slices that far
    apart, each part's fragments multiplied by the other operand's (loaded once)."""
    for p in T.unroll(PARTS if part_a + part_b > 0 else 1):
        if part_a > 0 or p == 0:
            for r in T.unroll(tl.FR):
                T.evaluate(T.tvm_load_matrix_sync(
                    fa.data, TC, TC, TC, r, sa.access_ptr("r", offset=p * part_a + a_at(kk * TC, (wr * tl.FR + r) * TC)),
                    LA, a_lay))
        if part_b > 0 or p == 0:
            for c in T.unroll(tl.FC):
                T.evaluate(T.tvm_load_matrix_sync(
                    fb.data, TC, TC, TC, c, sb.access_ptr("r", offset=p * part_b + b_at(kk * TC, (wc * tl.FC + c) * TC)),
                    LB, b_lay))
        for r in T.unroll(tl.FR):
            for c in T.unroll(tl.FC):
                T.evaluate(T.tvm_mma_sync(acc.data, r * tl.FC + c, fa.data, r, fb.data, c, acc.data, r * tl.FC + c))


@T.macro
def _causal_step(tl, fa, fb, acc, diag, sa, sb, wr, wc, tx, i0, s0, kk, end, L2, LX):
    """The causal sum's 16 positions from s0 (the slice's kk-th step) into the warp's fragments: mma where all
    of them precede the fragment's rows, per element with the guard s < end(l) on the diagonal block (into
    ``diag``, the thread's elements of each fragment; its second half keeps each element's own x[l], staged
    here: the carry's), nothing above it."""
    for c in T.unroll(tl.FC):
        T.evaluate(T.tvm_load_matrix_sync(fb.data, TC, TC, TC, c,
                                          sb.access_ptr("r", offset=kk * TC * LX + (wc * tl.FC + c) * TC), LX,
                                          "row_major"))
    for r in T.unroll(tl.FR):
        if s0 + TC <= i0 + (wr * tl.FR + r) * TC:
            T.evaluate(T.tvm_load_matrix_sync(fa.data, TC, TC, TC, r,
                                              sa.access_ptr("r", offset=(wr * tl.FR + r) * TC * L2 + kk * TC), L2,
                                              "row_major"))
            for c in T.unroll(tl.FC):
                T.evaluate(T.tvm_mma_sync(acc.data, r * tl.FC + c, fa.data, r, fb.data, c, acc.data, r * tl.FC + c))
        elif s0 == i0 + (wr * tl.FR + r) * TC:
            for c in T.unroll(tl.FC):
                for q in T.unroll(TC * TC // 32):
                    diag[(tl.FR * tl.FC + r * tl.FC + c) * (TC * TC // 32) + q] = sb[
                        (kk * TC + (q * 32 + tx % 32) // TC) * LX + (wc * tl.FC + c) * TC + (q * 32 + tx % 32) % TC
                    ].astype("float32")
                    for s in range(TC):
                        if s0 + s < end(s0 + (q * 32 + tx % 32) // TC):
                            e = T.meta_var((r * tl.FC + c) * (TC * TC // 32) + q)
                            w = T.meta_var(sa[((wr * tl.FR + r) * TC + (q * 32 + tx % 32) // TC) * L2 + kk * TC + s])
                            x = T.meta_var(sb[(kk * TC + s) * LX + (wc * tl.FC + c) * TC + (q * 32 + tx % 32) % TC])
                            diag[e] = diag[e] + w.astype("float32") * x.astype("float32")


@T.macro
def _through_shared(tl, accs, so, r, c, tx, apply):
    """Fragment (r, c) of each accumulator in ``accs`` (one or two) of the computing warps to the warp's shared
    tiles (``so``: len(accs) tiles of TC x TC per warp), then ``apply(q, l, j, e)`` per element (q: the thread's
    element, l / j tile-relative, e its index in the first tile; the second is TC x TC after it), every thread
    at the barriers."""
    if tx // 32 < tl.WR * tl.WC:
        T.evaluate(T.tvm_store_matrix_sync(accs[0].data, TC, TC, TC, r * tl.FC + c,
                                           so.access_ptr("w", offset=tx // 32 * len(accs) * TC * TC), TC,
                                           "row_major"))
        if len(accs) > 1:
            T.evaluate(T.tvm_store_matrix_sync(accs[1].data, TC, TC, TC, r * tl.FC + c,
                                               so.access_ptr("w", offset=(tx // 32 * 2 + 1) * TC * TC), TC,
                                               "row_major"))
    T.tvm_storage_sync("shared")
    if tx // 32 < tl.WR * tl.WC:
        for q in T.unroll(TC * TC // 32):
            apply(q, (tx // 32 // tl.WC * tl.FR + r) * TC + (q * 32 + tx % 32) // TC,
                  (tx // 32 % tl.WC * tl.FC + c) * TC + (q * 32 + tx % 32) % TC,
                  tx // 32 * len(accs) * TC * TC + q * 32 + tx % 32)
    T.tvm_storage_sync("shared")


@T.macro
def _store_if(store, rows, t, l, j, v):
    if l < rows(t):
        store(t, l, j, v)


def tc_causal(tl: TcTiling, end):
    """``tiled_causal`` on tensor cores (16-bit x / C; ``TcTiling`` over M = chunk, W = headdim, K = dstate):
    the carried product C . Sin as in ``tc_matmul`` (the states rounded to the 16-bit dtype, as upstream casts
    them before tl.dot) into its own accumulators; the causal sum slice by slice into others, its weights
    (rounded) and x staged in shared memory.
    A warp's fragments whose 16 positions s all precede its 16 rows (s-block < row-block: every pair causal, also
    strict or in whole step groups of a size dividing 16) take ``mma_sync``; the diagonal blocks are summed by
    the warp's threads per element with the causal guard (s < end(l): a later position's x, even non-finite, is
    never multiplied in) into registers. Blocks above the diagonal are never visited. At the end, per element
    through the per-warp shared tiles: carry(C . Sin) + the causal sum + the diagonal's (wmma cannot load an
    accumulator back in TVM's codegen: its layout argument is dropped, so carry is not applied in between).
    The carry's x[l] (D x) is the one the diagonal block staged (exact: x arrives in the 16-bit dtype), not a
    second read of x per output."""
    TM, TW, KT, FR, FC = tl.TM, tl.TW, tl.KT, tl.FR, tl.FC
    KS = TC * largest_divisor(tl.M // TC, K_SLICE // TC)
    L1, L2, LX = KT + 8, KS + 8, TW + 8  # C / Sin rows along k; weights along s; x rows along j
    copy_c, copy_s = _copy16(tl, KT, TM, True, lambda k, i: i * L1 + k), _copy16(tl, KT, TW, True,
                                                                               lambda k, j: j * L1 + k)
    copy_w, copy_x = _copy16(tl, KS, TM, True, lambda s, i: i * L2 + s), _copy16(tl, KS, TW, False,
                                                                               lambda s, j: s * LX + j)
    fill_rows, fill_cols, out_fill = _fill(tl, TM), _fill(tl, KS), _fill(tl, tl.WR * tl.WC * TC * TC)
    blocks, warps, NQ = tl.M // TM * (tl.W // TW), tl.WR * tl.WC, TC * TC // 32
    SA, SB = max(TM * L1, TM * L2), max(TW * L1, KS * LX)

    stage_rows, stage_cols = _stage_positions(fill_rows), _stage_positions(fill_cols)

    @T.macro
    def run(extent, rows, carried, lhs, rhs, carry, weight, xs, store, pos):
        for bx in T.thread_binding(extent * blocks, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # see MIN_BLOCKS
            sa = T.alloc_buffer((SA,), tl.dtype, scope="shared")
            sb = T.alloc_buffer((SB,), tl.dtype, scope="shared")
            so = T.alloc_buffer((warps * 2 * TC * TC,), "float32", scope="shared")  # two fragments per warp
            vr = T.meta_var(_typed("shared", "vr", TM, pos))
            vc = T.meta_var(_typed("shared", "vc", KS, pos))
            for tx in T.thread_binding(tl.threads, thread="threadIdx.x"):
                t, i0, j0 = T.meta_var(_tile_of(tl, bx))
                wr, wc = T.meta_var((tx // 32 // tl.WC, tx // 32 % tl.WC))
                fa = T.alloc_buffer((FR * TC, TC), tl.dtype, scope="wmma.matrix_a")
                fs = T.alloc_buffer((TC, FC * TC), tl.dtype, scope="wmma.matrix_b")  # Sin (column-major)
                fx = T.alloc_buffer((TC, FC * TC), tl.dtype, scope="wmma.matrix_b")  # x (row-major)
                acc_c = T.alloc_buffer((FR * TC, FC * TC), "float32", scope="wmma.accumulator")  # C . Sin
                acc = T.alloc_buffer((FR * TC, FC * TC), "float32", scope="wmma.accumulator")  # causal sum
                diag = T.alloc_buffer((2 * FR * FC * NQ,), "float32", scope="local")  # sums, then x[l]
                for f in T.unroll(FR * FC):
                    T.evaluate(T.tvm_fill_fragment(acc_c.data, TC, TC, TC, f, T.float32(0)))
                    T.evaluate(T.tvm_fill_fragment(acc.data, TC, TC, TC, f, T.float32(0)))
                for q in T.unroll(2 * FR * FC * NQ):
                    diag[q] = T.float32(0)
                out_fill(so, 0, lambda q: T.float32(0), tx)  # (touched before the slices: see tc_matmul)
                stage_rows(vr, pos, t, i0, tx)
                if carried(t):  # the same for the whole block: its barriers are reached by every thread
                    for ko in range(tl.K // KT):
                        copy_s(sb, lambda k, j: rhs(t, ko * KT + k, j0 + j), tx)
                        copy_c(sa, lambda k, i: lhs(t, i0 + i, ko * KT + k), tx)
                        T.tvm_storage_sync("shared")
                        for kk in range(KT // TC):
                            if tx // 32 < warps:
                                _mma_step(tl, fa, fs, acc_c, sa, sb, wr, wc, kk, lambda k, i: i * L1 + k, L1,
                                          "row_major", lambda k, j: j * L1 + k, L1, "col_major", 0, 0)
                        T.tvm_storage_sync("shared")
                for ko in range((T.min(end(i0 + TM - 1), rows(t)) + KS - 1) // KS):
                    stage_cols(vc, pos, t, ko * KS, tx)
                    T.tvm_storage_sync("shared")
                    copy_w(sa, lambda s, i: weight(t, i0 + i, ko * KS + s, _values(vr, i), _values(vc, s)), tx)
                    copy_x(sb, lambda s, j: xs(t, ko * KS + s, j0 + j), tx)
                    T.tvm_storage_sync("shared")
                    if tx // 32 < warps:
                        for kk in range(KS // TC):
                            _causal_step(tl, fa, fx, acc, diag, sa, sb, wr, wc, tx, i0, ko * KS + kk * TC, kk,
                                         end, L2, LX)
                    T.tvm_storage_sync("shared")
                for r in T.unroll(FR):
                    for c in T.unroll(FC):
                        _through_shared(tl, (acc_c, acc), so, r, c, tx, lambda q, l, j, e: _store_if(
                            store, rows, t, i0 + l, j0 + j,
                            carry(t, i0 + l, j0 + j, so[e], diag[(FR * FC + r * FC + c) * NQ + q], _values(vr, l))
                            + so[e + TC * TC] + diag[(r * FC + c) * NQ + q]))

    return run
