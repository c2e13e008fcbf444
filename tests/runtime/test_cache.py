"""build_and_load: memo, disk cache, races between threads and processes, corrupt files, keys, targets."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from tvm_mamba.runtime import KernelKey, build_and_load, cache, cpu_target, cuda_target, target_key
from tvm_mamba.runtime.key import pow2_bucket, shape_bucket
from tvm_mamba.runtime.target import host_cpu


def _key(dim=20, seqlen=64):
    return KernelKey.make("causal_conv1d", "fwd", {"x": "float32", "weight": "float32"},
                          dict(dim=dim, width=4, activation="none", has_bias=False, has_seq_idx=False,
                               has_init=False, return_final=False),
                          target_key(cpu_target()), shape_bucket(seqlen=seqlen))


def _run(kern, dim=20, seqlen=50):
    x, w = torch.randn(2, dim, seqlen), torch.randn(dim, 4)
    out = torch.empty_like(x)
    kern(x, w, torch.zeros(1), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out, torch.zeros(1, 1, 1))
    ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (3, 0)), w[:, None, :], groups=dim)
    assert torch.allclose(out, ref, atol=1e-5)


def test_key_is_frozen_hashable_and_round_trips():
    k = _key()
    assert hash(k) == hash(_key()) and k == _key()
    with pytest.raises(Exception):
        k.op = "other"  # frozen
    assert KernelKey.from_json(k.to_json()) == k
    assert k.workload() == _key(seqlen=10).workload()  # buckets do not change the binary
    assert pow2_bucket(1000) == 1024 and pow2_bucket(1) == 1 and pow2_bucket(1024) == 1024


def test_targets():
    t = cpu_target()
    assert t.kind.name == "llvm" and t.attrs["mcpu"] == host_cpu() != "native"
    assert int(t.attrs["num-cores"]) >= 1
    assert target_key(cuda_target("sm_80")) == "cuda-sm_80"
    with pytest.raises(ValueError, match="arch"):
        cuda_target("90")


def test_memo_then_disk_then_build(fresh_cache):
    k = _key()
    kern = build_and_load(k)
    assert kern.path.exists() and kern.path.is_relative_to(fresh_cache)
    assert build_and_load(k) is kern  # memo
    cache.clear_memo()
    before = dict(cache.stats)
    again = build_and_load(k)
    assert again is not kern and cache.stats["disk_loads"] == before["disk_loads"] + 1
    assert cache.stats["builds"] == before["builds"]
    _run(again)


def test_threads_racing_on_a_new_key_build_once(fresh_cache):
    k = _key(dim=28)
    before = cache.stats["builds"]
    results, errors = [], []

    def worker():
        try:
            kern = build_and_load(k)
            _run(kern, dim=28)
            results.append(kern)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.stats["builds"] == before + 1
    assert all(r is results[0] for r in results)


_PROC = """
import sys, torch
from tvm_mamba.runtime import KernelKey, build_and_load, cache
k = KernelKey.from_json({key!r})
kern = build_and_load(k)
x, w = torch.randn(2, 36, 40), torch.randn(36, 4); out = torch.empty_like(x)
kern(x, w, torch.zeros(1), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out, torch.zeros(1, 1, 1))
ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (3, 0)), w[:, None, :], groups=36)
assert torch.allclose(out, ref, atol=1e-5)
print("built", cache.stats["builds"])
"""


def test_processes_racing_on_a_new_key_build_once(fresh_cache, monkeypatch):
    k = _key(dim=36)
    code = _PROC.format(key=k.to_json())
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-800:] for o in outs]
    built = sorted(int(o[0].split()[-1]) for o in outs)
    assert built == [0, 0, 1], built


def test_corrupt_cache_file_is_discarded_and_rebuilt(fresh_cache):
    """A later process finds a corrupt / truncated cache file: it warns, removes it, rebuilds, and
    computes correctly. (A fresh process, since dlopen keeps returning a library already loaded from
    the same path.)"""
    k = _key(dim=36)
    path = build_and_load(k).path
    code = _PROC.format(key=k.to_json())
    for data in (b"\x7fELF this is not a shared object", b""):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # a new inode: this process's mapped copy stays valid
        proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-1500:]
        assert "discarding unloadable cached kernel" in proc.stderr
        assert proc.stdout.split()[-1] == "1"  # rebuilt once
        assert path.stat().st_size > 1000


def test_cache_path_names_versions(fresh_cache):
    import tvm

    root = cache.cache_root()
    assert root.parent == fresh_cache
    assert f"tvm-{tvm.__version__}" in root.name and "tvm_mamba-" in root.name
    assert build_and_load(_key()).path.parent.name == target_key(cpu_target())
