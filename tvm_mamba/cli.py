"""``python -m tvm_mamba <command>``: info, build-check, sim-check, roofline, cache, tune, aot.

info         target, thread count, cache location, versions, the WebGPU adapter, and one checked kernel call
             (causal conv1d against the float64 reference; ``--webgpu``: also on WebGPU).
build-check  builds every registered kernel configuration (each compute module's build_check_configs())
             for CUDA with no GPU: TVM codegen, then nvcc --cubin with the packs' flags (runtime/nvcc.py
             NVCC_FLAGS: -O3 --use_fast_math, ptxas -v); prints registers, shared
             memory and spill bytes per kernel and ends with exactly one line
             ``build-check: N kernels, F failed, S spilling (cuda sm_XY)``. Exit 1 if F > 0.
             ``--target webgpu|opencl|metal``: the GPU rules' source in that language, checked where a
             checker is here (tvm_mamba/tools/gpu_sources.py); ``--target cpu``: LLVM's code for a CPU.
sim-check    runs every configuration build-check builds (same flags; ``--target webgpu``: the float32 ones
             on WebGPU through wgpu instead) on the CPU through the CUDA execution
             harness (runtime/cudasim.py: TVM's CUDA source, g++, the CUDA execution model) against its
             float64 reference (tvm_mamba/tools/simcheck/<op>.py), and ends with exactly one line
             ``sim-check: N kernels, F failed (cuda sm_XY)``. Exit 1 if F > 0. ``--full``: each check with
             two whole production tiles / chunks and a ragged tail (simcheck.extent; CPU-heavy).
tune         searches every kernel's knobs per (batch, seqlen) bucket on this machine (or a remote device
             through a TVM RPC tracker) and appends the best to the user tuning folder (tvm_mamba/tools/tune.py).
cache        lists the kernel cache per version folder; --clear removes it, --prune other versions' folders.
roofline     each CUDA kernel at a preset's shapes: global bytes / flops / exps counted through the CUDA harness
             against the algorithm's minimum, occupancy from ptxas, the H200 roofline bound; ends with exactly
             one line ``roofline: N kernels, K above 2x of their bound, T on tensor cores (cuda sm_XY)``;
             --out writes docs/roofline.md (tvm_mamba/tools/roofline/).
aot          builds a kernel pack for a machine with only the TVM runtime (tvm_mamba/tools/aot.py, runtime/pack.py).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import re
import sys
import time


def cmd_info(args) -> int:
    import torch
    import tvm
    import tvm_ffi

    import tvm_mamba
    from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref
    from tvm_mamba.runtime import cache, target_for_device, target_key

    print(f"tvm_mamba {tvm_mamba.__version__}  (tvm {tvm.__version__}, tvm-ffi {tvm_ffi.__version__}, "
          f"torch {torch.__version__})")
    print(f"cpu target:  {target_for_device('cpu')}")
    env = __import__("os").environ
    from tvm_mamba.runtime import threads

    pool = "torch's OpenMP team" if threads.enabled() else f"TVM's pool ({threads.ENV}=tvm)"
    print(f"threads:     kernels on {pool}, torch {torch.get_num_threads()}; TVM pool "
          f"{env.get('TVM_NUM_THREADS')} (bind {env.get('TVM_BIND_THREADS')})")
    if torch.cuda.is_available():
        print(f"cuda target: {target_for_device('cuda:0')}")
    print(f"cache:       {cache.cache_root()}")
    _print_tuning(target_key(target_for_device("cpu")))
    if torch.cuda.is_available():
        _print_tuning(target_key(target_for_device("cuda:0")), torch.cuda.get_device_name())
    x = torch.randn(2, 64, 300)
    w, b = torch.randn(64, 4), torch.randn(64)
    t0 = time.perf_counter()
    out = tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")
    dt = time.perf_counter() - t0
    err = (out.double() - causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")).abs().max().item()
    ok = err < 1e-4
    print(f"check:       causal_conv1d_fn (2, 64, 300) silu: max |err| vs float64 reference = {err:.2e} "
          f"({'ok' if ok else 'FAILED'}; first call incl. build/load {dt:.2f}s)")
    ok = _print_webgpu(getattr(args, "webgpu", False), (x, w, b)) and ok
    return 0 if ok else 1


def _print_webgpu(check: bool, inputs) -> bool:
    """The ``webgpu:`` line (the adapter wgpu finds, or why there is none) and, with ``check``, the same
    conv call on WebGPU (``with tvm_mamba.webgpu():``); False when that check fails or cannot run."""
    import importlib.util

    import tvm_mamba
    from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref
    from tvm_mamba.runtime import webgpu

    if importlib.util.find_spec("wgpu") is None:
        print("webgpu:      wgpu not installed (pip install 'tvm-mamba[webgpu]')")
        return not check
    info = webgpu.adapter_info()
    if info is None:
        print("webgpu:      wgpu found no adapter")
        return not check
    limits = info["limits"]
    print(f"webgpu:      {info['device']} ({info['backend']}, {info['type']}; {info['description']}); "
          f"{limits['max-compute-invocations-per-workgroup']} invocations, "
          f"{limits['max-compute-workgroup-storage-size']} B workgroup memory, "
          f"{limits['max-storage-buffers-per-shader-stage']} storage buffers a stage; "
          f"shader-f16: {'yes' if 'shader-f16' in info['features'] else 'no'}")
    if not check:
        return True
    x, w, b = inputs
    t0 = time.perf_counter()
    with tvm_mamba.webgpu():
        out = tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")
    dt = time.perf_counter() - t0
    err = (out.double() - causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")).abs().max().item()
    print(f"check:       the same call on WebGPU: max |err| = {err:.2e} ({'ok' if err < 1e-4 else 'FAILED'}; "
          f"first call incl. build {dt:.2f}s)")
    return err < 1e-4


def _print_tuning(tkey: str, gpu_name: str | None = None) -> None:
    """``device key:`` and ``tuning:`` lines: which records (user folder first, then shipped) apply here, and
    the stand-in class whose records serve when none do (tuning.stand_in: same ISA class required, then vendor,
    then model), else the nearest device's, which does not serve."""
    from tvm_mamba.runtime import tuning

    s = tuning.device_summary(tkey, gpu_name)
    (n_user, user), (n_shipped, shipped) = s["user"], s["shipped"]
    print(f"device key:  {s['device']}")
    if n_user or n_shipped:
        print(f"tuning:      shipped records for this device: {n_shipped} ({shipped}); "
              f"user records: {n_user} ({user})")
        return
    near, sub = s["nearest"], s["stand_in"]
    if sub:
        print(f"tuning:      none for this device (shipped: {shipped}, user: {user}); the records of {sub} "
              f"serve (stand-in: the same ISA class)")
        return
    where = f"nearest: {near[0]} ({near[1]}, {near[2]} records; another ISA class, not served)" if near \
        else "no records for a similar device"
    print(f"tuning:      none for this device (shipped: {shipped}, user: {user}); {where}; hand defaults serve")


