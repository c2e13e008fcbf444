"""AOT kernel packs: built here, served with only the TVM runtime (TVM_USE_RUNTIME_LIB=1), CUDA cubins
built with no GPU."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tvm_mamba.tools.aot import build_pack

STATIC = dict(dim=24, width=4, activation="silu", has_bias=True, has_seq_idx=False, has_init=False)
DT = {"x": "float32", "weight": "float32"}
CONFIGS = [("causal_conv1d", "fwd", dict(STATIC, return_final=False), DT),
           ("causal_conv1d", "bwd", dict(STATIC, has_dfinal=False), DT)]

RUN = """
import torch, tvm.base
import tvm_mamba
from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref
assert tvm.base._RUNTIME_ONLY
x = torch.randn(3, 24, 77, requires_grad=True); w = torch.randn(24, 4); b = torch.randn(24)
out = tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")
xd = x.detach().double().requires_grad_()
ref = causal_conv1d_ref(xd, w.double(), b.double(), activation="silu")
assert (out - ref).abs().max() < 1e-4
out.sum().backward(); ref.sum().backward()
assert (x.grad - xd.grad).abs().max() < 1e-4
assert "pack:" in tvm_mamba.explain(tvm_mamba.causal_conv1d_fn, x, w, b, activation="silu")
try:
    tvm_mamba.causal_conv1d_fn(torch.randn(1, 8, 10), torch.randn(8, 4))
    raise SystemExit("expected an error for a kernel missing from the pack")
except RuntimeError as err:
    assert "not in the kernel pack" in str(err) and "aot" in str(err)
