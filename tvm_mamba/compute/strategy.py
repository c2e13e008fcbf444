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
  where a launch is the only way (GPUs);
- ``checks_values``: whether the kernel reads its index arguments where it can raise (a CPU kernel is its own
  host function): then it refuses a slot out of range or taken twice itself (:func:`slot_checks`), before it
  writes, and the torch op's prepared launch need not read the indices in Python first. A GPU kernel cannot
  raise; its op checks the values before the launch.

This base class is the serial layout (tests, and the unscheduled definition a builder returns). The machine's
half lives with the rules and is one mixin per target kind, selected by the rule from the target's
capability: ``schedules/cpu/_strategy.py`` (``CpuLoops``: parallel blocks, vectorized task axes) and
``schedules/cuda/_strategy.py`` (``GpuLoops``: blockIdx x threadIdx, registers). An op family adds its own
vocabulary on top, in one subclass per family: the scans' ``Layout`` (selective_scan/_layout.py: dstate
lanes, warp sums, time threads; the Mamba-3 step uses it too), SSD's ``ChunkStrategy`` (ssd/strategy.py: the
chunk matmuls; the Mamba-3 preprocess uses it too).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._math import Math


class Strategy:
    """Serial blocks of ``threads`` serial tasks, no vectors, scratch in ``scope``, ``math``."""

    name = "serial"
    vector = False  # whether a task vectorizes its own contiguous axes (vloop)
    serial_work = None  # CPU: at most this much work runs on the calling thread (compute._common.SERIAL_WORK)
    checks_values = True  # the kernel runs on the host: it refuses bad index values itself (slot_checks)

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


def slot_checks(name: str, pool: str, idx_dtype: str = "int32"):
    """A macro ``check(idx, batch, slots)`` for a kernel whose strategy ``checks_values``: ValueError (an
    AssertStmt, raised by the kernel's host function) unless every ``idx[b]`` (b < batch) is below ``slots`` and
    no two non-negative entries are equal; placed before the kernel's first write, so a refused call leaves
    the pool as it was. ``name`` and ``pool`` name the index argument and the pool tensor in the messages (the
    torch ops' names). The duplicate test is an or-reduction over the earlier rows (batch^2 / 2 comparisons,
    vectorized): a decode batch's rows each stream a whole state slot, far more."""
    zero, seen_dtype = T.Cast(idx_dtype, 0), "int32"

    @T.macro
    def check(idx, batch, slots):
        seen = T.alloc_buffer((1,), seen_dtype)
        for b in T.serial(batch):
            T.Assert(idx[b] < T.Cast(idx_dtype, slots),
                     f"{name}: a slot is out of range for {pool} (>= {pool}.shape[0]); negative marks a padding "
                     "row", "ValueError")
            seen[0] = 0
            for c in T.serial(b):
                seen[0] = seen[0] | T.Cast(seen_dtype, idx[c] == idx[b])
            T.Assert(tirx.Or(idx[b] < zero, seen[0] == 0),
                     f"{name}: two rows name the same {pool} slot (each row updates its slot in place)", "ValueError")

    return check
