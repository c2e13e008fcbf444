"""Every shared library tvm_mamba maps from its cache or a kernel pack goes through verified.load: a truncated
kernel or thread launcher in the cache is removed and rebuilt (not mapped: mapping it dies with SIGBUS, exit
135), a truncated pack file is refused naming it, and a build survives a concurrent ``cache --clear``."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tvm_mamba.runtime import KernelKey, build_and_load, cache, cpu_target, pack, target_key, threads, verified
from tvm_mamba.runtime.key import shape_bucket


def _key(dim: int) -> KernelKey:
    return KernelKey.make("causal_conv1d", "fwd", {"x": "float32", "weight": "float32"},
                          dict(dim=dim, width=4, activation="none", has_bias=False, has_seq_idx=False,
                               has_init=False, return_final=False),
                          target_key(cpu_target()), shape_bucket(seqlen=64))


# A fresh process: dlopen returns a library already loaded from the same path, so only a new process maps
# what is on disk now. torch first, so the kernel's parallel loops are routed to the launcher (threads.py).
_CHILD = """
import os, sys, torch
from tvm_mamba.runtime import KernelKey, build_and_load, cache, threads
dim = {dim}
for folder in sys.argv[1:]:  # one cache per damaged copy: each library is a new path to this process
    os.environ["TVM_MAMBA_CACHE_DIR"] = folder
    cache.clear_memo()
    threads._state.clear()  # decide the launcher again, from this cache
    kern = build_and_load(KernelKey.from_json({key!r}))
    x, w = torch.randn(2, dim, 40), torch.randn(dim, 4); out = torch.empty_like(x)
    kern(x, w, torch.zeros(1), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out, torch.zeros(1, 1, 1))
    ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (3, 0)), w[:, None, :], groups=dim)
    assert torch.allclose(out, ref, atol=1e-5)
    print("routed", threads._state.get("addr") is not None, "built", cache.stats["builds"])
"""


def _child(dim: int, *folders, env: dict | None = None, wait: bool = True):
    code = _CHILD.format(dim=dim, key=_key(dim).to_json())
    args = [sys.executable, "-W", "always", "-c", code, *map(str, folders)]
    if not wait:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def _replace(path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a new file (this process's mapping of the old one stays valid)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    tmp.replace(path)


def _lengths(n: int):
    return {"empty": 0, "10%": n // 10, "50%": n // 2, "all but the last byte": n - 1}


def test_truncated_kernel_and_launcher_are_rebuilt_in_a_fresh_process(fresh_cache, tmp_path):
    """Both kinds of cache library truncated at once, at four lengths (a copy of the cache each): a fresh
    process warns, removes and rebuilds each, routes its kernels to the rebuilt launcher and computes
    correctly (exit 0, not SIGBUS's 135)."""
    kern = build_and_load(_key(36))
    lib = threads.build_launcher(cache.build_root(), private=True)  # (this process decided its own earlier)
    good_kernel, good_lib = kern.path.read_bytes(), lib.read_bytes()
    copies = {}
    for name, n in _lengths(len(good_lib)).items():
        copy = copies[name] = tmp_path / name.replace(" ", "_")
        shutil.copytree(fresh_cache, copy)
        root = copy / cache.cache_root().name
        _replace(root / kern.path.relative_to(cache.cache_root()), good_kernel[:_lengths(len(good_kernel))[name]])
        _replace(root / lib.name, good_lib[:n])
    proc = _child(36, *copies.values())
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1500:])
    assert proc.stderr.count("discarding cached kernel") == 4, proc.stderr[-1500:]
    assert proc.stderr.count("discarding the cached thread launcher") == 4, proc.stderr[-1500:]
    assert [line.split() for line in proc.stdout.splitlines()] == [
        ["routed", "True", "built", str(i)] for i in (1, 2, 3, 4)], proc.stdout
    for copy in copies.values():  # rebuilt, with stamps
        root = copy / cache.cache_root().name
        verified.verify(root / lib.name, facts=threads.FACTS)
        verified.verify(root / kern.path.relative_to(cache.cache_root()), facts=cache._facts(kern.key, kern.plan))


@pytest.fixture(scope="module")
def small_pack(tmp_path_factory):
    from tvm_mamba.tools.aot import build_pack

    static = dict(dim=24, width=4, activation="silu", has_bias=True, has_seq_idx=False, has_init=False,
                  return_final=False)
    folder = build_pack([], str(tmp_path_factory.mktemp("pack") / "pack"), "cpu", seqlens=(64,), batches=(1,),
                        configs=[("causal_conv1d", "fwd", static, {"x": "float32", "weight": "float32"})])
    return folder


