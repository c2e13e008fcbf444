"""Every op a kernel key can name, with where its kernels are defined and scheduled: the one table kernel
discovery reads (runtime/rules.py, tune, aot, the CLI, the roofline).

One row per op: its compute module (``KERNELS``: direction -> builder, ``DIMS``: the typed static dims,
``build_check_configs`` / ``tuning_configs`` / ``derived_dims`` where it has them) and its two rules, the
CPU's (``schedules/cpu/<op>.py``) and the GPU's (``schedules/cuda/<op>.py``), each ``lay_out(direction,
dims, target, decisions)``. Each is a plain import, made when first asked for, and the compute module apart from the
rules: the rules and most compute modules write TVMScript, which a runtime-only TVM (the GPU machine serving
an AOT pack, ``tune --measure`` there) cannot import, so the call-time path imports none of them until a
kernel is built, and a TE-only compute module (conv1d, RMSNorm, int8, linear) is readable there without its
rules. A new op is a compute module (its name in ``OPS`` and its import in ``_compute`` below) and a rule
module in each of schedules/cpu and schedules/cuda (in their ``RULES`` tables).
"""
from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

from tvm.target import Target


OPS: tuple[str, ...] = ("causal_conv1d", "int8_dot", "linear", "mamba3", "rmsnorm_gated", "selective_scan", "ssd")


def _compute(name: str) -> ModuleType:
    if name == "causal_conv1d":
        from ..compute import causal_conv1d as compute
    elif name == "int8_dot":
        from ..compute import int8_dot as compute
    elif name == "linear":
        from ..compute import linear as compute
    elif name == "mamba3":
        from ..compute import mamba3 as compute
    elif name == "rmsnorm_gated":
        from ..compute import rmsnorm_gated as compute
    elif name == "selective_scan":
        from ..compute import selective_scan as compute
    elif name == "ssd":
        from ..compute import ssd as compute
    else:
        raise KeyError(f"unknown op {name!r} (ops: {', '.join(OPS)})")
    return compute


def _rules(name: str) -> tuple[ModuleType, ModuleType]:
    """(CPU rule, GPU rule): the ``RULES`` tables of schedules/cpu and schedules/cuda."""
    from ..schedules import cpu, cuda

    return cpu.RULES[name], cuda.RULES[name]


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """An op's compute module and its CPU and GPU rules (each imported on first use)."""
    name: str

    @property
    def compute(self) -> ModuleType:
        return _compute(self.name)

    def builder(self, direction: str) -> Callable:
        """The builder of kernel ``<op>_<direction>`` (``compute.KERNELS``)."""
        kernels = self.compute.KERNELS
        if direction not in kernels:
            raise KeyError(f"{self.name}: no kernel {direction!r} (the op has {', '.join(kernels)})")
        return kernels[direction]

    def dims(self, direction: str):
        """The kernel's typed static dims class (``compute.DIMS``: one class, or direction -> class)."""
        dims = self.compute.DIMS
        if not isinstance(dims, dict):
            return dims
        if direction not in dims:
            raise KeyError(f"{self.name}: no kernel {direction!r} (the op has {', '.join(dims)})")
        return dims[direction]

    def rule(self, target: Target) -> ModuleType:
        """The GPU rule (thread blocks, warps, shared memory) for a target with the ``gpu`` key, else the
        CPU rule: by capability, not by kind name, so the GPU rules serve every GPU codegen TVM has."""
        cpu, gpu = _rules(self.name)
        return gpu if "gpu" in target.keys else cpu


def ops() -> tuple[str, ...]:
    """Every op's name, sorted."""
    return OPS


def op(name: str) -> OpEntry:
    """The registry's row of op ``name``."""
    if name not in OPS:
        raise KeyError(f"unknown op {name!r} (ops: {', '.join(OPS)})")
    return OpEntry(name)  # its modules are imported when asked for
