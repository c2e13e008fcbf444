"""Torch device -> TVM target, and the short target key used in cache paths and kernel keys.

CPU: ``llvm`` with the host's real ``mcpu`` as LLVM detects it (``rocketlake``, ``znver5``, ...) and
``num-cores``. Never ``mcpu=native``: TVM 0.27 logs that it is invalid and silently falls back to
``generic`` (2.9x slower RMSNorm in the field guide).
CUDA: ``cuda`` with the device's ``sm_XY`` arch, read from torch for ``cuda:N``, or given explicitly for
cross-compiling on a machine without a GPU (``cuda_target("sm_90")``).
"""
from __future__ import annotations

import functools
import os

# TVM's thread pool assumes 2-way hyperthreading on x86 and uses hardware_concurrency()/2 threads. On
# these 2-vCPU machines that is one thread (conv1d forward: 740 us with 1 thread, 420 us with 2). Use
# every CPU this process may run on unless the user said otherwise. Must be set before the pool starts.
def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one: Linux; else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


os.environ.setdefault("TVM_NUM_THREADS", str(usable_cpus()))

import tvm  # noqa: E402
from tvm.target import Target  # noqa: E402
from .cudasim import active as cudasim_active  # noqa: E402
from .webgpu import active as webgpu_active  # noqa: E402

CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100")


@functools.lru_cache(maxsize=None)
def host_cpu() -> str:
    """LLVM's name for this host CPU (e.g. ``rocketlake``, ``znver5``); ``generic`` if unknown."""
    name = str(tvm.target.codegen.llvm_get_system_cpu())
    return name if name and name != "native" else "generic"


@functools.lru_cache(maxsize=None)
def host_has_avx512() -> bool:
    """Whether the host CPU target has AVX-512 (16 float32 lanes a vector register)."""
    try:
        return bool(tvm.target.codegen.target_has_features("avx512f", cpu_target()))
    except Exception:  # a CPU LLVM cannot query (another architecture): no
        return False


def num_cores() -> int:
    return int(os.environ.get("TVM_NUM_THREADS") or usable_cpus())


# LLVM AArch64 CPU names (``llc -mtriple=aarch64 -mcpu=help``) by prefix: a key ``llvm-neoverse-v1`` is built for
# aarch64-linux-gnu, so ``build-check --target cpu --mcpu neoverse-v1`` checks the CPU strategies' ARM codegen
ARM_CPU_PREFIXES = ("neoverse-", "cortex-a", "cortex-x", "apple-", "a64fx", "ampere", "thunderx", "oryon", "grace")


@functools.lru_cache(maxsize=None)
def cpu_target(mcpu: str | None = None) -> Target:
    """The llvm target for this host (or for ``mcpu`` when cross-compiling for another CPU: an x86 one with the
    host's triple, an AArch64 one (ARM_CPU_PREFIXES) with ``aarch64-linux-gnu``)."""
    mcpu = mcpu or host_cpu()
    arm = mcpu.startswith(ARM_CPU_PREFIXES)
    return Target({
        "kind": "llvm",
        "mtriple": "aarch64-linux-gnu" if arm else str(tvm.target.codegen.llvm_get_system_triple()),
        "mcpu": mcpu,
        "num-cores": num_cores(),
    })


@functools.lru_cache(maxsize=None)
def cuda_target(arch: str = "sm_90") -> Target:
    """A CUDA target for ``arch`` (``sm_80``, ``sm_90``, ...), usable with no GPU present."""
    if not (isinstance(arch, str) and arch.startswith("sm_") and arch[3:].isdigit()):
        raise ValueError(f"arch: expected a CUDA arch such as 'sm_90', got {arch!r}")
    # max_shared_memory_per_block etc. given explicitly: a bare {"kind": "cuda"} warns and assumes 48 KiB.
    return Target({
        "kind": "cuda", "arch": arch,
        "max_shared_memory_per_block": 49152, "max_threads_per_block": 1024,
        "thread_warp_size": 32, "max_num_threads": 1024,
    })


