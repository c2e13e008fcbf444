"""The CUDA form of the SSD strategy's ``crossing_pass`` (compute/ssd/strategy.py: ssd_chunk_scan_bwd's d dt, the
crossing pairs of d dA_step, the carried-state terms' reverse cumsum and dD, scan_bwd_launch.py): a block per
task (batch, chunk, head), a thread per column k of the chunk.

Thread k keeps x_k (headdim values) in registers and its column's two running sums (d dt's and the crossing
pairs' R[k]). The rows are visited from the last up in bands of ``BAND`` (fewer rows where a block's shared
memory is small: ``band_within``): the band's g rows are staged in shared memory (read by every thread:
broadcasts), each thread forms the band's g_l . x_k in registers
(headdim-long, p ascending; not where the whole band lies before column k's causal rows or past the
sequence: the warps above the diagonal skip the band's multiply-adds), then row by row from the band's last
its weight (one exp per causal pair), its running sums, and R_l[k] into a shared band table (the weight's
per-position values: the band's rows staged with g, every column's once per block, read from shared memory
per pair: read in place they were two global requests per pair, kept in registers they pushed the kernel
past 255 registers and it spilled); after a barrier, thread r of the band sums row l's R_l[k] over k < l
(and the staged chunk-state prefix terms) in k order, the staged carried-state terms from the last row down
to l (their reverse cumsum, in the serial order), and stores d dA_step[l]. Each pair's product and exp is
computed once, where the per-position launch this replaces recomputed them per (q, l, k) triple: O(Q^2
headdim) per task instead of O(Q^3 headdim).

dD (``_dd``): per position (diag_skip) thread k's own g_k . x_k, the band product's diagonal; per channel
thread p adds the staged band's g times x at (row, p). The sums are the serial layout's, term for term in the
same order; the band's row sums run on ``BAND`` threads (Q-long sums each, beside the band's BAND x headdim
multiply-adds per thread). The band table's rows are padded by one float (the row sums read down a column
of it).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ._tiled import _buffers, _fill, _stage_positions, _typed, _values, largest_divisor

BAND = 16  # rows per band (the row sums' threads; each thread's band of g . x accumulators)
READERS = 3  # the pass's per-position readers at most: dA_cs, dt and the sequence id (scan_bwd_launch.py)


def _bands(Q: int, band: int = BAND) -> int:
    """The band's rows: the largest divisor of Q <= ``band``, two bands at least (with one, at chunk 16, TVM
    0.27's CompactBufferAllocation failed: an int32 literal out of range)."""
    return largest_divisor(Q, min(band, max(1, Q // 2)))


def crossing_floats(Q: int, P: int, band: int = BAND) -> int:
    """The 4-byte words of shared memory ``crossing_pass(Q, P, start, band)`` allocates: the band table TB x
    (Q + 1), the band's g rows TB x P, pre and after (Q each), the band's and the columns' per-position values."""
    TB = _bands(Q, band)
    return TB * (Q + 1) + TB * P + 2 * Q + READERS * (TB + Q)


def band_within(Q: int, P: int, shared_bytes: int) -> int:
    """The widest band (BAND, or a smaller divisor of Q) whose pass fits ``shared_bytes``: at chunk 256 and
    headdim 64, BAND's 25.3 KB is over WebGPU's 16 KB of workgroup memory, a band of 8 takes 15.1 KB."""
    fits = [b for b in range(1, BAND + 1) if Q % b == 0 and 4 * crossing_floats(Q, P, b) <= shared_bytes]
    return max(fits, default=1)


def crossing_pass(Q: int, P: int, start, band: int = BAND):
    """The strategy's ``crossing_pass`` run (strategy.py), a block of Q threads per task, the rows in bands of
    ``band`` (at most; ``band_within``: a smaller block budget takes narrower bands, the sums are the same)."""
    TB = _bands(Q, band)
    LR = Q + 1  # the band table's row stride
    NB = Q // TB
    copies = (TB * P + Q - 1) // Q
    stage_band = _stage_positions(_fill(_Threads(Q), TB))
    stage_columns = _stage_positions(_fill(_Threads(Q), Q))
    dd_band, dd_store = _dd(Q, TB, P)

    def first(ops, k):  # column k's first row whose g . x_k the bands read (its own with dD per position)
        return k if hasattr(ops, "dd") and ops.dd.per_position else start(k)

    @T.macro
    def run(extent, ops):
        for bx in T.thread_binding(extent, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # (_tiled.py: MIN_BLOCKS)
            sh = T.meta_var(_buffers("shared", g=(TB * P,), rs=(TB * LR,), pre=(Q,), after=(Q,)))
            vb = T.meta_var(_slots("vb", TB, ops.pos))  # the band's per-position values
            vk = T.meta_var(_slots("vk", Q, ops.pos))  # the columns' (read after the first barrier)
            for tx in T.thread_binding(Q, thread="threadIdx.x"):
                reg = T.meta_var(_buffers("local", xr=(P,), acc=(TB,), run=(6,), dc=((P + Q - 1) // Q,)))
                for p in T.unroll(P):
                    reg.xr[p] = ops.x(bx, tx, p)
                sh.pre[tx] = ops.pre(bx, tx)
                sh.after[tx] = ops.after(bx, tx)
                stage_columns(vk, ops.pos, bx, 0, tx)
                reg.run[0] = T.float32(0)
                reg.run[1] = T.float32(0)
                for e in T.unroll((P + Q - 1) // Q):
                    reg.dc[e] = T.float32(0)
                for bi in range(NB):
                    for e in T.unroll(copies):  # the band's g rows
                        if e * Q + tx < TB * P:
                            sh.g[e * Q + tx] = ops.g(bx, (NB - 1 - bi) * TB + (e * Q + tx) // P, (e * Q + tx) % P)
                    stage_band(vb, ops.pos, bx, (NB - 1 - bi) * TB, tx)
                    T.tvm_storage_sync("shared")
                    for r in T.unroll(TB):
                        reg.acc[r] = T.float32(0)
                    if T.And((NB - 1 - bi) * TB + TB - 1 >= first(ops, tx), (NB - 1 - bi) * TB < ops.end(bx)):
                        for p in T.unroll(P):  # (a band wholly before column tx's causal rows: none of it read)
                            for r in T.unroll(TB):
                                reg.acc[r] = reg.acc[r] + sh.g[r * P + p] * reg.xr[p]
                    dd_band(ops, sh, reg, bx, (NB - 1 - bi) * TB, tx)
                    for rr in T.unroll(TB):
                        if T.And((NB - 1 - bi) * TB + TB - 1 - rr >= start(tx),
                                 (NB - 1 - bi) * TB + TB - 1 - rr < ops.end(bx)):
                            reg.run[2] = ops.weight(bx, (NB - 1 - bi) * TB + TB - 1 - rr, tx, reg.acc[TB - 1 - rr],
                                                    _values(vb, TB - 1 - rr), _values(vk, tx))
                            reg.run[0] = reg.run[0] + reg.run[2]
                            reg.run[1] = reg.run[1] + ops.pair(bx, tx, reg.run[2], _values(vk, tx))
                        sh.rs[(TB - 1 - rr) * LR + tx] = reg.run[1]
                    T.tvm_storage_sync("shared")
                    if tx < TB:  # row (NB - 1 - bi) TB + tx: its crossing pairs and prefix, k ascending
                        reg.run[3] = T.float32(0)
                        reg.run[4] = T.float32(0)
                        reg.run[5] = T.float32(0)
                        for k in range((NB - 1 - bi) * TB + tx):
                            reg.run[3] = reg.run[3] + sh.rs[tx * LR + k]
                            reg.run[4] = reg.run[4] + sh.pre[k]
                        for lr in range(Q - (NB - 1 - bi) * TB - tx):  # the reverse cumsum, from the last row
                            reg.run[5] = reg.run[5] + sh.after[Q - 1 - lr]
                        ops.row_store(bx, (NB - 1 - bi) * TB + tx, reg.run[3], reg.run[4], reg.run[5])
                ops.col_store(bx, tx, reg.run[0])
                dd_store(ops, reg, bx, tx)

    return run


def _slots(name: str, n: int, pos) -> list:
    """The shared per-position slots (_tiled.py ``_typed``) of at most READERS readers (``crossing_floats``)."""
    assert len(pos) <= READERS, f"crossing_pass: {len(pos)} per-position readers, crossing_floats counts {READERS}"
    return _typed("shared", name, n, pos)


def _dd(Q: int, TB: int, P: int):
    """Macros ``band(ops, sh, reg, bx, l0, tx)`` and ``store(ops, reg, bx, tx)``: the crossing pass's dD
    (``ops.dd``, strategy.py). Per position: thread k's own g_k . x_k, the band's product at row k (so the bands
    from row k on are read, not from its causal start). Per channel: thread p < P adds the band's g (staged)
    times x at (row, p), rows from the band's last up, then stores its sum (channels Q apart per thread)."""
    EP = (P + Q - 1) // Q

    @T.macro
    def band(ops, sh, reg, bx, l0, tx):
        if hasattr(ops, "dd"):
            if ops.dd.per_position:
                for rr in T.unroll(TB):
                    if l0 + rr == tx:
                        ops.dd.store(bx, tx, reg.acc[rr])
            else:
                for e in T.unroll(EP):
                    if e * Q + tx < P:
                        for rr in T.unroll(TB):
                            reg.dc[e] = reg.dc[e] + sh.g[(TB - 1 - rr) * P + e * Q + tx] * ops.x(
                                bx, l0 + TB - 1 - rr, e * Q + tx)

    @T.macro
    def store(ops, reg, bx, tx):
        if hasattr(ops, "dd"):
            if not ops.dd.per_position:
                for e in T.unroll(EP):
                    if e * Q + tx < P:
                        ops.dd.store(bx, e * Q + tx, reg.dc[e])

    return band, store


class _Threads:
    """The block's thread count, as ``_tiled._fill`` reads it from a tiling."""

    def __init__(self, threads: int):
        self.threads = threads
