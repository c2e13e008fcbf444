"""``build_and_load(key)``: the one entry from a kernel key to a callable compiled kernel.

memo (in process) -> disk cache (verify, then load) -> file lock -> re-check -> build -> atomic write (temp
file + rename, then a stamp: the sha256 of the file's bytes, the key and the plan) -> load.

Every library is mapped through verified.load: a cached file is loaded only when its bytes match its stamp
and the stamp names this key and plan, so a truncated, overwritten or swapped file is never mapped: it is
removed with a warning and rebuilt (a pack's file is refused instead: a pack is not rebuilt in place). The
cache folders must be the user's own (cache_dir: ``UntrustedPath`` otherwise). A ``cache --clear`` in
another process while a kernel builds removes the folder under the build: the compiled library is kept in
memory and written again into a recreated folder (CLEAR_RETRIES times).

The cache lives in ``$TVM_MAMBA_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tvm_mamba`` or ``~/.cache/tvm_mamba``),
under a folder named by the package, TVM and tvm-ffi versions and a digest of the package's compute/schedule
sources (so an edited kernel never loads a stale binary), then by target key. Threads and processes racing on
a new key build it once: a per-key thread lock inside the process, a ``filelock`` across processes (with a
timeout: a process stuck holding it makes the others build privately, with a warning). Building itself
(scheduling + codegen) is serialized within a process.
"""
from __future__ import annotations

import copy
import hashlib
import os
import pathlib
import tempfile
import threading
import time
import warnings
from typing import Any

import filelock
import tvm
import tvm_ffi

from . import cudasim, dispatch, kernel_sets, pack, progress, threads, verified, webgpu
from .cache_dir import (_source_digest, build_root, cache_base, cache_root, private_mkdir,  # noqa: F401
                        UntrustedPath)
from .key import KernelKey, Plan


class Kernel:
    """A loaded kernel: ``kernel(*tensors)``; ``.key``, ``.plan``, ``.path``, ``.build_seconds``; ``.on_host``: a
    CPU kernel (its own host function: it refuses bad index values itself, compute/strategy.py)."""

    def __init__(self, key: KernelKey, plan: Plan, module: Any, path: pathlib.Path | None,
                 build_seconds: float, load_seconds: float):
        self.key, self.plan, self.module, self.path = key, plan, module, path
        self.build_seconds, self.load_seconds = build_seconds, load_seconds
        self.fn = module[f"{key.op}_{key.direction}"]  # a WebGPU module's: its launcher, called with tensors
        self.simulated = cudasim.is_sim(key.target)
        self.webgpu = webgpu.is_webgpu(key.target)
        self.on_host = key.target.startswith("llvm")  # a CPU kernel: it can raise (compute/strategy.py checks_values)

    def __call__(self, *args):
        dispatch.note_key(self.key, self.plan)
        if self.simulated:
            return cudasim.call(self.module, self.fn, args, label=str(self.key))
        return self.fn(*args)

    def bind(self, *args):
        """A callable that runs this kernel on ``args`` again, for callers that replay one launch on the same
        tensors (modules/_decode.py's decode plans). The tensors are converted to TVM tensors once here (a
        DLPack view: same memory, no copy): converting ~10 torch tensors per call costs ~5-10 us, the kernel
        launch itself under 1 us, and a decode step replays ~170 launches. The caller keeps the tensors
        alive and never resizes them (a replay would write the old memory)."""
        if self.simulated or self.webgpu:
            return lambda: self(*args)
        fn, key, plan = self.fn, self.key, self.plan
        views = tuple(tvm_ffi.from_dlpack(a.detach()) if hasattr(a, "__dlpack__") else a for a in args)

        def run():
            dispatch.note_key(key, plan)
            return fn(*views)

        return run

    def __repr__(self) -> str:
        return f"Kernel({self.key}, {self.plan.source})"


def cache_path(key: KernelKey, plan: Plan, root: pathlib.Path | None = None) -> pathlib.Path:
    """The kernel's file under ``root`` (default cache_root(); build_root() is where this process writes); a
    simulated kernel built for the checker has its own (cudasim.variant)."""
    tag = hashlib.sha256((key.workload().digest() + plan.digest() + cudasim.variant(key.target)).encode())
    tag = tag.hexdigest()[:16]
    return (root or cache_root()) / key.target / f"{key.op}-{key.direction}-{tag}.so"


LOCK_TIMEOUT_S = 600.0  # longer than any one build here (the largest CUDA + nvcc builds take ~30 s)
CLEAR_RETRIES = 3  # a concurrent `cache --clear` removing the folder mid-build: write it again this often
_build_lock = threading.Lock()
_memo: dict[tuple[KernelKey, str], Kernel] = {}
_memo_lock = threading.Lock()
_key_locks: dict[tuple[KernelKey, str], threading.Lock] = {}
stats = {"builds": 0, "disk_loads": 0, "discarded": 0}


