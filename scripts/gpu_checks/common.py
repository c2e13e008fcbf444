"""What the GPU check's modules share: a case (one op configuration at one size, or an LM run), its sizes,
a kernel configuration's name, and the timer. Its own module, so that cases.py, runner.py, lm.py and
upstream.py import it and not each other in a circle."""
from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    direction: str
    static: dict
    dtypes: dict
    sizes: dict  # simcheck.size overrides ({} at "small": simcheck's own sizes)
    kind: str  # "small" | "preset" | "ragged" | "lm"
    preset: str = ""

    def shape(self) -> str:
        s = self.sizes
        return f"{s['batch']}x{s['seqlen']}" if "seqlen" in s else "small"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def sizes(batch: int, seqlen: int) -> dict:
    """simcheck.size overrides: batch, seqlen, and rows = batch x seqlen (linear / int8 products)."""
    return {"batch": batch, "seqlen": seqlen, "rows": batch * seqlen}


def timer(device: torch.device, fn, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` (CUDA events; wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(repeats, 1)):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def ident(op: str, direction: str, static: dict, dtypes: dict) -> str:
    """The target-free name of a kernel configuration (estimates and configs are keyed by it)."""
    return json.dumps([op, direction, dict(static), dict(dtypes)], sort_keys=True)
