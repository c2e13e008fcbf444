"""A model's kernel set: the kernel keys one of its runs resolved, kept per model signature, so that the next
cold start (an empty cache, a new version of the package or of TVM: the cache folder is per version) compiles
them together in a pool of processes instead of one after another as the first forward reaches each.

    with kernel_sets.recording(signature):   # modules: around a model's generate
        ...                                   # every key resolved in this thread is noted, then saved

``recording`` first starts ``prefetch(signature)``: the keys of the saved set whose file is not in the cache
are built by ``jobs`` worker processes (default: one per core but one, the caller compiling too) in reverse
order of first use, while the caller builds from the front as its forward reaches each; the cache's file lock
makes whichever comes second load the other's file. A set is saved in ``<cache base>/kernel_sets/<signature>
.json`` (outside the per-version folder, so an upgrade's cold start is pooled), a JSON list of KernelKey
objects merged with what was saved before; ``python -m tvm_mamba aot --model`` writes the same file (from a
dry run of the model) and builds it. Files are data: a key that does not parse is skipped; the folder is the
kernel cache's, so it is held to the same trust rules (cache_dir.require_trusted).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import pathlib
import threading

from . import records
from .cache_dir import cache_base, private_mkdir, require_trusted
from .key import KernelKey

FOLDER = "kernel_sets"
MAX_KEYS = 512  # a set larger than this is cut (its first keys kept): a model runs tens of kernels
_local = threading.local()
_prefetching: dict[str, threading.Thread] = {}
_settled: dict[tuple, frozenset] = {}  # (cache base, signature) -> keys saved and resolved in this process


def folder() -> pathlib.Path:
    base = cache_base()
    require_trusted(base)
    return base / FOLDER


def path(signature: str) -> pathlib.Path:
    if not signature.isalnum():
        raise ValueError(f"kernel set signature: expected letters and digits, got {signature!r}")
    return folder() / f"{signature}.json"


def load(signature: str) -> list[KernelKey]:
    """The saved set of ``signature`` in first-use order ([] when none or unreadable)."""
    text, _ = records.read_text(path(signature))
    obj, why = records.parse_json(text, limit=records.MAX_FILE_BYTES) if text is not None else (None, "absent")
    keys = []
    for item in (obj.get("keys") if isinstance(obj, dict) and not why else None) or ():
        try:
            keys.append(KernelKey.from_json(item))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # data, not code: a key this version does not read is left out
    return keys


def save(signature: str, keys) -> None:
    """Merge ``keys`` into the saved set (new ones appended), written atomically."""
    have = load(signature)
    merged = list(dict.fromkeys([*have, *keys]))[:MAX_KEYS]
    if merged == have:
        return
    target = path(signature)
    private_mkdir(target.parent)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"keys": [k.to_json() for k in merged]}, sort_keys=True))
    tmp.replace(target)


class _Stub:
    """What build_and_load hands out in a dry run: a kernel that runs nothing (outputs keep whatever memory
    they were given), so a model's forward reaches every kernel key it would use without compiling any."""

    simulated, module, path, build_seconds, load_seconds = False, None, None, 0.0, 0.0

    def __init__(self, key: KernelKey):
        from .key import Plan

        self.key, self.plan = key, Plan(key, (), "dry run")
        self.fn = self

    def __call__(self, *args):
        return None

    def bind(self, *args):
        return self


def stub_for(key: KernelKey):
    """A stub kernel when this thread is in a dry run (``dry_run``), else None (cache._resolve asks)."""
    return _Stub(key) if getattr(_local, "dry", False) else None


@contextlib.contextmanager
def dry_run():
    """``with dry_run(): model.generate(...)``: kernel calls run nothing, no kernel is compiled or loaded, and
    no prefetch starts; with ``recording`` inside, the keys are saved as a real run's. Only for a process that
    exits afterwards (``aot --model``'s child): the ops' own memos then hold stubs."""
    _local.dry = True
    try:
        yield
    finally:
        _local.dry = False


def note(key: KernelKey) -> None:
    """Called by cache.build_and_load for every key it resolves anew: kept when this thread is recording."""
    got = getattr(_local, "keys", None)
    if got is not None:
        got.setdefault(key, None)


@contextlib.contextmanager
def recording(signature: str, jobs: int | None = None):
    """Prefetch ``signature``'s saved set, then note the keys this thread resolves in the block and save
    them (also when the block raises: what ran is still the model's)."""
    prefetch(signature, jobs)
    outer = getattr(_local, "keys", None)
    _local.keys = {}
    try:
        yield
    finally:
        got, _local.keys = _local.keys, outer
        if outer is not None:
            outer.update(got)
        settled = (str(cache_base()), signature)
        if not set(got) <= _settled.get(settled, frozenset()):
            with contextlib.suppress(OSError):
                save(signature, got)
                _settled[settled] = _settled.get(settled, frozenset()) | frozenset(got)


def missing(keys) -> list[KernelKey]:
    """The keys whose kernel (with the plan dispatch picks now) is in neither the cache nor a pack."""
    from . import cache, dispatch, pack

    pk = pack.active_pack()
    return [k for k in keys if not (pk is not None and pk.find(k) is not None)
            and not cache.cache_path(k, dispatch.plan(k)).exists()]


def prefetch(signature: str, jobs: int | None = None) -> threading.Thread | None:
    """Start building the missing part of ``signature``'s saved set in the background (module docstring);
    the thread, or None when there is nothing (or too little) to build or it already runs."""
    running = _prefetching.get(signature)
    if (getattr(_local, "dry", False) or (str(cache_base()), signature) in _settled
            or (running is not None and running.is_alive())):
        return None
    todo = missing([k for k in load(signature) if k.target.startswith("llvm")])  # CPU kernels: the GPU's
    # are compiled by nvcc, and a simulated kernel's build is the checker's business
    jobs = max(1, (os.cpu_count() or 2) - 1) if jobs is None else jobs
    if len(todo) < 2 or jobs < 1:
        return None
    worker = threading.Thread(target=build_in_pool, args=(todo[::-1], jobs, True), daemon=True,
                              name=f"tvm_mamba-prefetch-{signature[:8]}")
    _prefetching[signature] = worker
    worker.start()
    return worker


def build_in_pool(keys, jobs: int, while_main_runs: bool = False) -> dict:
    """{key: its file in the kernel cache | the exception}, built ``jobs`` processes at a time (spawned: TVM's
    build holds the GIL, and TVM and torch start threads at import, so no fork). ``while_main_runs``: submit
    no further key once the main thread has ended (an exiting program does not wait for a prefetch)."""
    out: dict = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        running: dict = {}
        for key in keys:
            if while_main_runs and not threading.main_thread().is_alive():
                break
            if len(running) >= jobs:
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for f in done:
                    out[running.pop(f)] = _outcome(f)
            running[pool.submit(cached_file, key.to_json())] = key
        for f in running:
            out[running[f]] = _outcome(f)
    return out


def _outcome(future):
    try:
        return future.result()
    except Exception as err:  # noqa: BLE001 - one key's failure is reported, the rest still built
        return err


def cached_file(key_json: dict) -> str:
    """A worker's task: the kernel's file in this user's kernel cache, built there if missing."""
    from . import cache

    return str(cache.build_and_load(KernelKey.from_json(key_json)).path)
