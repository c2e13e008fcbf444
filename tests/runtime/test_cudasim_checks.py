"""The harness's race, alignment and wmma checks (cudasim_include/tvm_mamba_cudasim_checks.h, mma.h) catch the
GPU bugs the plain harness computes right: hand-written CUDA C mutants (a lost update, a missing barrier, a
misaligned float4, a wmma called with a per-lane or misaligned pointer or by half a warp) are reported, naming
the kind, the buffer and both threads; correct kernels (barriers, __syncwarp, atomics, a whole-warp wmma) are
not, in every thread order.

Every hand kernel lives in one library, built once: a TIR function per kernel gives TVM's host code (the
launch: its grid, block and arguments) and tvm_callback_cuda_postproc replaces the device source with the
hand-written kernels of the same names."""
from __future__ import annotations

import pytest
import torch
import tvm
from tvm.script import tirx as T

from tvm_mamba.runtime import cuda_target, cudasim
from tvm_mamba.runtime.cudasim import SimConfig, SimError

from .test_cudasim import postproc

_CTYPE = {"float32": "float", "bfloat16": "nv_bfloat16"}

# name: (threads per block, blocks, (a dtype, a length), (b dtype, b length), kernel body over a_ptr, b_ptr)
KERNELS = {
    # a non-atomic `s[0] += v` from two warps: the harness's fibers never interleave inside it, so the sum is
    # always right here; on a GPU updates are lost
    "lost_update": (64, 1, ("float32", 64), ("float32", 64), """
  __shared__ float s[1];
  if (threadIdx.x == 0) s[0] = 0.0f;
  __syncthreads();
  s[0] += a_ptr[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) b_ptr[0] = s[0];"""),
    "lost_update_global": (64, 1, ("float32", 64), ("float32", 64), """
  b_ptr[0] += a_ptr[threadIdx.x];"""),
    # thread 0 writes s[0]; warp 1 reads it with no barrier between: right whenever thread 0 runs first
    "missing_barrier": (64, 1, ("float32", 64), ("float32", 64), """
  __shared__ float s[1];
  if (threadIdx.x == 0) s[0] = a_ptr[0];
  b_ptr[threadIdx.x] = (threadIdx.x >= 32 ? s[0] : a_ptr[0]) + a_ptr[threadIdx.x];"""),
    # lane 0 of each warp writes, the other lanes read: the lanes of a warp need a __syncwarp
    "missing_syncwarp": (64, 1, ("float32", 64), ("float32", 64), """
  __shared__ float s[2];
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = a_ptr[threadIdx.x];
  b_ptr[threadIdx.x] = s[threadIdx.x / 32];"""),
    "with_syncwarp": (64, 1, ("float32", 64), ("float32", 64), """
  __shared__ float s[2];
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = a_ptr[threadIdx.x];
  __syncwarp();
  b_ptr[threadIdx.x] = s[threadIdx.x / 32];"""),
    # produce, barrier, consume (reversed), barrier, overwrite, barrier, consume (rotated)
    "producer_consumer": (64, 2, ("float32", 128), ("float32", 128), """
  __shared__ float s[64];
  const int t = threadIdx.x, base = blockIdx.x * 64;
  s[t] = a_ptr[base + t];
  __syncthreads();
  float v = s[63 - t];
  __syncthreads();
  s[t] = 2.0f * v;
  __syncthreads();
  b_ptr[base + t] = s[(t + 1) % 64];"""),
    "atomic_sum": (64, 2, ("float32", 128), ("float32", 128), """
  __shared__ float s[1];
  if (threadIdx.x == 0) s[0] = 0.0f;
  __syncthreads();
  atomicAdd(&s[0], a_ptr[blockIdx.x * 64 + threadIdx.x]);
  atomicAdd(&b_ptr[127], a_ptr[blockIdx.x * 64 + threadIdx.x]);
  __syncthreads();
  if (threadIdx.x == 0) b_ptr[blockIdx.x] = s[0];"""),
    # 16-byte loads / stores at 4 bytes past a 16-byte boundary (a GPU faults: misaligned address)
    "float4_global": (16, 1, ("float32", 68), ("float32", 64), """
  *(float4*)(b_ptr + 4 * threadIdx.x) = *(float4*)(a_ptr + 1 + 4 * threadIdx.x);"""),
    "float4_shared": (16, 1, ("float32", 64), ("float32", 64), """
  __shared__ alignas(16) float s[68];
  *(float4*)(s + 1 + 4 * threadIdx.x) = *(float4*)(a_ptr + 4 * threadIdx.x);
  __syncthreads();
  b_ptr[threadIdx.x] = s[1 + threadIdx.x];"""),
    "float4_aligned": (16, 1, ("float32", 68), ("float32", 64), """
  __shared__ alignas(16) float s[64];
  *(float4*)(s + 4 * threadIdx.x) = *(float4*)(a_ptr + 4 + 4 * threadIdx.x);
  __syncthreads();
  *(float4*)(b_ptr + 4 * threadIdx.x) = *(float4*)(s + 4 * (15 - threadIdx.x));"""),
    "bf16x2_global": (16, 1, ("bfloat16", 34), ("float32", 64), """
  nv_bfloat162 v = *(nv_bfloat162*)(a_ptr + 1 + 2 * threadIdx.x);
  b_ptr[threadIdx.x] = (float)v.x + (float)v.y;"""),
    # D = A B for one 16x16x16 bf16 tile (a: A then B, row-major), by a whole warp, and its mutants
    "wmma_ok": (32, 1, ("bfloat16", 512), ("float32", 256), "WMMA(a_ptr, a_ptr + 256)"),
    "wmma_per_lane": (32, 1, ("bfloat16", 512), ("float32", 256),
                      "WMMA(a_ptr + 16 * (threadIdx.x % 2), a_ptr + 256)"),
    "wmma_misaligned": (32, 1, ("bfloat16", 520), ("float32", 256), "WMMA(a_ptr + 8, a_ptr + 264)"),
    "wmma_half_warp": (32, 1, ("bfloat16", 512), ("float32", 256), """
  if (threadIdx.x < 16) { WMMA(a_ptr, a_ptr + 256); }"""),
}

