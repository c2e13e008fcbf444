"""Tuning logs are data: every malformed log variant below leaves the op working with the hand default, one
warning naming the bad file, and explain() saying "default"; special files are never opened for reading
(a FIFO does not hang). Plus the user tuning folder (read before the shipped logs), nearest device keys and
the tuner's progress lines. Every test writes its own log for the current device: they run on any CPU."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import threading
import time
import warnings

import pytest
import torch

import tvm_mamba
from tvm_mamba.tools import tune
from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref
from tvm_mamba.runtime import KernelKey, cpu_target, dispatch, target_key, tuning

STATIC = dict(dim=16, width=4, activation="silu", has_bias=True, has_seq_idx=False, has_init=False,
              return_final=False)
DT = {"x": "float32", "weight": "float32"}
DEV = tuning.device_key(target_key(cpu_target()))


def _key(batch=2, seqlen=64, **static):
    return KernelKey.make("causal_conv1d", "fwd", DT, dict(STATIC, **static), target_key(cpu_target()),
                          {"batch": batch, "seqlen": seqlen})


def _line(key=None, decisions=None, time_s=1e-3, default_time_s=2e-3, **edit) -> str:
    """A record line for the call below (x: (2, 16, 50) -> bucket batch=2, seqlen=64), ``edit`` overriding
    top-level fields and ``key_<field>`` fields of the key."""
    rec = {"key": (key or _key()).to_json(), "decisions": {"vector": 8} if decisions is None else decisions,
           "time_s": time_s, "default_time_s": default_time_s, "candidates": 3}
    for name, value in edit.items():
        if name.startswith("key_"):
            rec["key"][name[4:]] = value
        else:
            rec[name] = value
    return json.dumps(rec)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


# (name, what to write): a records.jsonl line, or a callable(folder) that breaks the folder's files
def _meta(text):
    return lambda folder: (folder / "meta.json").write_text(text)


def _replace(name, make):
    def apply(folder):
        path = folder / name
        path.unlink()
        make(path)
    return apply


VARIANTS = [
    ("knob_float", _line(decisions={"vector": 8.0})),  # 8.0 == 8 in Python; a float width does not build
    ("knob_bool", _line(decisions={"vector": True})),
    ("knob_string", _line(decisions={"vector": "8"})),
    ("knob_not_in_list", _line(decisions={"vector": 7})),
    ("knob_unknown", _line(decisions={"vectr": 8})),
    ("knob_null", _line(decisions={"vector": None})),
    ("knob_list", _line(decisions={"vector": [8]})),
    ("decisions_string", _line(decisions="vector=8")),
    ("bucket_string", _line(key_shape_bucket="batch=2,seqlen=64")),
    ("bucket_value_string", _line(key_shape_bucket={"batch": "2", "seqlen": "64"})),
    ("bucket_zero", _line(key_shape_bucket={"batch": 0, "seqlen": 64})),
    ("bucket_float", _line(key_shape_bucket={"batch": 2, "seqlen": 64.0})),
    ("static_nested_list", _line(key_static_dims=dict(STATIC, dim=[[16]]))),
    ("static_not_object", _line(key_static_dims=[["dim", 16]])),
    ("dtypes_not_strings", _line(key_dtypes={"x": 32, "weight": "float32"})),
    ("op_not_string", _line(key_op=["causal_conv1d"])),
    ("time_string", _line(time_s="fast")),
    ("time_negative", _line(time_s=-1.0)),  # "faster than the default" if it were believed
    ("time_nan", _line().replace('"time_s": 0.001', '"time_s": NaN')),
    ("time_bool", _line(time_s=True)),
    ("deep_json", _deep(20000)),  # RecursionError in json.loads
    ("deep_json_in_record", _line(decisions={"vector": 8}).replace('"candidates": 3', '"c": ' + _deep(5000))),
    ("huge_line", "[" * 200000),
    ("truncated", _line()[:50]),
    ("json_array", "[1, 2, 3]"),
    ("invalid_utf8", lambda folder: (folder / "causal_conv1d" / tuning.RECORDS).write_bytes(b"\xff\xfe{\x00\n")),
    ("records_directory", _replace("causal_conv1d/records.jsonl", lambda p: p.mkdir())),
    ("records_fifo", _replace("causal_conv1d/records.jsonl", lambda p: os.mkfifo(p))),
    ("records_device", _replace("causal_conv1d/records.jsonl", lambda p: p.symlink_to("/dev/zero"))),
    ("meta_list", _meta("[]")),
    ("meta_null", _meta("null")),
    ("meta_deep", _meta(_deep(20000))),
    ("meta_truncated", _meta('{"tvm": ')),
    ("meta_directory", _replace("meta.json", lambda p: p.mkdir())),
    ("meta_fifo", _replace("meta.json", lambda p: os.mkfifo(p))),
    ("meta_missing", lambda folder: (folder / "meta.json").unlink()),
]


def _make_logs(root: pathlib.Path, lines) -> pathlib.Path:
    folder = root / DEV
    (folder / "causal_conv1d").mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps(tuning.running_meta()))
    (folder / "causal_conv1d" / tuning.RECORDS).write_text("".join(ln + "\n" for ln in lines))
    return folder


def _call(root: pathlib.Path, timeout: float = 300.0) -> dict:
    """Run the op and explain() under ``root``'s logs (shipped logs left out) in a thread, so a blocking
    read fails the test instead of hanging it. The context and warnings filter are per-thread state of
    the call, so they are set inside the thread."""
    got: dict = {}
    x, w, b = torch.randn(2, 16, 50, generator=torch.Generator().manual_seed(0)), torch.ones(16, 4), torch.zeros(16)

    def work():
        try:
            with warnings.catch_warnings(record=True) as caught, tvm_mamba.tuning_logs(path=root, shipped=False):
                warnings.simplefilter("always")
                got["out"] = tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")
                got["explain"] = tvm_mamba.explain(tvm_mamba.causal_conv1d_fn, x, w, b, activation="silu")
            got["warnings"] = [str(c.message) for c in caught]
        except BaseException as err:  # noqa: BLE001 - reported by the test
            got["error"] = err

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the kernel call blocked on the tuning logs"
    if "error" in got:
        raise got["error"]
    got["ref"] = causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")
    return got


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private kernel cache (the rule-check memo lives there too)."""
    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(tmp_path / "kcache"))
    tuning._checked.clear()
    yield
    tuning._checked.clear()


