"""MetaSchedule JSONDatabase files: trials measured elsewhere (the runtime-only GPU round) are committed with
their traces, and every committed database record is rebuilt the MetaSchedule way (trace applied to the
bucket's static PrimFunc) and checked against the hand-default kernel (CPU) or built (CUDA)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import tvm

from tvm_mamba.tools import candidates, metaschedule as msd, tune
from tvm_mamba.compute.causal_conv1d import build_check_configs
from tvm_mamba.runtime import KernelKey, cpu_target, cuda_target, dispatch, target_key, tuning
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.schedules.rule import Decisions


def test_gpu_round_commit_writes_a_metaschedule_database(tmp_path):
    d, st, dt = build_check_configs()[0]
    key = KernelKey.make("causal_conv1d", d, dt, st, target_key(cuda_target("sm_90")), {"batch": 1, "seqlen": 512})
    assert msd.block_scheduled(key)
    times = {256: 3e-5, 128: 2e-5, 64: 4e-5}  # as `tune --measure` would write them on the GPU
    results = [{"key": key.to_json(), "decisions": {"threads": t, "tile": 1024}, "default": t == 256, "time_s": s}
               for t, s in times.items()]
    timings = tmp_path / "timings.json"
    timings.write_text(json.dumps({"target": "cuda-sm_90", "device": "nvidia-h200-sm90", "results": results}))
    folder = candidates.commit(str(timings), str(tmp_path / "logs"))
    (rec,) = [json.loads(l) for l in (folder / "causal_conv1d" / tuning.RECORDS).read_text().splitlines()]
    assert rec["source"] == "metaschedule" and rec["decisions"] == {"threads": 128, "tile": 1024}
    assert rec["time_s"] == 2e-5 and rec["default_time_s"] == 3e-5
    db = msd.database(folder / "causal_conv1d")
    assert len(db) == 3
    mod, best = msd.replay(key, folder / "causal_conv1d")
    assert [float(s) for s in best.run_secs] == [2e-5]
    assert msd.knobs_of(key, best.trace) == {"threads": 128, "tile": 1024}
    target = cuda_target("sm_90")
    with target:
        ex = tvm.compile(mod, target=target)
    assert "__launch_bounds__(128)" in ex.mod.imports[0].inspect_source("cuda")

    # an interrupted run's cut line and foreign text: dropped with a warning naming the file, the rest kept
    trials = folder / "causal_conv1d" / msd.TRIALS
    trials.write_bytes(trials.read_bytes()[:-40])
    with open(folder / "causal_conv1d" / msd.WORKLOADS, "a") as f:
        f.write("not json {\n")
    with pytest.warns(RuntimeWarning) as caught:
        db = msd.database(folder / "causal_conv1d")
    said = " ".join(str(w.message) for w in caught)
    assert msd.TRIALS in said and msd.WORKLOADS in said
    assert len(db) == 2
    # appendable after the repair
    msd.commit_trials(key, folder / "causal_conv1d", [({"threads": 512, "tile": 1024}, 5e-5)])
    assert len(msd.database(folder / "causal_conv1d")) == 3


def _db_records():
    out = []
    for f in sorted(tuning.package_logs_dir().glob(f"*/*/{tuning.RECORDS}")):
        for line in f.read_text().splitlines():
            obj = json.loads(line)
            if obj.get("source") == "metaschedule":
                key = KernelKey.from_json(obj["key"])
                out.append(pytest.param(key, f.parent, id=f"{f.parent.parent.name}:{key.slug()}"))
    return out


def _random_args(func, bucket, seed):
    rng = np.random.default_rng(seed)
    analyzer = tune.bucket_analyzer(func, bucket)
    args = []
    for p in func.params:
        shape, dtype = tune._shape(p, bucket, analyzer), str(p.dtype)
        if dtype.startswith("int"):
            info = np.iinfo(dtype)
            host = rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)
        else:
            host = rng.uniform(-1, 1, size=shape).astype(dtype)
        args.append(host)
    return args


@pytest.mark.parametrize("key,folder", _db_records() or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no committed MetaSchedule records"))])
def test_committed_database_record_replays(key, folder):
    """Runs on any machine: a CPU record tuned on another CPU is built for this one (code for the record's
    -mcpu may not run here); the trace, not the -mcpu, is what is checked."""
    mod, rec = msd.replay(key, folder)
    if key.target.startswith("cuda-"):
        target = dispatch.target_from_key(key.target)
        with target:
            ex = tvm.compile(mod, target=target)
        assert "__global__" in ex.mod.imports[0].inspect_source("cuda")
        return
    key = dataclasses.replace(key, target=target_key(cpu_target()))
    target = dispatch.target_from_key(key.target)
    with target:
        ex = tvm.compile(mod, target=target)
    bucket = dict(key.shape_bucket)
    host = _random_args(dispatch.build_func(key), bucket, seed=3)
    outs = []
    for fn in (ex["main"], compile_module(key, dispatch.schedule(key, Decisions()))[f"{key.op}_{key.direction}"]):
        args = [tvm.runtime.tensor(h.copy()) for h in host]
        fn(*args)
        outs.append([a.numpy() for a in args])
    for got, want in zip(*outs):
        np.testing.assert_array_equal(got, want)