WMMA = """
#include <mma.h>
#define WMMA(A, B) {                                                                        \\
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, nv_bfloat16, nvcuda::wmma::row_major> fa; \\
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, nv_bfloat16, nvcuda::wmma::row_major> fb; \\
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;              \\
    nvcuda::wmma::fill_fragment(acc, 0.0f);                                                 \\
    nvcuda::wmma::load_matrix_sync(fa, A, 16);                                              \\
    nvcuda::wmma::load_matrix_sync(fb, B, 16);                                              \\
    nvcuda::wmma::mma_sync(acc, fa, fb, acc);                                               \\
    nvcuda::wmma::store_matrix_sync(b_ptr, acc, 16, nvcuda::wmma::mem_row_major);          \\
  }
"""


def _host(name, threads, blocks, a, b):
    """A TIR kernel with the hand kernel's launch and arguments (its body is replaced)."""
    (a_dtype, a_len), (b_dtype, b_len) = a, b

    @T.prim_func
    def f(x: T.Buffer((a_len,), a_dtype), y: T.Buffer((b_len,), b_dtype)):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                y[tx] = T.Cast(b_dtype, x[tx])

    return f


def _device_source(code: str) -> str:
    """TVM's source up to its first kernel (the prelude: includes, macros), then the hand kernels."""
    kernels = []
    for name, (_, _, (a_dtype, _), (b_dtype, _), body) in KERNELS.items():
        kernels.append(f'extern "C" __global__ void {name}_kernel({_CTYPE[a_dtype]}* __restrict__ a_ptr, '
                       f'{_CTYPE[b_dtype]}* __restrict__ b_ptr) {{{body}\n}}\n')
    return code[:code.index('extern "C" __global__')] + WMMA + "\n".join(kernels)


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    mod = tvm.IRModule({name: _host(name, *spec[:4]) for name, spec in KERNELS.items()})
    with postproc(lambda code, target: _device_source(code)):
        built = cudasim.build(mod, cuda_target("sm_90"), label="hand", checks=True)
    path = str(tmp_path_factory.mktemp("hand") / "hand.so")
    built.export_library(path)
    return cudasim.load(path)


def test_checks_need_the_instrumented_build(tmp_path):
    """A library built with checks off has no hooks on its memory accesses: asking it to check is an error
    naming the cause, never a run that records nothing and passes."""
    mod = tvm.IRModule({"lost_update": _host("lost_update", *KERNELS["lost_update"][:4])})
    with postproc(lambda code, target: _device_source(code)):
        built = cudasim.build(mod, cuda_target("sm_90"), label="plain")
    built.export_library(str(tmp_path / "plain.so"))
    plain = cudasim.load(str(tmp_path / "plain.so"))
    run(plain, "lost_update", checks=False)
    with pytest.raises(SimError, match="built without the checker's instrumentation"):
        run(plain, "lost_update", checks=True)