def compile_module(key: KernelKey, mod: tvm.IRModule):
    """tvm.compile for the key's target (CUDA inside ``with target:``, which nvcc mode reads the arch from); for
    a ``cudasim-`` key, TVM's host code and CUDA source for the CPU harness (cudasim.py). A CUDA cubin is
    compiled with nvcc.nvcc_command, build-check's flags (nvcc.install_cuda_compile_hook)."""
    target = dispatch.target_from_key(key.target)
    if cudasim.is_sim(key.target):
        return cudasim.build(mod, target, label=str(key), checks=bool(cudasim.variant(key.target)))
    if webgpu.is_webgpu(key.target):
        return webgpu.build(mod, target, label=str(key))
    if target.kind.name == "cuda":
        from .nvcc import install_cuda_compile_hook

        install_cuda_compile_hook()
    with target:
        return tvm.compile(mod, target=target)


def _map(path: pathlib.Path):
    """The mapper verified.load calls for a cache file (never call it on an unverified file)."""
    if path.parent.name.startswith(cudasim.PREFIX):
        return cudasim.load(str(path))
    if webgpu.is_webgpu(path.parent.name):
        return webgpu.load(str(path))
    return load_library(path)


def load_library(path: pathlib.Path, pack_folder: pathlib.Path | None = None):
    """tvm.runtime.load_module, a CPU library's parallel loops then put on torch's OpenMP team (threads.py:
    the launcher a kernel pack ships, else one built into the cache, never with only the TVM runtime).
    A mapper for verified.load: the file has been verified before this is called."""
    module = tvm.runtime.load_module(str(path))
    threads.route(path, None if pack.runtime_only() else build_root(),
                  pack_folder / PACK_THREADS if pack_folder is not None else None)
    return module


PACK_THREADS = "threads"  # a kernel pack's subfolder holding the OpenMP launcher (aot.build_pack)


def _facts(key: KernelKey, plan: Plan) -> dict:
    """What a kernel file's stamp says it was built for, beside its sha256 (verified.py)."""
    return {"key": key.workload().digest(), "plan": hashlib.sha256(plan.digest().encode()).hexdigest()[:16]}


def _try_load(path: pathlib.Path, key: KernelKey, plan: Plan, may_discard: bool):
    """The module at ``path`` if it verifies and loads (verified.load: a truncated, overwritten or swapped
    file is never mapped); else None, removing the file with a warning only when ``may_discard``: under the
    build lock, so a reader never removes a file a writer is finishing."""
    if not path.exists():
        return None
    try:
        return verified.load(path, _map, facts=_facts(key, plan))
    except verified.BadLibrary as err:
        if err.path != path:  # not this file (the pack launcher its mapper loads): not ours to discard
            raise
        if may_discard and path.exists():
            warnings.warn(f"tvm_mamba: discarding cached kernel {path} ({err.why}); rebuilding", RuntimeWarning,
                          stacklevel=4)
            stats["discarded"] += 1
            verified.discard(path)
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
    path, source, sha256 = found
    memo_key = (key.workload(), str(path))
    kern = _memo.get(memo_key)
    if kern is None:
        if key.target.startswith("cuda-"):
            pack.load_cuda_runtime()
        t0 = time.perf_counter()
        try:  # not the user's cache: packs are named by the user, like PYTHONPATH, so not owner-checked
            module = verified.load(path, lambda p: load_library(p, pk.folder), sha256=sha256, private=False)
        except verified.BadLibrary as err:
            if err.path != path:  # the pack's launcher: threads.py names it
                raise
            raise verified.BadLibrary(path, f"{err.why}; refusing the kernel pack {pk.folder} (a pack is not "
                                            f"rebuilt in place: copy it again, or rebuild it with `python -m "
                                            f"tvm_mamba aot`)") from err
        kern = Kernel(key, Plan(key, (), f"pack: {path.name} ({source})"), module, path, 0.0,
                      time.perf_counter() - t0)
        _memo[memo_key] = kern
    return kern


FAST_TTL_S = 1.0  # as tuning's stamp TTL: a record written by another process is served within ~1 s
# the environment variables that change which kernel a key is served by (a pack, the tuning logs, the cache)
KERNEL_ENV_VARS = ("TVM_MAMBA_KERNEL_PACK", "TVM_MAMBA_TUNING_LOGS", "TVM_MAMBA_CACHE_DIR", "XDG_CACHE_HOME", "HOME")
class _Fast(threading.local):
    memo = None  # per thread; a class default, not a missing attribute (see dispatch._Recording)


_fast = _Fast()


def build_and_load(key: KernelKey) -> Kernel:
    """Return the compiled kernel for ``key``. A decode step calls dozens of kernels; resolving each call
    (pack, plan, tuning lookup, memo) costs tens of microseconds of Python, so a per-thread fast path serves a
    key it resolved less than FAST_TTL_S ago, while nothing that picks kernels has changed (the environment
    variables above, dispatch.generation(): tuning refreshes and ``tuning_logs`` blocks)."""
    now = time.monotonic()
    env = os.environ
    ctx = (dispatch.generation(), cudasim.variant(key.target), *(env.get(name) for name in KERNEL_ENV_VARS))
    memo = getattr(_fast, "memo", None)
    if memo is None:
        memo = _fast.memo = {}
    hit = memo.get(key)
    if hit is not None and hit[1] == ctx and now - hit[0] < FAST_TTL_S:
        return hit[2]
    kern = _resolve(key)
    if len(memo) > 65536:
        memo.clear()
    memo[key] = (now, ctx, kern)
    return kern


