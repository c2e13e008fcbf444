"""``python -m tvm_mamba aot``: build an AOT kernel pack (see runtime/pack.py for the format and loading).

    python -m tvm_mamba aot --target cuda --arch sm_90 --out packs/sm_90
    python -m tvm_mamba aot --target cpu --out packs/cpu
    python -m tvm_mamba aot --target cuda --configs FILE.json --out packs/sm_90   # exactly FILE's kernels
    python -m tvm_mamba aot --target cpu --model CHECKPOINT_DIR [--dtype bfloat16] [--weights int8]

``--model``: the kernels a model's ``generate`` runs, into this user's kernel cache (no pack), ``--jobs``
processes at a time. The model is loaded as ``MambaLMHeadModel.from_pretrained(DIR)`` in a child process that
runs a short generate as a dry run (``runtime/kernel_sets.dry_run``: no kernel runs or compiles) to learn its
kernel set, which is saved as the model's (so a later cold start of that model is pooled too) and then built.

``--configs FILE.json``: a list of {op, direction, static, dtypes[, batches, seqlens]} (the shape buckets each
is built for; default --batches / --seqlens), or scripts/gpu_check.py's configs file ({"configs": that list,
"cases": ...}), which is also copied into the pack as ``gpu_check_configs.json`` (where gpu_check's ``run``
reads its case list on a machine without TVM's compiler).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import multiprocessing
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from ..runtime import KernelKey, cpu_target, cuda_target, target_key
from ..runtime import dispatch, pack, registry, rules, threads
from ..runtime.cache import PACK_THREADS, compile_module

CASES_COPY = "gpu_check_configs.json"  # the name scripts/gpu_checks/cases.py looks for in a pack


def _configs(op: str, preset: str):
    mod = registry.op(op).compute
    seen, out = set(), []
    for fn in ("build_check_configs", "tuning_configs"):
        f = getattr(mod, fn, None)
        if f is None:
            continue
        for direction, static, dtypes in (f() if fn == "build_check_configs" else f(preset)):
            marker = (direction, tuple(sorted(static.items())), tuple(sorted(dtypes.items())))
            if marker not in seen:
                seen.add(marker)
                out.append((direction, static, dtypes))
    return out


def _needs_stub_reexec(target_kind: str) -> bool:
    if target_kind != "cuda":
        return False
    import tvm_ffi

    has_cuda = tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None
    return not (has_cuda and os.environ.get("TVM_CUDA_COMPILE_MODE") == "nvcc")


def _plan(configs, tkey: str, batches, seqlens):
    """[(key, plan)] for every configuration and shape bucket (a configuration's own buckets, where given,
    replace ``batches`` / ``seqlens``)."""
    out = []
    for op, direction, static, dtypes, *buckets in configs:
        bs, Ls = (buckets + [None, None])[:2]
        for b, L in itertools.product(bs or batches, Ls or seqlens):
            key = KernelKey.make(op, direction, dtypes, static, tkey, {"batch": b, "seqlen": L})
            out.append((key, dispatch.plan(key)))
    return out


def _build_cpu(keys, jobs: int) -> dict:
    """{key: its file in the kernel cache | the exception}: what the test suite or an earlier call built is
    reused, the rest built ``jobs`` at a time (prebuild.build_in_pool)."""
    from ..runtime import prebuild

    with _no_pack():  # the cache, not a pack this process may have been pointed at
        if jobs <= 1:
            return {k: _attempt(prebuild.cached_file, k.to_json()) for k in keys}
        return prebuild.build_in_pool(keys, jobs)


@contextlib.contextmanager
def _no_pack():
    saved = os.environ.pop(pack.ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[pack.ENV] = saved


def _attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported by build_pack, the rest still built
        return err


def _build_cuda(keys, folder: pathlib.Path) -> dict:
    """{key: a cubin library compiled into ``folder`` | the exception}, one at a time (nvcc is the cost)."""
    return {key: _attempt(_compile_into, key, folder / f"{key.workload().slug()}-{i}.so")
            for i, key in enumerate(keys)}


def _compile_into(key: KernelKey, path: pathlib.Path) -> str:
    compile_module(key, dispatch.schedule(key)).export_library(str(path))
    return str(path)


def build_pack(ops, out: str, target_kind: str = "cpu", arch: str = "sm_90", preset: str = "default",
               seqlens=(512, 2048), batches=(1, 4), mcpu: str | None = None, configs=None,
               jobs: int = 1) -> pathlib.Path:
    """Build the pack into ``out``; ``configs`` ([(op, direction, static, dtypes[, batches, seqlens])]) overrides
    the ops' lists. CPU kernels come from (and go into) the kernel cache, ``jobs`` processes at a time; CUDA
    kernels are compiled here (this machine cannot load them, so the cache, which loads, is not used)."""
    target = cuda_target(arch) if target_kind == "cuda" else cpu_target(mcpu)
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    configs = configs if configs is not None else [(op, *c) for op in ops for c in _configs(op, preset)]
    t0 = time.perf_counter()
    planned = _plan(configs, target_key(target), batches, seqlens)
    unique = {(k.workload(), p.digest()): k for k, p in planned}  # one file per (workload, plan)
    keys = list(unique.values())
    made = _build_cuda(keys, folder) if target_kind == "cuda" else _build_cpu(keys, jobs)
    names, failed = {}, []
    for i, (ident, key) in enumerate(unique.items()):
        got = made[key]
        if isinstance(got, Exception):
            failed.append(f"{key.workload()}: {type(got).__name__}: {str(got).strip()[-300:]}")
            continue
        name = pathlib.Path(got).name if target_kind == "cuda" else f"{key.workload().slug()}-{i}.so"
        if target_kind != "cuda":
            shutil.copyfile(got, folder / name)
        names[ident] = name
    entries = [{"key": k.to_json(), "file": names[(k.workload(), p.digest())], "plan": p.source}
               for k, p in planned if (k.workload(), p.digest()) in names]
    print(f"aot: {len(configs)} configurations, {len(names)} files, {time.perf_counter() - t0:.0f}s",
          file=sys.stderr)
    for line in failed:
        print(f"aot: FAILED {line}", file=sys.stderr)
    if target_kind != "cuda":  # the OpenMP launcher, for hosts with only the TVM runtime (runtime/threads.py)
        threads.build_launcher(folder / PACK_THREADS)
    pack.write_manifest(folder, target_key(target), entries)
    build_pack.failed = failed
    return folder


def read_configs(path: str) -> list[tuple]:
    """``--configs`` FILE (module docstring) -> build_pack's configs: [(op, direction, static, dtypes, batches,
    seqlens)]; ValueError naming the file for anything else."""
    data = json.loads(pathlib.Path(path).read_text())
    entries = data.get("configs") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"--configs {path}: expected a list of kernel configurations or a gpu_check configs file")
    out = []
    for e in entries:
        if not isinstance(e, dict) or not {"op", "direction", "static", "dtypes"} <= set(e):
            raise ValueError(f"--configs {path}: an entry needs op, direction, static, dtypes; got {e!r:.200}")
        out.append((e["op"], e["direction"], e["static"], e["dtypes"], e.get("batches"), e.get("seqlens")))
    return out


DRY_PROMPT, DRY_NEW_TOKENS = 16, 2  # the dry run's generate: a prefill, then decode steps


def model_kernels(model_dir: str, dtype: str, weights: str | None) -> list[dict]:
    """(in a spawned child) The kernel keys (JSON) of a short generate of the checkpoint in ``model_dir``, cast
    to ``dtype`` and quantized to ``weights`` ("int8" / "bfloat16") if given; saved as its kernel set."""
    import torch

    from ..modules.generation import model_signature
    from ..modules.lm import MambaLMHeadModel
    from ..modules.quantize import quantize_weights
    from ..runtime import kernel_sets

    model = MambaLMHeadModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    if weights:
        quantize_weights(model, weights)
    with torch.no_grad(), kernel_sets.dry_run():
        model.generate(torch.zeros(1, DRY_PROMPT, dtype=torch.long), max_new_tokens=DRY_NEW_TOKENS)
    return [k.to_json() for k in kernel_sets.load(model_signature(model))]


def build_model(args) -> int:
    """``aot --model``: learn the model's kernel set in a child process, then build what the cache lacks."""
    from ..runtime import prebuild

    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # a fresh process: the dry run leaves stubs in its memos
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as child:
        found = child.submit(model_kernels, args.model, args.dtype, args.weights).result()
    keys = [KernelKey.from_json(k) for k in found]
    with _no_pack():
        todo = prebuild.missing(keys)
        made = prebuild.build_in_pool(todo, args.jobs or os.cpu_count() or 1) if todo else {}
    failed = [f"{k}: {type(v).__name__}: {str(v).strip()[-300:]}" for k, v in made.items() if isinstance(v, Exception)]
    print(f"aot: {args.model}: {len(keys)} kernels, {len(todo) - len(failed)} built into the kernel cache, "
          f"{len(keys) - len(todo)} already there, {len(failed)} failed ({time.perf_counter() - t0:.0f}s)")
    for line in failed:
        print(f"aot: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


def main(args) -> int:
    if getattr(args, "model", None):
        return build_model(args)
    ops = args.ops.split(",") if args.ops else rules.compute_ops()
    if _needs_stub_reexec(args.target):
        with tempfile.TemporaryDirectory(prefix="tvm_mamba_stub_") as tmp:
            stub = pack.make_stub_driver(pathlib.Path(tmp))
            env = dict(os.environ, TVM_CUDA_COMPILE_MODE="nvcc",
                       LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("LD_LIBRARY_PATH")])))
            return subprocess.run([sys.executable, "-m", "tvm_mamba", *sys.argv[1:]], env=env).returncode
    seqlens = tuple(int(v) for v in args.seqlens.split(","))
    batches = tuple(int(v) for v in args.batches.split(","))
    configs = read_configs(args.configs) if getattr(args, "configs", None) else None
    folder = build_pack(ops, args.out, args.target, args.arch, args.preset, seqlens, batches, args.mcpu, configs,
                        jobs=args.jobs or os.cpu_count() or 1)
    if configs is not None and "cases" in json.loads(pathlib.Path(args.configs).read_text()):
        (folder / CASES_COPY).write_text(pathlib.Path(args.configs).read_text())
    n = len(list(folder.glob("*.so")))
    failed = getattr(build_pack, "failed", [])
    print(f"aot: {n} kernel files for {args.target} {args.arch if args.target == 'cuda' else ''} in {folder} "
          f"(manifest {folder / pack.MANIFEST}); {len(failed)} configuration(s) failed")
    return 1 if failed else 0
