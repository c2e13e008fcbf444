"""The cache's trust model (runtime/cache_dir.py): folders created 0700 and files 0600; a cache or tuning
folder, or a file loaded from one, owned by another user or writable by group/others is refused naming it
and the fix; TVM_MAMBA_SHARED_CACHE=readonly reads such a cache without writing to it."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from tvm_mamba.runtime import KernelKey, build_and_load, cache, cpu_target, target_key, tuning
from tvm_mamba.runtime.cache_dir import SHARED_ENV, UntrustedPath, shared_readonly
from tvm_mamba.runtime.key import shape_bucket

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _key(dim: int) -> KernelKey:
    return KernelKey.make("causal_conv1d", "fwd", {"x": "float32", "weight": "float32"},
                          dict(dim=dim, width=4, activation="none", has_bias=False, has_seq_idx=False,
                               has_init=False, return_final=False),
                          target_key(cpu_target()), shape_bucket(seqlen=64))


def _check(kern, dim: int) -> None:
    x, w = torch.randn(1, dim, 30), torch.randn(dim, 4)
    out = torch.empty_like(x)
    kern(x, w, torch.zeros(1), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out, torch.zeros(1, 1, 1))
    ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (3, 0)), w[:, None, :], groups=dim)
    assert torch.allclose(out, ref, atol=1e-5)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_cache_folders_are_created_0700_and_files_0600(tmp_path, monkeypatch):
    base = tmp_path / "xdg" / "cache"  # neither exists yet
    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(base))
    cache.clear_memo()
    kern = build_and_load(_key(20))
    _check(kern, 20)
    for folder in (tmp_path / "xdg", base, cache.cache_root(), kern.path.parent):
        assert _mode(folder) == 0o700, folder
    assert _mode(kern.path) == 0o600 and _mode(cache.verified.stamp_path(kern.path)) == 0o600
    cache.clear_memo()


def test_tuning_folders_are_created_0700(tmp_path):
    folder = tmp_path / "logs" / "some-device"
    tuning.write_meta(folder, "some-device", {"trials_per_workload": 1})
    tuning.append_record(folder, _key(20), {}, 1e-3, 2e-3, 1)
    for f in (tmp_path / "logs", folder, folder / "causal_conv1d"):
        assert _mode(f) == 0o700, f


def test_a_ci_checkout_umask_022_cache_is_trusted(tmp_path, monkeypatch):
    """What a fresh clone in CI has: folders 0755 and files 0644, owned by the user."""
    base = tmp_path / "cache"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(base))
    root = cache.cache_root()
    os.chmod(root, 0o755)
    assert cache.cache_root() == root


@pytest.fixture
def built(fresh_cache):
    """A cache holding one built kernel: (kernel, the folders and file a later load reads)."""
    kern = build_and_load(_key(28))
    cache.clear_memo()
    levels = {"base": fresh_cache, "version folder": cache.cache_root(), "target folder": kern.path.parent,
              "kernel file": kern.path}
    return kern, levels


def _refused(path, match: str) -> None:
    cache.clear_memo()
    with pytest.raises(UntrustedPath) as err:
        build_and_load(_key(28))
    msg = str(err.value)
    assert f" {path}: " in msg and match in msg and "TVM_MAMBA_CACHE_DIR" in msg and SHARED_ENV in msg, msg


@pytest.mark.parametrize("level", ["base", "version folder", "target folder", "kernel file"])
@pytest.mark.parametrize("bits", [stat.S_IWGRP, stat.S_IWOTH], ids=["group", "others"])
def test_group_or_other_writable_cache_is_refused(built, level, bits):
    _, levels = built
    path = levels[level]
    old = _mode(path)
    os.chmod(path, old | bits)
    try:
        _refused(path, f"writable by group or others (mode {old | bits:04o})")
        _refused(path, f"Fix: `chmod go-w {path}`")
    finally:
        os.chmod(path, old)
    _check(build_and_load(_key(28)), 28)  # trusted again


@root_only
@pytest.mark.parametrize("level", ["base", "version folder", "target folder", "kernel file"])
def test_cache_owned_by_another_user_is_refused(built, level):
    _, levels = built
    path = levels[level]
    os.chown(path, 65534, -1)
    try:
        _refused(path, "owned by uid 65534, not by you (uid 0)")
        _refused(path, f"Fix: `chown $USER {path}`")
    finally:
        os.chown(path, 0, -1)
    _check(build_and_load(_key(28)), 28)


def _tree(folder):
    return sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*"))


@root_only
def test_shared_cache_opt_in_reads_without_writing(built, monkeypatch):
    """TVM_MAMBA_SHARED_CACHE=readonly: a cache owned by another user serves the kernel it holds (verified),
    and a kernel it lacks, or one that does not verify, is built in a private folder; the shared cache is
    never written (no lock, stamp or rebuilt file)."""
    kern, levels = built
    for p in levels.values():
        os.chown(p, 65534, -1)
    monkeypatch.setenv(SHARED_ENV, "readonly")
    before = _tree(levels["base"])
    cache.clear_memo()
    loaded = build_and_load(_key(28))
    assert loaded.path == kern.path and loaded.build_seconds == 0.0
    _check(loaded, 28)
    other = build_and_load(_key(36))  # not in the shared cache
    assert not str(other.path).startswith(str(levels["base"])) and _mode(other.path.parent.parent.parent) == 0o700
    _check(other, 36)
    assert _tree(levels["base"]) == before
    cache.clear_memo()
    monkeypatch.delenv(SHARED_ENV)
    for p in levels.values():
        os.chown(p, 0, -1)


def test_shared_cache_value_is_checked(monkeypatch):
    monkeypatch.setenv(SHARED_ENV, "yes")
    with pytest.raises(ValueError, match=f"{SHARED_ENV}: expected 'readonly'"):
        shared_readonly()


def _logs(tmp_path):
    """A user tuning logs folder with one device folder and its meta.json (no records)."""
    from tvm_mamba.runtime.tuning import device_key

    dev = device_key(target_key(cpu_target()))
    folder = tmp_path / "logs" / dev
    tuning.write_meta(folder, dev, {"trials_per_workload": 1})
    return tmp_path / "logs", folder


@pytest.mark.parametrize("what", ["logs folder", "device folder", "meta.json"])
def test_writable_user_tuning_logs_are_refused(tmp_path, monkeypatch, what):
    root, dev = _logs(tmp_path)
    path = {"logs folder": root, "device folder": dev, "meta.json": dev / "meta.json"}[what]
    monkeypatch.setenv(tuning.ENV, str(root))
    os.chmod(path, _mode(path) | stat.S_IWOTH)
    tuning.refresh()
    with pytest.raises(UntrustedPath, match=f"refusing the tuning (logs directory|log) {path}: .*{tuning.ENV}"):
        tuning.lookup(_key(20))
    os.chmod(path, _mode(path) & ~stat.S_IWOTH)
    tuning.refresh()
    assert tuning.lookup(_key(20)) is None  # trusted again (and no record for it)


def test_shipped_tuning_logs_are_trusted_as_the_package_is(tmp_path, monkeypatch):
    """The package's own tuning_logs are not owner/mode checked: whoever can write them can edit the code."""
    root, dev = _logs(tmp_path)
    os.chmod(root, 0o777)
    monkeypatch.setattr(tuning, "package_logs_dir", lambda: root)
    monkeypatch.setenv(tuning.ENV, str(root))  # the user folder is the shipped one: read as shipped
    tuning.refresh()
    assert tuning.lookup(_key(20)) is None
    tuning.refresh()
