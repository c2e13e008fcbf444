"""Shared timing helpers for scripts/bench.py and scripts/bench_<op>.py (CPU wall clock; CUDA events on GPU).

Every op module ``scripts/bench_<op>.py`` defines ``run(quick: bool) -> list[Row]``; bench.py runs them all
in one process and prints one table: medians, ratio against the PyTorch reference and against a memory
copy (``torch.clone`` of the op's main input: the bytes a memory-bound kernel must at least move).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch


@dataclasses.dataclass
class Row:
    op: str          # "causal_conv1d"
    case: str        # "fwd (b=4, d=256, L=2048, w=4, silu)"
    tvm_ms: float
    ref_ms: float    # the PyTorch reference / eager composition
    copy_ms: float | None = None  # torch.clone of the main input (None when not meaningful)
    ref_name: str = "torch eager"
    note: str = ""


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


def format_table(rows: list[Row]) -> str:
    head = f"{'op':<16} {'case':<52} {'tvm ms':>9} {'ref ms':>9} {'ref/tvm':>8} {'copy ms':>8} {'tvm/copy':>8}  ref"
    lines = [head, "-" * len(head)]
    for r in rows:
        copy = f"{r.copy_ms:8.3f}" if r.copy_ms else f"{'-':>8}"
        vs_copy = f"{r.tvm_ms / r.copy_ms:8.2f}" if r.copy_ms else f"{'-':>8}"
        lines.append(f"{r.op:<16} {r.case:<52} {r.tvm_ms:9.3f} {r.ref_ms:9.3f} {r.ref_ms / r.tvm_ms:8.2f} "
                     f"{copy} {vs_copy}  {r.ref_name}{('; ' + r.note) if r.note else ''}")
    return "\n".join(lines)
