"""Kernel key -> typed dims -> the target's rule lays the kernel out: ``apply(key, decisions)``.

Both come from the op's row of runtime/registry.py: the key's ``(op, direction)`` names the kernel, its two
maps rebuild its typed static dims (the op's ``DIMS``: ``Dims.from_key``), and the op's CPU or GPU rule
(``lay_out(direction, dims, target, decisions)``, schedules/rule.py) returns the Schedule to compile. A
kernel no rule lays out is its compute definition (``build_func``: the op's builder), given dlight's GPU
fallback on a GPU and left as written on a CPU.

This module knows nothing of tuning records or plans: ``apply(key, decisions)`` lays out with the decisions
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


def dims_of(key: KernelKey):
    """The kernel's typed static dims (a ``compute._common.Dims``), rebuilt from the key's two maps."""
    return registry.op(key.op).dims(key.direction).from_key(key.static, key.dtype)


def build_func(key: KernelKey) -> tvm.tirx.PrimFunc:
    """The kernel's compute definition (the op's builder: unscheduled, serial loops): what MetaSchedule binds
    a shape bucket into, what the tools read parameters from, and what runs where no rule lays it out."""
    return builder(key)(dims_of(key))


def rule_module(target: Target, op: str):
    """The op's rule for ``target`` (registry: the GPU rule on a target with the ``gpu`` key, else the CPU's)."""
    return registry.op(op).rule(target)


def apply(key: KernelKey, decisions: Decisions) -> tvm.IRModule:
    """``key`` laid out by its target's rule with ``decisions``; an IRModule ready for ``tvm.compile``. A kernel
    whose rule declines it gets dlight's GPU fallback on a GPU target, and stays unscheduled on a CPU."""
    target = target_from_key(key.target)
    sch = rule_module(target, key.op).lay_out(key.direction, dims_of(key), target, decisions)
    if sch is not None:
        return sch.mod
    func = build_func(key)
    if "gpu" in target.keys:
        from tvm.s_tir import dlight as dl

        with target:
            return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({key.op + "_" + key.direction: func}))
    return tvm.IRModule({f"{key.op}_{key.direction}": func})


def compute_ops() -> list[str]:
    """The ops a key can name (the registry's)."""
    return list(registry.ops())
