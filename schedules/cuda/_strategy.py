"""The GPU's half of the strategy protocol (tvm_mamba/compute/strategy.py), mixed into every op family's GPU
strategy (the scans' ``CudaLayout`` / ``CudaTimeLayout``, SSD's and Mamba-3's ``Gpu``): blocks of tasks on
blockIdx.x, a block's tasks on threadIdx.x, a task's axes serial in its thread (no vectors)."""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute._math import math_for
from ...compute.strategy import Strategy


class GpuLoops:
    """Put first in the bases (``class Gpu(GpuLoops, ChunkStrategy)``): its loops override the serial ones."""

    name = "gpu"
    vector = False

    def block_loop(self, n):
        return T.thread_binding(n, thread="blockIdx.x")

    def thread_loop(self, n):
        return T.thread_binding(n, thread="threadIdx.x")


class GpuStrategy(GpuLoops, Strategy):
    """The protocol alone on a GPU, for a template with no family vocabulary (the conv1d decode step):
    ``threads`` tasks a block, scratch in registers, the target's native float32 math."""

    def __init__(self, threads: int):
        super().__init__(math_for(native=True), threads=threads, scope="local")
