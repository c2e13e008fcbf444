"""Building a model's kernel set ahead of its calls (runtime/kernel_sets.py holds the sets): the keys of the saved
set whose file is not in the cache are built by ``jobs`` worker processes (default: one per core but one, the
caller compiling too) in reverse order of first use, while the caller builds from the front as its forward
reaches each; the cache's file lock makes whichever comes second load the other's file. Workers are spawned
processes that import TVM first (seconds), so the pool pays off for sets of more than a few seconds of compile
and on machines with more than two cores. ``aot --model`` and aot's CPU packs build through ``build_in_pool``.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading

from . import cache, dispatch, kernel_sets, pack
from .key import KernelKey

_prefetching: dict[str, threading.Thread] = {}


def missing(keys) -> list[KernelKey]:
    """The keys whose kernel (with the plan dispatch picks now) is in neither the cache nor a pack."""
    pk = pack.active_pack()
    return [k for k in keys if not (pk is not None and pk.find(k) is not None)
            and not cache.cache_path(k, dispatch.plan(k)).exists()]


def prefetch(signature: str, jobs: int | None = None) -> threading.Thread | None:
    """Start building the missing part of ``signature``'s saved set in the background (module docstring);
    the thread, or None when there is nothing (or too little) to build, it already runs, this process has
    already run the model (kernel_sets.settled) or is in a dry run."""
    running = _prefetching.get(signature)
    if (kernel_sets.in_dry_run() or kernel_sets.settled(signature)
            or (running is not None and running.is_alive())):
        return None
    todo = missing([k for k in kernel_sets.load(signature) if k.target.startswith("llvm")])  # CPU kernels: the GPU's
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
    return str(cache.build_and_load(KernelKey.from_json(key_json)).path)
