"""scripts/bench_linear.py (one quick row per weight dtype, GB/s in the note) and bench_lm.py --weights (one
set of rows per weight dtype, the quantized model built in the child; bad values refused)."""
from __future__ import annotations

import pytest

from tests.test_scripts import _load, scripts_path  # noqa: F401  (fixture: scripts/ on sys.path)


def test_bench_linear_quick_rows(scripts_path, monkeypatch):
    bl = _load("bench_linear", monkeypatch)
    rows = bl.run(quick=True)
    assert [r.case for r in rows] == ["fwd float32 weights", "fwd bfloat16 weights", "fwd int8 weights"]
    for r in rows:
        assert r.shape == "rows=1, 768->3072" and r.tvm_ms > 0 and r.ref_ms > 0 and "GB/s" in r.note


def test_bench_lm_weights(scripts_path, monkeypatch):
    lm = _load("bench_lm", monkeypatch)
    specs = []

    def fake_child(spec):
        specs.append(spec)
        return dict(seconds=0.5, software={})
    monkeypatch.setattr(lm, "run_child", fake_child)
    rows, _ = lm.run_all(lm.parse(["--quick", "--no-hf", "--no-llamacpp", "--models", "mamba1-tiny",
                                   "--prefill", "0", "--weights", "fp32,int8"]))
    assert [s["weights"] for s in specs] == ["fp32", "int8"]
    assert [r.shape for r in rows] == ["mamba1-tiny b=1", "mamba1-tiny b=1 int8"]
    with pytest.raises(SystemExit, match="--weights must be"):
        lm.run_all(lm.parse(["--quick", "--no-llamacpp", "--weights", "int4"]))


def test_bench_lm_builds_the_quantized_model(scripts_path, monkeypatch):
    from tvm_mamba.modules.quantize import QuantizedLinear

    lm = _load("bench_lm", monkeypatch)
    ours, ref = lm.build_models("mamba2-tiny", hf=False, weights="bf16")
    assert ref is None and isinstance(ours.lm_head, QuantizedLinear) and ours.lm_head.dtype == "bfloat16"
