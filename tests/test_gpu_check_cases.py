"""scripts/gpu_check.py on the CPU (the CI rehearsal of the GPU check): ``run --device cpu --small`` gives one
row per kernel with the verdict of simcheck's comparison against the float64 reference (a wrong result fails
its row and the exit code), and ``configs`` lists every kernel configuration such a run resolves (what an AOT
pack built from it must hold)."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_checks import cases  # noqa: E402

OPS = "linear,int8_dot"  # two cheap ops: ~30 small cases, seconds once their kernels are built


def _shipped(op: str) -> list:
    """An op's small cases: its build-check configurations and its presets' tuning configurations."""
    return cases._configs(op, "build_check_configs") + [c for p in cases.PRESETS
                                                         for c in cases._configs(op, "tuning_configs", p)]


def _run(tmp_path, capsys, *extra) -> tuple[int, list[dict], str]:
    rc = gpu_check.main(["run", "--out", str(tmp_path), "--device", "cpu", "--small", "--ops", OPS, *extra])
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    return rc, rows, capsys.readouterr().out


def test_run_cpu_small_rows(tmp_path, capsys):
    rc, rows, out = _run(tmp_path, capsys)
    shipped = {(op, d, json.dumps(s, sort_keys=True)) for op in OPS.split(",")
               for d, s, _ in _shipped(op)}
    assert {(r["op"], r["direction"], json.dumps(r["static"], sort_keys=True)) for r in rows} == shipped
    for r in rows:
        assert r["ok"], r
        assert r["kernel"].startswith(f"{r['op']}.") or r["op"] in r["kernel"], r["kernel"]
        assert r["checked"] >= 1 and r["max_err"] is not None  # simcheck.compare logged the comparisons
        assert r["time_ms"] is None  # --small: no timing repeats
        assert r["upstream"] is None or r["upstream"].startswith("not available")
    lines = [ln for ln in out.splitlines() if ln.startswith(("linear.", "int8_dot."))]
    assert len(lines) == len(rows)  # one summary line per kernel
    assert out.strip().splitlines()[-1].startswith(f"gpu_check: {len(rows)} checks, 0 failed")
    assert rc == 0
    assert "| linear.fwd |" in (tmp_path / "gpu_check.md").read_text()


def test_wrong_result_fails_its_row(tmp_path, capsys, monkeypatch):
    """A kernel result off its reference (here: the reference moved by 1e-2) fails that op's rows and the run."""
    import tvm_mamba.reference.linear as ref

    good = ref.linear_ref
    monkeypatch.setattr(ref, "linear_ref", lambda *a, **k: good(*a, **k) + 1e-2)
    rc, rows, out = _run(tmp_path, capsys)
    bad = [r for r in rows if not r["ok"]]
    assert bad and all((r["op"], r["direction"]) == ("linear", "fwd") for r in bad)
    assert all("CheckFailed" in r["error"] for r in bad)
    assert rc == 1 and f"{len(bad)} failed" in out.strip().splitlines()[-1]


def test_configs_cover_every_kernel_the_run_resolves(tmp_path, capsys, monkeypatch):
    """``configs`` (a dry run: kernels are no-ops) lists every kernel configuration the real run resolves,
    shape buckets included: a pack built from it serves the run without compiling (see docs/gpu.md)."""
    from tvm_mamba.runtime import cache

    cfg = tmp_path / "configs.json"
    assert gpu_check.main(["configs", "--device", "cpu", "--small", "--ops", OPS, "--out", str(cfg)]) == 0
    data = json.loads(cfg.read_text())
    listed = {(c["op"], c["direction"], json.dumps(c["static"], sort_keys=True), json.dumps(c["dtypes"],
              sort_keys=True)): c for c in data["configs"]}
    assert len(data["cases"]) == len({(op, d, json.dumps(st, sort_keys=True), json.dumps(dt, sort_keys=True))
                                      for op in OPS.split(",") for d, st, dt in _shipped(op)})
    resolved = []
    real = cache._resolve
    monkeypatch.setattr(cache, "_resolve", lambda key: resolved.append(key) or real(key))
    monkeypatch.setattr(cache._fast, "memo", {})
    rc = gpu_check.main(["run", "--out", str(tmp_path / "out"), "--device", "cpu", "--small", "--ops", OPS,
                         "--cases", str(cfg)])
    assert rc == 0 and resolved
    for key in resolved:
        entry = listed.get((key.op, key.direction, json.dumps(dict(key.static), sort_keys=True),
                            json.dumps(dict(key.dtype), sort_keys=True)))
        assert entry is not None, f"configs misses {key}"
        bucket = dict(key.shape_bucket)
        assert bucket.get("batch", None) in entry["batches"] + ([None] if not entry["batches"] else [])
        assert bucket.get("seqlen", None) in entry["seqlens"] + ([None] if not entry["seqlens"] else [])


