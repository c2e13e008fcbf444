"""CUDA schedule of the Mamba-3 kernels: the compute templates laid out by the selective scan's ``CudaLayout``.

Decode step: one thread per (batch, head, headdim_v row) lane (``warp=False``: blockIdx x threadIdx, the
lane's rotary pairs serial in registers; at upstream's shape, batch 1 x 32 heads x 64 rows = 2048 threads),
CUDA's own expf / tanhf / cosf / sinf. Knob: ``threads`` per block (64, 128, 256 up to the target's
``max_num_threads``; default 128). Serves any target with the "gpu" key. The MIMO step (``mimo_step``) the same
way: rotate a thread per (batch, rank, head, pair), update a thread per row holding its R output sums in
registers (rank 4 at upstream's shape: 39-48 registers, no spills). Upstream's two-function path
(``step_rotate``, ``step_update``: each pass alone, one launch each) the same way.
The update pass (siso_step, mimo_step, step_update) runs on warp lanes over headdim_qk where the target's
warps shuffle (``thread_warp_size`` >= 32, read from ``target.attrs``: selective_scan.py's warp kernels);
where they do not (WebGPU without subgroups: 1) a lane is one thread, one row, its headdim_qk states serial
and its dot products a loop (the serial layout's loops on blockIdx x threadIdx), as pass 1 always is.

Chunked forward's preprocess: the SSD CUDA strategy (schedules/cuda/ssd.py ``Gpu``): a launch per pass, a thread
per task (angles: (batch, head, angle), serial over time; rotate: (batch, 16 steps, rotary pair); chunk: (batch,
head, chunk); skip: (batch, 8 positions, up to 8 heads of one Q / K head); init: (batch, head, headdim_v row,
headdim_qk element)); knob ``threads`` as above. Its backward (``siso_preprocess_bwd``) likewise: a launch per
pass, a thread per task (init: (batch, head); dots: the forward's skip blocks; angles and reverse: (batch, head,
angle); pairs: (batch, 16 steps, pair); chunk: (batch, head, chunk)).
"""
from __future__ import annotations

from ...compute import mamba3 as compute
from ..rule import Decisions, schedule_of
from ._strategy import GpuCaps
from .selective_scan import HEAD_ROWS, WARP, CudaLayout, pick_threads, target_math
from .ssd import Gpu


def lay_out(direction: str, dims, target, decisions: Decisions):
    """A Mamba-3 kernel's template under the GPU's strategy; None for another kernel or target."""
    if "gpu" not in target.keys or direction not in compute.TEMPLATES:
        return None
    name = f"mamba3_{direction}"
    caps = GpuCaps.of(target)
    dims = caps.storable(dims)  # 32-bit buffers where the target has no others (WebGPU)
    threads = pick_threads(caps, decisions, 128)
    if direction in compute.PREPROCESS:
        return schedule_of(compute.build(direction, dims, Gpu(threads, libm=caps.libm)), name)
    math = target_math(dims, caps)
    if direction == "step_rotate" or caps.warp < WARP:  # a thread per lane: no shuffles (or pass 1 alone)
        layout = CudaLayout(math, threads)
    else:  # pass 2 on warp lanes over headdim_qk, rows of a head per lane; pass 1 a thread per rotary pair
        layout = CudaLayout(math, threads, dims.headdim_qk, warp=True)
        # rows sharing the head's R x (K state, new k, rotated q) staged in registers: 4 per rank keeps those
        # reads near a quarter of the state's
        rows = [r for r in HEAD_ROWS if dims.headdim_v % r == 0]
        want = min(4 * dims.rank, HEAD_ROWS[-1])
        layout.head_rows = decisions.pick("head_rows", rows, max(r for r in rows if r <= want))
        layout.stage_bc = layout.head_rows > 1
        layout.rotate_layout = CudaLayout(math, threads)
    return schedule_of(compute.build(direction, dims, layout), name)
