"""The schedule-rule contract: one entry per rule.

Every ``schedules/<cpu|cuda>/<op>.py`` exposes::

    def lay_out(kernel: str, dims: Dims, target: Target, decisions: Decisions) -> s_tir.Schedule | None

``kernel`` names one of the op's kernels (the key's direction: ``"fwd"``, ``"chunk_scan"``) and ``dims`` are
its typed static dims (``compute.<op>.DIMS``, rebuilt from the kernel key by ``Dims.from_key``). A rule checks
that it knows the kernel and that the target has its capability (``"gpu" in target.keys`` for the ``cuda/``
rules, which serve any GPU codegen; ``"cpu"`` for ``cpu/``) and returns None otherwise (never raises on a
kernel or target it does not take: tests/schedules/test_rule_contract.py). It returns a Schedule in one of two
forms:

- a **template laid out** for the target: the op's loop-nest template built from ``dims`` under the target's
  strategy (the one protocol of compute/strategy.py, its CPU / GPU half from the folder's ``_strategy.py``
  mixin: lanes, vectors, threads, shared memory), ``schedule_of(prim, name)``. Scans, windowed convs with a
  scalar head and tail, the SSD kernels: see TVM_FIELD_GUIDE §10 (vectorizing a scan block returns wrong
  numbers);
- the op's **compute definition scheduled** block by block: ``schedule_compute(build(dims))``, the TE kernels
  the GPU rules split, bind and stage. Only this form is a MetaSchedule design space (``on_schedule``).

Each rule is a *design space*: every choice (vector width, time tile, threads per block, unroll, chunk
length, algorithm) is made through ``decisions.pick(name, candidates, default)``. With no tuning record the
defaults are used, so the hand schedule and the tuned one are the same code.
"""
from __future__ import annotations

import contextlib
import json
import threading
from typing import Any, Iterable, Mapping

import tvm
from tvm import s_tir

from tvm_mamba.compute._common import SERIAL_WORK, stamp  # noqa: F401  (SERIAL_WORK: re-exported for the rules)


class Decisions:
    """Knob values for one kernel: fixed (defaults or a tuning record), recorded as they are read."""

    def __init__(self, values: Mapping[str, Any] | None = None):
        self.values = dict(values or {})
        self.used: dict[str, Any] = {}
        self.space: dict[str, tuple] = {}

    def pick(self, name: str, candidates: Iterable[Any], default: Any) -> Any:
        candidates = tuple(candidates)
        if default not in candidates:
            raise ValueError(f"decision {name}: default {default!r} not among {candidates}")
        value = self.values.get(name, default)
        if value not in candidates:  # a stale record for another shape: fall back to the default
            value = default
        self.used[name] = value
        self.space[name] = candidates
        return value

    def digest(self) -> str:
        return json.dumps(self.values, sort_keys=True)


def lay_out_by_kernel(table: Mapping[str, Any], kernel: str, dims, target, decisions: Decisions,
                      capability: str):
    """The ``lay_out`` of a rule file that has one function per kernel: ``table[kernel](dims, decisions)``
    where the target has ``capability`` (``"gpu"`` / ``"cpu"`` in ``target.keys``); None for another kernel
    or target (the function itself may return None for a shape it does not take)."""
    schedule = table.get(kernel)
    if schedule is None or capability not in target.keys:
        return None
    return schedule(dims, decisions)


def vector_floats(target) -> int:
    """float32 lanes of a CPU target's vector registers, for register-blocking defaults: 16 with AVX-512
    (zmm), else 8 (AVX2's ymm; also the default for other CPUs). A register block sized for zmm is twice
    as many ymm and runs out of AVX2's 16 registers (the SSD matmuls' 4 x 32 block: 16 accumulators)."""
    from tvm.target import codegen

    try:
        return 16 if codegen.target_has_features("avx512f", target) else 8
    except Exception:  # a target LLVM cannot query (another architecture's triple): the narrower default
        return 8


class SampledDecisions(Decisions):
    """MetaSchedule mode: each pick becomes ``sch.sample_categorical`` (default = the initial decision),
    so a rule written for fixed decisions generates a MetaSchedule design space unchanged. Integer knobs
    only; the value returned is an ExprRV (usable as a split factor, not in Python arithmetic)."""

    def __init__(self, sch: s_tir.Schedule):
        super().__init__()
        self.sch = sch
        self.order: list[str] = []

    def pick(self, name: str, candidates: Iterable[Any], default: Any) -> Any:
        candidates = tuple(candidates)
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in candidates):
            raise TypeError(f"decision {name}: MetaSchedule samples integer knobs only, got {candidates}")
        rv = self.sch.sample_categorical(list(candidates), [1.0 / len(candidates)] * len(candidates),
                                         decision=candidates.index(default))
        self.space[name], self.used[name] = candidates, rv
        self.order.append(name)
        return rv


_active = threading.local()


@contextlib.contextmanager
def _scoped(name: str, value):
    prev = getattr(_active, name, None)
    setattr(_active, name, value)
    try:
        yield value
    finally:
        setattr(_active, name, prev)


def on_schedule(sch: s_tir.Schedule):
    """Within the block, ``schedule_compute`` hands rules this schedule (MetaSchedule's, over the kernel's
    compute definition with the bucket's shapes bound) instead of a new one."""
    return _scoped("sch", sch)


def watch():
    """Within the block, the schedule helpers note which form the rule took: ``.block`` True when it scheduled
    the compute definition (``schedule_compute``: a MetaSchedule design space), False for a template."""
    return _scoped("watch", _Seen())


class _Seen:
    block: bool | None = None


class NotBlockScheduled(TypeError):
    """A loop-nest template rule was asked for a MetaSchedule design space (it builds a new PrimFunc)."""


def _new_schedule(func: tvm.tirx.PrimFunc, name: str) -> s_tir.Schedule:
    sch = s_tir.Schedule(tvm.IRModule({name: func}))
    sch.work_on(name)
    return sch


def schedule_of(prim: tvm.tirx.PrimFunc, name: str) -> s_tir.Schedule:
    """A Schedule over a template's PrimFunc laid out for the target (final: the rule's picks built it), named
    after its kernel ``name`` (``compute._common.stamp``). Inside ``on_schedule`` a NotBlockScheduled: a
    template is not a MetaSchedule design space."""
    seen = getattr(_active, "watch", None)
    if seen is not None:
        seen.block = False
    if getattr(_active, "sch", None) is not None:
        raise NotBlockScheduled("a loop-nest template is not a MetaSchedule design space")
    return _new_schedule(stamp(prim, name), name)


def schedule_compute(func: tvm.tirx.PrimFunc, name: str) -> s_tir.Schedule:
    """A Schedule over the kernel's compute definition ``func`` (the op's builder called with the rule's dims),
    for the rule to split, bind and stage; inside ``on_schedule`` the schedule being sampled instead (the same
    definition, its symbolic dims bound to a shape bucket's)."""
    seen = getattr(_active, "watch", None)
    if seen is not None:
        seen.block = True
    active = getattr(_active, "sch", None)
    return active if active is not None else _new_schedule(func, name)
