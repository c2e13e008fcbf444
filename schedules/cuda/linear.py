"""CUDA rule for linear (compute/linear.py), correctness first.

fwd: one warp per output feature: the 32 lanes of a warp read consecutive elements of one weight row (and
of the x row: coalesced), each lane sums its strided part of in_features in a register, and the warp's
partial sums meet in a cross-thread reduction (warp shuffles); ``warps`` output features per block
(threadIdx.y), the (row, feature block) pairs fused on blockIdx.x (rows are symbolic and may exceed
gridDim.y's 65535). The scale, bias and cast follow in the same thread.
bwd: one thread per dx element, the sum over out_features serial in a register; consecutive threads take
consecutive in_features, so the weight rows are read coalesced.
Knobs: ``warps`` (fwd), ``threads`` (bwd).
"""
from __future__ import annotations

from tvm_mamba.schedules import rule
from ._common import bind_flat

WARP = 32


def _fwd(func, decisions):
    warps = decisions.pick("warps", (1, 2, 4, 8), 4)
    sch = rule.schedule_of(func, name="linear_fwd")
    acc, y = sch.get_sblock("acc"), sch.get_sblock("y")
    m, n = sch.get_loops(y)
    no, ni = sch.split(n, [None, warps])
    sch.bind(sch.fuse(m, no), "blockIdx.x")
    sch.bind(ni, "threadIdx.y")
    sch.compute_at(acc, ni)
    _, ki = sch.split(sch.get_loops(acc)[-1], [None, WARP])
    sch.bind(ki, "threadIdx.x")
    sch.set_scope(acc, 0, "local")
    return sch


def _bwd(func, decisions):
    threads = decisions.pick("threads", (64, 128, 256), 128)
    sch = rule.schedule_of(func, name="linear_bwd")
    acc = sch.get_sblock("acc")
    sch.compute_at(acc, bind_flat(sch, sch.get_sblock("dx"), threads))
    sch.set_scope(acc, 0, "local")
    return sch


def apply(func, target, decisions: rule.Decisions):
    """Schedule a linear kernel for CUDA; None for foreign functions."""
    name, _ = rule.kernel_attrs(func)
    if name == "linear_fwd":
        return _fwd(func, decisions)
    if name == "linear_bwd":
        return _bwd(func, decisions)
    return None
