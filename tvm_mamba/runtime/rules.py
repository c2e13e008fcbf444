"""Kernel key -> unscheduled PrimFunc (the op's compute builder) -> scheduled IRModule (the target's rule).

Discovery is by the one-file-name-per-op convention: key ``(op, direction)`` is built by
``tvm_mamba.compute.<op>.<op>_<direction>``, called with the op's typed dims (``compute.<op>.DIMS``, a
``compute._common.Dims`` rebuilt from the key) or, for an op without ``DIMS``, with
``**static_dims, **{<tensor>_dtype: ...}``; it is scheduled by ``tvm_mamba.schedules.<gpu|cpu>.<op>.apply``.

This module knows nothing of tuning records or plans: ``apply(key, decisions)`` schedules with the decisions
it is given. ``dispatch`` chooses them (tuning logs or hand defaults); ``tuning`` applies a record's
decisions here to judge whether the rule accepts them. Both import this module, neither imports the other's
caller, so the runtime's imports point one way.
"""
from __future__ import annotations

import importlib
from typing import Callable

import tvm
from tvm.target import Target

from ..schedules.rule import Decisions
from .key import KernelKey
from .target import target_from_key


def builder(key: KernelKey) -> Callable[..., tvm.tirx.PrimFunc]:
    module = importlib.import_module(f"tvm_mamba.compute.{key.op}")
    fn = getattr(module, f"{key.op}_{key.direction}", None)
    if fn is None:
        raise KeyError(f"no compute builder {key.op}_{key.direction} in tvm_mamba.compute.{key.op}")
    return fn


def dims_class(key: KernelKey):
    """The op's typed static dims (``compute.<op>.DIMS``, a ``compute._common.Dims``), or None for an op
    whose builders still take keyword arguments."""
    dims = getattr(importlib.import_module(f"tvm_mamba.compute.{key.op}"), "DIMS", None)
    return dims.get(key.direction) if isinstance(dims, dict) else dims


def build_func(key: KernelKey) -> tvm.tirx.PrimFunc:
    """The unscheduled PrimFunc of a key (pure function of its static dims and dtypes)."""
    cls = dims_class(key)
    if cls is not None:
        return builder(key)(cls.from_key(key.static, key.dtype))
    dtypes = {f"{name}_dtype": dt for name, dt in key.dtypes}
    return builder(key)(**key.static, **dtypes)


def rule_folder(target: Target) -> str:
    """``cuda`` (the GPU rules: thread blocks, warps, shared memory) for any target with the ``gpu`` key,
    else ``cpu``. By capability, not by kind name, so the GPU rules serve every GPU codegen TVM has."""
    return "cuda" if "gpu" in target.keys else "cpu"


def rule_module(target: Target, op: str):
    try:
        return importlib.import_module(f"tvm_mamba.schedules.{rule_folder(target)}.{op}")
    except ModuleNotFoundError:
        return None


def apply(key: KernelKey, decisions: Decisions) -> tvm.IRModule:
    """Build ``key`` and schedule it with ``decisions``; an IRModule ready for ``tvm.compile``. A kernel
    no rule claims gets dlight's GPU fallback on a GPU target, and stays unscheduled on a CPU."""
    func = build_func(key)
    target = target_from_key(key.target)
    rules = rule_module(target, key.op)
    sch = rules.apply(func, target, decisions) if rules is not None else None
    if sch is not None:
        return sch.mod
    if "gpu" in target.keys:
        from tvm.s_tir import dlight as dl

        with target:
            return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({key.op + "_" + key.direction: func}))
    return tvm.IRModule({f"{key.op}_{key.direction}": func})


def compute_ops() -> list[str]:
    """The ops a key can name: the public modules of ``tvm_mamba.compute`` (one per op; an op whose compute
    is large is a package, ``compute/ssd/``)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "compute"
    names = {p.stem for p in root.glob("*.py")} | {p.parent.name for p in root.glob("*/__init__.py")}
    return sorted(name for name in names if not name.startswith("_"))
