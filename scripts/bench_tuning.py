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

from tvm_mamba.tools import tune
from tvm_mamba.runtime import KernelKey, cpu_target, dispatch, target_key, tuning
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.schedules.rule import Decisions


def run(quick: bool = False) -> list[Row]:
    dev = tuning.device_key(target_key(cpu_target()))
    folder = tuning.package_logs_dir() / dev  # the committed (shipped) records
    rows, ratios, kept = [], {}, {}
    measure = tune.LocalMeasurer()
    for f in sorted(folder.glob(f"*/{tuning.RECORDS}")):
        lines = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        for rec in lines[: 2 if quick else None]:
            key = KernelKey.from_json(rec["key"])
            if rec["time_s"] >= rec["default_time_s"]:
                kept[key.op] = kept.get(key.op, 0) + 1  # the default won: dispatch serves the default itself
                continue
            args = tune.make_args(key, tvm.cpu(0))
            t_tuned = measure(key, compile_module(key, dispatch.schedule(key, Decisions(rec["decisions"]))), args)
            t_def = measure(key, compile_module(key, dispatch.schedule(key, Decisions())), args)
            bucket = ",".join(f"{k}={v}" for k, v in key.shape_bucket)
            knobs = ",".join(f"{k}={v}" for k, v in rec["decisions"].items())
            rows.append(Row(key.op, f"{key.direction} tuned {knobs}", bucket, 1e3 * t_tuned, 1e3 * t_def,
                            ref_name="hand default",
                            note=f"at tuning: {rec['default_time_s'] / rec['time_s']:.2f}x"))
            ratios.setdefault(key.op, []).append(t_def / t_tuned)
    for op, rs in sorted(ratios.items()):
        every = rs + [1.0] * kept.get(op, 0)
        print(f"tuned vs default, {op}: median {statistics.median(rs):.2f}x over {len(rs)} winning records; "
              f"{statistics.median(every):.2f}x over all {len(every)} tuned workloads (default kept = 1.00x)")
    if ratios:
        med = statistics.median(statistics.median(r) for r in ratios.values())
        med_all = statistics.median(statistics.median(r + [1.0] * kept.get(op, 0)) for op, r in ratios.items())
        print(f"tuned vs default, median over ops: {med:.2f}x (winning records), {med_all:.2f}x (all workloads)")
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
