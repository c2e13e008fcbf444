"""CPU rule for the SSD kernels: they are hand-written loop nests already (tvm_mamba/compute/ssd.py).

Why loop nests: with a symbolic seqlen, s_tir split + vectorize adds a ``t < seqlen`` predicate and LLVM
emits no vector code; the SSD chunk matmuls have static extents (chunk_size, headdim, dstate) inside a
chunk, so each is written as register-blocked row updates vectorized over its contiguous static axis
(tvm_mamba/compute/_ssd_mm.py), and the ragged last chunk is handled by staging zeros. One (batch, chunk,
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

from ...compute import ssd as compute
from ...compute._ssd_mm import COLS, DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, ORDERS, ROWS
from ..rule import Decisions, kernel_attrs, schedule_of

_BLOCKED = ("ssd_bmm_chunk", "ssd_chunk_state", "ssd_chunk_scan", "ssd_chunk_scan_bwd_dstates", "ssd_chunk_scan_bwd")


def apply(func, target, decisions: Decisions):
    """Schedule over the SSD loop nest, or None for a kernel that is not an SSD kernel."""
    name, static = kernel_attrs(func)
    if target.kind.name != "llvm" or name is None or not name.startswith("ssd_"):
        return None
    if name not in _BLOCKED:
        return schedule_of(func, name=name)
    rows = decisions.pick("rows", ROWS, DEFAULT_ROWS)
    cols = decisions.pick("cols", COLS, DEFAULT_COLS)
    order = decisions.pick("order", ORDERS, DEFAULT_ORDER)
    return schedule_of(getattr(compute, name)(**static, rows=rows, cols=cols, order=order), name=name)