def _configs(ops: list[str]):
    from tvm_mamba.runtime import registry

    for op in ops:
        mod = registry.op(op).compute
        fn = getattr(mod, "build_check_configs", None)
        if fn is None:
            continue
        for direction, static, dtypes in fn():
            yield op, direction, static, dtypes


class _UsageError(Exception):
    """A bad command-line value: main prints the one-line message on stderr and returns 2."""


def _checked_ops_arch(args, cmd: str):
    """(ops, arch) from --target / --ops / --arch; a _UsageError listing the valid values."""
    valid = ("cuda", "cpu", "webgpu", "metal", "opencl") if cmd == "build-check" else ("cuda", "webgpu")
    if args.target not in valid:
        raise _UsageError(f"{cmd}: --target must be one of {', '.join(valid)}, got {args.target!r}")
    if args.target != "cuda":
        return _checked_ops(args.ops, cmd), None
    return _checked_ops(args.ops, cmd), _checked_arch(args.arch, cmd)


def _checked_ops(ops_arg: str, cmd: str) -> list[str]:
    """--ops (comma-separated; empty: every op) -> op names, or a _UsageError listing the valid ones."""
    from tvm_mamba.runtime.rules import compute_ops

    valid = compute_ops()
    ops = [o for o in ops_arg.split(",") if o] if ops_arg else valid
    unknown = [o for o in ops if o not in valid]
    if unknown:
        raise _UsageError(f"{cmd}: unknown op {', '.join(unknown)}; valid: {', '.join(valid)}")
    return ops


