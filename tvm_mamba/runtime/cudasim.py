"""Run TVM's CUDA kernels on the CPU, with the CUDA execution model (docs/cuda_sim.md).

A kernel key whose target is ``cudasim-sm_XY`` is scheduled exactly like ``cuda-sm_XY`` (same rule, same
decisions) and lowered by TVM's own pipeline. The two halves are then built like this:

* host: TVM's generated host function, compiled for LLVM as usual. It checks the arguments, computes the
  grid and block extents from the symbolic batch / seqlen, and calls each kernel by name through the packed
  calling convention, exactly as it calls the CUDA module's functions on a GPU;
* device: the CUDA C source TVM generates (``inspect_source("cuda")``, after ``tvm_callback_cuda_postproc``
  when one is registered: the text nvcc compiles in ``build-check``), compiled by g++ against this package's
  ``cudasim_include/`` (``cuda.h``, ``cuda_bf16.h``, ... stand-ins for ``tvm_mamba_cudasim.h``), plus one
  generated entry point per kernel, ``__tvm_ffi_<kernel>``, that takes the packed arguments and launch
  extents and runs the grid (``tvm_mamba_sim::launch``).

Both objects are linked into one shared library, so ``tvm.runtime.load_module`` finds the kernels where the
host code looks them up (the module itself), and the disk cache stores it like any other kernel.

At call time every tensor argument is copied into a buffer of exactly its size placed between
``PROT_NONE`` guard pages (bytes between the buffer and a guard page hold 0xFF canaries, checked after the
call), presented to the host code as a CUDA tensor, and copied back. An access outside it faults; the fault is
caught inside the kernel and reported with the argument it hit.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import subprocess
import tempfile
import threading

import filelock
import tvm
import tvm_ffi
from tvm.target import Target

from .cudasim_guard import Guarded as _Guarded
from .cudasim_guard import dltensor_of as _dltensor_of

PREFIX = "cudasim-"
_INCLUDE = pathlib.Path(__file__).resolve().parent / "cudasim_include"
ORDERS = {"random": 0, "forward": 1, "reversed": 2}
MIN_ARCH = 80  # bf16 arithmetic (cuda_bf16.h's operators, __hgt) needs sm_80; older archs fail in nvcc


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """arch: the CUDA arch whose source is run (``sm_90``); order: the order threads and blocks run in
    (``random``: seeded by ``seed``, ``forward``, ``reversed``); checks: the race and alignment checker
    (tvm_mamba_cudasim_checks.h: every access to shared memory and the argument buffers recorded per barrier
    interval; a kernel is built with the checker's instrumentation only when they are on: cache.cache_path
    keeps the two builds apart, and turning them on for a build without it is an error, not a silent pass)."""

    arch: str = "sm_90"
    order: str = "random"
    seed: int = 0
    checks: bool = dataclasses.field(default_factory=lambda: os.environ.get("TVM_MAMBA_SIM_CHECKS", "1") != "0")

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order: expected one of {sorted(ORDERS)}, got {self.order!r}")
        if not (isinstance(self.arch, str) and self.arch.startswith("sm_") and self.arch[3:].isdigit()):
            raise ValueError(f"arch: expected a CUDA arch such as 'sm_90', got {self.arch!r}")
        if int(self.arch[3:]) < MIN_ARCH:
            raise ValueError(f"arch: {self.arch!r} is below the minimum sm_{MIN_ARCH} (the kernels use sm_80's bf16 "
                             "arithmetic); use 'sm_80' or newer, e.g. 'sm_90'")

    @property
    def target_key(self) -> str:
        return PREFIX + self.arch


_active: list[SimConfig] = []


@contextlib.contextmanager
def simulate(arch: str = "sm_90", order: str = "random", seed: int = 0, checks: bool | None = None):
    """``with simulate("sm_90"):`` every kernel call on CPU tensors runs the CUDA kernels of ``arch`` through
    this harness instead of the CPU kernels (the kernel keys say ``cudasim-sm_90``; ``explain`` shows it).
    ``checks=False`` turns the race and alignment checker off (SimConfig)."""
    cfg = SimConfig(arch, order, seed) if checks is None else SimConfig(arch, order, seed, checks)
    _active.append(cfg)
    try:
        yield cfg
    finally:
        _active.remove(cfg)


def active() -> SimConfig | None:
    return _active[-1] if _active else None


def current() -> SimConfig:
    """The configuration a simulated kernel is built and called under: the innermost ``simulate``, else the
    defaults (checks from $TVM_MAMBA_SIM_CHECKS)."""
    return _active[-1] if _active else SimConfig()


def variant(target_key: str) -> str:
    """What a simulated build of ``target_key`` depends on beyond the kernel (a part of its cache file's
    name): "checks" when the checker is on, whose instrumentation slows every memory access, "" otherwise
    and for any other target."""
    return "checks" if target_key.startswith(PREFIX) and current().checks else ""


def is_sim(target_key: str) -> bool:
    return target_key.startswith(PREFIX)


# ---- build -----------------------------------------------------------------------------------------------------
def lower(mod: tvm.IRModule, target: Target) -> tuple[tvm.IRModule, tvm.IRModule, Target]:
    """TVM's ``tirx.build`` up to code generation (steps 0-6 of ``tvm/tirx/build.py``): (host IRModule,
    device IRModule, host target)."""
    from tvm.tirx.build import split_host_device_mods

    target_host = Target("llvm")
    bound = Target(target).with_host(target_host)
    mod = tvm.tirx.transform.BindTarget(bound)(mod)
    pipeline, finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    mod = pipeline(mod)
    host_mod, device_mods = split_host_device_mods(mod)
    host_mod = finalize_host()(host_mod)
    if len(device_mods) != 1:
        raise RuntimeError(f"cudasim: expected one device module, got {len(device_mods)}")
    (device_mod,) = (finalize_device()(m) for m in device_mods.values())
    return host_mod, device_mod, target_host


@dataclasses.dataclass
class SimBuild:
    """The two halves of one simulated kernel key, ready to be linked by :meth:`export_library`."""

    host: object  # tvm runtime Module (LLVM)
    source: str  # the CUDA C source, as nvcc would receive it
    kernels: tuple  # ((name, (launch tags...)), ...)
    arch: str
    label: str = ""
    checks: bool = False  # compiled with the checker's instrumentation (CHECK_FLAGS)

    def export_library(self, path: str) -> None:
        link(self, path)


def load(path: str):
    """Load a simulated kernel library. It holds the host code and the kernels' entry points; TVM's host code
    looks kernels up in its module's *imports* (then the global registry), so the library is loaded twice,
    kernels first: the second load (whose ``__tvm_ffi__library_ctx`` the host code then uses) imports the
    first."""
    kernels = tvm.runtime.load_module(path)
    host = tvm.runtime.load_module(path)
    host.import_module(kernels)
    return host


def build(mod: tvm.IRModule, target: Target, label: str = "", checks: bool = False) -> SimBuild:
    """Lower ``mod`` (scheduled for the CUDA ``target``) and generate host code and CUDA source; ``checks``:
    link() instruments the kernels for the race and alignment checker."""
    from tvm.tirx.build import codegen_build

    with target:
        host_mod, device_mod, target_host = lower(mod, target)
        source = codegen_build(device_mod, target).inspect_source("cuda")
        host = codegen_build(host_mod, target_host)
    kernels = tuple((str(gv.name_hint), tuple(str(t) for t in f.attrs["tirx.kernel_launch_params"]))
                    for gv, f in device_mod.functions.items())
    return SimBuild(host, source, kernels, str(target.attrs["arch"]), label, checks)


# extern __shared__ T name[];  ->  T* name = <the block's dynamic shared memory>;  (the one textual rewrite:
# an extern array cannot be made per block by a macro; docs/cuda_sim.md)
_DYN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;")


def prepare_source(source: str) -> str:
    return _DYN_SHARED.sub(r"TVM_MAMBA_SIM_DYN_SHARED(\1, \2);", source)


def entry_points(kernels) -> str:
    lines = ["", "// ---- tvm_mamba cudasim: one packed entry point per kernel (generated) ----"]
    for name, tags in kernels:
        tag_list = ", ".join(f'"{t}"' for t in tags) or "nullptr"
        lines += [
            f'extern "C" __attribute__((visibility("default"))) int __tvm_ffi_{name}(void*, const TVMFFIAny* args,',
            "    int32_t nargs, TVMFFIAny*) {",
            f"  static const char* const tags[] = {{{tag_list}}};",
            "  ::tvm_mamba_sim::FpMode fp_mode;  // the nvcc flags' fp mode (-ftz) while the kernel runs",
            f'  return ::tvm_mamba_sim::launch("{name}", &{name}, args, nargs, tags, {len(tags)});',
            "}",
        ]
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def _nvcc_version() -> tuple[int, int]:
    """The CUDA version whose nvcc compiles build-check's source (it decides the source's #if branches)."""
    from .nvcc import nvcc_path

    nvcc = nvcc_path()
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release (\d+)\.(\d+)", out)
        if m:
            return int(m.group(1)), int(m.group(2))
    return 12, 8


