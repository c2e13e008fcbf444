"""Tuning a device that has no TVM: emit candidates here, measure there with the runtime only, commit here.

    python -m tvm_mamba tune --emit-candidates 8 --target cuda --arch sm_90 --out cand/   # build host
    python -m tvm_mamba tune --measure cand/ --timings timings.json                      # GPU, runtime only
    python -m tvm_mamba tune --commit timings.json                                       # build host

The candidate pack is an AOT pack (runtime/pack.py layout) whose manifest entries also carry the
candidate's decisions, whether it is the hand default, and the kernel's parameter shapes and dtypes at
the bucket's shape, so the measuring side needs neither the compiler nor the compute definitions.
Measuring uses torch tensors (CUDA events on a GPU, wall clock on a CPU); committing appends the best of
each workload, with the default's time, to <logs>/<device-key>/ exactly like a local tuning run (``--out``, else
the user tuning folder, ``tuning.logs_dir()``); the
trials of block-scheduled kernels (MetaSchedule design spaces: most CUDA rules) also go, with their traces, to
the op's MetaSchedule JSONDatabase there.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

from . import metaschedule as msd
from ..runtime import KernelKey, cpu_target, cuda_target, target_key
from ..runtime import dispatch, pack, tuning, verified
from ..runtime.cache import compile_module
from ..schedules.rule import Decisions


def emit(ops, out: str, n: int, target_kind: str = "cuda", arch: str = "sm_90", preset: str = "default",
         seqlens=(512, 2048), batches=(1, 4), metaschedule: bool = False, directions=None) -> pathlib.Path:
    """Build n candidates per workload; with ``metaschedule`` they are drawn from the rule's MetaSchedule
    design space (replay-trace sampling) instead of enumerated from its knob lists."""
    from . import tune

    target = cuda_target(arch) if target_kind == "cuda" else cpu_target()
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    keys = tune.workloads(ops, target, preset, seqlens, batches, directions)
    for i, key in enumerate(keys):
        defaults = Decisions()
        dispatch.schedule(key, defaults)
        func = dispatch.build_func(key)
        dims = dict(key.shape_bucket)
        dims.update(tune._derived(key, dims))
        analyzer = tune.bucket_analyzer(func, dims)
        params = [{"shape": list(tune._shape(p, dims, analyzer)), "dtype": str(p.dtype)} for p in func.params]
        if metaschedule:
            from . import metaschedule as msd

            cands = msd.sample_candidates(key, n)
        else:
            cands = tune.candidates(defaults.space, defaults.used, n)
        for j, values in enumerate(cands):
            ex = compile_module(key, dispatch.schedule(key, Decisions(values)))
            name = f"{key.slug()}-{dict(key.shape_bucket).get('batch', 1)}x{dict(key.shape_bucket).get('seqlen', 1)}-c{j}.so"
            ex.export_library(str(folder / name))
            entries.append({"key": key.to_json(), "file": name, "plan": "candidate", "decisions": values,
                            "default": j == 0, "params": params})
        sys.stderr.write(f"\remit: {i + 1}/{len(keys)} workloads, {len(entries)} candidates")
    sys.stderr.write("\n")
    pack.write_manifest(folder, target_key(target), entries)
    return folder


def _tensor(torch, spec, device, gen):
    dtype = getattr(torch, spec["dtype"])
    if dtype.is_floating_point:
        return (torch.rand(spec["shape"], generator=gen, device="cpu") * 2 - 1).to(device=device, dtype=dtype)
    return torch.zeros(spec["shape"], dtype=dtype, device=device)


def measure(pack_dir: str, timings: str, repeats: int = 20) -> pathlib.Path:
    """Time every candidate of a candidate pack on this machine (torch + the TVM runtime only)."""
    import torch
    import tvm

    folder = pathlib.Path(pack_dir)
    manifest = pack.read_manifest(folder)
    cuda = manifest["target"].startswith("cuda-")
    device = "cuda" if cuda else "cpu"
    if cuda:
        pack.load_cuda_runtime()
    gen = torch.Generator().manual_seed(0)
    results = []
    for i, e in enumerate(manifest["entries"]):
        key = KernelKey.from_json(e["key"])
        lib = verified.load(folder / e["file"], lambda p: tvm.runtime.load_module(str(p)), sha256=e["sha256"],
                            private=False)  # mapped only if its bytes are the ones the manifest lists
        fn = lib[f"{key.op}_{key.direction}"]
        args = [_tensor(torch, spec, device, gen) for spec in e["params"]]
        times = []
        for r in range(repeats + 3):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*args)
                end.record()
                torch.cuda.synchronize()
                t = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn(*args)
                t = time.perf_counter() - t0
            if r >= 3:
                times.append(t)
        results.append({"key": e["key"], "decisions": e["decisions"], "default": e["default"],
                        "time_s": statistics.median(times)})
        sys.stderr.write(f"\rmeasure: {i + 1}/{len(manifest['entries'])}")
    sys.stderr.write("\n")
    device_name = torch.cuda.get_device_name() if cuda else None
    out = pathlib.Path(timings)
    out.write_text(json.dumps({"target": manifest["target"], "device_name": device_name,
                               "device": tuning.device_key(manifest["target"], device_name),
                               "tvm": manifest["tvm"], "tvm_ffi": manifest["tvm_ffi"], "results": results}, indent=1))
    return out


def commit(timings: str, out: str | None = None) -> pathlib.Path:
    """Append the best candidate of each workload (with the default's time) to the tuning logs in ``out``,
    else the user tuning folder (read by dispatch before the shipped logs)."""
    data = json.loads(pathlib.Path(timings).read_text())
    folder = pathlib.Path(out or tuning.logs_dir()) / data["device"]
    by_key: dict[KernelKey, list[dict]] = {}
    for r in data["results"]:
        by_key.setdefault(KernelKey.from_json(r["key"]), []).append(r)
    tuning.write_meta(folder, data["device"], {"source": "candidate pack measured with the TVM runtime only",
                                               "workloads": len(by_key)})
    done = tuning.recorded_keys(folder)
    for key, rs in by_key.items():
        if key in done:
            continue
        default = next((r for r in rs if r["default"]), None)
        if default is None:
            continue
        best = min(rs, key=lambda r: r["time_s"])
        source = "template"
        if msd.block_scheduled(key):  # every measured trial also goes to the op's MetaSchedule JSONDatabase
            msd.commit_trials(key, folder / key.op, [(r["decisions"], r["time_s"]) for r in rs])
            source = "metaschedule"
        tuning.append_record(folder, key, best["decisions"], best["time_s"], default["time_s"], len(rs),
                             source=source)
    return folder