def _checked_arch(arch: str, cmd: str) -> str:
    """--arch, or a _UsageError naming the minimum (sm_80) and the known archs."""
    from tvm_mamba.runtime.cudasim import MIN_ARCH
    from tvm_mamba.runtime.target import CUDA_ARCHS

    if not (arch.startswith("sm_") and arch[3:].isdigit()) or int(arch[3:]) < MIN_ARCH:
        raise _UsageError(f"{cmd}: unsupported --arch {arch!r}; the minimum is sm_{MIN_ARCH} (bf16); known: "
                          f"{', '.join(CUDA_ARCHS)}")
    return arch


def _print_build(key, stats) -> tuple[bool, bool]:
    """Print one build-check result; returns (failed, spilling)."""
    if not stats["ok"]:
        print(f"FAIL  {key}\n      nvcc: {stats['error'][:400]}", flush=True)
        return True, False
    spills = sum(k["spill_stores"] + k["spill_loads"] for k in stats["kernels"])
    print(f"{'SPILL' if spills else 'ok   '} {key}")
    for k in stats["kernels"]:
        print(f"      {k['name']:<44} regs {k['registers']:>3}  smem {k['smem']:>6} B  "
              f"spill {k['spill_stores']}/{k['spill_loads']} B  stack {k['stack']} B")
    sys.stdout.flush()
    return False, spills > 0


def cmd_build_check(args) -> int:
    from tvm_mamba.runtime import KernelKey, cuda_target, target_key
    from tvm_mamba.runtime import dispatch
    from tvm_mamba.runtime.cache import compile_module
    from tvm_mamba.runtime.nvcc import ptxas_stats

    ops, arch = _checked_ops_arch(args, "build-check")
    if args.target == "cpu":
        return _build_check_cpu(ops, args.mcpu)
    if args.target in ("webgpu", "metal", "opencl"):
        from tvm_mamba.tools import gpu_sources

        return gpu_sources.run(_configs(ops), args.target)
    tkey = target_key(cuda_target(arch))
    pending: list = []
    failed = spilling = total = 0
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs)

    def drain(block: bool) -> None:  # print finished results in order, as they come
        nonlocal failed, spilling
        while pending and (block or pending[0][1].done()):
            key, fut = pending.pop(0)
            f, sp = _print_build(key, fut.result())
            failed += f
            spilling += sp

    for op, direction, static, dtypes in _configs(ops):
        key = KernelKey.make(op, direction, dtypes, static, tkey)
        total += 1
        try:
            ex = compile_module(key, dispatch.schedule(key))
            src = ex.mod.imports[0].inspect_source("cuda")
            pending.append((key, pool.submit(ptxas_stats, src, arch)))
        except Exception as err:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            msg = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
            print(f"FAIL  {key}\n      codegen: {msg}", flush=True)
        drain(block=False)
    drain(block=True)
    pool.shutdown()
    print(f"build-check: {total} kernels, {failed} failed, {spilling} spilling (cuda {arch})")
    return 1 if failed else 0


VECTOR_FMA = {"aarch64": re.compile(r"\bfml[as]\s+(v\d+\.\d+s|z\d+\.s)"), "x86": re.compile(r"\bvfn?madd\w*ps\b")}


def _build_check_cpu(ops: list[str], mcpu: str | None) -> int:
    """``build-check --target cpu [--mcpu NAME]``: every configuration through the CPU rules and LLVM's codegen
    for that CPU (an AArch64 one for an ARM name: runtime/target.py), no linking; per kernel the assembly's
    vector FMA count (NEON / SVE ``fmla``, x86 ``vfmadd..ps``), which shows the strategy vectorized there."""
    from tvm_mamba.runtime import KernelKey, cpu_target, dispatch, target_key
    from tvm_mamba.runtime.cache import compile_module

    target = cpu_target(mcpu)
    tkey, triple = target_key(target), str(target.attrs["mtriple"])
    fma = VECTOR_FMA["aarch64" if triple.startswith("aarch64") else "x86"]
    failed = total = 0
    for op, direction, static, dtypes in _configs(ops):
        key = KernelKey.make(op, direction, dtypes, static, tkey)
        total += 1
        try:
            asm = compile_module(key, dispatch.schedule(key)).mod.inspect_source("asm")
            print(f"ok    {key}\n      {len(asm.splitlines())} asm lines, {len(fma.findall(asm))} vector FMAs",
                  flush=True)
        except Exception as err:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            msg = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
            print(f"FAIL  {key}\n      codegen: {msg}", flush=True)
    print(f"build-check: {total} kernels, {failed} failed (llvm {target.attrs['mcpu']}, {triple})")
    return 1 if failed else 0


