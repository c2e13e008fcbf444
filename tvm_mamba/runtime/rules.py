"""Kernel key -> unscheduled PrimFunc (the op's compute builder) -> scheduled IRModule (the target's rule).

Both come from the op's row of runtime/registry.py: key ``(op, direction)`` is built by the op's
``KERNELS[direction]``, called with the kernel's typed dims (``DIMS``, a ``compute._common.Dims`` rebuilt
from the key) or, for a kernel without typed dims, with ``**static_dims, **{<tensor>_dtype: ...}``; it is
scheduled by the op's CPU or GPU rule (``apply(func, target, decisions)``).

This module knows nothing of tuning records or plans: ``apply(key, decisions)`` schedules with the decisions
it is given. ``dispatch`` chooses them (tuning logs or hand defaults); ``tuning`` applies a record's
decisions here to judge whether the rule accepts them. Both import this module, neither imports the other's
caller, so the runtime's imports point one way.
"""
from __future__ import annotations

from typing import Callable

import tvm
from tvm.target import Target

from ..schedules.rule import Decisions
from . import registry
from .key import KernelKey
from .target import target_from_key


def builder(key: KernelKey) -> Callable[..., tvm.tirx.PrimFunc]:
    return registry.op(key.op).builder(key.direction)


def dims_class(key: KernelKey):
    """The kernel's typed static dims (a ``compute._common.Dims``), or None for a kernel whose builder still
    takes keyword arguments."""
    return registry.op(key.op).dims(key.direction)


def build_func(key: KernelKey) -> tvm.tirx.PrimFunc:
    """The unscheduled PrimFunc of a key (pure function of its static dims and dtypes)."""
    cls = dims_class(key)
    if cls is not None:
        return builder(key)(cls.from_key(key.static, key.dtype))
    dtypes = {f"{name}_dtype": dt for name, dt in key.dtypes}
    return builder(key)(**key.static, **dtypes)


def rule_module(target: Target, op: str):
    """The op's rule for ``target`` (registry: the GPU rule on a target with the ``gpu`` key, else the CPU's)."""
    return registry.op(op).rule(target)


def apply(key: KernelKey, decisions: Decisions) -> tvm.IRModule:
    """Build ``key`` and schedule it with ``decisions``; an IRModule ready for ``tvm.compile``. A kernel
    whose rule declines it gets dlight's GPU fallback on a GPU target, and stays unscheduled on a CPU."""
    func = build_func(key)
    target = target_from_key(key.target)
    sch = rule_module(target, key.op).apply(func, target, decisions)
    if sch is not None:
        return sch.mod
    if "gpu" in target.keys:
        from tvm.s_tir import dlight as dl

        with target:
            return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({key.op + "_" + key.direction: func}))
    return tvm.IRModule({f"{key.op}_{key.direction}": func})


def compute_ops() -> list[str]:
    """The ops a key can name (the registry's)."""
    return list(registry.ops())
