"""Register-blocked chunk matmuls of the SSD CPU kernels: out[i, j] = init(i, j) + sum_k a(i, k) b(k, j).

A ``rows`` x ``cols`` block of the output stays in accumulators (two stack buffers, each under TVM's
1 KiB stack-alloca limit, so LLVM keeps them in vector registers) while k runs: each b(k, j) vector load
feeds ``rows`` FMAs, and the block's rows * cols / lanes independent FMA chains hide the FMA latency.
The unblocked row update (one output row of 64 floats = 4 chains) runs at about half the FMA rate.

Every output element sums over k in ascending order from its init whatever the tiling, so all tilings
give bitwise-equal results. Triangular ranges (``tri``: k <= i or k >= i) run the k of the row block's
diagonal part under a per-row Select, so a term outside a row's own range is never added: a padding term
0 * b would be NaN for b = NaN / Inf and leak a non-finite x (or dy) at one position into the outputs of up
to rows - 1 *earlier* positions (issue #16: outputs must stay causal). A square product whose
consumers read only its causal part (``lower=True``) computes, for the row block [lo, hi), the column blocks
that start below hi: every (l, s <= l) and the rest of the diagonal blocks; the blocks right of them are
not written (consumers mask them with a Select, never by multiplying with 0).

Measured on the 2-vCPU rocketlake (per chunk 256x128 @ 128x256, incl. staging): 82 GFLOP/s unblocked,
161-202 GFLOP/s with 8 accumulators (2 x 64, 4 x 32), 214 with 16 (4 x 64); 64 wide: 134 -> 166-175.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

F32 = "float32"
ROWS = (1, 2, 4, 8)
COLS = (16, 32, 64, 128)
DEFAULT_ROWS, DEFAULT_COLS = 4, 32  # 8 zmm accumulators on AVX-512 (knobs ``rows`` / ``cols``)
ORDERS = (0, 1)
DEFAULT_ORDER = 0  # knob ``order``: row blocks outer


def block(M: int, W: int, rows: int, cols: int, group: int = 1) -> tuple[int, int]:
    """(rows, cols) of the accumulator block for an M x W output: rows divides M, cols divides W (the
    whole width when ``cols`` does not divide it or is wider); with a ``group`` > 1 (a step-grouped
    triangle) rows is also a multiple or a divisor of it, so a row block's masked part has a static length."""
    rb = max(r for r in ROWS if r <= rows and M % r == 0 and (r % group == 0 or group % r == 0))
    return rb, (cols if cols < W and W % cols == 0 else W)


def vblock(width: int) -> int:
    """The vector block of a row pass over a ``lower=True`` product: 16 floats, or the whole row when 16
    does not divide it (then no column block divides it either and the product is written in full)."""
    return 16 if width % 16 == 0 else width


