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


def _damaged_versions(good: bytes, other: bytes):
    """(name, bytes) of damaged cache files: truncated at several offsets, overwritten mid-file, another valid
    kernel of the same size class copied over it, and not an ELF at all."""
    for frac in (0.0, 0.5, 0.999):
        yield f"truncated to {frac:.0%}", good[:int(len(good) * frac)]
    mid = len(good) // 2
    yield "overwritten mid-file", good[:mid] + b"\xcc" * 4096 + good[mid + 4096:]
    yield "another kernel copied over it", other
    yield "not a shared object", b"\x7fELF this is not a shared object"


def test_damaged_cache_file_is_never_mapped(fresh_cache):
    """A later process finds a damaged cache file: it warns, removes it, rebuilds, and computes correctly; no
    crash (mapping a truncated .so faults with SIGBUS). A fresh process each time, since dlopen keeps returning
    a library already loaded from the same path."""
    k = _key(dim=36)
    path = build_and_load(k).path
    good = path.read_bytes()
    other = build_and_load(_key(dim=44)).path.read_bytes()  # silu vs none would be a silent wrong answer
    code = _PROC.format(key=k.to_json())
    for name, data in _damaged_versions(good, other):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # a new inode: this process's mapped copy stays valid
        proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-1500:])
        assert "discarding cached kernel" in proc.stderr, name
        assert proc.stdout.split()[-1] == "1", name  # rebuilt once
        assert path.read_bytes() != data, name


def test_unusable_cache_dir_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(blocker / "cache"))
    cache.clear_memo()
    with pytest.warns(RuntimeWarning, match="a_file/cache is not usable"):
        kern = build_and_load(_key(dim=52))
    _run(kern, dim=52)
    assert not str(kern.path).startswith(str(blocker))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once per process and directory
        cache.cache_root()
    cache.clear_memo()


def test_stuck_build_lock_builds_privately(fresh_cache, monkeypatch):
    import filelock

    k = _key(dim=60)
    path = cache.cache_path(k, cache.dispatch.plan(k))
    path.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.5)
    holder = subprocess.Popen([sys.executable, "-c", f"import filelock, time; l = filelock.FileLock({str(path) + '.lock'!r}); "
                               "l.acquire(); print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.warns(RuntimeWarning, match="building causal_conv1d.fwd privately"):
            kern = build_and_load(k)
        _run(kern, dim=60)
        assert kern.path != path and not path.exists()
    finally:
        holder.kill()
        holder.wait()
    assert isinstance(filelock.Timeout("x"), Exception)


def test_threads_building_distinct_new_kernels(fresh_cache):
    """8 threads, each building a different new kernel, 10 rounds (CPython 3.11's TVMScript parser is not
    thread-safe: builds are serialized inside the process)."""
    errors = []

    def worker(dim):
        try:
            _run(build_and_load(_key(dim=dim)), dim=dim)
        except Exception as err:  # noqa: BLE001
            errors.append(repr(err))

    for rnd in range(10):
        threads = [threading.Thread(target=worker, args=(100 + 8 * rnd + i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:3]


def test_cache_path_names_versions(fresh_cache):
    import tvm

    root = cache.cache_root()
    assert root.parent == fresh_cache
    assert f"tvm-{tvm.__version__}" in root.name and "tvm_mamba-" in root.name
    assert build_and_load(_key()).path.parent.name == target_key(cpu_target())


def test_fast_path_re_resolves_when_plan_hooks_or_tuning_blocks_change(monkeypatch):
    """The per-thread fast path serves a key again without plan(), but never across a change of the plan
    hooks or a tuning_logs block (dispatch.generation)."""
    from tvm_mamba.runtime import dispatch, tuning

    k = _key(dim=28)
    first = build_and_load(k)
    assert build_and_load(k) is first
    seen = []
    monkeypatch.setattr(dispatch, "_plan_hooks", [lambda key: seen.append(key)])
    build_and_load(k)
    assert seen == [k]  # new hooks: resolved again at once
    build_and_load(k)
    assert seen == [k]  # then served from the fast path
    with tuning.tuning_logs(enabled=False):
        build_and_load(k)
    assert seen == [k, k]


def test_bound_launch_replays_on_the_same_tensors_and_is_recorded():
    """Kernel.bind (decode plans' replays): the tensors are converted once, so a replay computes on their
    current contents (no copy was taken), writes the same output tensor, and explain()'s recorder sees it."""
    from tvm_mamba.runtime.dispatch import record_keys

    kern = build_and_load(_key())
    x, w = torch.randn(2, 20, 50), torch.randn(20, 4)
    out = torch.empty_like(x)
    args = (x, w, torch.zeros(1), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out,
            torch.zeros(1, 1, 1))
    run = kern.bind(*args)
    for _ in range(2):
        x.copy_(torch.randn_like(x))  # new contents in the same memory
        with record_keys() as used:
            run()
        ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (3, 0)), w[:, None, :], groups=20)
        assert torch.allclose(out, ref, atol=1e-5)
        assert [k for k, _ in used] == [kern.key]
