"""The schedule-rule contract.

Every ``schedules/<cpu|cuda>/<op>.py`` exposes::

    def apply(func: PrimFunc, target: Target, decisions: Decisions) -> s_tir.Schedule | None

``func`` is the compute builder's PrimFunc for one kernel; its ``tvm_mamba.kernel`` attribute names the
kernel (``causal_conv1d_fwd``) and ``tvm_mamba.static`` carries its static dims and dtypes (an op with
typed dims rebuilds them: ``compute.<op>.DIMS[direction](**static)``). A rule checks that it knows the
kernel and the target's capability first (``"gpu" in target.keys`` for the ``cuda/`` rules, which serve any
GPU codegen; ``"cpu"`` for ``cpu/``) and returns None when it does not (never raises on a foreign pattern:
tests/schedules/test_rule_contract.py).

Each rule is a *design space*: every choice (vector width, time tile, threads per block, unroll, chunk
length, algorithm) is made through ``decisions.pick(name, candidates, default)``. With no tuning record the
defaults are used, so the hand schedule and the tuned one are the same code. CPU kernels whose state is
per vector lane (scans, windowed convs with a scalar head/tail) are written as explicit loop nests from a
template (see TVM_FIELD_GUIDE §10: vectorizing a scan block returns wrong numbers); the rule then returns a
Schedule over that loop nest, and its knobs are searched by measurement.
"""
from __future__ import annotations

import contextlib
import json
import threading
from typing import Any, Iterable, Mapping

import tvm
from tvm import s_tir


from tvm_mamba.compute._common import SERIAL_WORK  # noqa: E402,F401  (re-exported for the rules)


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


def apply_by_kernel(table: Mapping[str, Any], func: tvm.tirx.PrimFunc, target, decisions: Decisions,
                    capability: str):
    """The ``apply`` of a rule file that has one schedule function per kernel: ``table[kernel](func, static,
    decisions)`` where the target has ``capability`` (``"gpu"`` / ``"cpu"`` in ``target.keys``); None for a
    foreign PrimFunc or target (the function itself may return None for a shape it does not take)."""
    name, static = kernel_attrs(func)
    schedule = table.get(name)
    if schedule is None or capability not in target.keys:
        return None
    return schedule(func, static, decisions)


def vector_floats(target) -> int:
    """float32 lanes of a CPU target's vector registers, for register-blocking defaults: 16 with AVX-512
    (zmm), else 8 (AVX2's ymm; also the default for other CPUs). A register block sized for zmm is twice
    as many ymm and runs out of AVX2's 16 registers (the SSD matmuls' 4 x 32 block: 16 accumulators)."""
    from tvm.target import codegen

    try:
        return 16 if codegen.target_has_features("avx512f", target) else 8
    except Exception:  # a target LLVM cannot query (another architecture's triple): the narrower default
        return 8


def kernel_attrs(func: tvm.tirx.PrimFunc) -> tuple[str | None, dict]:
    """(kernel name, static dict) stamped on a compute builder's PrimFunc; (None, {}) if foreign."""
    attrs = func.attrs
    if attrs is None or "tvm_mamba.kernel" not in attrs:
        return None, {}
    static = json.loads(str(attrs["tvm_mamba.static"])) if "tvm_mamba.static" in attrs else {}
    return str(attrs["tvm_mamba.kernel"]), static


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
    """Within the block, ``schedule_of`` hands rules this schedule (MetaSchedule's) instead of a new one."""
    return _scoped("sch", sch)


def watch(func: tvm.tirx.PrimFunc):
    """Within the block, ``schedule_of`` notes whether a rule scheduled ``func`` itself (``.block`` True: a
    block-scheduled rule, a MetaSchedule design space) or a PrimFunc of its own (a loop-nest template)."""
    return _scoped("watch", _Seen(func))


class _Seen:
    def __init__(self, func):
        self.func, self.block = func, None


class NotBlockScheduled(TypeError):
    """A loop-nest template rule was asked for a MetaSchedule design space (it builds a new PrimFunc)."""


def schedule_of(func: tvm.tirx.PrimFunc, name: str = "main") -> s_tir.Schedule:
    """A Schedule over ``func`` (or, inside ``on_schedule``, the schedule being sampled: only a rule that
    schedules the compute's own PrimFunc can be one; a template's new PrimFunc raises NotBlockScheduled)."""
    seen = getattr(_active, "watch", None)
    if seen is not None:
        seen.block = func.same_as(seen.func)
    active = getattr(_active, "sch", None)
    if active is not None:
        if not func.same_as(active.mod[active.func_working_on or "main"]):
            raise NotBlockScheduled("a loop-nest template is not a MetaSchedule design space")
        return active
    sch = s_tir.Schedule(tvm.IRModule({name: func}))
    sch.work_on(name)
    return sch
