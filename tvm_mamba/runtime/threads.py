"""One CPU thread pool for torch and tvm_mamba: TVM kernels run their parallel loops on torch's OpenMP team.

Why: a process that mixes torch ops and TVM kernels otherwise has two pools on the same cores. torch's
intra-op pool is OpenMP (libgomp): after each parallel region its workers spin for a while (unless
``OMP_WAIT_POLICY=PASSIVE`` was set before torch loaded). TVM's own pool has pinned workers of its own. A
decode step alternates small torch GEMVs and small TVM kernels, so each pool's workers keep spinning on the
cores the other pool's workers need, and a step runs several times slower than either pool alone.

How: every TVM-compiled CPU library calls its parallel loops through one entry point, a function pointer
``__TVMBackendParallelLaunch`` in the library's data that TVM's loader points at TVM's pool. ``route(path)``
re-points it, once the library is loaded, at a small launcher (C, built once per cache folder with the C
compiler TVM links kernels with) that runs the same parallel lambda on the calling thread's OpenMP team.
There is one libgomp per process (shared by soname), so kernels and torch ops share the team, its thread
count (``torch.set_num_threads``) and its wait policy; inside an OpenMP region (e.g. a torch parallel
section calling back) the lambda runs serially.

When: only when torch is already loaded (no torch, no second pool to cooperate with), for CPU libraries, and
unless ``TVM_MAMBA_CPU_POOL=tvm`` keeps TVM's pool. A launcher that cannot be built or loaded (no C compiler,
no libgomp) leaves TVM's pool in place with one warning.

The launcher is a shared library in the cache like a kernel, and is mapped the same way: through
verified.load, against the stamp written with it. A cached one that does not verify (truncated: mapping it
would SIGBUS) is removed with a warning and rebuilt, under a file lock; a pack's is refused (an error naming
it), as a pack's kernels are. An untrusted cache folder raises (cache_dir.UntrustedPath).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import sys
import tempfile
import threading
import warnings

from . import cache_dir, verified

ENV = "TVM_MAMBA_CPU_POOL"  # "openmp" (default) or "tvm"
SYMBOL = "__TVMBackendParallelLaunch"

# TVMParallelGroupEnv is {void* sync_handle; int32_t num_task;}; the lambda is
# int (*)(int task_id, TVMParallelGroupEnv* penv, void* cdata), as in tvm/runtime/c_backend_api.h.
# libgomp's functions are handed in as pointers (set_omp), so the launcher links nothing: it uses the
# libgomp the process already has.
LAUNCHER_C = r"""
#include <stdint.h>
#ifdef __cplusplus
extern "C" {  /* TVM's compiler may be a C++ one */
#endif
typedef struct { void* sync_handle; int32_t num_task; } Env;
typedef int (*Lambda)(int, Env*, void*);
typedef void (*GompParallel)(void (*)(void*), void*, unsigned, unsigned);
typedef int (*IntFn)(void);
static GompParallel gomp_parallel;
static IntFn thread_num, num_threads, in_parallel, max_threads;

void tvm_mamba_set_omp(void* parallel, void* tnum, void* nthreads, void* inpar, void* maxthr) {
  gomp_parallel = (GompParallel)parallel; thread_num = (IntFn)tnum; num_threads = (IntFn)nthreads;
  in_parallel = (IntFn)inpar; max_threads = (IntFn)maxthr;
}

typedef struct { Lambda f; void* cdata; int err; } Call;

static void body(void* p) {
  Call* c = (Call*)p;
  Env env = {0, num_threads()};
  int r = c->f(thread_num(), &env, c->cdata);
  if (r != 0) __atomic_store_n(&c->err, r, __ATOMIC_RELAXED);
}

int tvm_mamba_parallel_launch(Lambda f, void* cdata, int num_task) {
  if (num_task == 1 || in_parallel() || max_threads() <= 1) {
    Env env = {0, 1};
    return f(0, &env, cdata);
  }
  Call c = {f, cdata, 0};
  gomp_parallel(body, &c, num_task > 0 ? (unsigned)num_task : 0u, 0u);
  return c.err;
}
#ifdef __cplusplus
}
#endif
"""

_lock = threading.Lock()
_state: dict = {}  # "lib": the launcher's ctypes.CDLL, "addr": int | None once decided
FACTS = {"launcher": hashlib.sha256(LAUNCHER_C.encode()).hexdigest()[:12]}  # what its stamp says it is
LOCK_TIMEOUT_S = 120.0  # building the launcher takes ~0.3 s; past this a stuck process is assumed


def enabled() -> bool:
    """Whether CPU kernels loaded from now on are routed to OpenMP: torch loaded and not opted out."""
    choice = os.environ.get(ENV, "openmp").strip().lower()
    if choice not in ("openmp", "tvm"):
        raise ValueError(f"{ENV}: expected 'openmp' or 'tvm', got {choice!r}")
    return choice == "openmp" and "torch" in sys.modules


def launcher_file(folder: pathlib.Path) -> pathlib.Path:
    return folder / f"omp_launch-{hashlib.sha256(LAUNCHER_C.encode()).hexdigest()[:12]}.so"


def _compile_launcher() -> bytes:
    """The launcher library's bytes, compiled in a private temporary folder with TVM's C compiler."""
    from tvm.support import cc

    with tempfile.TemporaryDirectory(prefix="tvm_mamba_launcher_") as tmp:
        src, out = os.path.join(tmp, "omp_launch.c"), os.path.join(tmp, "omp_launch.so")
        pathlib.Path(src).write_text(LAUNCHER_C)
        cc.create_shared(out, [src], options=["-O2", "-fPIC"])
        return pathlib.Path(out).read_bytes()


def build_launcher(folder: pathlib.Path, private: bool = False) -> pathlib.Path:
    """The launcher library in ``folder``, verified: kept if it matches its stamp, else (missing, or removed
    with a warning when it does not verify) compiled and written there with its stamp, under a file lock.
    ``private`` (the cache): ``folder`` is created 0700 and must be trusted (cache_dir); else it is an AOT
    pack's folder, made for others to read. Survives a concurrent ``cache --clear`` (the folder is made
    again)."""
    import filelock

    path, last = launcher_file(folder), None
    for _ in range(3):
        try:
            cache_dir.private_mkdir(folder) if private else folder.mkdir(parents=True, exist_ok=True)
            with filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
                try:
                    verified.verify(path, facts=FACTS, private=private)
                    return path
                except verified.BadLibrary as err:
                    if path.exists():
                        warnings.warn(f"tvm_mamba: discarding the cached thread launcher {path} ({err.why}); "
                                      f"rebuilding", RuntimeWarning, stacklevel=3)
                        verified.discard(path)
                verified.write(path, _compile_launcher(), FACTS)
                return path
        except FileNotFoundError as err:  # the folder was removed meanwhile (`cache --clear`): make it again
            last = err
    raise last


def _open(shipped: pathlib.Path | None, build_in: pathlib.Path | None):
    """The launcher, mapped through verified.load: a pack's (``shipped``; a bad one raises BadLibrary: a pack
    is not rebuilt in place), else the one in the cache folder ``build_in`` (built or rebuilt there); None
    for a runtime-only install whose pack has no launcher."""
    if shipped is not None and launcher_file(shipped).exists():
        try:
            return verified.load(launcher_file(shipped), ctypes.CDLL, facts=FACTS, private=False)
        except verified.BadLibrary as err:
            raise verified.BadLibrary(err.path, f"{err.why}; refusing the kernel pack's thread launcher (a pack "
                                                f"is not rebuilt in place: copy it again, or rebuild it with "
                                                f"`python -m tvm_mamba aot`)") from err
    if build_in is None:
        return None
    why = None
    for _ in range(3):
        try:
            return verified.load(build_launcher(build_in, private=True), ctypes.CDLL, facts=FACTS)
        except verified.BadLibrary as err:  # replaced or removed since it was checked: check (rebuild) again
            why = err
    raise RuntimeError(f"no thread launcher that verifies in {build_in} ({why})")  # TVM's pool, with a warning


def launcher_address(build_in: pathlib.Path | None, shipped: pathlib.Path | None = None) -> int | None:
    """Address of the OpenMP launcher: the one in ``shipped`` (a kernel pack's), else built into
    ``build_in`` on first use; None where it cannot be had (decided once per process). A damaged pack
    launcher (BadLibrary) or an untrusted cache (cache_dir.UntrustedPath) raises, and is decided again on
    the next call."""
    with _lock:
        if "addr" not in _state:
            try:
                lib = _open(shipped, build_in)
                if lib is None:  # a runtime-only install whose pack has no launcher: TVM's pool
                    _state["addr"] = None
                    return None
                gomp = ctypes.CDLL("libgomp.so.1")  # torch's, already loaded: one libgomp per process
                lib.tvm_mamba_set_omp(*(ctypes.cast(getattr(gomp, n), ctypes.c_void_p) for n in (
                    "GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads", "omp_in_parallel",
                    "omp_get_max_threads")))
                _state["lib"] = lib
                _state["addr"] = ctypes.cast(lib.tvm_mamba_parallel_launch, ctypes.c_void_p).value
            except (cache_dir.UntrustedPath, verified.BadLibrary):  # a damaged pack, an untrusted cache
                raise
            except Exception as err:  # noqa: BLE001 - no compiler / no libgomp: keep TVM's pool
                _state["addr"] = None
                warnings.warn(f"tvm_mamba: CPU kernels keep TVM's thread pool ({type(err).__name__}: {err}); "
                              f"set {ENV}=tvm to silence this", RuntimeWarning, stacklevel=3)
        return _state["addr"]


def route(path: str | os.PathLike, build_in: pathlib.Path | None, shipped: pathlib.Path | None = None) -> bool:
    """Point the already loaded CPU library at ``path`` at the OpenMP launcher (see launcher_address); True
    when it now uses it. A library without parallel loops has no entry point and is left as it is."""
    if not enabled():
        return False
    addr = launcher_address(build_in, shipped)
    if addr is None:
        return False
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # TVM's handle, not a second copy
        entry = ctypes.c_void_p.in_dll(lib, SYMBOL)
    except (OSError, ValueError):
        return False
    entry.value = addr
    return True
