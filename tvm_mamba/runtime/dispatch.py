"""Kernel key -> scheduled IRModule (compute builder + schedule rule + decisions), and explain().

Discovery is by the one-file-name-per-op convention: key ``(op, direction)`` is built by
``tvm_mamba.compute.<op>.<op>_<direction>(**static_dims, **{<tensor>_dtype: ...})`` and scheduled by
``tvm_mamba.schedules.<cpu|cuda>.<op>.apply``. Decisions come from a tuning record for the key's bucket
(see ``tuning.py``) or are the rule's defaults; ``explain`` reports which.
"""
from __future__ import annotations

import dataclasses
import importlib
import threading
from typing import Callable

import tvm
from tvm.target import Target

from ..schedules.rule import Decisions
from .key import KernelKey
from .target import target_from_key


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one kernel key is served: the decisions and where they came from."""

    key: KernelKey
    decisions: tuple  # sorted (name, value) pairs
    source: str  # "default" or "tuned: <file> (<seconds> s)"

    def digest(self) -> str:
        return repr(self.decisions)


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


def rule_module(target: Target, op: str):
    kind = "cuda" if target.kind.name == "cuda" else "cpu"
    try:
        return importlib.import_module(f"tvm_mamba.schedules.{kind}.{op}")
    except ModuleNotFoundError:
        return None


_plan_hooks: list[Callable[[KernelKey], Plan | None]] = []
_plan_lock = threading.Lock()


_generation = [0]


def invalidate() -> None:
    """Tell kernel callers that what plan() returns may have changed (tuning logs refreshed, a
    ``tuning_logs`` block entered or left): cache.build_and_load's per-thread fast path re-resolves."""
    _generation[0] += 1


def generation() -> tuple:
    """Changes whenever what plan() returns may change: invalidate() calls and the set of plan hooks."""
    return (_generation[0], tuple(map(id, _plan_hooks)))


def register_plan_hook(hook: Callable[[KernelKey], Plan | None]) -> None:
    """Tuning-log lookup registers itself here (kept out of this module so dispatch has no file I/O)."""
    with _plan_lock:
        if hook not in _plan_hooks:
            _plan_hooks.append(hook)


def plan(key: KernelKey) -> Plan:
    """The decisions that serve ``key``: the best tuning record of its bucket, else the hand defaults. A
    ``cudasim-sm_XY`` key is served as ``cuda-sm_XY`` would be, so the harness runs what the GPU runs."""
    lookup = key
    if key.target.startswith("cudasim-"):
        lookup = dataclasses.replace(key, target="cuda-" + key.target[len("cudasim-"):])
    for hook in list(_plan_hooks):
        found = hook(lookup)
        if found is not None:
            return found if lookup is key else Plan(key, found.decisions, found.source)
    return Plan(key, (), "default")


def schedule(key: KernelKey, decisions: Decisions | None = None) -> tvm.IRModule:
    """Build and schedule ``key``; returns an IRModule ready for ``tvm.compile``."""
    func = build_func(key)
    target = target_from_key(key.target)
    decisions = decisions if decisions is not None else Decisions(dict(plan(key).decisions))
    rules = rule_module(target, key.op)
    sch = rules.apply(func, target, decisions) if rules is not None else None
    if sch is not None:
        return sch.mod
    if target.kind.name == "cuda":
        from tvm.s_tir import dlight as dl

        with target:
            return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({key.op + "_" + key.direction: func}))
    return tvm.IRModule({f"{key.op}_{key.direction}": func})


def explain_key(key: KernelKey, served: Plan | None = None) -> str:
    p = served or plan(key)
    knobs = ", ".join(f"{k}={v}" for k, v in p.decisions) or "hand defaults"
    return f"{key}\n    schedule: {p.source} ({knobs})"


# --- explain(): record the keys a call uses -------------------------------------------------------
_recording = threading.local()


def note_key(key: KernelKey, served: Plan | None = None) -> None:
    """Called for every kernel run (cheap when nobody records): the key and the plan that served it."""
    rec = getattr(_recording, "keys", None)
    if rec is not None and all(k != key for k, _ in rec):
        rec.append((key, served))


class record_keys:
    """``with record_keys() as used: fn(...)`` collects (key, plan) for every kernel the call ran."""

    def __enter__(self) -> list[KernelKey]:
        self._prev = getattr(_recording, "keys", None)
        _recording.keys = []
        return _recording.keys

    def __exit__(self, *exc) -> None:
        _recording.keys = self._prev
