"""How a template's loops land on a machine: the one strategy protocol every loop-nest template takes.

A template (the scans, SSD, Mamba-3, the conv1d decode step) writes a kernel's math once over abstract loops
and asks its strategy where they run. The protocol every strategy speaks:

- **tasks**: the kernel's independent units of work (a scan lane: one (batch, channel); an SSD task: one
  (batch, chunk, head, ...); a conv1d decode row). A template runs ``extent`` of them as
  ``for bx in S.outer(extent): for tx in S.inner(): i = S.index(bx, tx); if i < extent: ...``: ``threads``
  tasks per block (a CUDA block's threads; 1 on a CPU, where the bound check folds away), ``blocks(extent)``
  blocks, ``block_loop`` / ``thread_loop`` the two loop kinds;
- **vectors**: ``vector`` says whether a task vectorizes its own contiguous axes (dstate, headdim, a matmul
  row), ``vloop(width)`` is such an axis' loop (vectorized on a CPU, serial on a GPU thread);
- **where scratch lives** (``scope``: a CPU task's stack, CUDA registers) and the **math** (``math``: a
  ``_math.Math``, the CPU's vectorizable polynomials or the target's native exp / log1p);
- ``serial_work``: the CPU's size below which a kernel runs on the calling thread (no pool launch); None
  where a launch is the only way (GPUs).

This base class is the serial layout (tests, and the unscheduled definition a builder returns). The machine's
half lives with the rules and is one mixin per target kind, selected by the rule from the target's
capability: ``schedules/cpu/_strategy.py`` (``CpuLoops``: parallel blocks, vectorized task axes) and
``schedules/cuda/_strategy.py`` (``GpuLoops``: blockIdx x threadIdx, registers). An op family adds its own
vocabulary on top, in one subclass per family: the scans' ``Layout`` (selective_scan/_layout.py: dstate
lanes, warp sums, time threads; the Mamba-3 step uses it too), SSD's ``ChunkStrategy`` (ssd/strategy.py: the
chunk matmuls; the Mamba-3 preprocess uses it too).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ._math import Math


class Strategy:
    """Serial blocks of ``threads`` serial tasks, no vectors, scratch in ``scope``, ``math``."""

    name = "serial"
    vector = False  # whether a task vectorizes its own contiguous axes (vloop)
    serial_work = None  # CPU: at most this much work runs on the calling thread (compute._common.SERIAL_WORK)

    def __init__(self, math: Math, threads: int = 1, scope: str = "global"):
        self.math, self.threads, self.scope = math, threads, scope

    def block_loop(self, n):
        """The loop over blocks of tasks (CPU: parallel; CUDA: blockIdx.x)."""
        return T.serial(n)

    def thread_loop(self, n):
        """The loop over a block's tasks (CUDA: threadIdx.x)."""
        return T.serial(n)

    def blocks(self, extent):
        """Blocks of ``threads`` tasks covering ``extent`` (one task a block: ``extent`` itself)."""
        return extent if self.threads == 1 else (extent + self.threads - 1) // self.threads

    def outer(self, extent):
        return self.block_loop(self.blocks(extent))

    def inner(self):
        return self.thread_loop(self.threads)

    def index(self, bx, tx):
        return bx * self.threads + tx

    def vloop(self, width: int):
        return T.vectorized(width) if self.vector else T.serial(width)