def compile_flags(arch: str) -> list[str]:
    major, minor = _nvcc_version()
    ffi_inc = pathlib.Path(tvm_ffi.__file__).resolve().parent / "include"
    return ["-std=c++17", "-O1", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off", "-fwrapv",
            "-fsanitize=bounds", "-fsanitize-undefined-trap-on-error", "-w",
            f"-D__CUDA_ARCH__={int(arch[3:]) * 10}", f"-D__CUDACC_VER_MAJOR__={major}",
            f"-D__CUDACC_VER_MINOR__={minor}", *fast_math_defines(), f"-I{_INCLUDE}", f"-I{ffi_inc}",
            "-include", "tvm_mamba_cudasim.h"]


def fast_math_defines() -> list[str]:
    """``-D__USE_FAST_MATH__`` exactly when nvcc's flag set (nvcc.NVCC_FLAGS) holds --use_fast_math, as nvcc
    defines it: the harness then computes expf, logf, tanhf, ... and flushes subnormals as the GPU binary does
    (cudasim_include/tvm_mamba_cudasim_fastmath.h)."""
    from .nvcc import NVCC_FLAGS

    return ["-D__USE_FAST_MATH__"] if "--use_fast_math" in NVCC_FLAGS else []


def _explain_compile_error(log: str, label: str) -> str:
    missing = sorted(set(re.findall(r"['\u2018]([A-Za-z_]\w*)['\u2019] was not declared in this scope", log)) |
                     set(re.findall(r"no matching function for call to ['\u2018]([A-Za-z_]\w*)\(", log)))
    head = f"cudasim: {label}: g++ could not compile the CUDA source"
    if missing:
        head += ("; it uses " + ", ".join(f"`{m}`" for m in missing) +
                 ", which tvm_mamba's CUDA execution header does not implement")
    if re.search(r"Error: no such instruction|unknown mnemonic|invalid instruction", log):
        head += "; it contains inline PTX (asm), which the harness does not execute"
    return head + "\n" + "\n".join(l for l in log.splitlines() if "error" in l.lower())[:3000]


