"""One case on a device: run it (simcheck's case, natively), then time each kernel it launched by replaying
those launches on the same tensors, and return one row per kernel.

Timing replays the captured launches (torch_ops' capture_launches: kernel + argument tensors) after the
case's comparisons are done, so in-place kernels and accumulated gradients cannot disturb the check; the time
is the kernels' alone (no Python glue, no allocation): CUDA events around one pass over the key's launches,
median of ``repeats`` passes after two warm-up passes (wall clock on a CPU). GB/s is the launches' distinct
argument bytes over that time (every buffer read or written once: a lower bound of the traffic).
"""
from __future__ import annotations

import contextlib
import time
import traceback

import torch

from .common import ident, timer


def call_case(case, arch: str = "sm_90") -> dict:
    """Run ``case``'s checks (inside simcheck.on_device): simcheck's configuration check, or an LM case (which
    returns its timings)."""
    from tvm_mamba.tools.simcheck import ops as simcheck_ops

    if case.op == "lm":
        from . import lm

        return lm.check(case)
    simcheck_ops.run_config(case.op, case.direction, case.static, case.dtypes, arch)
    return {}


def _arg_bytes(launches) -> int:
    seen, total = set(), 0
    for launch in launches:
        for a in launch.args:
            if isinstance(a, torch.Tensor) and a.data_ptr() not in seen:
                seen.add(a.data_ptr())
                total += a.numel() * a.element_size()
    return total


def _dtype(dtypes: dict) -> str:
    names = sorted(set(dtypes.values())) or ["int8"]
    return "/".join(n.replace("bfloat16", "bf16").replace("float", "fp") for n in names)


def run_case(case, device: torch.device, repeats: int, time_it: bool, estimates: dict) -> list[dict]:
    """Rows for ``case`` on ``device``: one per kernel of the case's own (op, direction) it launched (all its
    kernels when none matches, e.g. the CPU's variant of a CUDA-only direction), each with the case's verdict."""
    from tvm_mamba.tools import simcheck

    from . import upstream

    t0 = time.perf_counter()
    error, extra = None, {}
    with simcheck.on_device(device, case.sizes) as where, upstream.watch(case, device) as ups:
        try:
            extra = call_case(case)
        except Exception as err:  # noqa: BLE001 - one row says what failed; the run goes on
            error = f"{type(err).__name__}: {str(err).strip()[-1200:]}"
            if not isinstance(err, AssertionError):
                error += "\n" + traceback.format_exc()[-1500:]
    base = dict(op=case.op, direction=case.direction, static=case.static, dtypes=case.dtypes, kind=case.kind, preset=case.preset, shape=case.shape(),
                dtype=_dtype(case.dtypes), ok=error is None, error=error,
                max_err=max((e[1] for e in where.errors), default=None),
                worst=max((e[2] for e in where.errors), default=None), checked=len(where.errors),
                upstream=ups.result(), seconds=round(time.perf_counter() - t0, 3))
    if case.op == "lm":
        return [dict(base, kernel=None, gbps=None, estimate=None, **{"time_ms": None, **extra})]  # its own timings
    groups: dict = {}
    for launch in where.launches:
        groups.setdefault(launch.kernel.key, []).append(launch)
    own = [k for k in groups if (k.op, k.direction) == (case.op, case.direction)] or list(groups)
    rows = []
    for key in own or [None]:
        row = dict(base, kernel=str(key) if key is not None else None, time_ms=None, gbps=None, estimate=None)
        if key is not None:
            runs = [launch.kernel.bind(*launch.args) for launch in groups[key]]
            if time_it and error is None:
                row["time_ms"] = timer(device, lambda: [r() for r in runs], repeats)
                row["bytes"] = _arg_bytes(groups[key])
                row["gbps"] = row["bytes"] / row["time_ms"] / 1e6
            est = estimates.get(ident(key.op, key.direction, key.static, key.dtype) + "@" + case.shape())
            row["estimate"] = est
            if est and row["time_ms"]:
                row["tflops"] = est["flops"] / row["time_ms"] / 1e9
        rows.append(row)
    return rows


class _DryKernel:
    """A kernel that does nothing; the keys resolved are appended to ``resolved`` (kernel_configs' dry runs)."""

    def __init__(self, key, resolved: list):
        from tvm_mamba.runtime import dispatch

        self.key, self.plan = key, dispatch.plan(key)
        resolved.append(key)

    def __call__(self, *args):
        from tvm_mamba.runtime import dispatch

        dispatch.note_key(self.key, self.plan)

    def bind(self, *args):
        return lambda: self(*args)


@contextlib.contextmanager
def dry_kernels():
    """``with dry_kernels() as resolved:`` every kernel resolved inside is a :class:`_DryKernel` (nothing
    compiles, nothing runs) and its key is appended to ``resolved`` (whatever captures or records launches,
    e.g. an LM's decode plan)."""
    from tvm_mamba.runtime import cache

    resolved: list = []
    saved, fast = cache._resolve, getattr(cache._fast, "memo", None)
    cache._resolve, cache._fast.memo = (lambda key: _DryKernel(key, resolved)), {}
    try:
        yield resolved
    finally:
        cache._resolve, cache._fast.memo = saved, fast
