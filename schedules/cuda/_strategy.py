"""The GPU's half of the strategy protocol (tvm_mamba/compute/strategy.py), mixed into every op family's GPU
strategy (the scans' ``CudaLayout`` / ``CudaTimeLayout``, SSD's and Mamba-3's ``Gpu``): blocks of tasks on
blockIdx.x, a block's tasks on threadIdx.x, a task's axes serial in its thread (no vectors)."""
from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from ...compute._math import math_for
from ...compute.strategy import Strategy


class GpuLoops:
    """Put first in the bases (``class Gpu(GpuLoops, ChunkStrategy)``): its loops override the serial ones."""

    name = "gpu"
    vector = False
    checks_values = False  # a device kernel cannot raise: the op reads the indices before the launch

    def block_loop(self, n):
        return T.thread_binding(n, thread="blockIdx.x")

    def thread_loop(self, n):
        return T.thread_binding(n, thread="threadIdx.x")


class GpuStrategy(GpuLoops, Strategy):
    """The protocol alone on a GPU, for a template with no family vocabulary (the conv1d decode step):
    ``threads`` tasks a block, scratch in registers, the target's native float32 math."""

    def __init__(self, threads: int):
        super().__init__(math_for(native=True), threads=threads, scope="local")


CUDA_SHARED_BYTES = 48 * 1024  # a CUDA block's static shared memory: what the rules' default tiles are sized for

# ---- a GPU target's capabilities, for the rules that schedule TE computes (norms, int8 dot, linear) ----------
_HALF = ("bfloat16", "float16")


def _supports(target, attr: str) -> bool:
    """A ``supports_*`` attribute where the target kind has one (Vulkan's ``supports_float64``,
    ``supports_8bit_buffer``, ...), else whether the kind is one whose codegen has every scalar type (CUDA,
    ROCm). WebGPU (WGSL: f32, i32, u32 only) and any kind not listed say no."""
    if attr in target.attrs:
        return bool(target.attrs[attr])
    return target.kind.name in ("cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class GpuCaps:
    """What a GPU target offers a rule, read from ``target.attrs`` (the kind only where no attribute says it):

    - ``max_threads``: threads a block may have (``max_num_threads``: CUDA 1024, WebGPU 256);
    - ``shared_bytes``: shared memory a block may allocate (``max_shared_memory_per_block``: 48 KB of CUDA
      static shared memory, WebGPU's 16 KB of workgroup memory);
    - ``warp``: ``thread_warp_size`` (CUDA 32). At 1 (WebGPU, no subgroups) TVM lowers a cross-thread reduction
      to a tree in shared memory, one float per thread, instead of warp shuffles: see :meth:`reduction_bytes`;
    - ``tensor_cores`` (wmma, and the bf16 splits staged for them) and ``dp4a`` (``__dp4a``): CUDA, whose
      ``arch`` says which (tensor cores from sm_80: int8 and bf16 wmma); no attribute exists for either;
    - ``float64``: float64 arithmetic (WGSL has none);
    - ``bytes``: 8-bit buffers (int8 codes, uint8 masks); without them an 8-bit tensor is passed as the
      32-bit words of its bytes (compute/int8_dot/codes.py);
    - ``halves``: bfloat16 / float16 buffers; without them the kernels take float32 (:meth:`storable`);
    - ``libm``: C libm's functions beyond exp / log / tanh / sin / cos (CUDA's log1pf, expm1f, sincospif);
    - ``int64``: 64-bit integers (WGSL has none: slot indices are taken as int32, :meth:`storable`)."""

    max_threads: int
    shared_bytes: int
    warp: int
    tensor_cores: bool
    dp4a: bool
    float64: bool
    bytes: bool
    halves: bool
    libm: bool = True  # C libm's names beyond exp / log / tanh (log1pf, expm1f, sincospif): CUDA, not WGSL
    int64: bool = True  # 64-bit integers (slot indices): not WGSL

    @classmethod
    def of(cls, target) -> "GpuCaps":
        a = target.attrs
        arch = str(a.get("arch", "")) if target.kind.name == "cuda" else ""
        sm = int(arch[3:]) if arch.startswith("sm_") and arch[3:].isdigit() else 0
        return cls(max_threads=int(a.get("max_num_threads", 1024)),
                   shared_bytes=int(a.get("max_shared_memory_per_block", 48 * 1024)),
                   warp=int(a.get("thread_warp_size", 32)), tensor_cores=sm >= 80, dp4a=sm >= 61,
                   float64=_supports(target, "supports_float64"), bytes=_supports(target, "supports_8bit_buffer"),
                   halves=_supports(target, "supports_16bit_buffer"), libm=target.kind.name == "cuda",
                   int64=target.kind.name != "webgpu")

    def threads(self, candidates) -> tuple:
        """The thread counts of ``candidates`` a block may have (at least the smallest one)."""
        fit = tuple(t for t in candidates if t <= self.max_threads)
        return fit or tuple(candidates)[:1]

    def reduction_bytes(self, threads: int) -> int:
        """Shared memory of one cross-thread float32 reduction over ``threads`` threads: a float per warp on a
        shuffle target (the warps' partial sums), a float per thread where there are no shuffles (warp 1)."""
        return 4 * (threads // self.warp if self.warp > 1 else threads)

    def storable(self, dims):
        """``dims`` with every bfloat16 / float16 dtype field made float32 where the target has no 16-bit
        buffers, and every int64 one (slot indices) int32 where it has no 64-bit integers (WGSL has neither):
        the kernels there take 32-bit tensors, which the WebGPU launcher converts (bf16 / fp16 / int64 tensors on
        their way to the adapter and back; runtime/webgpu_launch.py)."""
        swap = {} if self.halves else {h: "float32" for h in _HALF}
        if not self.int64:
            swap["int64"] = "int32"
        narrow = {f.name: swap[getattr(dims, f.name)] for f in dataclasses.fields(dims)
                  if f.name.endswith("_dtype") and getattr(dims, f.name) in swap}
        return dataclasses.replace(dims, **narrow) if narrow else dims