# g++'s ThreadSanitizer instrumentation (only for a build with checks on: SimBuild.checks), used only as a hook: a call to __tsan_read4(addr), __tsan_write16(addr),
# ... before every memory access, which tvm_mamba_cudasim_checks.h implements (libtsan is never linked: the
# link step has no -fsanitize=thread). -fno-tree-sra keeps a float4 / uint4 copy one 16-byte access (else g++
# splits it into four 4-byte ones before instrumenting, and a misaligned vector access could not be seen).
CHECK_FLAGS = ["-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0", "-fno-tree-sra"]


HARNESS_DIR = "cudasim-harness"  # in the kernel cache: the harness's runtime object and header, per flag set


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=dict(os.environ, LC_ALL="C"))


@dataclasses.dataclass(frozen=True)
class Harness:
    """The harness compiled once for one flag set: ``runtime`` (the object every kernel library links: the
    scheduler, the checker, the entry points; ``TVM_MAMBA_SIM_RUNTIME`` in tvm_mamba_cudasim.h) and ``header``
    (a stub that includes the real header, with the precompiled ``.gch`` beside it; None where g++ could not
    precompile it, then the kernels include the header itself)."""

    runtime: pathlib.Path
    header: pathlib.Path | None


def harness(cxx: str, flags: list[str]) -> Harness:
    """The harness for exactly ``flags`` (the kernels' compile flags), built on first use into the kernel cache,
    in a folder named by the digest of the compiler, the flags and every file the header includes (an edited
    header or another flag set gets its own). The runtime is thousands of lines that g++ would otherwise
    optimize again for every kernel; the precompiled header saves parsing it (~57,000 lines preprocessed)."""
    base = [f for f in flags if f not in ("-include", "tvm_mamba_cudasim.h")]
    key = _harness_key(cxx, tuple(base))
    from .cache_dir import build_root, private_mkdir, require_trusted

    folder = build_root() / HARNESS_DIR / key
    runtime, stub, gch = _harness_files(folder)
    if not runtime.is_file():
        private_mkdir(folder)
        with filelock.FileLock(str(folder / "build.lock"), timeout=600):
            if not runtime.is_file():
                _build_harness(cxx, flags, base, folder)
    for path in (folder.parent, folder, runtime, stub, gch):  # linked into, or read for, code this process runs
        require_trusted(path, "CUDA harness file")
    return Harness(runtime, stub if gch.is_file() else None)


