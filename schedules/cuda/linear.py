"""CUDA rule for linear (compute/linear/), correctness first.

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

from tvm_mamba.compute.linear import linear_bwd, linear_fwd
from tvm_mamba.schedules import rule
from ._common import bind_flat

WARP = 32


def _fwd(d, decisions):
    warps = decisions.pick("warps", (1, 2, 4, 8), 4)
    sch = rule.schedule_compute(linear_fwd(d), "linear_fwd")
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


def _bwd(d, decisions):
    threads = decisions.pick("threads", (64, 128, 256), 128)
    sch = rule.schedule_compute(linear_bwd(d), "linear_bwd")
    acc = sch.get_sblock("acc")
    sch.compute_at(acc, bind_flat(sch, sch.get_sblock("dx"), threads))
    sch.set_scope(acc, 0, "local")
    return sch


def lay_out(kernel: str, dims, target, decisions: rule.Decisions):
    """A linear kernel's compute scheduled for a GPU; None for another kernel or target."""
    return rule.lay_out_by_kernel({"fwd": _fwd, "bwd": _bwd}, kernel, dims, target, decisions, "gpu")