def lower_cols(l, width: int, vb: int):
    """The column end of row l's causal part rounded up to a ``vb``-wide block: what a ``lower=True``
    product with a column block multiple of ``vb`` (or the whole width) has written in row l."""
    return T.min((l // vb + 1) * vb, width)


TRI = (None, "le", "lt", "ge", "gt")  # no mask; row i sums k <= i, k < i (klo .. hi); k >= i, k > i (lo .. khi)


def matmul(M: int, W: int, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS, lower: bool = False,
           order: int = DEFAULT_ORDER, tri=None, group: int = 1):
    """A TVMScript macro ``mm(klo, khi, a, b, init, store)`` computing an M x W product block by block
    (``lower``: only the column blocks starting below each row block's end; M == W).

    klo(lo, hi), khi(lo, hi): the k range of the row block [lo, hi) (a triangular range covers the union
    of its rows'; ``a`` is 0 outside a row's own range); a(i, k): scalar; b(k, j): the vector
    operand (contiguous in j); init(i, j): the accumulator's start; store(i, j, v): the epilogue.
    ``order`` 0: row blocks outer (each row block streams all of b); 1: column blocks outer (a K x cols
    tile of b is reused by every row block: it stays in L1 when K * cols * 4 bytes fits).
    ``tri`` "le": row i sums k in [klo, i] (khi must be the block end hi): k < lo unmasked, k in [lo, hi)
    selected per row; "lt": the same for k in [klo, i); "ge": row i sums k in [i, khi) (klo must be lo): k in
    [lo, hi) selected per row, then k >= hi unmasked; "gt": the same for k in (i, khi). The masked part is rows
    iterations per row block (of up to M).
    ``group`` G > 1 (with "lt" / "gt"; M a multiple of G): positions in groups of G, row i sums the k of strictly
    earlier groups, k // G < i // G ("lt"), or strictly later ones, k // G > i // G ("gt") (``_masked_part``).
    """
    RB, SV = block(M, W, rows, cols, group)
    RH = max(RB // 2, 1)  # rows per accumulator buffer (two buffers when RB > 1)
    TWO = RB > 1
    if lower and M != W:
        raise ValueError(f"matmul: lower=True needs a square product, got {M} x {W}")
    if order not in ORDERS:
        raise ValueError(f"matmul: order must be one of {ORDERS}, got {order!r}")
    if tri not in TRI:
        raise ValueError(f"matmul: tri must be one of {TRI}, got {tri!r}")
    if group > 1 and (tri not in ("lt", "gt") or M % group):
        raise ValueError(f"matmul: group={group} needs tri 'lt' or 'gt' and M={M} a multiple of it")
    masked, ok = _masked_part(RB, tri, group)

    def col_blocks(i0):  # column blocks of row block i0
        return T.min((i0 * RB + RB + SV - 1) // SV, W // SV) if lower else W // SV

    def first_row_block(j0):  # the first row block that has column block j0
        return (j0 * SV) // RB if lower else 0

    @T.macro
    def fma(a, b, acc0, acc1, i0, j0, k):
        for r in T.unroll(RH):
            for j in T.vectorized(SV):
                acc0[r, j] = acc0[r, j] + a(i0 * RB + r, k) * b(k, j0 * SV + j)
                if TWO:
                    acc1[r, j] = acc1[r, j] + a(i0 * RB + RH + r, k) * b(k, j0 * SV + j)

    @T.macro
    def fma_masked(a, b, acc0, acc1, i0, j0, k, ok):  # the term only where row i's range holds k
        for r in T.unroll(RH):
            for j in T.vectorized(SV):
                acc0[r, j] = T.Select(ok(i0 * RB + r, k), acc0[r, j] + a(i0 * RB + r, k) * b(k, j0 * SV + j),
                                      acc0[r, j])
                if TWO:
                    acc1[r, j] = T.Select(ok(i0 * RB + RH + r, k),
                                          acc1[r, j] + a(i0 * RB + RH + r, k) * b(k, j0 * SV + j), acc1[r, j])

    @T.macro
    def tile(klo, khi, a, b, init, store, acc0, acc1, i0, j0):
        for r in T.unroll(RH):
            for j in T.vectorized(SV):
                acc0[r, j] = init(i0 * RB + r, j0 * SV + j)
                if TWO:
                    acc1[r, j] = init(i0 * RB + RH + r, j0 * SV + j)
        if tri is None:
            for k in range(klo(i0 * RB, i0 * RB + RB), khi(i0 * RB, i0 * RB + RB)):
                fma(a, b, acc0, acc1, i0, j0, k)
        elif tri == "le" or tri == "lt":
            for k in range(klo(i0 * RB, i0 * RB + RB), masked.start(i0)):
                fma(a, b, acc0, acc1, i0, j0, k)
            for kd in range(masked.extent):
                fma_masked(a, b, acc0, acc1, i0, j0, masked.start(i0) + kd, ok)
        else:
            for kd in range(masked.extent):
                fma_masked(a, b, acc0, acc1, i0, j0, masked.start(i0) + kd, ok)
            for k in range(masked.end(i0), khi(i0 * RB, i0 * RB + RB)):
                fma(a, b, acc0, acc1, i0, j0, k)
        for r in T.unroll(RH):
            for j in T.vectorized(SV):
                store(i0 * RB + r, j0 * SV + j, acc0[r, j])
                if TWO:
                    store(i0 * RB + RH + r, j0 * SV + j, acc1[r, j])

    @T.macro
    def mm(klo, khi, a, b, init, store):
        acc0 = T.alloc_buffer((RH, SV), F32)
        acc1 = T.alloc_buffer((RH, SV), F32)
        if order == 1:
            for j0 in range(W // SV):
                for i0 in range(first_row_block(j0), M // RB):
                    tile(klo, khi, a, b, init, store, acc0, acc1, i0, j0)
        else:
            for i0 in range(M // RB):
                for j0 in range(col_blocks(i0)):
                    tile(klo, khi, a, b, init, store, acc0, acc1, i0, j0)

    return mm


def _masked_part(RB: int, tri, G: int):
    """(the masked k of row block i0 of a triangular ``tri``: ``start(i0)``, a static ``extent`` and ``end(i0)``,
    where the unmasked "ge" / "gt" range starts; the per-row test ok(i, k)). G = 1: the block's own [lo, hi),
    lo = i0 RB. Grouped (G > 1; RB a multiple or a divisor of G, ``block``): row block [lo, hi) spans the
    groups gl = lo // G .. gh = (hi - 1) // G; "lt" sums k < gl G unmasked, then selects k in [gl G, gh G);
    "gt" selects k in [(gl + 1) G, (gh + 1) G), then sums k >= (gh + 1) G: RB - G selected k where G divides
    RB, none where RB divides G (the block's rows share a group)."""
    if G == 1:
        ok = {"le": _le, "lt": _lt, "ge": _ge, "gt": _gt}.get(tri)
        return SimpleNamespace(start=lambda i0: i0 * RB, extent=RB, end=lambda i0: i0 * RB + RB), ok
    first = (lambda i0: i0 * RB // G * G) if tri == "lt" else (lambda i0: (i0 * RB // G + 1) * G)
    ok = (lambda i, k: k // G < i // G) if tri == "lt" else (lambda i, k: k // G > i // G)
    return SimpleNamespace(start=first, extent=RB - G if RB % G == 0 else 0,
                           end=lambda i0: ((i0 * RB + RB - 1) // G + 1) * G), ok


def _le(i, k):
    return k <= i


def _lt(i, k):
    return k < i


def _ge(i, k):
    return k >= i


def _gt(i, k):
    return k > i


def zero(i, j):
    return T.float32(0)