def test_a_good_record_serves(tmp_path, cache):
    """The control for the variants: the well-formed record is used (so each variant breaks a used record)."""
    _make_logs(tmp_path / "logs", [_line()])
    got = _call(tmp_path / "logs")
    assert "tuned:" in got["explain"] and "vector=8" in got["explain"]
    assert not [w for w in got["warnings"] if "tuning" in w]
    torch.testing.assert_close(got["out"].double(), got["ref"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,bad", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_a_malformed_log_is_skipped_with_one_warning(tmp_path, cache, name, bad):
    if name.endswith("_fifo") and not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    if name == "records_device" and not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    folder = _make_logs(tmp_path / "logs", [bad] if isinstance(bad, str) else [_line()])
    if callable(bad):
        bad(folder)
    got = _call(tmp_path / "logs")
    torch.testing.assert_close(got["out"].double(), got["ref"], atol=1e-4, rtol=1e-4)
    assert "schedule: default" in got["explain"] and "vector=8" not in got["explain"], got["explain"]
    named = "meta.json" if name.startswith("meta") else str(folder / "causal_conv1d" / tuning.RECORDS)
    ours = [w for w in got["warnings"] if "tuning" in w]
    assert len(ours) == 1 and named in ours[0] and (str(folder) in ours[0]), ours


def test_a_rejected_record_gives_way_to_the_next_usable_one(tmp_path, cache):
    """Exact bucket with a knob the rule does not accept; the next-nearest bucket's record serves."""
    folder = _make_logs(tmp_path / "logs", [_line(decisions={"vector": 7}),
                                            _line(key=_key(seqlen=128), decisions={"vector": 32})])
    got = _call(tmp_path / "logs")
    assert "vector=32)" in got["explain"] and "seqlen=128" in got["explain"], got["explain"]
    (w,) = [w for w in got["warnings"] if "tuning" in w]
    assert "does not accept" in w and "vector=7 is not one of (8, 16, 32)" in w and str(folder / "causal_conv1d") in w


def test_rule_verdicts_are_remembered_on_disk(tmp_path, cache, monkeypatch):
    """A warm start does not apply the rule again to check a record (0.1-3 s per workload)."""
    assert tuning._rule_problem(_key().workload(), {"vector": 8}) is None
    assert "7 is not one of" in tuning._rule_problem(_key().workload(), {"vector": 7})
    tuning._checked.clear()
    monkeypatch.setattr(tuning, "_check_decisions", lambda *a: pytest.fail("re-checked"))
    assert tuning._rule_problem(_key().workload(), {"vector": 8}) is None
    assert "7 is not one of" in tuning._rule_problem(_key().workload(), {"vector": 7})


def test_tuner_files_that_are_not_files(tmp_path):
    """The tuner's own readers (resume, recheck, meta history) skip what does not validate; appending to a
    FIFO / directory where the log should be is refused with the path named."""
    folder = _make_logs(tmp_path / "logs", [_line(), _line(decisions={"vector": 8.0})[:30], _deep(20000),
                                            _line(key_shape_bucket="x")])
    assert tuning.recorded_keys(folder) == {_key()}
    (folder / "meta.json").write_text("[]")
    tuning.write_meta(folder, DEV, {"budget_s": 1})
    assert json.loads((folder / "meta.json").read_text())["runs"] == [{"budget_s": 1, "date": time.strftime("%Y-%m-%d")}]
    (folder / "causal_conv1d" / tuning.RECORDS).unlink()
    (folder / "causal_conv1d" / tuning.RECORDS).mkdir()
    with pytest.raises(OSError, match="not a regular file"):
        tuning.append_record(folder, _key(), {"vector": 8}, 1e-3, 2e-3, 3)
    assert tuning.recorded_keys(folder) == set()


# --- the user tuning folder ------------------------------------------------------------------------
def test_user_folder_default_and_order(tmp_path, monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    user = tmp_path / "xdg" / "tvm_mamba" / "tuning_logs"
    assert tuning.logs_dir() == user
    assert tuning.search_roots() == (user, tuning.package_logs_dir())
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning.logs_dir() == pathlib.Path(os.path.expanduser("~/.cache/tvm_mamba/tuning_logs"))
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "env"))
    assert tuning.search_roots() == (tmp_path / "env", tuning.package_logs_dir())
    with tvm_mamba.tuning_logs(path=tmp_path / "ctx", shipped=False):
        assert tuning.search_roots() == (tmp_path / "ctx",)
    monkeypatch.setenv(tuning.ENV, str(tuning.package_logs_dir()))  # a maintainer re-tuning the checkout
    assert tuning.search_roots() == (tuning.package_logs_dir(),)


def test_tune_writes_to_the_user_folder_not_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tune, "workloads", lambda *a, **k: [])
    folder = tune.run(["causal_conv1d"])
    assert folder == tmp_path / "xdg" / "tvm_mamba" / "tuning_logs" / DEV and (folder / "meta.json").is_file()


