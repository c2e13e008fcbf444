"""Tuning logs: lookup by bucket, never slower than default, A/B switch, explain, bad logs, the tuner
(resumable, interrupted runs), distributed measuring through a TVM RPC tracker on loopback, and replay of
every committed record against the hand default."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import tvm

import tvm_mamba
from tvm_mamba.tools import tune
from tvm_mamba.runtime import KernelKey, cpu_target, dispatch, target_key, tuning
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.schedules.rule import Decisions

STATIC = dict(dim=16, width=4, activation="silu", has_bias=True, has_seq_idx=False, has_init=False,
              return_final=False)
DT = {"x": "float32", "weight": "float32"}


def _key(batch=1, seqlen=512):
    return KernelKey.make("causal_conv1d", "fwd", DT, STATIC, target_key(cpu_target()),
                          {"batch": batch, "seqlen": seqlen})


def _write_logs(root, records, meta=None):
    dev = tuning.device_key(target_key(cpu_target()))
    folder = root / dev
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps(meta if meta is not None else tuning.running_meta()))
    for key, decisions, t, t0, *source in records:
        tuning.append_record(folder, key, decisions, t, t0, 3, **({"source": source[0]} if source else {}))
    return folder


@pytest.fixture
def logs(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "logs"))
    return tmp_path / "logs"


def test_exact_and_nearest_bucket_and_never_slower(logs):
    _write_logs(logs, [(_key(seqlen=512), {"vector": 32}, 1e-3, 2e-3),
                       (_key(seqlen=4096), {"vector": 8}, 1e-3, 2e-3),
                       (_key(seqlen=65536), {"vector": 8}, 3e-3, 2e-3)])  # slower than default: unused
    assert dict(dispatch.plan(_key(seqlen=512)).decisions) == {"vector": 32}
    assert dict(dispatch.plan(_key(seqlen=1024)).decisions) == {"vector": 32}  # nearest (log2 distance 1)
    assert dict(dispatch.plan(_key(seqlen=8192)).decisions) == {"vector": 8}
    assert dict(dispatch.plan(_key(seqlen=65536)).decisions) == {"vector": 8}  # 4096's, not the slow one
    other = KernelKey.make("causal_conv1d", "fwd", DT, dict(STATIC, dim=32), target_key(cpu_target()), {"seqlen": 512})
    assert dispatch.plan(other).source == "default"


def test_disable_switch_env_and_explain(logs):
    _write_logs(logs, [(_key(batch=2, seqlen=64), {"vector": 8}, 1e-3, 2e-3)])
    x, w, b = torch.randn(2, 16, 50), torch.randn(16, 4), torch.randn(16)
    text = tvm_mamba.explain(tvm_mamba.causal_conv1d_fn, x, w, b, activation="silu")
    assert "tuned:" in text and "records.jsonl" in text and "vector=8" in text and "MetaSchedule" not in text
    with tvm_mamba.tuning_logs(enabled=False):
        assert "schedule: default" in tvm_mamba.explain(tvm_mamba.causal_conv1d_fn, x, w, b, activation="silu")
        out_default = tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")
    assert torch.allclose(tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu"), out_default, atol=1e-6)


def test_explain_names_a_metaschedule_record(logs):
    _write_logs(logs, [(_key(batch=1, seqlen=64), {"vector": 32}, 1e-3, 2e-3, "metaschedule")])
    text = tvm_mamba.explain(tvm_mamba.causal_conv1d_fn, torch.randn(1, 16, 50), torch.randn(16, 4),
                             torch.randn(16), activation="silu")
    assert "vector=32" in text and "MetaSchedule)" in text


def test_malformed_foreign_and_mismatched_logs_are_skipped_with_a_warning(logs):
    folder = _write_logs(logs, [(_key(seqlen=256), {"vector": 8}, 1e-3, 2e-3)])
    rec = folder / "causal_conv1d" / "records.jsonl"
    with open(rec, "a") as f:
        f.write('{"key": {"op": "causal_conv1d"}, "decisions": "import os"}\n')  # foreign / wrong types
        f.write('{"key": {"op": "causal_conv1d", "direc')  # truncated by an interrupted run
    tuning.refresh()  # logs are re-read at most once a second; this test edits them by hand
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dispatch.plan(_key(seqlen=256))
    assert dict(plan.decisions) == {"vector": 8}
    assert any("malformed" in str(w.message) and str(rec) in str(w.message) for w in caught)
    (folder / "meta.json").write_text(json.dumps(dict(tuning.running_meta(), tvm="0.0.1")))
    tuning.refresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.plan(_key(seqlen=256)).source == "default"
    assert any("ignoring tuning logs" in str(w.message) for w in caught)


def test_recheck_demotes_winners_that_do_not_hold(logs, monkeypatch):
    """`tune --recheck`: winners re-timed against the default; one that is no longer CONFIRM_MARGIN faster is
    rewritten as "default kept" (dispatch then serves the default), one that holds keeps its decisions."""
    folder = _write_logs(logs, [(_key(seqlen=512), {"vector": 32}, 1e-3, 2e-3),
                                (_key(seqlen=4096), {"vector": 8}, 1e-3, 2e-3),
                                (_key(seqlen=64), {"vector": 16}, 2e-3, 2e-3)])  # default kept: not rechecked
    timed = []

    def fake_confirm(key, measure, ex_best, ex_default, args, rounds):
        timed.append(dict(key.shape_bucket)["seqlen"])
        return (1.0, 1.01) if dict(key.shape_bucket)["seqlen"] == 512 else (0.5, 1.0)

    monkeypatch.setattr(tune, "confirm", fake_confirm)
    assert tune.recheck(["causal_conv1d"], str(logs)) == (2, 1)
    assert sorted(timed) == [512, 4096]
    recs = {dict(KernelKey.from_json(r["key"]).shape_bucket)["seqlen"]: r for r in map(
        json.loads, (folder / "causal_conv1d" / "records.jsonl").read_text().splitlines())}
    assert recs[512]["decisions"] == {"vector": 16} and recs[512]["time_s"] == recs[512]["default_time_s"]
    assert recs[4096]["decisions"] == {"vector": 8} and recs[4096]["rechecked"]
    assert dispatch.plan(_key(seqlen=512)).decisions != (("vector", 32),)
    assert dict(dispatch.plan(_key(seqlen=4096)).decisions) == {"vector": 8}
    assert tune.recheck(["causal_conv1d"], str(logs)) == (0, 0)  # rechecked records are not timed again


def test_tuner_writes_resumes_and_survives_interruption(logs):
    out = logs / "run"
    folder = tune.run(["causal_conv1d"], preset="mamba-130m", seqlens=(64,), batches=(1,), trials=2,
                      budget_s=600, out=str(out))
    rec = folder / "causal_conv1d" / "records.jsonl"
    lines = rec.read_text().splitlines()
    assert len(lines) == 2 and json.loads((folder / "meta.json").read_text())["tvm"] == tvm.__version__
    for line in lines:
        obj = json.loads(line)
        assert obj["candidates"] == 2 and obj["time_s"] <= obj["default_time_s"] and "vector" in obj["decisions"]
    tune.run(["causal_conv1d"], preset="mamba-130m", seqlens=(64,), batches=(1,), trials=2, out=str(out))
    assert rec.read_text().splitlines() == lines  # nothing re-tuned
    rec.write_text(lines[0] + "\n" + lines[1][:40])  # interrupted while writing the second record
    tune.run(["causal_conv1d"], preset="mamba-130m", seqlens=(64,), batches=(1,), trials=2, out=str(out))
    done = tuning.recorded_keys(folder)
    assert len(done) == 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(cond, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout}s")


def test_tuning_through_an_rpc_tracker_on_loopback(logs):
    pytest.importorskip("tornado")
    from tvm import rpc

    port = _free_port()
    tracker = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                                "--port-end", str(port + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    server = None
    try:
        _wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() is None, "RPC tracker")
        server = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
                                   "--key", "loopback", "--host", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait_for(lambda: "loopback" in str(rpc.connect_tracker("127.0.0.1", port).summary()), "RPC server")
        # conv1d forward: loop-nest templates measured by our RPC measurer; int8 pack: block-scheduled, so
        # tuned by MetaSchedule (tune_tir with its RPCRunner) into the op's JSONDatabase
        folder = tune.run(["causal_conv1d", "int8_dot"], preset="mamba-130m", seqlens=(64,), batches=(1,),
                          trials=2, out=str(logs / "rpc"), rpc_tracker=f"127.0.0.1:{port}", rpc_key="loopback",
                          directions=("fwd", "pack"))
        lines = (folder / "causal_conv1d" / "records.jsonl").read_text().splitlines()
        assert len(lines) == 1 and all(json.loads(l)["source"] == "template" for l in lines)
        (pack,) = [json.loads(l) for l in (folder / "int8_dot" / "records.jsonl").read_text().splitlines()]
        assert pack["source"] == "metaschedule" and pack["candidates"] >= 1
        trials = (folder / "int8_dot" / "database_tuning_record.json").read_text().splitlines()
        assert len(trials) == pack["candidates"] and all(json.loads(t)[1][1][0] < 1.0 for t in trials)  # measured
        assert json.loads((folder / "meta.json").read_text())["budget"]["rpc"] is True
    finally:
        for p in (server, tracker):
            if p is not None:  # the whole process group: the server's session workers outlive it otherwise
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)


def _committed_records():
    root = tuning.package_logs_dir()
    out = []
    seen = set()
    for f in sorted(root.glob("*/*/records.jsonl")):
        for line in f.read_text().splitlines():
            obj = json.loads(line)
            key = KernelKey.from_json(obj["key"])
            # batch / seqlen are symbolic: one build of (workload, decisions) serves every bucket's record
            group = (key.workload(), json.dumps(obj["decisions"], sort_keys=True))
            if group in seen or not (key.target.startswith("llvm-") or key.target.startswith("cuda-")):
                continue
            seen.add(group)
            knobs = ",".join(f"{k}={v}" for k, v in sorted(obj["decisions"].items()))
            out.append(pytest.param(key, obj["decisions"], id=f"{f.parent.parent.name}:{key.slug()}:{knobs}"))
    return out


_default_runs: dict = {}  # workload -> the hand default's outputs at the small shape (built once per workload)


def _on_this_cpu(key: KernelKey) -> KernelKey:
    """``key`` for this machine's CPU target: a record tuned on another CPU (llvm-rocketlake: AVX-512) is
    replayed with the host's -mcpu, since code built for the record's CPU may not run here (SIGILL). The
    knobs are what is being checked; they are target-independent loop shapes."""
    return dataclasses.replace(key, target=target_key(cpu_target()))


def _run_small(key, mod):
    names = list(dict(key.shape_bucket))
    small = KernelKey.make(key.op, key.direction, dict(key.dtypes), dict(key.static_dims), key.target,
                           tune.bucket_for(names, 1, 37))  # a small, odd shape inside the kernel's domain
    ex = compile_module(key, mod)
    args = tune.make_args(small, tvm.cpu(0), seed=7)
    ex[f"{key.op}_{key.direction}"](*args)
    return [a.numpy().astype("float64") for a in args]


@pytest.mark.parametrize("key,decisions", _committed_records() or [pytest.param(None, None, marks=pytest.mark.skip(reason="no committed logs"))])
def test_committed_record_replays_and_matches_the_default(key, decisions):
    """Every committed record is replayed (once per distinct workload and decisions), on any machine: its
    knobs must be ones the rule accepts (as dispatch checks them: type and value); CPU records are then
    built for this CPU and run at a small shape against the hand-default kernel (itself tested against the
    float64 references); CUDA records built."""
    strict = tuning._StrictDecisions(decisions)
    tuned_mod = dispatch.schedule(key, strict)
    assert not strict.rejected and set(decisions) <= set(strict.space), (strict.rejected, strict.space)
    if key.target.startswith("cuda-"):
        target = dispatch.target_from_key(key.target)
        with target:
            ex = tvm.compile(tuned_mod, target=target)
        assert "__global__" in ex.mod.imports[0].inspect_source("cuda")
        return
    key = _on_this_cpu(key)
    if key.workload() not in _default_runs:
        _default_runs[key.workload()] = _run_small(key, dispatch.schedule(key, Decisions()))
    defaults = Decisions()
    dispatch.schedule(key, defaults)
    tuned = _run_small(key, dispatch.schedule(key, Decisions(decisions))) if {**defaults.used, **decisions} != defaults.used else None
    for got, want in zip(tuned or [], _default_runs[key.workload()]):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)  # fp32, another summation order


def test_shipped_logs_load_without_a_warning():
    """Every shipped device folder's meta matches the running versions and every line validates (the check
    that the shipped records still load: a TVM upgrade without re-tuning makes this fail, on purpose)."""
    root = tuning.package_logs_dir()
    folders = sorted(p.parent for p in root.glob("*/meta.json"))
    if not folders:
        pytest.skip("no shipped logs")
    tuning.refresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for folder in folders:
            lines = sum(1 for f in folder.glob(f"*/{tuning.RECORDS}") for ln in f.read_text().splitlines() if ln.strip())
            assert tuning._count(root, folder.name) == lines, folder
    assert not [str(w.message) for w in caught if "tuning" in str(w.message)]
