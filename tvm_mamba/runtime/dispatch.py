"""Kernel key -> plan (which decisions serve it) -> scheduled IRModule, and explain().

``rules.py`` builds a key's PrimFunc and applies the target's schedule rule (see there for how a key names
its builder and rule). This module chooses the decisions: ``plan(key)`` asks the registered plan hooks (an
explicit override: a test or a tool pinning decisions), then the tuning logs (``tuning.lookup``, called
here by name, not registered as an import side effect), else the rule's hand defaults; ``explain``
reports which.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import tvm

from ..schedules.rule import Decisions
from . import tuning
from .key import KernelKey, Plan  # noqa: F401  (Plan: re-exported, dispatch.Plan is its name in use)
from . import rules
from .rules import build_func, builder, compute_ops, dims_of, rule_module  # noqa: F401  (dispatch's API)
from .target import target_from_key  # noqa: F401  (re-exported: cache and tests name it here)


_plan_hooks: list[Callable[[KernelKey], Plan | None]] = []
_plan_lock = threading.Lock()


_generation = [0]


def invalidate() -> None:
    """Tell kernel callers that what plan() returns may have changed (a kernel cache cleared, a hook's
    answers changed): cache.build_and_load's per-thread fast path re-resolves."""
    _generation[0] += 1


def generation() -> tuple:
    """Changes whenever what plan() returns may change: invalidate() calls, the tuning logs' state
    (``tuning.generation()``: refreshes, ``tuning_logs`` blocks entered or left) and the set of plan hooks."""
    return (_generation[0], tuning.generation(), tuple(map(id, _plan_hooks)))


def register_plan_hook(hook: Callable[[KernelKey], Plan | None]) -> None:
    """Add an override consulted before the tuning logs (first non-None answer serves); for tools and
    tests that pin decisions. The tuning logs need no hook: plan() calls them itself."""
    with _plan_lock:
        if hook not in _plan_hooks:
            _plan_hooks.append(hook)


def plan(key: KernelKey) -> Plan:
    """The decisions that serve ``key``: a plan hook's (an explicit override), else the best tuning record
    of its bucket, else the hand defaults. A ``cudasim-sm_XY`` key is served as ``cuda-sm_XY`` would be, so
    the harness runs what the GPU runs."""
    lookup = key
    if key.target.startswith("cudasim-"):
        lookup = dataclasses.replace(key, target="cuda-" + key.target[len("cudasim-"):])
    for ask in (*_plan_hooks, tuning.lookup):
        found = ask(lookup)
        if found is not None:
            return found if lookup is key else Plan(key, found.decisions, found.source)
    return Plan(key, (), "default")


def schedule(key: KernelKey, decisions: Decisions | None = None) -> tvm.IRModule:
    """Build and schedule ``key`` with ``decisions`` (default: ``plan(key)``'s); returns an IRModule ready
    for ``tvm.compile``."""
    return rules.apply(key, decisions if decisions is not None else Decisions(dict(plan(key).decisions)))


def explain_key(key: KernelKey, served: Plan | None = None) -> str:
    p = served or plan(key)
    knobs = ", ".join(f"{k}={v}" for k, v in p.decisions) or "hand defaults"
    return f"{key}\n    schedule: {p.source} ({knobs})"


# --- explain(): record the keys a call uses -------------------------------------------------------
class _Recording(threading.local):
    """The keys a ``record_keys`` block collects, per thread. The class default None makes the read in
    note_key a plain lookup: a thread-local attribute a thread never set is an AttributeError raised and
    caught inside getattr (~1.5 us, on every kernel run)."""
    keys = None


_recording = _Recording()


def note_key(key: KernelKey, served: Plan | None = None) -> None:
    """Called for every kernel run (cheap when nobody records): the key and the plan that served it."""
    rec = getattr(_recording, "keys", None)
    if rec is not None and all(k != key for k, _ in rec):
        rec.append((key, served))


class collect_into:
    """``with collect_into(local, name) as items:`` binds ``local.<name>`` (a threading.local) to a fresh list
    for the block and restores the previous binding after, so blocks nest; whoever records appends to the
    bound list (record_keys here, torch_ops/_dlpack.py's capture_launches)."""

    def __init__(self, local: threading.local, name: str):
        self._local, self._name = local, name

    def __enter__(self) -> list:
        self._prev = getattr(self._local, self._name, None)
        items: list = []
        setattr(self._local, self._name, items)
        return items

    def __exit__(self, *exc) -> None:
        setattr(self._local, self._name, self._prev)


class record_keys(collect_into):
    """``with record_keys() as used: fn(...)`` collects (key, plan) for every kernel the call ran."""

    def __init__(self):
        super().__init__(_recording, "keys")