def test_user_records_serve_before_shipped_ones(tmp_path, monkeypatch, cache):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    _make_logs(shipped, [_line(decisions={"vector": 32}), _line(key=_key(dim=32), decisions={"vector": 32})])
    _make_logs(user, [_line(decisions={"vector": 8})])
    monkeypatch.setattr(tuning, "package_logs_dir", lambda: shipped)
    monkeypatch.setenv(tuning.ENV, str(user))
    tuning.refresh()
    assert dict(dispatch.plan(_key()).decisions) == {"vector": 8}  # the user's own run wins
    assert dict(dispatch.plan(_key(dim=32)).decisions) == {"vector": 32}  # shipped, where the user has none
    summary = tuning.device_summary(target_key(cpu_target()))
    assert summary["user"] == (1, user / DEV) and summary["shipped"] == (2, shipped / DEV)
    assert summary["nearest"] is None


def test_info_names_the_nearest_device_when_none_apply(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    for dev in ("cpu-amd-znver5-avx512", "cpu-intel-skylake-avx2", "nvidia-h200-sm90"):
        (shipped / dev / "causal_conv1d").mkdir(parents=True)
        (shipped / dev / "meta.json").write_text(json.dumps(tuning.running_meta()))
        (shipped / dev / "causal_conv1d" / tuning.RECORDS).write_text(_line() + "\n")
    monkeypatch.setattr(tuning, "package_logs_dir", lambda: shipped)
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "user"))
    monkeypatch.setattr(tuning, "_cpu_vendor", lambda: "intel")
    monkeypatch.setattr(tuning, "_cpu_isa", lambda: "avx512")
    tuning.refresh()
    summary = tuning.device_summary("llvm-rocketlake")
    assert summary["device"] == "cpu-intel-rocketlake-avx512" and summary["shipped"][0] == 0
    assert summary["nearest"] == ("cpu-amd-znver5-avx512", "shipped", 1)