_PACK_CHILD = """
import os, sys, torch, tvm_mamba
from tvm_mamba.runtime import verified
for folder in sys.argv[1:]:
    os.environ["TVM_MAMBA_KERNEL_PACK"] = folder
    try:
        tvm_mamba.causal_conv1d_fn(torch.randn(1, 24, 64), torch.randn(24, 4), torch.randn(24), activation="silu")
        print("loaded", folder)
    except verified.BadLibrary as err:
        print("refused", err.path)
"""


def test_damaged_pack_files_are_refused_naming_them(small_pack, tmp_path, monkeypatch):
    """A pack's kernel or launcher that does not match its digest is refused, never mapped: an error names
    the file and says the pack is not rebuilt in place. Four lengths each in this process (safe: a file
    that does not verify is never mapped), then in a fresh process a copy of the pack with a truncated
    kernel and one with a truncated launcher (the kernel then maps, the launcher must not)."""
    manifest = pack.read_manifest(small_pack)
    kernel = small_pack / manifest["entries"][0]["file"]
    lib = threads.launcher_file(small_pack / cache.PACK_THREADS)
    good = {kernel: kernel.read_bytes(), lib: lib.read_bytes()}
    monkeypatch.setenv(pack.ENV, str(small_pack))
    try:
        for path, data in good.items():
            for name, n in _lengths(len(data)).items():
                _replace(path, data[:n])
                with pytest.raises(verified.BadLibrary, match="refusing the kernel pack") as err:
                    if path == kernel:
                        cache.clear_memo()
                        build_and_load(KernelKey.from_json(manifest["entries"][0]["key"]))
                    else:
                        threads._open(lib.parent, None)
                assert err.value.path == path, name
            copy = tmp_path / path.name
            shutil.copytree(small_pack, copy)
            _replace(path, data)
    finally:
        for path, data in good.items():
            _replace(path, data)
        cache.clear_memo()
    env = dict(os.environ, TVM_MAMBA_CACHE_DIR=str(tmp_path / "cache"))
    copies = [tmp_path / kernel.name, tmp_path / lib.name, small_pack]
    proc = subprocess.run([sys.executable, "-c", _PACK_CHILD, *map(str, copies)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert proc.stdout.splitlines() == [f"refused {copies[0] / kernel.name}",
                                        f"refused {copies[1] / cache.PACK_THREADS / lib.name}",
                                        f"loaded {small_pack}"], proc.stdout


def _clear() -> None:
    """The real ``python -m tvm_mamba cache --clear``, run in this process."""
    from tvm_mamba.cli import cmd_cache

    assert cmd_cache(argparse.Namespace(clear=True, prune=False)) == 0


def test_build_survives_a_clear_between_mkdir_and_the_temp_file(fresh_cache, monkeypatch):
    """The reported race, made deterministic: the version folder is removed (by the cache command's own
    code) just before the build creates its temp file in it. The build recreates it and writes the
    library it already compiled (one build), which then loads from the cache."""
    import tempfile

    real, cleared = tempfile.mkstemp, []

    def mkstemp(*args, **kw):
        if not cleared and str(kw.get("dir", "")).startswith(str(fresh_cache)):
            _clear()
            cleared.append(kw["dir"])
        return real(*args, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    before = cache.stats["builds"]
    kern = build_and_load(_key(44))
    assert cleared and cache.stats["builds"] == before + 1
    verified.verify(kern.path, facts=cache._facts(kern.key, kern.plan))
    x, w = torch.randn(1, 44, 30), torch.randn(44, 4)
    out = torch.empty_like(x)
    kern(x, w, torch.zeros(1), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out, torch.zeros(1, 1, 1))
    assert torch.allclose(out, torch.nn.functional.conv1d(torch.nn.functional.pad(x, (3, 0)), w[:, None, :],
                                                          groups=44), atol=1e-5)


def test_build_in_another_process_survives_cache_clear(fresh_cache):
    """Two processes side by side: a child compiles a new kernel; as soon as its target folder appears
    (compiling takes ~1 s after that) this process runs the cache command's clear. The child's call
    succeeds and computes correctly."""
    folder = cache.cache_root() / target_key(cpu_target())
    child = _child(52, fresh_cache, wait=False)
    deadline = time.monotonic() + 120
    while not folder.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert folder.exists(), "the child never created its target folder"
    _clear()
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-1500:]
    assert "built 1" in out
    assert list(folder.glob("causal_conv1d-fwd-*.so")), "written after the clear (the clear came mid-build)"


def test_cache_clear_keeps_the_user_tuning_logs(fresh_cache, monkeypatch):
    """``cache --clear`` removes version folders only: the default user tuning logs folder lives in the
    same base folder and holds the user's own tuning runs."""
    monkeypatch.delenv("TVM_MAMBA_TUNING_LOGS", raising=False)
    logs = fresh_cache / "tuning_logs"
    logs.mkdir(parents=True)
    (logs / "keep").write_text("x")
    cache.cache_root()
    _clear()
    assert (logs / "keep").exists() and [p.name for p in fresh_cache.iterdir()] == ["tuning_logs"]
