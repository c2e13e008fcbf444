"""CPU schedule of the Mamba-3 kernels: the compute templates laid out by the selective scan's ``CpuLayout``.

Decode step: lanes (one (batch, head, headdim_v row) each) are ``T.parallel``, or run on the calling thread
up to ``SERIAL_WORK`` state elements (no thread-pool launch at decode sizes, as the scan's decode step);
a lane's rotary pairs run serially (scalar: cos / sin / tanh of headdim_angles values per lane), exp and
sigmoid are the vectorizable polynomials of ``compute._math`` (float64 builds: libm). No knobs yet.
"""
from __future__ import annotations

from ...compute import mamba3 as compute
from ...compute._math import Math
from ..rule import Decisions, kernel_attrs, schedule_of
from .selective_scan import CpuLayout


def apply(func, target, decisions: Decisions):
    name, static = kernel_attrs(func)
    direction = name[len("mamba3_"):] if name and name.startswith("mamba3_") else None
    if "cpu" not in target.keys or direction not in compute.TEMPLATES:
        return None
    dims = compute.DIMS[direction](**static)
    return schedule_of(compute.build(direction, dims, CpuLayout(Math(dims.acc), vec=1)), name=name)