def cmd_cache(args) -> int:
    """List, clear or prune the kernel cache (one folder per package / TVM / source version)."""
    import shutil

    from tvm_mamba.runtime import cache

    base, current = cache.cache_base(), cache.cache_root()
    # version folders only: the default user tuning logs (tuning_logs/) live in the same base folder
    folders = sorted(p for p in base.iterdir() if p.is_dir() and p.name.startswith("tvm_mamba-")) \
        if base.is_dir() else []

    def size(p):
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    if args.clear or args.prune:
        doomed = [p for p in folders if args.clear or p != current]
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        print(f"cache: removed {len(doomed)} folder(s) from {base}")
        return 0
    print(f"cache: {base}")
    for p in folders:
        mark = "  (this version)" if p == current else ""
        print(f"  {size(p) / 2**20:8.1f} MiB  {p.name}{mark}")
    print(f"cache: {len(folders)} folder(s), {sum(size(p) for p in folders) / 2**20:.1f} MiB")
    return 0


def cmd_sim_check(args) -> int:
    """Every build-check configuration through the CUDA execution harness against its float64 reference."""
    from tvm_mamba.tools import simcheck
    from tvm_mamba.tools.simcheck import ops as simcheck_ops
    from tvm_mamba.runtime import KernelKey, build_and_load

    ops, arch = _checked_ops_arch(args, "sim-check")
    configs = list(_configs(ops))
    if args.target == "webgpu":  # float32 only (WGSL); built on first use (the keys carry the call's shape bucket)
        arch, configs = simcheck.WEBGPU, [c for c in configs if simcheck.on_webgpu(c[3])]
        keys = [KernelKey.make(op, d, dt, st, "webgpu") for op, d, st, dt in configs]
        warm = [None] * len(keys)
    else:
        keys = [KernelKey.make(op, d, dt, st, "cudasim-" + arch) for op, d, st, dt in configs]
        print(f"sim-check: compiling {len(keys)} kernels for the harness ({args.jobs} jobs) ...", flush=True)
        warm = _compile_all(keys, args.jobs, build_and_load)
    failed = 0
    for i, ((op, direction, static, dtypes), key, err) in enumerate(zip(configs, keys, warm)):
        t0 = time.perf_counter()
        if err is None:
            with simcheck.full_shapes(args.full):
                err = _try(simcheck_ops.run_config, op, direction, static, dtypes, arch)
        status = "ok  " if err is None else "FAIL"
        print(f"[{i + 1}/{len(keys)}] {status} {key}  ({time.perf_counter() - t0:.1f} s)", flush=True)
        if err is not None:
            failed += 1
            print("      " + err.replace("\n", "\n      ")[:1500], flush=True)
    where = "webgpu" if arch == simcheck.WEBGPU else f"cuda {arch}"
    print(f"sim-check: {len(keys)} kernels, {failed} failed ({where}{', full shapes' if args.full else ''})")
    return 1 if failed else 0