def _resolve(key: KernelKey) -> Kernel:
    """An AOT pack's kernel if one is active, else memo -> disk (verified) -> lock -> re-check -> build ->
    atomic write."""
    kernel_sets.note(key)
    kern = kernel_sets.stub_for(key) or _from_pack(key)
    if kern is not None:
        return kern
    plan = dispatch.plan(key)
    memo_key = (key.workload(), plan.digest(), cudasim.variant(key.target))
    kern = _memo.get(memo_key)
    if kern is not None:
        return _serving(kern, key, plan)
    with _memo_lock:
        lock = _key_locks.setdefault(memo_key, threading.Lock())
    with lock:
        kern = _memo.get(memo_key)
        if kern is not None:
            return _serving(kern, key, plan)
        path = cache_path(key, plan)
        t0 = time.perf_counter()
        module = _try_load(path, key, plan, may_discard=False)
        build_s = 0.0
        if module is not None:
            stats["disk_loads"] += 1
        else:  # build_root() is cache_root() unless the cache is shared read-only
            module, path, build_s = _locked_build(key, plan, cache_path(key, plan, build_root()))
        kern = Kernel(key, plan, module, path, build_s, time.perf_counter() - t0 - build_s)
        _memo[memo_key] = kern
        return kern


_views: dict[tuple, Kernel] = {}


def _serving(kern: Kernel, key: KernelKey, plan: Plan) -> Kernel:
    """``kern`` (built for the same workload and decisions) as serving this call's key and plan: the same
    binary, but explain() must name this call's bucket and the record that chose its decisions, not those of
    the call that built it."""
    if kern.key == key and kern.plan == plan:
        return kern
    view = _views.get((key, plan))
    if view is None or view.module is not kern.module:
        view = copy.copy(kern)
        view.key, view.plan = key, plan
        if len(_views) > 65536:
            _views.clear()
        _views[(key, plan)] = view
    return view


def _locked_build(key: KernelKey, plan: Plan, path: pathlib.Path):
    """Under the cross-process lock: load what another process built, or build and write atomically. If the
    lock is not had within LOCK_TIMEOUT_S (a process stuck holding it), build privately with a warning. If the
    folder or file vanishes meanwhile (another process ran ``cache --clear``), the folder is recreated and the
    library, compiled once and kept in memory, written again."""
    built, last = None, None
    for _ in range(CLEAR_RETRIES):
        try:
            private_mkdir(path.parent)
            with filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
                module = _try_load(path, key, plan, may_discard=True)  # another process built it
                if module is not None:
                    stats["disk_loads"] += 1
                    return module, path, 0.0
                built = built or _compile(key)
                verified.write(path, built[0], _facts(key, plan))
                return verified.load(path, _map, facts=_facts(key, plan)), path, built[1]
        except filelock.Timeout:
            warnings.warn(f"tvm_mamba: the build lock {path}.lock has been held for over {LOCK_TIMEOUT_S:.0f} s "
                          f"by another process; building {key.op}.{key.direction} privately", RuntimeWarning,
                          stacklevel=3)
            private = pathlib.Path(tempfile.mkdtemp(prefix="tvm_mamba_private_")) / path.parent.name / path.name
            private_mkdir(private.parent)
            built = built or _compile(key)
            verified.write(private, built[0], _facts(key, plan))
            return verified.load(private, _map, facts=_facts(key, plan)), private, built[1]
        except (OSError, verified.BadLibrary) as err:
            if isinstance(err, UntrustedPath) or path.exists():
                raise  # not a vanished folder or file: a real failure
            last = err
    raise last


def _compile(key: KernelKey) -> tuple[bytes, float]:
    """(the library's bytes, seconds): compiled and exported in a private temporary folder, so that a
    cleared cache folder costs a rewrite, not a rebuild."""
    tb = time.perf_counter()
    with _build_lock, progress.compiling(f"{key.op}.{key.direction}", key.target, str(build_root())):
        ex = compile_module(key, dispatch.schedule(key))  # the lock: TVMScript parsing is not thread-safe in 3.11
    with tempfile.TemporaryDirectory(prefix="tvm_mamba_build_") as tmp:
        out = os.path.join(tmp, "kernel.so")
        ex.export_library(out)
        data = pathlib.Path(out).read_bytes()
    stats["builds"] += 1
    return data, time.perf_counter() - tb


def clear_memo() -> None:
    """Forget loaded kernels in this process (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()
        _views.clear()
    dispatch.invalidate()  # every thread's fast path too