print("runtime-only ok")
from tvm_mamba.runtime import threads
print("routed", threads._state.get("addr") is not None)
"""


def test_cpu_pack_runs_with_only_the_tvm_runtime(tmp_path):
    folder = build_pack([], str(tmp_path / "pack"), "cpu", seqlens=(64,), batches=(1, 4), configs=CONFIGS)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == 2 and len(manifest["entries"]) == 4 and len(list(folder.glob("*.so"))) == 2
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVM_MAMBA_KERNEL_PACK=str(folder),
               TVM_MAMBA_CACHE_DIR=str(tmp_path / "no-cache"))
    proc = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "runtime-only ok" in proc.stdout
    assert not (tmp_path / "no-cache").exists()  # nothing was built
    assert "routed True" in proc.stdout  # the pack's OpenMP launcher serves its kernels' parallel loops


def test_cpu_pack_reuses_the_kernel_cache(tmp_path, monkeypatch):
    """A CPU pack's kernels come from the kernel cache: a second pack (two worker processes) builds nothing,
    and its files are the cache's bytes."""
    from tvm_mamba.runtime import cache

    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_memo", {})
    first = build_pack([], str(tmp_path / "one"), "cpu", seqlens=(64,), batches=(1,), configs=CONFIGS)
    cached = sorted((tmp_path / "cache").rglob("causal_conv1d-*.so"))
    assert len(cached) == 2
    stamps = {p: p.stat().st_mtime_ns for p in cached}
    second = build_pack([], str(tmp_path / "two"), "cpu", seqlens=(64,), batches=(1,), configs=CONFIGS, jobs=2)
    after = sorted((tmp_path / "cache").rglob("causal_conv1d-*.so"))
    assert after == cached and {p: p.stat().st_mtime_ns for p in after} == stamps  # nothing rewritten
    blobs = sorted(p.read_bytes() for p in cached)
    for folder in (first, second):
        assert sorted(p.read_bytes() for p in folder.glob("causal_conv1d*.so")) == blobs
    assert json.loads((second / "manifest.json").read_text())["entries"]


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("gcc") is None, reason="needs nvcc and gcc")
def test_cuda_pack_contains_cubins(tmp_path):
    out = tmp_path / "sm90"
    proc = subprocess.run([sys.executable, "-m", "tvm_mamba", "aot", "--target", "cuda", "--arch", "sm_90",
                           "--ops", "causal_conv1d", "--preset", "mamba-130m", "--seqlens", "512", "--batches", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "cuda-sm_90" and manifest["entries"]
    so = out / manifest["entries"][0]["file"]
    blob = so.read_bytes()
    assert b"nv.info" in blob or b".nv." in blob  # a device ELF (cubin), not CUDA source
    assert b"__global__" not in blob


def test_candidate_round_emit_measure_runtime_only_commit(tmp_path):
    """The GPU tuning round, exercised on this CPU: emit candidates, time them in a runtime-only process,
    commit the best into tuning logs that dispatch then uses."""
    def cli(*args, env=None):
        proc = subprocess.run([sys.executable, "-m", "tvm_mamba", "tune", *args], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]

    cand, timings, logs = tmp_path / "cand", tmp_path / "timings.json", tmp_path / "logs"
    cli("--emit-candidates", "2", "--target", "cpu", "--ops", "causal_conv1d", "--preset", "mamba-130m",
        "--seqlens", "128", "--batches", "1", "--out", str(cand))
    cli("--measure", str(cand), "--timings", str(timings), env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"))
    data = json.loads(timings.read_text())
    assert len(data["results"]) == 4 and sum(r["default"] for r in data["results"]) == 2
    cli("--commit", str(timings), "--out", str(logs))
    records = [json.loads(l) for l in next(logs.glob("*/causal_conv1d/records.jsonl")).read_text().splitlines()]
    assert len(records) == 2 and all(r["candidates"] == 2 for r in records)


def _good_manifest() -> dict:
    from tvm_mamba.runtime import KernelKey

    key = KernelKey.make("causal_conv1d", "fwd", DT, CONFIGS[0][2], "llvm-x", {"batch": 1, "seqlen": 64})
    return {"format": 2, "target": "llvm-x", "entries": [{"key": key.to_json(), "file": "k.so",
                                                           "plan": "default", "sha256": "ab" * 32}]}


def _entry(**change):
    def mutate(m):
        for name, value in change.items():
            if value is None:
                del m["entries"][0][name]
            else:
                m["entries"][0][name] = value
    return mutate


MALFORMED = {  # name: (how the manifest is spoiled, what the error says)
    "missing": (None, "unreadable (No such file or directory)"),
    "not JSON": ('{"format": 2, ', "not JSON"),
    "a list": ("[1, 2]", "the top level is list, not an object"),
    "format 1": (lambda m: m.update(format=1), "format 1, expected 2 (a pack made before file digests"),
    "no format": (lambda m: m.pop("format"), "format None, expected 2"),
    "target not a string": (lambda m: m.update(target=3), "target is not a string"),
    "entries not a list": (lambda m: m.update(entries=3), "entries is not a list"),
    "entry not an object": (lambda m: m.update(entries=[1]), "entries[0] is int, not an object"),
    "entry without sha256": (_entry(sha256=None), "entries[0] has no 'sha256'"),
    "key not an object": (_entry(key=[1]), "entries[0] key is not an object"),
    "key with a bad field": (_entry(key={"op": 1}), "entries[0] key.op is not a string"),
    "file outside the pack": (_entry(file="../x.so"), "entries[0] file '../x.so' is not a file name inside"),
    "file not a string": (_entry(file=5), "entries[0] file 5 is not a file name"),
    "plan not a string": (_entry(plan=None), "entries[0] has no 'plan'"),
    "sha256 not hex": (_entry(sha256="xyz"), "entries[0] sha256 is not 64 lowercase hex digits"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_manifest_is_refused_naming_the_file(tmp_path, kind):
    """Each way a manifest can be malformed gives BadManifest (a ValueError) naming manifest.json and what is
    wrong, never a TypeError from deep inside the loader (the issue's ``'int' object is not subscriptable``)."""
    from tvm_mamba.runtime import pack

    spoil, says = MALFORMED[kind]
    if spoil is not None:
        data = _good_manifest()
        text = spoil if isinstance(spoil, str) else (spoil(data), json.dumps(data))[1]
        (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(pack.BadManifest) as err:
        pack.Pack(tmp_path)
    assert str(err.value).startswith(f"kernel pack manifest {tmp_path / 'manifest.json'}: ") and says in str(err.value)
    assert isinstance(err.value, ValueError)


def test_good_manifest_reads_and_the_public_call_names_a_bad_one(tmp_path):
    from tvm_mamba.runtime import pack

    (tmp_path / "manifest.json").write_text(json.dumps(_good_manifest()))
    assert pack.Pack(tmp_path).target == "llvm-x"  # the base of the malformed cases is itself valid
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text(json.dumps(dict(_good_manifest(), entries=[1])))
    code = ("import torch, tvm_mamba\n"
            "tvm_mamba.causal_conv1d_fn(torch.randn(1, 24, 8), torch.randn(24, 4))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TVM_MAMBA_KERNEL_PACK=str(bad)))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last == (f"tvm_mamba.runtime.pack.BadManifest: kernel pack manifest "
                                             f"{bad / 'manifest.json'}: entries[0] is int, not an object"), last
