"""CPU rule for the SSD kernels, and the CPU strategy (compute/ssd/strategy.py) it lays templates out with.

``Cpu``: a parallel loop over the tasks, each task's lane axis (dstate) vectorized, scratch on the stack, the
vectorizable polynomial math: serves the kernels with one template for every target (chunk_cumsum(_bwd),
state_passing(_bwd), head_sum). The chunk-matmul kernels are CPU loop nests (tvm_mamba/compute/ssd/) rebuilt
with the knobs below.

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
from ...compute.ssd.dt import cumsum_bwd_template, cumsum_template
from ...compute.ssd.mm import COLS, DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, ORDERS, ROWS
from ...compute.ssd.passing import head_sum_template, passing_bwd_template, passing_template
from ...compute.ssd.strategy import Strategy
from ..rule import Decisions, kernel_attrs, schedule_of

_BLOCKED = ("ssd_bmm_chunk", "ssd_chunk_state", "ssd_chunk_scan", "ssd_chunk_scan_bwd_dstates", "ssd_chunk_scan_bwd")
SHARED = {"ssd_chunk_cumsum": cumsum_template, "ssd_chunk_cumsum_bwd": cumsum_bwd_template,
          "ssd_state_passing": passing_template, "ssd_state_passing_bwd": passing_bwd_template,
          "ssd_head_sum": head_sum_template}


class Cpu(Strategy):
    """Parallel tasks, whole lane axes vectorized, stack scratch, the polynomial math (x86 / Arm via LLVM)."""

    name = "cpu"
    vector = True

    def outer(self, extent):
        return T.parallel(extent)


def apply(func, target, decisions: Decisions):
    """Schedule over the SSD loop nest, or None for a kernel that is not an SSD kernel."""
    name, static = kernel_attrs(func)
    if target.kind.name != "llvm" or name is None or not name.startswith("ssd_"):
        return None
    dims = compute.DIMS[name[len("ssd_"):]](**static)
    if name in SHARED:
        prim = SHARED[name](dims, Cpu()).with_attrs(dict(func.attrs))
        return schedule_of(prim, name=name)
    if name not in _BLOCKED:
        return schedule_of(func, name=name)
    rows = decisions.pick("rows", ROWS, DEFAULT_ROWS)
    cols = decisions.pick("cols", COLS, DEFAULT_COLS)
    order = decisions.pick("order", ORDERS, DEFAULT_ORDER)
    return schedule_of(getattr(compute, name)(dims, rows=rows, cols=cols, order=order), name=name)
