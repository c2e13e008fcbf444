"""Tuned vs hand-default schedules, per committed tuning record of this machine's device key.

Each row times the same kernel at its record's bucket shape twice in this run — with the record's
decisions ("tvm ms") and with the hand defaults ("ref ms", ref = "hand default") — so ref/tvm is the
speedup tuning bought. The record's own tuning-time figures are printed beside it.
"""
from __future__ import annotations

import json
import statistics

import tvm
from benchlib import Row

from tvm_mamba import tune
from tvm_mamba.runtime import KernelKey, cpu_target, dispatch, target_key, tuning
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.schedules.rule import Decisions


def run(quick: bool = False) -> list[Row]:
    dev = tuning.device_key(target_key(cpu_target()))
    folder = tuning.logs_dir() / dev
    rows, ratios = [], {}
    measure = tune.LocalMeasurer()
    for f in sorted(folder.glob(f"*/{tuning.RECORDS}")):
        lines = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        for rec in lines[: 2 if quick else None]:
            key = KernelKey.from_json(rec["key"])
            if rec["time_s"] >= rec["default_time_s"]:
                continue  # never used by dispatch
            args = tune.make_args(key, tvm.cpu(0))
            t_tuned = measure(key, compile_module(key, dispatch.schedule(key, Decisions(rec["decisions"]))), args)
            t_def = measure(key, compile_module(key, dispatch.schedule(key, Decisions())), args)
            bucket = ",".join(f"{k}={v}" for k, v in key.shape_bucket)
            knobs = ",".join(f"{k}={v}" for k, v in rec["decisions"].items())
            rows.append(Row(key.op, f"{key.direction} [{bucket}] {knobs}"[:52], 1e3 * t_tuned, 1e3 * t_def,
                            ref_name="hand default",
                            note=f"at tuning: {rec['default_time_s'] / rec['time_s']:.2f}x"))
            ratios.setdefault(key.op, []).append(t_def / t_tuned)
    for op, rs in sorted(ratios.items()):
        print(f"tuned vs default, {op}: median {statistics.median(rs):.2f}x over {len(rs)} records")
    if ratios:
        print(f"tuned vs default, median over ops: {statistics.median(statistics.median(r) for r in ratios.values()):.2f}x")
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