def test_cases_cover_every_op_and_the_lms():
    """The full case list: every op's shipped configurations (small), the presets' kernels at the roofline's
    shape and a ragged one, and the 130M / 370M Mamba-1 / Mamba-2 LMs in fp32 and bf16."""
    pytest.importorskip("tvm")
    all_cases = cases.enumerate_cases("cuda")
    kinds = {(c.op, c.kind) for c in all_cases}
    for op in ("causal_conv1d", "selective_scan", "ssd", "mamba3", "rmsnorm_gated", "int8_dot", "linear"):
        assert (op, "small") in kinds and (op, "preset") in kinds and (op, "ragged") in kinds, op
    ragged = [c for c in all_cases if c.kind == "ragged"]
    assert all(c.sizes["batch"] % 2 == 1 and c.sizes["seqlen"] % 16 for c in ragged)
    lms = {(c.preset, c.dtypes["x"]) for c in all_cases if c.op == "lm"}
    assert lms == {(p, d) for p in ("mamba-130m", "mamba-370m", "mamba2-130m", "mamba2-370m")
                   for d in ("float32", "bfloat16")}
    directions = {(c.op, c.direction) for c in all_cases}
    for want in [("selective_scan", "fwd_complex"), ("selective_scan", "bwd_complex"), ("selective_scan", "update"),
                 ("causal_conv1d", "update"), ("causal_conv1d", "varlen_states"), ("mamba3", "mimo_step"),
                 ("int8_dot", "wgrad"), ("int8_dot", "dgrad"), ("ssd", "head_sum"), ("ssd", "chunk_scan_bwd")]:
        assert want in directions, want


def test_upstream_side_by_side_on_the_same_tensors(monkeypatch):
    """Where upstream imports, its function runs on clones of the case's first call and the row records its
    time and its distance from our output; here the float64 reference stands in for mamba_ssm's Triton
    layernorm_fn (no Triton, no CUDA on this machine: the real row says "not available")."""
    import torch

    from gpu_checks import runner, upstream

    case = next(c for c in cases.enumerate_cases("cpu", small=True, ops=["rmsnorm_gated"])
                if c.direction == "fwd" and c.dtypes["x"] == "float32" and c.static.get("has_z"))
    monkeypatch.setattr(upstream, "available", lambda device: None)
    monkeypatch.setattr(upstream, "UPSTREAM",
                        {"layernorm_fn": ("tvm_mamba.reference.rmsnorm_gated", "layernorm_gated_ref")})
    (row,) = runner.run_case(case, torch.device("cpu"), repeats=1, time_it=False, estimates={})
    up = row["upstream"]
    assert row["ok"] and up["function"].endswith("layernorm_gated_ref") and up["time_ms"] > 0
    assert 0 < up["max_diff_vs_tvm_mamba"] < 1e-4  # fp32 kernel vs the reference run on fp32 inputs
    monkeypatch.setattr(upstream, "available", lambda device: "no CUDA device (cpu)")
    (row,) = runner.run_case(case, torch.device("cpu"), repeats=1, time_it=False, estimates={})
    assert row["upstream"] == "not available (no CUDA device (cpu))"
