"""CPU rule for the SSD kernels: they are hand-written loop nests already (tvm_mamba/compute/ssd.py).

Why loop nests: with a symbolic seqlen, s_tir split + vectorize adds a ``t < seqlen`` predicate and LLVM
emits no vector code; the SSD chunk matmuls have static extents (chunk_size, headdim, dstate) inside a
chunk, so each is written as a row update vectorized over its contiguous static axis, and the ragged last
chunk is handled by staging zeros. One (batch, chunk, head) per parallel iteration (batch*nchunks*nheads
>= 2 cores at every shape of interest).

Knobs: none yet (``decisions`` is accepted and unused; the space is empty). Register blocking of the
chunk matmuls would be the first knob to add (see docs/ssd.md).
"""
from __future__ import annotations

from ..rule import Decisions, kernel_attrs, schedule_of


def apply(func, target, decisions: Decisions):
    """Schedule over the SSD loop nest, or None for a kernel that is not an SSD kernel."""
    name, _static = kernel_attrs(func)
    if name is None or not name.startswith("ssd_"):
        return None
    return schedule_of(func, name=name)