def _harness_files(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(runtime object, header stub, its precompiled .gch) in a harness folder."""
    return folder / "runtime.o", folder / "tvm_mamba_cudasim.h", folder / "tvm_mamba_cudasim.h.gch"


def _build_harness(cxx: str, flags: list[str], base: list[str], folder: pathlib.Path) -> None:
    """Compile the runtime object (an error if it does not compile) and precompile the header (skipped if it
    does not), each to a temporary name first, so a reader never sees half a file."""
    runtime, stub, gch = _harness_files(folder)
    empty = folder / "runtime.cc"
    empty.write_text("// the harness runtime: everything tvm_mamba_cudasim.h guards by TVM_MAMBA_SIM_RUNTIME\n")
    tmp = folder / f"runtime.o.{os.getpid()}.tmp"
    proc = _run([cxx, *flags, "-DTVM_MAMBA_SIM_RUNTIME", "-c", "-o", str(tmp), str(empty)], str(folder))
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(_explain_compile_error(proc.stdout + proc.stderr, "the harness runtime"))
    stub.write_text(f'#include "{_INCLUDE / "tvm_mamba_cudasim.h"}"\n')
    tmp_gch = folder / f"{gch.name}.{os.getpid()}.tmp"
    if _run([cxx, *base, "-x", "c++-header", "-o", str(tmp_gch), str(stub)], str(folder)).returncode == 0:
        os.chmod(tmp_gch, 0o600)
        os.replace(tmp_gch, gch)
    else:
        tmp_gch.unlink(missing_ok=True)
    os.chmod(tmp, 0o600)
    os.replace(tmp, runtime)  # last: its presence says the folder is complete


@functools.lru_cache(maxsize=None)
def _harness_key(cxx: str, base: tuple) -> str:
    """sha256 (16 hex digits) of the compiler's version, ``base`` and the contents of every file the harness
    header includes (g++ -M)."""
    proc = _run([cxx, *base, "-M", "-x", "c++", str(_INCLUDE / "tvm_mamba_cudasim.h")], str(_INCLUDE))
    ver = _run([cxx, "--version"], str(_INCLUDE))
    if proc.returncode != 0 or ver.returncode != 0:
        raise RuntimeError(_explain_compile_error(proc.stdout + proc.stderr + ver.stderr, "the harness header"))
    deps = sorted(set(proc.stdout.replace("\\\n", " ").split()[1:]))
    h = hashlib.sha256(ver.stdout.encode() + repr(base).encode())
    for dep in deps:
        h.update(dep.encode() + pathlib.Path(dep).read_bytes())
    return h.hexdigest()[:16]


def link(b: SimBuild, path: str) -> None:
    """Compile the kernels with g++ (instrumented for the checker when ``b.checks``) and link them with the
    host object and the harness runtime (built once per flag set) into one shared library at ``path``."""
    cxx = os.environ.get("CXX") or "g++"
    ffi_lib = pathlib.Path(tvm_ffi.__file__).resolve().parent / "lib"
    with tempfile.TemporaryDirectory(prefix="tvm_mamba_cudasim_") as tmp:
        cu = pathlib.Path(tmp, "kernels.cu")
        cu.write_text(prepare_source(b.source))
        wrap = pathlib.Path(tmp, "entry.cc")
        wrap.write_text('#include "kernels.cu"\n' + entry_points(b.kernels))
        host_o = pathlib.Path(tmp, "host.o")
        b.host.write_to_file(str(host_o))
        kernels_o = pathlib.Path(tmp, "kernels.o")
        flags = [*compile_flags(b.arch), *(CHECK_FLAGS if b.checks else [])]
        h = harness(cxx, flags)
        compile_cmd = [cxx, *flags, "-c", "-o", str(kernels_o), str(wrap)]
        proc = _run(_with_header(compile_cmd, h.header), tmp) if h.header else None
        if proc is None or proc.returncode != 0:  # a failure is judged, and explained, without the PCH
            proc = _run(compile_cmd, tmp)
        if proc.returncode == 0:
            proc = _run([cxx, "-shared", "-o", path, str(kernels_o), str(h.runtime), str(host_o), f"-L{ffi_lib}",
                         "-ltvm_ffi", f"-Wl,-rpath,{ffi_lib}"], tmp)
        if proc.returncode != 0:
            raise RuntimeError(_explain_compile_error(proc.stdout + proc.stderr, b.label or "kernel"))


def _with_header(cmd: list[str], stub: pathlib.Path) -> list[str]:
    """``cmd`` with ``-include tvm_mamba_cudasim.h`` pointing at the precompiled header's stub."""
    i = cmd.index("tvm_mamba_cudasim.h")
    return [*cmd[:i], str(stub), *cmd[i + 1:]]


_call_lock = threading.Lock()


class SimError(RuntimeError):
    """A simulated CUDA kernel failed: a fault, a barrier / warp error, or an out-of-bounds write."""


def call(module, fn, args, cfg: SimConfig | None = None, label: str = "") -> None:
    """Run host function ``fn`` of a simulated kernel module on ``args`` (DLPack tensors, e.g. CPU torch
    tensors, and scalars). It runs twice on fresh guarded copies of the arguments: once with every buffer as
    close to its trailing guard page as alignment allows and thread order ``cfg.seed``, once flush against its
    leading guard page and seed + 1. A fault in either, a written canary, or a result that differs between the two runs (a race:
    the answer depends on the order threads or blocks run in) raises SimError. The second run's results are
    copied back into ``args``."""
    cfg = cfg or current()
    with _call_lock:
        tensors = [(i, _dltensor_of(a)) for i, a in enumerate(args)]
        first = None
        for run, head in enumerate((False, True)):
            guarded = _run_once(module, fn, args, tensors, head, cfg.seed + run, ORDERS[cfg.order], label,
                                checks=cfg.checks)
            try:
                if first is None:
                    first = [ctypes.string_at(g.data, g.nbytes) for g in guarded]
                    continue
                for g, before in zip(guarded, first):
                    if ctypes.string_at(g.data, g.nbytes) != before:
                        raise SimError(f"cudasim: {label}: argument #{g.index} {g.describe()} differs between two "
                                       "runs in different thread / block orders: a race (a missing barrier?)")
                for g in guarded:
                    g.copy_back()
            finally:
                for g in guarded:
                    g.free()


def _run_once(module, fn, args, tensors, head: bool, seed: int, order: int, label: str,
              checks: bool = False) -> list[_Guarded]:
    """One run on fresh guarded copies; ``checks``: with the race / alignment checker watching those copies."""
    guarded, passed = [], []
    try:
        for (i, dl), a in zip(tensors, args):
            if dl is None:
                passed.append(a)
                continue
            g = _Guarded(i, dl, head)
            guarded.append(g)
            passed.append(g.tensor())
        module["tvm_mamba_sim_config"](order, seed)
        watched = [v for g in guarded for v in (g.index, g.data, g.nbytes)] if checks else []
        try:
            module["tvm_mamba_sim_checks"](int(checks), *watched)
        except RuntimeError as err:  # checks asked of a library built without them
            raise SimError(f"cudasim: {label}: {err}") from None
        try:
            fn(*passed)
        except Exception as err:  # noqa: BLE001 - re-raised with the argument the fault hit
            raise SimError(_locate(str(err), guarded, label)) from None
        finally:
            module["tvm_mamba_sim_checks"](0)
        for g in guarded:
            bad = g.check_canaries()
            if bad:
                raise SimError(f"cudasim: {label}: {bad}")
        return guarded
    except BaseException:
        for g in guarded:
            g.free()
        raise


def _locate(msg: str, guarded: list[_Guarded], label: str) -> str:
    m = re.search(r"at address 0x([0-9a-f]+)", msg)
    if m:
        addr = int(m.group(1), 16)
        for g in guarded:
            where = g.where(addr)
            if where:
                return f"{msg.strip()} ({where}) [{label}]"
    return f"{msg.strip()} [{label}]"
