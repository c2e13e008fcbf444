"""The CPU's half of the strategy protocol (tvm_mamba/compute/strategy.py), mixed into every op family's CPU
strategy (the scans' ``CpuLayout``, SSD's and Mamba-3's ``Cpu``): blocks of tasks run in parallel on TVM's
thread pool (one task a block), a task's contiguous axes are vectorized, and decode-size work
(``serial_work``) runs on the calling thread."""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute._math import math_for
from ...compute.strategy import Strategy
from ..rule import SERIAL_WORK


class CpuLoops:
    """Put first in the bases (``class CpuLayout(CpuLoops, Layout)``): its loops override the serial ones."""

    name = "cpu"
    vector = True
    serial_work = SERIAL_WORK

    def block_loop(self, n):
        return T.parallel(n)


class CpuStrategy(CpuLoops, Strategy):
    """The protocol alone on a CPU, for a template with no family vocabulary (the conv1d decode step): the
    polynomial float32 math."""

    def __init__(self):
        super().__init__(math_for())
