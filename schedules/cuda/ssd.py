"""CUDA rule for the SSD kernels, and the CUDA strategy (compute/ssd/strategy.py) it lays templates out with.

Every SSD kernel has one template for every target (tvm_mamba/compute/ssd/): chunk_cumsum(_bwd),
state_passing(_bwd), head_sum, bmm_chunk, chunk_state, chunk_scan, chunk_scan_bwd_dstates, chunk_scan_bwd and
chunk_state_varlen are laid out here by ``Gpu``: blockIdx.x x threadIdx.x of ``threads``, a thread per task and
per lane (dstate element; a thread per output of a chunk matmul), scratch in registers, CUDA-native exp / log1p.
ssd_chunk_scan_bwd takes its non-vector form: a launch per piece, several launches inside one PrimFunc where a
later one reads what an earlier one wrote (launches run in order on the stream: the backward's cross-position sums
without atomics). C_l.B_s comes from ssd_bmm_chunk (once per group); no shared-memory staging and no tensor
cores yet, so they compile cleanly (0 spills) but are far from upstream's Triton speed (docs/ssd.md).
Selected by capability (``"gpu" in target.keys``). Knob: ``threads`` per block (64 / 128 / 256, default 128).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute import ssd as compute
from ...compute.ssd.strategy import Strategy
from ..rule import Decisions, kernel_attrs, schedule_of


class Gpu(Strategy):
    """blockIdx.x x threadIdx.x of ``threads``, a task per lane, scratch in registers, native math."""

    name = "gpu"
    scope = "local"

    def __init__(self, threads: int = 128):
        super().__init__(native_math=True)
        self.threads = threads

    def outer(self, extent):
        return T.thread_binding(self.blocks(extent), thread="blockIdx.x")

    def inner(self):
        return T.thread_binding(self.threads, thread="threadIdx.x")


def template(name: str, static: dict, threads: int = 128, serial: bool = False):
    """The CUDA layout of kernel ``name`` (serial=True: thread loops made serial, CUDA's math: for CPU tests)."""
    template, dims = compute.template_of(name)
    return template(dims(**static), Strategy(native_math=True) if serial else Gpu(threads))


def apply(func, target, decisions: Decisions):
    """The CUDA layout of an SSD kernel (same parameters as the compute builder), or None."""
    name, static = kernel_attrs(func)
    if "gpu" not in target.keys or compute.template_of(name) is None:
        return None
    threads = decisions.pick("threads", (64, 128, 256), 128)
    prim = template(name, static, threads).with_attrs({"global_symbol": name, "tirx.noalias": True,
                                                        "tvm_mamba.kernel": name})
    return schedule_of(prim, name=name)