def test_checked_builds_have_their_own_cache_files(monkeypatch):
    """The instrumented and the plain build of one simulated kernel are two cache files (and two memo
    entries); a CPU kernel's file does not depend on the checks setting."""
    from tvm_mamba.runtime import cache, dispatch
    from tvm_mamba.runtime.key import KernelKey

    def path(target, checks):
        monkeypatch.setenv("TVM_MAMBA_SIM_CHECKS", "1" if checks else "0")
        key = KernelKey("rmsnorm_gated", "fwd", (("x", "float32"),), (("hidden", 64),), target, ())
        return cache.cache_path(key, dispatch.Plan(key, (), "default"))

    assert path("cudasim-sm_90", True) != path("cudasim-sm_90", False)
    assert path("llvm-test", True) == path("llvm-test", False)
    with cudasim.simulate("sm_90", checks=True):
        monkeypatch.setenv("TVM_MAMBA_SIM_CHECKS", "0")
        assert cudasim.variant("cudasim-sm_90") == "checks"


def _inputs(name, seed=0):
    """Small integers (sums are exact in any order), as the kernel's dtypes."""
    _, _, (a_dtype, a_len), (b_dtype, b_len), _ = KERNELS[name]
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-4, 5, (a_len,), generator=g).to(getattr(torch, a_dtype))
    return a, torch.zeros(b_len, dtype=getattr(torch, b_dtype))


def run(hand, name, order="random", checks=True, seed=0):
    a, b = _inputs(name)
    cudasim.call(hand, hand[name], [a, b], cfg=SimConfig(order=order, seed=seed, checks=checks), label=name)
    return a, b


# ---- races -----------------------------------------------------------------------------------------------------
def test_lost_update_in_shared_memory(hand):
    a, b = run(hand, "lost_update", checks=False)  # the harness alone: right, every time
    assert b[0] == a.sum()
    with pytest.raises(SimError, match=r"kernel lost_update_kernel: race \((read|write)-write hazard\) on "
                                       r"__shared__ array s \(byte 0\) in block \(0,0,0\): thread \(\d+,0,0\) "
                                       r"(read|wrote) it and thread \(\d+,0,0\) (reads|writes) it"):
        run(hand, "lost_update")


def test_lost_update_in_global_memory(hand):
    a, b = run(hand, "lost_update_global", checks=False)
    assert b[0] == a.sum()
    with pytest.raises(SimError, match=r"race \((read|write)-write hazard\) on argument #1 \(256 bytes; byte 0\)"):
        run(hand, "lost_update_global")


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_missing_barrier_after_a_write(hand, order):
    """Forward: thread 0 writes before anyone reads, the answer is right; reversed: the reads come first. Both
    are the same hazard to the checker."""
    if order == "forward":
        a, b = run(hand, "missing_barrier", order=order, checks=False)
        assert torch.equal(b, a + a[0])
    with pytest.raises(SimError, match=r"race \(read-write hazard\) on __shared__ array s \(byte \d\).*"
                                       r"with no __syncthreads between them"):
        run(hand, "missing_barrier", order=order)


def test_missing_syncwarp_between_lanes(hand):
    with pytest.raises(SimError, match=r"race \(read-write hazard\) on __shared__ array s .* with no __syncwarp "
                                       r"or __syncthreads between them \(lanes of one warp"):
        run(hand, "missing_syncwarp", order="forward")
    a, b = run(hand, "with_syncwarp", order="reversed")
    assert torch.equal(b, a.view(2, 32)[:, :1].expand(2, 32).reshape(-1))


@pytest.mark.parametrize("order", ["random", "forward", "reversed"])
def test_barriers_and_atomics_are_not_races(hand, order):
    a, b = run(hand, "producer_consumer", order=order, seed=5)
    want = 2 * a.view(2, 64).flip(1).roll(-1, 1).reshape(-1)
    assert torch.equal(b, want)
    a, b = run(hand, "atomic_sum", order=order, seed=5)
    assert torch.equal(b[:2], a.view(2, 64).sum(1)) and b[127] == a.sum()


# ---- alignment -------------------------------------------------------------------------------------------------
def test_misaligned_float4_in_global_memory(hand):
    with pytest.raises(SimError, match=r"misaligned 16-byte load at 0x[0-9a-f]+ \(needs 16-byte alignment; it is 4 "
                                       r"past it\) in block \(0,0,0\), thread \(\d+,0,0\), on argument #0 "
                                       r"\(272 bytes; byte \d+\)"):
        run(hand, "float4_global")


def test_misaligned_float4_in_shared_memory(hand):
    with pytest.raises(SimError, match=r"misaligned 16-byte store .* on __shared__ array s \(byte \d+\)"):
        run(hand, "float4_shared")
    a, b = run(hand, "float4_aligned")
    assert torch.equal(b, a[4:].view(16, 4).flip(0).reshape(-1))