def _other_class(root: pathlib.Path, dev: str, target: str, decisions: dict) -> None:
    """``root``/``dev`` holding one record for the call below, keyed by another CPU class's ``target``."""
    (root / dev / "causal_conv1d").mkdir(parents=True)
    (root / dev / "meta.json").write_text(json.dumps(tuning.running_meta()))
    line = _line(key=dataclasses.replace(_key(), target=target), decisions=decisions)
    (root / dev / "causal_conv1d" / tuning.RECORDS).write_text(line + "\n")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_a_stand_in_class_of_the_same_isa_serves_a_device_with_no_records(tmp_path, monkeypatch, cache, isa):
    """This device has no log: the same-ISA class's record serves (looked up under its target key) and
    explain() names it; another ISA class's record does not; the device's own log, once it has one, wins."""
    shipped = tmp_path / "shipped"
    _other_class(shipped, f"cpu-zzz-model-{isa}", "llvm-model", {"vector": 8})
    other = "avx512" if isa == "avx2" else "avx2"
    _other_class(shipped, f"cpu-aaa-model-{other}", "llvm-othermodel", {"vector": 32})
    monkeypatch.setattr(tuning, "package_logs_dir", lambda: shipped)
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "user"))
    monkeypatch.setattr(tuning, "_cpu_isa", lambda: isa)
    tuning.refresh()
    plan = dispatch.plan(_key())
    assert dict(plan.decisions) == {"vector": 8}
    assert f"cpu-zzz-model-{isa}" in plan.source and "stand-in class" in plan.source
    assert tuning.device_summary(_key().target)["stand_in"] == f"cpu-zzz-model-{isa}"
    x, w, b = torch.randn(2, 16, 50), torch.randn(16, 4), torch.randn(16)
    text = tvm_mamba.explain(tvm_mamba.causal_conv1d_fn, x, w, b, activation="silu")
    assert "stand-in class" in text and f"cpu-zzz-model-{isa}" in text
    out = tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")
    torch.testing.assert_close(out.double(), causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu"),
                               atol=1e-5, rtol=1e-5)
    _other_class(tmp_path / "user", tuning.device_key(_key().target), _key().target, {"vector": 16})  # its own
    tuning.refresh()
    assert dict(dispatch.plan(_key()).decisions) == {"vector": 16}
    assert "stand-in" not in dispatch.plan(_key()).source


def test_no_stand_in_across_isa_classes(tmp_path, monkeypatch, cache):
    shipped = tmp_path / "shipped"
    _other_class(shipped, "cpu-intel-rocketlake-avx512", "llvm-rocketlake", {"vector": 8})
    monkeypatch.setattr(tuning, "package_logs_dir", lambda: shipped)
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "user"))
    monkeypatch.setattr(tuning, "_cpu_isa", lambda: "avx2")
    tuning.refresh()
    assert dispatch.plan(_key()).source == "default"
    summary = tuning.device_summary(_key().target)
    assert summary["stand_in"] is None and summary["nearest"][0] == "cpu-intel-rocketlake-avx512"


def test_nearest_device_order():
    """Same kind required; then the ISA (the knobs are vector widths), then the vendor, then the model."""
    have = ["cpu-intel-skylake-avx2", "cpu-amd-znver4-avx512", "cpu-intel-icelake-avx512", "nvidia-a100-sm80"]
    assert tuning.nearest_device("cpu-intel-rocketlake-avx512", have) == "cpu-intel-icelake-avx512"
    assert tuning.nearest_device("cpu-amd-znver5-avx512", have) == "cpu-amd-znver4-avx512"
    assert tuning.nearest_device("cpu-amd-znver3-avx2", have) == "cpu-intel-skylake-avx2"
    assert tuning.nearest_device("nvidia-h200-sm90", have) == "nvidia-a100-sm80"
    assert tuning.nearest_device("nvidia-h200-sm90", have[:3]) is None


# --- the tuner's progress ----------------------------------------------------------------------------
def test_progress_counts_what_fits_in_the_budget():
    out = io.StringIO()
    p = tune.Progress(10, budget_s=30.0, stream=out)
    p.step("first")
    assert "[1/10]" in out.getvalue()  # nothing measured yet: every workload
    p.t0 = time.perf_counter() - 10.0  # one workload took 10 s: 20 s left fit 2 more
    assert p.planned() == 3
    p.step("second")
    assert "[2/3 (of 10 to do)] second" in out.getvalue()


def test_workload_labels_are_readable():
    # flags that are off, the target and the dtype names' long forms are left out
    assert tune.workload_label(_key(batch=1, seqlen=512)) == "causal_conv1d.fwd f32 silu dim=16 bias width=4 | batch=1 seqlen=512"