def _compile_all(keys, jobs: int, build) -> list[str | None]:
    """``build`` every key, ``jobs`` at a time; each key's error or None, in order. A line every tenth of the
    way: a cold sim-check compiles for minutes before its first result."""
    t0, done, step = time.perf_counter(), 0, max(1, len(keys) // 10)
    errors: list[str | None] = [None] * len(keys)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        pending = {pool.submit(_try, build, key): i for i, key in enumerate(keys)}
        for fut in concurrent.futures.as_completed(pending):
            errors[pending[fut]] = fut.result()
            done += 1
            if done % step == 0 or done == len(keys):
                print(f"sim-check: compiled {done}/{len(keys)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return errors


def _try(fn, *args) -> str | None:
    """None if ``fn(*args)`` returns, else the error's message (one config's failure must not stop the rest)."""
    try:
        fn(*args)
        return None
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {str(err).strip()}"


def cmd_roofline(args) -> int:
    """Count, fit and bound every preset kernel; print the table and the summary line; --out: markdown."""
    from tvm_mamba.compute._presets import presets
    from tvm_mamba.tools.roofline import METHOD, report

    ops, arch = _checked_ops_arch(args, "roofline")
    names = [n for p in args.preset for n in p.split(",") if n]
    try:
        chosen = [name for p in names for name, _ in presets(p)]
    except ValueError as err:
        raise _UsageError(f"roofline: {err}") from None
    rows, failed = [], 0
    for preset in dict.fromkeys(chosen):
        for key in report.preset_keys(preset, ops, arch, args.dtype):
            if _directions(args) and key.direction not in _directions(args):
                continue
            try:
                rows.append(report.row(preset, key, args.batch, args.seqlen, arch))
                print(f"[{preset}] " + "  ".join(report.cells(rows[-1])), flush=True)
            except Exception as err:  # noqa: BLE001 - one kernel's failure must not stop the rest
                failed += 1
                print(f"FAIL  [{preset}] {key}: {type(err).__name__}: {str(err).strip()[:300]}", flush=True)
    print(report.text_table(rows))
    if args.out:
        cmd = "python -m tvm_mamba roofline " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["roofline"] else [])
        with open(args.out, "w") as f:
            f.write(report.markdown(rows, arch, args.batch, args.seqlen, cmd.strip(), METHOD))
    print(report.summary(rows, arch))
    return 1 if failed else 0


def _directions(args):
    return tuple(d for d in args.directions.split(",") if d) or None


def cmd_tune(args) -> int:
    from tvm_mamba.runtime.rules import compute_ops

    ops = args.ops.split(",") if args.ops else compute_ops()
    seqlens = tuple(int(v) for v in args.seqlens.split(","))
    batches = tuple(int(v) for v in args.batches.split(","))
    if args.emit_candidates or args.measure or args.commit:
        from tvm_mamba.tools import candidates

        if args.measure:
            path = candidates.measure(args.measure, args.timings or "timings.json")
            print(f"tune: timings written to {path}")
        elif args.commit:
            print(f"tune: records in {candidates.commit(args.commit, args.out)}")
        else:
            if not args.out:
                raise _UsageError("tune: --emit-candidates needs --out DIR")
            folder = candidates.emit(ops, args.out, args.emit_candidates, args.target, args.arch, args.preset,
                                     seqlens, batches, metaschedule=args.metaschedule,
                                     directions=_directions(args))
            print(f"tune: candidate pack in {folder}")
        return 0
    from tvm_mamba.tools import tune

    if args.recheck:
        checked, demoted = tune.recheck(ops, args.out)
        print(f"tune: rechecked {checked} winning records, {demoted} no longer faster than the default: demoted")
        return 0
    if args.rpc_tracker and not args.rpc_key:
        raise _UsageError("tune: --rpc-key is required with --rpc-tracker")
    folder = tune.run(ops, preset=args.preset, seqlens=seqlens, batches=batches, trials=args.trials,
                      budget_s=60.0 * args.budget_min, out=args.out, rpc_tracker=args.rpc_tracker,
                      rpc_key=args.rpc_key, directions=_directions(args))
    print(f"tune: records in {folder}")
    return 0


ARCH_HELP = "the CUDA arch whose kernels are built, sm_80 or newer (default: %(default)s)"
OPS_HELP = "comma-separated op names (default: {default}); valid: {ops}"


class _HelpFormatter(argparse.HelpFormatter):
    """Fills ``{ops}`` in a help string with the valid op names when help is printed (only then: listing them
    imports the op registry, TVM included, seconds every other command line would pay)."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if "{ops}" in text:
            from tvm_mamba.runtime.rules import compute_ops

            text = text.replace("{ops}", ", ".join(compute_ops()))
        return text


class _SubParser(argparse.ArgumentParser):
    """The subcommands' parser: _HelpFormatter unless told otherwise."""

    def __init__(self, *args, formatter_class=_HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subparser per command; every option has help (tests/test_cli_help.py)."""
    ap = argparse.ArgumentParser(prog="python -m tvm_mamba", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_SubParser)
    info = sub.add_parser("info", help="target, cache, and one checked kernel call")
    info.add_argument("--webgpu", action="store_true", help="also check the call on WebGPU (needs wgpu)")
    checks = (("build-check", "build every kernel for CUDA here (nvcc, ptxas -v)", "nvcc"),
              ("sim-check", "run every build-check kernel on the CPU through the CUDA harness", "g++"))
    for name, helps, jobs in checks:  # the same kernel configurations: the same options
        chk = sub.add_parser(name, help=helps)
        if name == "build-check":
            chk.add_argument("--target", default="cuda", choices=("cuda", "cpu", "webgpu", "metal", "opencl"),
                             help="cuda (nvcc, ptxas -v), cpu: LLVM codegen for --mcpu, or another GPU "
                                  "language's source: webgpu (WGSL, validated by wgpu's naga), opencl (parsed "
                                  "by libclang), metal (generated) (default: cuda)")
            chk.add_argument("--mcpu", default=None,
                             help="with --target cpu: the LLVM CPU, x86 (znver3, skylake-avx512) or AArch64 "
                                  "(neoverse-v1, cortex-a76, apple-m1) (default: this host's)")
        else:
            chk.add_argument("--target", default="cuda", choices=("cuda", "webgpu"),
                             help="cuda: the CUDA kernels through the harness, or webgpu: the float32 "
                                  "configurations on WebGPU through wgpu (default: cuda)")
        chk.add_argument("--arch", default="sm_90", help=ARCH_HELP)
        chk.add_argument("--ops", default="", help=OPS_HELP.format(default="all", ops="{ops}"))
        chk.add_argument("--jobs", type=int, default=2,
                         help=f"how many {jobs} processes run at once (default: %(default)s)")
        if name == "sim-check":
            chk.add_argument("--full", action="store_true",
                             help="run each check with its sequence (or row) axis at two whole production tiles "
                                  "and a ragged tail (SSD / Mamba-3 chunk 256: seqlen 515; conv tile 1024: 2051): "
                                  "CPU-heavy, hours for all ops; not part of the default check")
    rl = sub.add_parser("roofline", help="each CUDA kernel at a preset's shapes against the H200 roofline")
    rl.add_argument("--target", default="cuda", help="the codegen target: cuda, the only one (default: cuda)")
    rl.add_argument("--arch", default="sm_90", help=ARCH_HELP)
    rl.add_argument("--preset", action="append", default=None,
                    help="preset or group (repeatable, comma-separated; default: default)")
    rl.add_argument("--ops", default="", help=OPS_HELP.format(default="all with preset kernels", ops="{ops}"))
    rl.add_argument("--directions", default="", help="comma-separated kernel directions (default: all)")
    rl.add_argument("--batch", type=int, default=4, help="batch size the kernels are counted at (default: 4)")
    rl.add_argument("--seqlen", type=int, default=2048,
                    help="sequence length the kernels are counted at (default: 2048)")
    rl.add_argument("--dtype", default=None, choices=("bfloat16", "float16"),
                    help="activation dtype of the kernels (default: as the tuning configs, fp32)")
    rl.add_argument("--out", default=None, help="write the report as markdown here (e.g. docs/roofline.md)")
    ca = sub.add_parser("cache", help="list the kernel cache (default), --clear it, or --prune other versions")
    group = ca.add_mutually_exclusive_group()
    group.add_argument("--list", action="store_true", help="sizes per version folder (the default)")
    group.add_argument("--clear", action="store_true", help="remove every cached kernel")
    group.add_argument("--prune", action="store_true", help="remove the folders of other package / TVM versions")
    tu = sub.add_parser("tune", help="search schedule knobs per shape bucket on this machine and log the best",
                        description="Search schedule knobs per (batch, seqlen) bucket and append the best to "
                        "<logs>/<device-key>/<op>/records.jsonl. <logs> is --out, else the user tuning folder: "
                        "$TVM_MAMBA_TUNING_LOGS if set, else $XDG_CACHE_HOME/tvm_mamba/tuning_logs "
                        "(~/.cache/tvm_mamba/tuning_logs). Kernel calls read that folder first, then the logs "
                        "shipped in the package (never written: it may be read-only and upgrades replace it). "
                        "`python -m tvm_mamba info` shows which records apply to this device.")
    tu.add_argument("--ops", default="", help=OPS_HELP.format(default="all", ops="{ops}"))
    tu.add_argument("--preset", default="default", help="model preset or group: default, all, mamba-130m, ...")
    tu.add_argument("--seqlens", default="512,2048", help="sequence-length buckets (powers of two)")
    tu.add_argument("--batches", default="1,4", help="batch buckets (powers of two)")
    tu.add_argument("--directions", default="", help="comma-separated kernel directions (default: all), e.g. fwd,bwd")
    tu.add_argument("--trials", type=int, default=8, help="candidates per workload (the default included)")
    tu.add_argument("--budget-min", type=float, default=60.0, help="stop after this many minutes (resumable)")
    tu.add_argument("--out", default=None, help="logs folder (default: the user tuning folder, see above)")
    tu.add_argument("--rpc-tracker", default=None, help="HOST:PORT of a TVM RPC tracker to measure on")
    tu.add_argument("--rpc-key", default=None, help="device key registered with the tracker")
    tu.add_argument("--emit-candidates", type=int, default=0, metavar="N",
                    help="build N schedule candidates per workload into a pack (--out) for a runtime-only device")
    tu.add_argument("--target", default="cuda", choices=("cuda", "cpu"),
                    help="with --emit-candidates: build the candidates for a CUDA GPU or a CPU (default: cuda)")
    tu.add_argument("--metaschedule", action="store_true",
                    help="with --emit-candidates: draw candidates from the rule's MetaSchedule design space")
    tu.add_argument("--arch", default="sm_90", help="with --emit-candidates --target cuda: " + ARCH_HELP)
    tu.add_argument("--measure", default=None, metavar="PACK", help="time a candidate pack here (runtime only)")
    tu.add_argument("--timings", default=None, help="with --measure: where to write the timings JSON")
    tu.add_argument("--commit", default=None, metavar="TIMINGS", help="record the best of measured timings")
    tu.add_argument("--recheck", action="store_true",
                    help="re-time every winning record against the default here; demote those that do not hold")
    ao = sub.add_parser("aot", help="build a kernel pack (one .so per kernel + manifest) for a runtime-only machine")
    ao.add_argument("--target", default="cuda", choices=("cuda", "cpu"),
                    help="build the kernels for a CUDA GPU or for a CPU (default: cuda)")
    ao.add_argument("--arch", default="sm_90", help="with --target cuda: " + ARCH_HELP)
    ao.add_argument("--mcpu", default=None,
                    help="with --target cpu: the LLVM CPU name to build for, e.g. skylake-avx512 "
                         "(default: this host's)")
    ao.add_argument("--out", default=None, help="folder to write the pack to (one .so per kernel + manifest); "
                                                 "required unless --model")
    ao.add_argument("--model", default=None, metavar="CHECKPOINT_DIR",
                    help="with --target cpu: build the kernels this checkpoint's generate runs into your kernel "
                         "cache (a dry run learns them), --jobs at a time")
    ao.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="with --model: the dtype the model is loaded in (default: float32)")
    ao.add_argument("--weights", default=None, choices=("int8", "bfloat16"),
                    help="with --model: the model's projections quantized as quantize_weights does")
    ao.add_argument("--ops", default="", help=OPS_HELP.format(default="all", ops="{ops}"))
    ao.add_argument("--preset", default="default",
                    help="model preset or group whose shapes are built: default, all, mamba-130m, ...")
    ao.add_argument("--seqlens", default="512,2048",
                    help="comma-separated sequence-length buckets, powers of two (default: %(default)s)")
    ao.add_argument("--batches", default="1,4",
                    help="comma-separated batch buckets, powers of two (default: %(default)s)")
    ao.add_argument("--configs", default=None, metavar="FILE.json",
                    help="build exactly these kernel configurations (scripts/gpu_check.py configs writes one)")
    ao.add_argument("--jobs", type=int, default=0,
                    help="with --target cpu: kernels built at once, in processes (default: one per core); "
                         "kernels already in this user's kernel cache are copied, not rebuilt")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "roofline" and not args.preset:
        args.preset = ["default"]
    try:
        if args.cmd in ("aot", "tune"):  # their own code reads --ops / --arch: checked here first
            _checked_ops(args.ops, args.cmd)
            if args.target == "cuda":
                _checked_arch(args.arch, args.cmd)
        if args.cmd == "aot":
            from tvm_mamba.tools import aot

            if args.model and (args.target != "cpu" or args.out or args.configs):
                raise _UsageError("aot --model: builds CPU kernels into your kernel cache; give --target cpu, "
                                  "and no --out or --configs")
            if not args.model and not args.out:
                raise _UsageError("aot: --out is required (or --model CHECKPOINT_DIR with --target cpu)")

            return aot.main(args)
        return {"info": cmd_info, "build-check": cmd_build_check, "sim-check": cmd_sim_check, "cache": cmd_cache,
                "roofline": cmd_roofline,
                "tune": cmd_tune}[args.cmd](args)
    except _UsageError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
