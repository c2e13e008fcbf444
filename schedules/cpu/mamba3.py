"""CPU schedule of the Mamba-3 kernels: the compute templates laid out by the selective scan's ``CpuLayout``.

Decode step: both passes' lanes (rotate: one (batch, head, pair) each, scalar cos / sin / tanh; update: one
(batch, head, headdim_v row) each) are ``T.parallel``, or run on the calling thread up to ``SERIAL_WORK``
state elements (no thread-pool launch at decode sizes, as the scan's decode step); an update lane visits
headdim_qk in ``vector``-wide vectors (``T.vectorized``, h' . q as vector partials then one horizontal sum);
exp, sigmoid, tanh, silu are the vectorizable polynomials of ``compute._math`` (float64 builds: libm).
Knob: ``vector`` (powers of two dividing headdim_qk, <= 16; default the largest). The MIMO step
(``mimo_step``) is the same template and layout: rotate lanes per (batch, rank, head, pair), the update lane's
R rank terms and R output partials each a ``vector``-wide loop inside the dstate sweep. Upstream's
two-function path (``step_rotate``, ``step_update``: each pass alone) the same way.

Chunked forward's preprocess: the SSD CPU strategy (schedules/cpu/ssd.py ``Cpu``): each pass's tasks a parallel
loop (angles: (batch, head) over the angles' vector, serial over time; rotate: (batch, 16 steps) over the rotary
pairs' vector; chunk: (batch, head, chunk); skip: (batch, position, head), headdim_qk in vector partials; init:
(batch, head, headdim_v row) with headdim_qk vectorized), the polynomial math (libm cos / sin). No knobs.
Its backward (``siso_preprocess_bwd``) the same way: init a task per (batch, head) with headdim_qk vectorized,
the dots as the forward's skip, angles and reverse a task per (batch, head) over the angles' vector, pairs a
task per (batch, 16 steps) with a vector sweep over the rotary pairs and one over the pass-through pairs, chunk
a task per (batch, head, chunk).
"""
from __future__ import annotations

from ...compute import mamba3 as compute
from ...compute._math import Math
from ..rule import Decisions, schedule_of
from .selective_scan import CpuLayout
from .ssd import Cpu


def lay_out(direction: str, dims, target, decisions: Decisions):
    """A Mamba-3 kernel's template under the CPU's strategy; None for another kernel or target."""
    if "cpu" not in target.keys or direction not in compute.TEMPLATES:
        return None
    name = f"mamba3_{direction}"
    if direction in compute.PREPROCESS:
        return schedule_of(compute.build(direction, dims, Cpu()), name)
    widths = [v for v in (1, 2, 4, 8, 16) if dims.headdim_qk % v == 0]
    vec = decisions.pick("vector", widths, widths[-1])
    return schedule_of(compute.build(direction, dims, CpuLayout(Math(dims.acc), vec=vec)), name)
