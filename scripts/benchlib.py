"""Shared timing helpers for scripts/bench.py and scripts/bench_<op>.py (wall clock, synchronizing CUDA if used).

Every op module ``scripts/bench_<op>.py`` defines ``run(quick: bool) -> list[Row]``; bench.py runs them all
in one process and prints one table: medians, ratio against the PyTorch reference and against a memory
copy of the op's main input (the bytes a memory-bound kernel must at least move). The copy baseline is
timed in the same direction(s) as its row: a forward row against ``x.clone()``, a forward+backward row
against :func:`copy_fwd_bwd` (one copy forward, one copy of the gradient backward, through autograd), so
``tvm/copy`` never divides a forward+backward time by a forward-only one.

Timing is our own loop, not ``torch.utils.benchmark.Timer``: the Timer runs the statement with
``torch.set_num_threads(1)`` unless told otherwise (silently slowing the multi-threaded PyTorch baselines
while TVM's own thread pool is unaffected), and ``blocked_autorange`` has no minimum sample count, so a 1 s
reference timed with a small ``min_run_time`` reports the "median" of one block after untimed
block-size probes. Ours: ``warmup`` untimed calls, then at least ``iters`` timed calls (up to ``10 * iters``
while under ``min_time_s``), median of per-call times.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
import statistics
import time
from typing import Callable

import torch

# The columns of --csv and the keys of each --json row, in order (see bench.py's docstring for meanings).
ROW_FIELDS = ("op", "case", "shape", "tvm_s", "ref_s", "ref_name", "ref_over_tvm", "copy_s", "tvm_over_copy",
              "note", "overhead_s")
SCHEMA_VERSION = 1


@dataclasses.dataclass
class Row:
    op: str          # "causal_conv1d"
    case: str        # what is timed: "fwd", "fwd+bwd", "LM decode 8 tokens"
    shape: str       # "b=4, d=256, L=2048, w=4, silu, fp32"
    tvm_ms: float
    ref_ms: float | None  # the PyTorch reference / eager composition (None: no baseline measured)
    copy_ms: float | None = None  # memory-copy baseline, same direction(s) as the row (None: not meaningful)
    ref_name: str = "torch eager"
    note: str = ""
    overhead_ms: float | None = None  # bench_overhead.py's rows: the call minus its kernel launched alone

    def record(self) -> dict:
        """The row in the --json / --csv schema: seconds, ratios precomputed, None where not measured."""
        return dict(op=self.op, case=self.case, shape=self.shape, tvm_s=self.tvm_ms * 1e-3,
                    ref_s=None if self.ref_ms is None else self.ref_ms * 1e-3, ref_name=self.ref_name,
                    ref_over_tvm=None if self.ref_ms is None else self.ref_ms / self.tvm_ms,
                    copy_s=None if self.copy_ms is None else self.copy_ms * 1e-3,
                    tvm_over_copy=None if not self.copy_ms else self.tvm_ms / self.copy_ms, note=self.note,
                    overhead_s=None if self.overhead_ms is None else self.overhead_ms * 1e-3)


def median_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20, min_time_s: float = 0.2) -> float:
    """Median wall time of fn() in milliseconds (synchronizing CUDA if used)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    t_end = time.perf_counter() + min_time_s
    while len(times) < iters or (time.perf_counter() < t_end and len(times) < 10 * iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


class _Copy(torch.autograd.Function):
    """y = x.clone(); dx = dy.clone(): one read and one write of the tensor in each direction."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy.clone()


def copy_fwd_bwd(x: torch.Tensor, dout: torch.Tensor) -> Callable[[], None]:
    """A step that copies x forward and its gradient dout backward through autograd: the memory baseline of a
    forward+backward row (the least traffic of any op that reads x, writes y, then reads dy and writes dx;
    the kernels' extra reads of saved inputs are not counted, so tvm/copy is an upper bound on the gap)."""
    leaf = x.detach().clone().requires_grad_(True)

    def step():
        leaf.grad = None
        _Copy.apply(leaf).backward(dout)
    return step


def format_table(rows: list[Row]) -> str:
    head = f"{'op':<16} {'case':<64} {'tvm ms':>9} {'ref ms':>9} {'ref/tvm':>8} {'copy ms':>8} {'tvm/copy':>8}  ref"
    lines = [head, "-" * len(head)]
    for r in rows:
        copy = f"{r.copy_ms:8.3f}" if r.copy_ms else f"{'-':>8}"
        vs_copy = f"{r.tvm_ms / r.copy_ms:8.2f}" if r.copy_ms else f"{'-':>8}"
        case = f"{r.case} ({r.shape})" if r.shape else r.case
        ref = f"{r.ref_ms:9.3f} {r.ref_ms / r.tvm_ms:8.2f}" if r.ref_ms is not None else f"{'-':>9} {'-':>8}"
        lines.append(f"{r.op:<16} {case:<64} {r.tvm_ms:9.3f} {ref} "
                     f"{copy} {vs_copy}  {r.ref_name}{('; ' + r.note) if r.note else ''}")
    return "\n".join(lines)


def write_json(path, rows: list[Row], meta: dict) -> None:
    """{"schema": 1, **meta, "rows": [Row.record(), ...]} (see bench.py's docstring)."""
    doc = {"schema": SCHEMA_VERSION, **meta, "rows": [r.record() for r in rows]}
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def write_csv(path, rows: list[Row]) -> None:
    """One header line (ROW_FIELDS), one line per row; None is written as an empty field."""
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        for r in rows:  # ROW_FIELDS only: a row type's extra JSON fields (bench_lm's tokens/s) are left out
            rec = r.record()
            w.writerow({k: ("" if rec[k] is None else rec[k]) for k in ROW_FIELDS})
