"""CUDA rule for linear (compute/linear/), correctness first.

fwd: one warp per output feature: the 32 lanes of a warp read consecutive elements of one weight row (and
of the x row: coalesced), each lane sums its strided part of in_features in a register, and the warp's
partial sums meet in a cross-thread reduction (warp shuffles); ``warps`` output features per block
(threadIdx.y), the (row, feature block) pairs fused on blockIdx.x (rows are symbolic and may exceed
gridDim.y's 65535). The scale, bias and cast follow in the same thread.
bwd: one thread per dx element, the sum over out_features serial in a register; consecutive threads take
consecutive in_features, so the weight rows are read coalesced.
Capabilities (``GpuCaps``, from the target): blocks of at most the target's threads (``warps`` x 32 lanes);
where the target has no warp shuffles (WebGPU: thread_warp_size 1) TVM lowers the 32 lanes' reduction to a
tree in shared memory (128 bytes a feature). Where it has no 8-bit buffers an int8 weight is passed as the
int32 words of its bytes (compute/int8_dot/codes.py), and with no 16-bit buffers the kernels take and return
float32 x / weight (``GpuCaps.storable``: the WebGPU launcher converts the tensors).
Knobs: ``warps`` (fwd), ``threads`` (bwd).
"""
from __future__ import annotations

from tvm_mamba.compute.int8_dot.codes import held
from tvm_mamba.compute.linear import linear_bwd, linear_fwd
from tvm_mamba.schedules import rule
from ._common import bind_flat
from ._strategy import GpuCaps

WARP = 32


def _fwd(d, decisions, caps: GpuCaps):
    fit = tuple(w for w in (1, 2, 4, 8) if w * WARP <= caps.max_threads) or (1,)
    warps = decisions.pick("warps", fit, 4 if 4 in fit else fit[-1])
    sch = rule.schedule_compute(linear_fwd(caps.storable(d), held(caps.bytes)), "linear_fwd")
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


def _bwd(d, decisions, caps: GpuCaps):
    threads = decisions.pick("threads", caps.threads((64, 128, 256)), 128)
    sch = rule.schedule_compute(linear_bwd(caps.storable(d), held(caps.bytes)), "linear_bwd")
    acc = sch.get_sblock("acc")
    sch.compute_at(acc, bind_flat(sch, sch.get_sblock("dx"), threads))
    sch.set_scope(acc, 0, "local")
    return sch


def lay_out(kernel: str, dims, target, decisions: rule.Decisions):
    """A linear kernel's compute scheduled for a GPU by its capabilities (GpuCaps); None for another kernel
    or target."""
    schedule = {"fwd": _fwd, "bwd": _bwd}.get(kernel)
    if schedule is None or "gpu" not in target.keys:
        return None
    return schedule(dims, decisions, GpuCaps.of(target))
