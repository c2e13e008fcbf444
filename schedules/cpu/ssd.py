"""CPU rule for the SSD kernels, and the CPU strategy (compute/ssd/strategy.py) it lays templates out with.

``Cpu``: a parallel loop over the tasks, each task's lane axis (dstate) vectorized, scratch on the stack, the
vectorizable polynomial math: serves the kernels with one template for every target (chunk_cumsum(_bwd),
state_passing(_bwd), head_sum, chunk_state_varlen; bmm_chunk, chunk_state and chunk_scan_bwd_dstates through
its staged matmuls, chunk_scan through ``causal_matmul``, chunk_scan_bwd in its task-per-chunk form), with the
knobs below.

Why staged, register-blocked matmuls: with a symbolic seqlen, s_tir split + vectorize adds a ``t < seqlen`` predicate and LLVM
emits no vector code; the SSD chunk matmuls have static extents (chunk_size, headdim, dstate) inside a
chunk, so each is written as register-blocked row updates vectorized over its contiguous static axis
(tvm_mamba/compute/ssd/mm.py), and the ragged last chunk is handled by staging zeros. One (batch, chunk,
head) per parallel iteration (batch*nchunks*nheads >= 2 cores at every shape of interest).

Knobs (a template: the kernel is rebuilt with them), for the five kernels with chunk matmuls
(bmm_chunk, chunk_state, chunk_scan, chunk_scan_bwd_dstates, chunk_scan_bwd): ``rows`` (1, 2, 4, 8) and ``cols``
(16, 32, 64, 128 floats; the whole width where it does not divide it): the accumulator block of every
matmul of the kernel. Default 4 rows x 2 vector registers, 8 accumulators: 4 x 32 with AVX-512, 4 x 16 with
AVX2 (``rule.vector_floats``). ``rows=1, cols=128`` is close to the earlier unblocked kernels (a whole 64- or
128-wide row per step). ``order`` (0, 1): row blocks outer (default, the earlier loop order) or column blocks
outer, where a K x cols tile of the right operand is reused by every row block (L1 reuse when it fits; at the
Mamba-2 130M shape 1.04-1.07x for chunk_state / chunk_scan_bwd, 0.9x for chunk_scan). The whole space is 32
points; every point gives bitwise-equal results.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute import ssd as compute
from ...compute.ssd.mm import (COLS, DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, ORDERS, ROWS, lower_cols, matmul,
                               vblock, zero)
from ...compute.ssd.strategy import ChunkStrategy, at
from ..rule import Decisions, schedule_of, vector_floats
from ._strategy import CpuLoops

_BLOCKED = ("bmm_chunk", "chunk_state", "chunk_scan", "chunk_scan_bwd_dstates", "chunk_scan_bwd")


class Cpu(CpuLoops, ChunkStrategy):
    """Parallel tasks, whole lane axes vectorized, stack scratch, the polynomial math (x86 / Arm via LLVM)."""

    def __init__(self, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS, order: int = DEFAULT_ORDER):
        super().__init__()
        self.rows, self.cols, self.order = rows, cols, order

    def scaled_matmul(self, M: int, W: int, K: int):
        """A task per matmul: its operands staged in float32 stack buffers (rhs rows scaled once per k, lhs
        transposed so the k loop reads it contiguously), then the register-blocked matmul (mm.py)."""
        mm = matmul(M, W, self.rows, self.cols, order=self.order)

        @T.macro
        def run(extent, lhs, scale, rhs, store):
            for t in T.parallel(extent):
                bw = T.alloc_buffer((K, W), "float32")
                at = T.alloc_buffer((M, K), "float32")
                row = T.alloc_buffer((M,), "float32")
                sc = T.alloc_buffer((1,), "float32")
                for k in range(K):
                    sc[0] = scale(t, k)
                    for j in T.vectorized(W):
                        bw[k, j] = sc[0] * rhs(t, k, j)
                    for i in T.vectorized(M):  # vectorized (lhs may hold math: the gate's silu), then transposed
                        row[i] = lhs(t, i, k)
                    for i in range(M):
                        at[i, k] = row[i]
                mm(lambda lo, hi: 0, lambda lo, hi: K, lambda i, k: at[i, k], lambda k, j: bw[k, j], zero,
                   lambda i, j, v: store(t, i, j, v))

        return run

    def matmul_rows(self, M: int, W: int, K: int, lower: bool = False):
        """A task per matmul: lhs rows staged as they are (vectorized along k), rhs rows transposed into a
        K x W operand, then the register-blocked matmul (mm.py); no scale pass. The whole product, ``lower``
        or not (the template's store zeroes what lies above the diagonal)."""
        staged = _staged(matmul(M, W, self.rows, self.cols, order=self.order), M, W, K)

        @T.macro
        def run(extent, lhs, rhs, store):
            for t in T.parallel(extent):
                al = T.alloc_buffer((M, K), "float32")
                bt = T.alloc_buffer((K, W), "float32")
                staged(al, bt, lambda i, k: lhs(t, i, k), lambda k, j: rhs(t, j, k), lambda i, j, v: store(t, i, j, v))

        return run

    def causal_matmul(self, M: int, W: int, K: int, strict: bool = False, group: int = 1):
        """A task per chunk: its lhs rows, rhs (read k-inner: a state read transposed), xs rows (0 past seqlen) and
        the causal blocks of the weight (``lower_cols``: blocks right of them are never read) staged in float32
        stack buffers, then two register-blocked matmuls into one accumulator: the carried product (epilogue
        ``carry``; where ``carried(t)`` is false, no state enters the chunk: carry of 0, neither operand staged),
        then from it the lower-triangular one (``tri="le"``: a row never adds 0 * xs of a later position, so a
        non-finite x stays causal; ``strict``: ``tri="lt"``, not even its own position; ``group``: not its own
        step group's); then ``store`` for the rows the chunk has."""
        staged = _staged(matmul(M, W, self.rows, self.cols, order=self.order), M, W, K)
        mm_le = matmul(M, W, self.rows, self.cols, order=self.order, tri="lt" if strict else "le", group=group)
        VB = vblock(M)

        @T.macro
        def run(extent, rows, carried, lhs, rhs, carry, weight, xs, store, pos):
            for t in T.parallel(extent):
                a = T.alloc_buffer((M, K), "float32")
                bt = T.alloc_buffer((K, W), "float32")
                xv = T.alloc_buffer((M, W), "float32")
                w = T.alloc_buffer((M, M), "float32")
                acc = T.alloc_buffer((M, W), "float32")
                for i in range(M):
                    for j in T.vectorized(W):
                        xv[i, j] = xs(t, i, j)
                for i in range(M):
                    for sb in range(lower_cols(i, M, VB) // VB):
                        for v in T.vectorized(VB):
                            w[i, sb * VB + v] = weight(t, i, sb * VB + v, at(pos, t, i), at(pos, t, sb * VB + v))
                if carried(t):
                    staged(a, bt, lambda i, k: lhs(t, i, k), lambda k, j: rhs(t, k, j),
                           lambda i, j, v: T.buffer_store(acc, carry(t, i, j, v, xv[i, j], at(pos, t, i)), [i, j]))
                else:
                    for i in range(M):
                        for j in T.vectorized(W):
                            acc[i, j] = carry(t, i, j, T.float32(0), xv[i, j], at(pos, t, i))
                mm_le(lambda lo, hi: 0, lambda lo, hi: hi, lambda i, s: w[i, s], lambda s, j: xv[s, j],
                      lambda i, j: acc[i, j], lambda i, j, v: T.buffer_store(acc, v, [i, j]))
                for i in range(rows(t)):
                    for j in T.vectorized(W):
                        store(t, i, j, acc[i, j])

        return run


def _staged(mm, M: int, W: int, K: int):
    """A macro ``run(a, b, lhs, rhs, store)``: lhs(i, k) staged row by row into ``a`` (M x K, vectorized along
    k), rhs(k, j) into ``b`` (K x W, read k-inner), then the register-blocked ``mm`` of them with epilogue
    store(i, j, v)."""

    @T.macro
    def run(a, b, lhs, rhs, store):
        for i in range(M):
            for k in T.vectorized(K):
                a[i, k] = lhs(i, k)
        for j in range(W):
            for k in range(K):
                b[k, j] = rhs(k, j)
        mm(lambda lo, hi: 0, lambda lo, hi: K, lambda i, k: a[i, k], lambda k, j: b[k, j], zero, store)

    return run


def lay_out(direction: str, dims, target, decisions: Decisions):
    """The CPU layout of an SSD kernel (its template under ``Cpu``), or None for another kernel or target."""
    if "cpu" not in target.keys or direction not in compute.TEMPLATES:
        return None
    strategy = Cpu()
    if direction in _BLOCKED:
        # default block: 4 rows x 2 vector registers = 8 accumulator registers (4 x 32 with AVX-512, 4 x 16 with
        # AVX2: its 4 x 32 needs 16 ymm accumulators, all of AVX2's registers; measured on a 2-vCPU AVX2 EPYC at
        # the Mamba-2 130M shape, one thread: chunk_state 5.0 -> 3.9 ms, bmm_chunk 1.15 -> 0.65, chunk_scan
        # 8.9 -> 7.8)
        cols = 2 * vector_floats(target)
        strategy = Cpu(decisions.pick("rows", ROWS, DEFAULT_ROWS), decisions.pick("cols", COLS, cols),
                       decisions.pick("order", ORDERS, DEFAULT_ORDER))
    return schedule_of(compute.TEMPLATES[direction](dims, strategy), f"ssd_{direction}")
