"""CPU rule for the SSD kernels, and the CPU strategy (compute/ssd/strategy.py) it lays templates out with.

``Cpu``: a parallel loop over the tasks, each task's lane axis (dstate) vectorized, scratch on the stack, the
vectorizable polynomial math: serves the kernels with one template for every target (chunk_cumsum(_bwd),
state_passing(_bwd), head_sum, chunk_state, chunk_scan_bwd: its task-per-chunk form). The other chunk-matmul
kernels are CPU loop nests (tvm_mamba/compute/ssd/) rebuilt with the knobs below.

Why loop nests: with a symbolic seqlen, s_tir split + vectorize adds a ``t < seqlen`` predicate and LLVM
emits no vector code; the SSD chunk matmuls have static extents (chunk_size, headdim, dstate) inside a
chunk, so each is written as register-blocked row updates vectorized over its contiguous static axis
(tvm_mamba/compute/ssd/mm.py), and the ragged last chunk is handled by staging zeros. One (batch, chunk,
head) per parallel iteration (batch*nchunks*nheads >= 2 cores at every shape of interest).

Knobs (a template: the kernel is rebuilt with them), for the five kernels with chunk matmuls
(bmm_chunk, chunk_state, chunk_scan, chunk_scan_bwd_dstates, chunk_scan_bwd): ``rows`` (1, 2, 4, 8) and ``cols``
(16, 32, 64, 128 floats; the whole width where it does not divide it): the accumulator block of every
matmul of the kernel. Default 4 x 32: 8 zmm accumulators. ``rows=1, cols=128`` is close to the earlier
unblocked kernels (a whole 64- or 128-wide row per step). ``order`` (0, 1): row blocks outer (default, the
earlier loop order) or column blocks outer, where a K x cols tile of the right operand is reused by every
row block (L1 reuse when it fits; at the Mamba-2 130M shape 1.04-1.07x for chunk_state / chunk_scan_bwd, 0.9x for
chunk_scan). The whole space is 32 points; every point gives bitwise-equal results.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute import ssd as compute
from ...compute.ssd.chunk_state import chunk_state_template
from ...compute.ssd.dt import cumsum_bwd_template, cumsum_template
from ...compute.ssd.mm import COLS, DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, ORDERS, ROWS, matmul, zero
from ...compute.ssd.passing import head_sum_template, passing_bwd_template, passing_template
from ...compute.ssd.scan_bwd import chunk_scan_bwd_template
from ...compute.ssd.strategy import Strategy
from ..rule import Decisions, kernel_attrs, schedule_of

_BLOCKED = ("ssd_bmm_chunk", "ssd_chunk_state", "ssd_chunk_scan", "ssd_chunk_scan_bwd_dstates", "ssd_chunk_scan_bwd")
SHARED = {"ssd_chunk_cumsum": cumsum_template, "ssd_chunk_cumsum_bwd": cumsum_bwd_template,
          "ssd_state_passing": passing_template, "ssd_state_passing_bwd": passing_bwd_template,
          "ssd_head_sum": head_sum_template, "ssd_chunk_state": chunk_state_template,
          "ssd_chunk_scan_bwd": chunk_scan_bwd_template}


class Cpu(Strategy):
    """Parallel tasks, whole lane axes vectorized, stack scratch, the polynomial math (x86 / Arm via LLVM)."""

    name = "cpu"
    vector = True

    def __init__(self, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS, order: int = DEFAULT_ORDER):
        super().__init__()
        self.rows, self.cols, self.order = rows, cols, order

    def outer(self, extent):
        return T.parallel(extent)

    def scaled_matmul(self, M: int, W: int, K: int):
        """A task per matmul: its operands staged in float32 stack buffers (rhs rows scaled once per k, lhs
        transposed so the k loop reads it contiguously), then the register-blocked matmul (mm.py)."""
        mm = matmul(M, W, self.rows, self.cols, order=self.order)

        @T.macro
        def run(extent, lhs, scale, rhs, store):
            for t in T.parallel(extent):
                bw = T.alloc_buffer((K, W), "float32")
                at = T.alloc_buffer((M, K), "float32")
                sc = T.alloc_buffer((1,), "float32")
                for k in range(K):
                    sc[0] = scale(t, k)
                    for j in T.vectorized(W):
                        bw[k, j] = sc[0] * rhs(t, k, j)
                    for i in range(M):
                        at[i, k] = lhs(t, i, k)
                mm(lambda lo, hi: 0, lambda lo, hi: K, lambda i, k: at[i, k], lambda k, j: bw[k, j], zero,
                   lambda i, j, v: store(t, i, j, v))

        return run


def apply(func, target, decisions: Decisions):
    """Schedule over the SSD loop nest, or None for a kernel that is not an SSD kernel."""
    name, static = kernel_attrs(func)
    if target.kind.name != "llvm" or name is None or not name.startswith("ssd_"):
        return None
    dims = compute.DIMS[name[len("ssd_"):]](**static)
    if name not in _BLOCKED:
        return schedule_of(SHARED[name](dims, Cpu()).with_attrs(dict(func.attrs)) if name in SHARED else func,
                           name=name)
    rows = decisions.pick("rows", ROWS, DEFAULT_ROWS)
    cols = decisions.pick("cols", COLS, DEFAULT_COLS)
    order = decisions.pick("order", ORDERS, DEFAULT_ORDER)
    if name in SHARED:
        return schedule_of(SHARED[name](dims, Cpu(rows, cols, order)).with_attrs(dict(func.attrs)), name=name)
    return schedule_of(getattr(compute, name)(dims, rows=rows, cols=cols, order=order), name=name)
