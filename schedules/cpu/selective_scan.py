"""CPU schedules for the selective scan: the compute templates laid out by ``CpuLayout``.

``CpuLayout``: lanes are ``T.parallel`` (one (batch, channel) each), a lane's dstate is visited in vectors
of ``vector`` states (``T.vectorized``; dstate sums as vector partials then one horizontal sum), per-step
scalar math (softplus, SiLU) is batched per checkpoint chunk and vectorized over time, exp is the
vectorizable polynomial of ``compute._math``. Lane-local buffers are stack allocas (default scope; scope
"local" would be a heap workspace call per lane). Vectorizing a scan *block* with s_tir gives wrong
numbers (field guide §10), so per-lane state is explicit and the loops come from the templates.

Two forward layouts of the one forward template (knob ``layout``; forward, B/C varying, softplus, dim 256,
dstate 16, seqlen 512, single thread: ``channels`` about 1.4x faster than ``dstate``):
- ``channels`` (default when dim % 16 == 0): ``ChannelsLayout``, a lane is (batch, 16 channels), the
  vector axis is channels;
- ``dstate``: ``CpuLayout``, a lane is (batch, channel), the vector axis is dstate.
The backward, the chunked forward, the decode step and the complex-A scan use ``CpuLayout``.

Knobs (``decisions``): ``layout`` (channels, dstate), ``vector`` — dstate lanes per step (powers of two
dividing dstate, <= 16). The backward's channel block and the checkpoint chunk are static dims (they shape
the workspaces the torch op allocates), chosen by the torch op.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute import selective_scan as compute
from ...compute._math import Math
from ..rule import Decisions, schedule_of
from ._strategy import CpuLoops

CH = 16  # channels per vector in the channels layout (one zmm of fp32)


class CpuLayout(CpuLoops, compute.Layout):
    """Parallel lanes, dstate vectors of ``vec``, time-batched per-step math, polynomial exp; decode-size
    work on the calling thread (``serial_work``, the CPU mixin's)."""


class ChannelsLayout(CpuLayout):
    """The forward's vector axis is channels instead of dstate: a lane is (batch, 16 channels), h[dstate, 16]
    in the lane's stack, every per-step value (dt, dt*u, y) a 16-channel vector, dstate the serial loop.
    So y needs no horizontal sum (its one partial per channel starts from D u: out = (D u + sum_n C h)
    silu(z), the operation order this layout's fp32 results have always had), per-step math is inline (it is
    vector work already), and A and a time-invariant B / C are transposed into the lane once (a channel
    vector of them is then one contiguous load)."""

    time_batched = False
    stage_params = True
    y_from_skip = True

    def __init__(self, math: Math):
        super().__init__(math, vec=1)
        self.chans = CH

    def st_inner(self):
        return T.serial(self.V)

    def chan_loop(self):
        return T.vectorized(self.chans)

    def _build_reductions(self):
        super()._build_reductions()

        @T.macro
        def reduce(dst, i, parts, row):  # one partial per channel: the sum is that partial
            dst[i] = parts[row, 0]

        self.reduce = reduce


def lay_out(direction: str, dims, target, decisions: Decisions):
    """A selective-scan kernel's template under a CPU layout; None for another kernel or target."""
    if "cpu" not in target.keys or direction not in compute.TEMPLATES:
        return None
    name = f"selective_scan_{direction}"
    if direction == "fwd" and dims.dim % CH == 0:
        if decisions.pick("layout", ("channels", "dstate"), "channels") == "channels":
            return schedule_of(compute.build(direction, dims, ChannelsLayout(Math(dims.acc))), name)
    widths = [v for v in (1, 2, 4, 8, 16) if dims.dstate % v == 0]
    layout = CpuLayout(Math(dims.acc), vec=decisions.pick("vector", widths, compute.vector_width(dims.dstate)))
    if direction == "update" and dims.tie_hdim:
        rows = [r for r in (1, 2, 4, 8, 16, 32) if r < dims.headdim and dims.headdim % r == 0] + [dims.headdim]
        layout.head_rows = decisions.pick("head_rows", rows, dims.headdim)
    return schedule_of(compute.build(direction, dims, layout), name)