def test_misaligned_bf16x2(hand):
    with pytest.raises(SimError, match=r"misaligned 4-byte load .* it is 2 past it.* on argument #0"):
        run(hand, "bf16x2_global")


# ---- wmma ------------------------------------------------------------------------------------------------------
def test_wmma_whole_warp_is_right(hand):
    a, b = run(hand, "wmma_ok")
    want = a[:256].double().view(16, 16) @ a[256:].double().view(16, 16)
    assert torch.equal(b.double().view(16, 16), want)


@pytest.mark.parametrize("name, match", [
    ("wmma_per_lane", r"wmma contract: load_matrix_sync at line \d+ in warp 0 of block \(0,0,0\): lane \d+ passes "
                      r"pointer 0x[0-9a-f]+, ldm 16 but lane \d+ passes 0x[0-9a-f]+, ldm 16"),
    ("wmma_misaligned", r"wmma contract: load_matrix_sync .*misaligned wmma pointer 0x[0-9a-f]+ \(needs 32-byte "
                        r"alignment; it is 16 past it\) on argument #0"),
    ("wmma_half_warp", r"wmma contract: load_matrix_sync .*: lane 16 has exited \(all 32 lanes must call it"),
])
def test_wmma_contract(hand, name, match):
    with pytest.raises(SimError, match=match):
        run(hand, name, order="forward")


# ---- a generated kernel --------------------------------------------------------------------------------------
def test_generated_kernel_without_its_barrier(tmp_path, monkeypatch):
    """rmsnorm_gated's block reduction with the barrier after its per-warp partials removed (as a schedule bug
    would): warp 0 reads the other warps' partials with nothing ordering them."""
    from tvm_mamba.cli import _configs
    from tvm_mamba.tools.simcheck import ops as simcheck_ops
    from tvm_mamba.runtime import cache

    def drop_barrier(code, target):
        i = code.index("red_buf_staging_ptr[(((int)threadIdx.x) >> 5)] =")
        j = code.index("__syncthreads();", i)
        return code[:j] + code[j + len("__syncthreads();"):]

    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(tmp_path))  # the mutant must not enter the kernel cache
    monkeypatch.setenv("TVM_MAMBA_SIM_CHECKS", "1")  # the suite's default is off (tests/conftest.py)
    monkeypatch.setattr(cache, "_memo", {})
    op, direction, static, dtypes = next(iter(_configs(["rmsnorm_gated"])))
    with postproc(drop_barrier), pytest.raises(SimError, match=r"race \(read-write hazard\) on __shared__ array "
                                                                r"red_buf_staging_ptr \(byte \d+\)"):
        simcheck_ops.run_config(op, direction, static, dtypes, "sm_90")


def test_conv_bias_is_staged_by_one_thread(monkeypatch):
    """causal_conv1d's one-element bias copy had no loop to bind, so every thread of the block stored the same
    word: a write-write race the checker reported (schedules/cuda/causal_conv1d.py ``_cooperative`` now gives
    it a unit loop, thread 0 alone writes it). Every conv forward / backward configuration with a bias runs
    clean with the checker on."""
    from tvm_mamba.cli import _configs
    from tvm_mamba.tools.simcheck import ops as simcheck_ops

    monkeypatch.setenv("TVM_MAMBA_SIM_CHECKS", "1")
    configs = [c for c in _configs(["causal_conv1d"]) if c[1] in ("fwd", "bwd") and c[2].get("has_bias")]
    assert {c[1] for c in configs} == {"fwd", "bwd"}
    for op, direction, static, dtypes in configs[:1] + [c for c in configs if c[1] == "bwd"][:1]:
        simcheck_ops.run_config(op, direction, static, dtypes, "sm_90")


def test_update_padding_lanes_read_no_state(monkeypatch):
    """selective_state_update's warp layout runs the lanes past the last row (clamped to it) only so that they
    join the warp's shuffles. They read the last row's state while that row's own lane updates it in place:
    a read-write race the checker reported (in block (1,0,0), 3 heads x 3 rows x batch 3), until their load
    was guarded (compute/selective_scan/update.py ``_if_ok``). Mamba-2's layout (heads, groups), checks on."""
    from tests.cudasim.test_selective_scan import sc, X32
    from tvm_mamba.tools import simcheck

    monkeypatch.setenv("TVM_MAMBA_SIM_CHECKS", "1")
    static = dict(nheads=4, headdim=3, dstate=8, ngroups=2, has_D=True, has_z=True, has_dt_bias=True,
                  dt_softplus=True)
    res, keys = sc.update_results(sc.update_inputs(static, X32, batch=3, seed=3), "sm_90", steps=3)
    simcheck.ran(keys, "selective_scan", "update", static, X32)
    assert res