# WebGPU's default limits (the spec's: what every adapter grants without asking): invocations a workgroup,
# workgroup memory in bytes, storage buffers a shader stage. No warp: TVM's WebGPU codegen has no shuffles.
WEBGPU_LIMITS = {"max_num_threads": 256, "max_shared_memory_per_block": 16384, "max_storage_buffers": 8}


@functools.lru_cache(maxsize=None)
def webgpu_target() -> Target:
    """The WebGPU target (WGSL; runtime/webgpu.py runs it through wgpu) at WebGPU's default limits, so a kernel
    built for it runs on any adapter; its host code is never run (the launcher reads the lowered host
    function), so its host is the generic CPU."""
    return Target({"kind": "webgpu", "max_num_threads": WEBGPU_LIMITS["max_num_threads"],
                   "max_shared_memory_per_block": WEBGPU_LIMITS["max_shared_memory_per_block"],
                   "thread_warp_size": 1, "supports_subgroups": False}, host="llvm")


def target_for_device(device) -> Target:
    """The TVM target that serves tensors on torch ``device`` (a torch.device or its string)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cpu":
        return cpu_target()
    if kind == "cuda":
        import torch  # only here: runtime/ is torch-free everywhere else

        index = getattr(device, "index", None)
        major, minor = torch.cuda.get_device_capability(index if index is not None else 0)
        return cuda_target(f"sm_{major}{minor}")
    raise ValueError(f"device: tvm_mamba runs on 'cpu' and 'cuda' tensors, got {device!r}")


def device_target_key(device) -> str:
    """The target key serving torch ``device`` without constructing a Target (works with only the TVM
    runtime installed: then the CPU key comes from the active kernel pack)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cpu":
        if webgpu_active():  # `with tvm_mamba.webgpu():` CPU tensors run the WebGPU kernels through wgpu
            return "webgpu"
        sim = cudasim_active()
        if sim is not None:  # `with tvm_mamba.simulate_cuda(arch):` CPU tensors run the CUDA kernels
            return sim.target_key
    if kind == "cuda":
        import torch

        index = getattr(device, "index", None)
        major, minor = torch.cuda.get_device_capability(index if index is not None else 0)
        return f"cuda-sm_{major}{minor}"
    if kind != "cpu":
        raise ValueError(f"device: tvm_mamba runs on 'cpu' and 'cuda' tensors, got {device!r}")
    try:
        return f"llvm-{host_cpu()}"
    except AttributeError:  # runtime-only TVM: no LLVM to ask
        from .pack import active_pack

        pk = active_pack()
        if pk is None or not pk.target.startswith("llvm-"):
            raise RuntimeError("this TVM has no compiler (TVM_USE_RUNTIME_LIB=1) and no CPU kernel pack is set "
                               "($TVM_MAMBA_KERNEL_PACK)") from None
        return pk.target


def target_key(target: Target) -> str:
    """Short, path-safe name of a target: ``llvm-rocketlake`` or ``cuda-sm_90``."""
    kind = target.kind.name
    if kind == "llvm":
        return f"llvm-{target.attrs.get('mcpu', 'generic')}"
    if kind == "cuda":
        return f"cuda-{target.attrs.get('arch', 'sm_unknown')}"
    return kind


def target_from_key(key: str) -> Target:
    """Inverse of :func:`target_key`."""
    kind, _, rest = key.partition("-")
    if kind == "llvm":
        return cpu_target(rest)
    if kind in ("cuda", "cudasim"):  # cudasim: the CUDA kernels, run on the CPU by runtime/cudasim.py
        return cuda_target(rest)
    if key == "webgpu":
        return webgpu_target()
    raise ValueError(f"target: unknown target key {key!r} (expected 'llvm-<mcpu>', 'cuda-sm_XY', 'cudasim-sm_XY' "
                     "or 'webgpu')")
