"""``build_and_load(key)``: the one entry from a kernel key to a callable compiled kernel.

memo (in process) -> disk cache (load; a corrupt or unloadable file is removed with a warning and rebuilt)
-> file lock -> re-check -> build -> atomic write (temp file + rename) -> load.

The cache lives in ``$TVM_MAMBA_CACHE_DIR`` (default ``~/.cache/tvm_mamba``), under a folder named by the
package, TVM and tvm-ffi versions and a digest of the package's compute/schedule sources (so an edited
kernel never loads a stale binary), then by target key. Threads and processes racing on a new key build
it once: a per-key thread lock inside the process, ``fcntl.flock`` across processes.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import pathlib
import tempfile
import threading
import time
import warnings
from typing import Any

import tvm
import tvm_ffi

from . import cudasim, dispatch, pack
from .key import KernelKey

_PKG_ROOT = pathlib.Path(__file__).resolve().parent.parent


class Kernel:
    """A loaded kernel: ``kernel(*tensors)``; ``.key``, ``.plan``, ``.path``, ``.build_seconds``."""

    def __init__(self, key: KernelKey, plan: "dispatch.Plan", module: Any, path: pathlib.Path | None,
                 build_seconds: float, load_seconds: float):
        self.key, self.plan, self.module, self.path = key, plan, module, path
        self.build_seconds, self.load_seconds = build_seconds, load_seconds
        self.fn = module[f"{key.op}_{key.direction}"]
        self.simulated = cudasim.is_sim(key.target)

    def __call__(self, *args):
        dispatch.note_key(self.key, self.plan)
        if self.simulated:
            return cudasim.call(self.module, self.fn, args, label=str(self.key))
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"Kernel({self.key}, {self.plan.source})"


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    h = hashlib.sha256()
    for sub in ("compute", "schedules", "runtime"):
        root = _PKG_ROOT / sub
        if not root.exists():  # editable layouts map schedules/ elsewhere
            import importlib

            root = pathlib.Path(importlib.import_module(f"tvm_mamba.{sub}").__path__[0])
        files = list(root.rglob("*.py")) + [f for f in (root / "cudasim_include").rglob("*") if f.is_file()]
        for f in sorted(files):  # cudasim_include: the CUDA execution header the simulated kernels build with
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def cache_root() -> pathlib.Path:
    base = os.environ.get("TVM_MAMBA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tvm_mamba")
    from .. import __version__

    versions = f"tvm_mamba-{__version__}_tvm-{tvm.__version__}_ffi-{tvm_ffi.__version__}_src-{_source_digest()}"
    return pathlib.Path(base) / versions


def cache_path(key: KernelKey, plan: "dispatch.Plan") -> pathlib.Path:
    tag = hashlib.sha256((key.workload().digest() + plan.digest()).encode()).hexdigest()[:16]
    return cache_root() / key.target / f"{key.op}-{key.direction}-{tag}.so"


_memo: dict[tuple[KernelKey, str], Kernel] = {}
_memo_lock = threading.Lock()
_key_locks: dict[tuple[KernelKey, str], threading.Lock] = {}
stats = {"builds": 0, "disk_loads": 0, "discarded": 0}


def compile_module(key: KernelKey, mod: tvm.IRModule):
    """tvm.compile for the key's target (CUDA inside ``with target:``, which nvcc mode reads the arch from); for
    a ``cudasim-`` key, TVM's host code and CUDA source for the CPU harness (cudasim.py)."""
    target = dispatch.target_from_key(key.target)
    if cudasim.is_sim(key.target):
        return cudasim.build(mod, target, label=str(key))
    with target:
        return tvm.compile(mod, target=target)


def _load(path: pathlib.Path):
    return cudasim.load(str(path)) if path.parent.name.startswith(cudasim.PREFIX) else \
        tvm.runtime.load_module(str(path))


def _try_load(path: pathlib.Path):
    try:
        return _load(path)
    except Exception as err:  # noqa: BLE001 - any load failure means a bad file
        warnings.warn(f"tvm_mamba: discarding unloadable cached kernel {path} ({type(err).__name__}: "
                      f"{str(err).strip().splitlines()[-1][:160] if str(err).strip() else ''}); rebuilding",
                      RuntimeWarning, stacklevel=3)
        stats["discarded"] += 1
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return None


def _from_pack(key: KernelKey) -> Kernel | None:
    """Serve ``key`` from the AOT pack named by $TVM_MAMBA_KERNEL_PACK, if any (see pack.py)."""
    pk = pack.active_pack()
    if pk is None:
        return None
    found = pk.find(key)
    if found is None:
        if pack.runtime_only():
            raise RuntimeError(f"kernel {key} is not in the kernel pack {pk.folder} and this TVM has no compiler "
                               f"(TVM_USE_RUNTIME_LIB=1); add it with `python -m tvm_mamba aot` on a build host")
        return None
    path, source = found
    memo_key = (key.workload(), str(path))
    kern = _memo.get(memo_key)
    if kern is None:
        if key.target.startswith("cuda-"):
            pack.load_cuda_runtime()
        t0 = time.perf_counter()
        module = tvm.runtime.load_module(str(path))
        kern = Kernel(key, dispatch.Plan(key, (), f"pack: {path.name} ({source})"), module, path, 0.0,
                      time.perf_counter() - t0)
        _memo[memo_key] = kern
    return kern


def build_and_load(key: KernelKey) -> Kernel:
    """Return the compiled kernel for ``key``: an AOT pack if one is active, else memo -> disk -> lock ->
    re-check -> build -> atomic write."""
    kern = _from_pack(key)
    if kern is not None:
        return kern
    plan = dispatch.plan(key)
    memo_key = (key.workload(), plan.digest())
    kern = _memo.get(memo_key)
    if kern is not None:
        return kern
    with _memo_lock:
        lock = _key_locks.setdefault(memo_key, threading.Lock())
    with lock:
        kern = _memo.get(memo_key)
        if kern is not None:
            return kern
        path = cache_path(key, plan)
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        module = _try_load(path) if path.exists() else None
        build_s = 0.0
        if module is not None:
            stats["disk_loads"] += 1
        else:
            with open(str(path) + ".lock", "a+") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
                try:
                    module = _try_load(path) if path.exists() else None  # another process built it
                    if module is None:
                        tb = time.perf_counter()
                        ex = compile_module(key, dispatch.schedule(key))
                        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".tmp-", dir=path.parent)
                        os.close(fd)
                        try:
                            ex.export_library(tmp)
                            os.replace(tmp, path)
                        finally:
                            if os.path.exists(tmp):
                                os.unlink(tmp)
                        build_s = time.perf_counter() - tb
                        stats["builds"] += 1
                        module = _load(path)
                    else:
                        stats["disk_loads"] += 1
                finally:
                    fcntl.flock(lock_file, fcntl.LOCK_UN)
        load_s = time.perf_counter() - t0 - build_s
        kern = Kernel(key, plan, module, path, build_s, load_s)
        _memo[memo_key] = kern
        return kern


def clear_memo() -> None:
    """Forget loaded kernels in this process (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()
