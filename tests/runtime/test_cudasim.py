"""The CUDA execution harness (runtime/cudasim.py) is not a loop in disguise: hand-written TIR kernels with a
missing barrier, a wrong shuffle lane, out-of-bounds accesses or a divergent barrier fail; correct ones pass
in every thread order; the source it runs is build-check's, after tvm_callback_cuda_postproc."""
from __future__ import annotations

import contextlib

import pytest
import torch
import tvm
import tvm_ffi
from tvm.script import tirx as T

from tvm_mamba.runtime import cudasim, cuda_target
from tvm_mamba.runtime.cudasim import SimConfig, SimError

N = 128


@T.prim_func
def shift(a: T.Buffer((N,), "float32"), b: T.Buffer((N,), "float32")):
    """b[t] = a[(t + 1) % N] through shared memory: thread t reads what thread t + 1 wrote."""
    T.func_attr({"global_symbol": "shift", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(N, thread="threadIdx.x"):
            s = T.alloc_buffer((N,), "float32", scope="shared")
            s[tx] = a[tx]
            b[tx] = s[(tx + 1) % N]


def _warpsum(offsets, mask_expr=None):
    """Per warp, every lane gets the sum of the warp's 32 values (butterfly over ``offsets``)."""
    o0, o1, o2, o3, o4 = offsets

    @T.prim_func
    def warpsum(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        T.func_attr({"global_symbol": "warpsum", "tirx.noalias": True})
        for bx in T.thread_binding(2, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                v = T.alloc_buffer((1,), "float32", scope="local")
                m = T.alloc_buffer((1,), "uint32", scope="local")
                v[0] = a[bx * 32 + tx]
                m[0] = T.tvm_warp_activemask()
                v[0] = v[0] + T.tvm_warp_shuffle_xor(m[0], v[0], o0, 32, 32)
                v[0] = v[0] + T.tvm_warp_shuffle_xor(m[0], v[0], o1, 32, 32)
                v[0] = v[0] + T.tvm_warp_shuffle_xor(m[0], v[0], o2, 32, 32)
                v[0] = v[0] + T.tvm_warp_shuffle_xor(m[0], v[0], o3, 32, 32)
                v[0] = v[0] + T.tvm_warp_shuffle_xor(m[0], v[0], o4, 32, 32)
                b[bx * 32 + tx] = v[0]

    return warpsum


@T.prim_func
def halfmask(a: T.Buffer((32,), "float32"), b: T.Buffer((32,), "float32")):
    """A shuffle whose mask names lanes 0-15 only, reading lane t ^ 16: undefined on a GPU."""
    T.func_attr({"global_symbol": "halfmask", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(32, thread="threadIdx.x"):
            if tx < 16:
                b[tx] = T.tvm_warp_shuffle_xor(T.uint32(0xFFFF), a[tx], 16, 32, 32)


@T.prim_func
def store_past_end(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    T.func_attr({"global_symbol": "store_past_end", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            b[tx + 1] = a[tx]


@T.prim_func
def load_before_start(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    T.func_attr({"global_symbol": "load_before_start", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            b[tx] = a[tx - 1]


@T.prim_func
def shared_past_end(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    T.func_attr({"global_symbol": "shared_past_end", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            s = T.alloc_buffer((64,), "float32", scope="shared")
            s[tx + 1] = a[tx]
            b[tx] = s[tx]


@T.prim_func
def divergent_barrier(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    T.func_attr({"global_symbol": "divergent_barrier", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            if tx < 16:
                T.evaluate(T.tvm_storage_sync("shared"))
            b[tx] = a[tx]


@T.prim_func
def unknown_intrinsic(a: T.Buffer((32,), "float32"), b: T.Buffer((32,), "float32")):
    T.func_attr({"global_symbol": "unknown_intrinsic", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(32, thread="threadIdx.x"):
            b[tx] = T.call_extern("float32", "__no_such_intrinsic", a[tx])


@T.prim_func
def dyn_shared_reverse(a: T.Buffer((N,), "float32"), b: T.Buffer((N,), "float32")):
    """b = reversed a through dynamic shared memory (an ``extern __shared__`` array)."""
    T.func_attr({"global_symbol": "dyn_shared_reverse", "tirx.noalias": True})
    for bx in T.thread_binding(1, thread="blockIdx.x"):
        for tx in T.thread_binding(N, thread="threadIdx.x"):
            s = T.alloc_buffer((N,), "float32", scope="shared.dyn")
            s[tx] = a[tx]
            b[tx] = s[N - 1 - tx]


@T.prim_func
def to_bf16(a: T.Buffer((4096,), "float32"), b: T.Buffer((4096,), "bfloat16")):
    T.func_attr({"global_symbol": "to_bf16", "tirx.noalias": True})
    for bx in T.thread_binding(16, thread="blockIdx.x"):
        for tx in T.thread_binding(256, thread="threadIdx.x"):
            b[bx * 256 + tx] = T.Cast("bfloat16", a[bx * 256 + tx])


@T.prim_func
def sincospi_f32(a: T.Buffer((1024,), "float32"), b: T.Buffer((2, 1024), "float32")):
    """b[0, i], b[1, i] = sin(pi a[i]), cos(pi a[i]) through CUDA's sincospif (the complex scan's rotation)."""
    T.func_attr({"global_symbol": "sincospi_f32", "tirx.noalias": True})
    for bx in T.thread_binding(4, thread="blockIdx.x"):
        for tx in T.thread_binding(256, thread="threadIdx.x"):
            i = T.meta_var(bx * 256 + tx)
            T.evaluate(T.call_extern("void", "sincospif", a[i], T.address_of(b[0, i]), T.address_of(b[1, i])))


@contextlib.contextmanager
def postproc(fn):
    """Register ``tvm_callback_cuda_postproc`` (TVM calls it on the generated CUDA source) for the block."""
    tvm_ffi.register_global_func("tvm_callback_cuda_postproc", fn, override=True)
    try:
        yield
    finally:
        tvm_ffi.registry.remove_global_func("tvm_callback_cuda_postproc")


def _build(func, tmp_path, arch="sm_90"):
    name = func.attrs["global_symbol"]
    built = cudasim.build(tvm.IRModule({name: func}), cuda_target(arch), label=name)
    path = str(tmp_path / f"{name}.so")
    built.export_library(path)
    return built, cudasim.load(path), name


def _run(func, tmp_path, *args, cfg=None):
    built, module, name = _build(func, tmp_path)
    cudasim.call(module, module[name], list(args), cfg=cfg, label=name)
    return built


@pytest.mark.parametrize("order", ["random", "forward", "reversed"])
def test_shared_memory_with_barrier_is_right_in_every_order(tmp_path, order):
    a, b = torch.randn(N), torch.zeros(N)
    built = _run(shift, tmp_path, a, b, cfg=SimConfig(order=order, seed=3))
    assert "__syncthreads()" in built.source
    torch.testing.assert_close(b, a.roll(-1), rtol=0, atol=0)


def test_missing_barrier_is_caught(tmp_path):
    """The same kernel with its barrier removed from the source (by the postproc hook, as a codegen bug would):
    thread t may read s[t + 1] before thread t + 1 wrote it; the harness must not give the right answer."""
    with postproc(lambda code, target: code.replace("__syncthreads();", "")):
        built, module, name = _build(shift, tmp_path)
    assert "__syncthreads" not in built.source.split('extern "C" __global__')[-1]
    a, b = torch.randn(N), torch.zeros(N)
    try:
        cudasim.call(module, module[name], [a, b], cfg=SimConfig(order="forward"), label=name)
    except SimError as err:  # the two runs (two thread orders) disagree: reported as a race
        assert "race" in str(err)
        return
    assert not torch.equal(b, a.roll(-1)), "a missing __syncthreads went unnoticed"


def test_warp_shuffle_exchanges_values(tmp_path):
    a, b = torch.randn(64), torch.zeros(64)
    _run(_warpsum((1, 2, 4, 8, 16)), tmp_path, a, b)
    want = a.view(2, 32).double().sum(1, keepdim=True).expand(2, 32).reshape(-1)
    torch.testing.assert_close(b.double(), want, rtol=1e-5, atol=1e-5)


def test_wrong_shuffle_lane_is_caught(tmp_path):
    """Offsets 1, 2, 4, 8, 8: lanes never see the other half-warp, so the sum is wrong."""
    a, b = torch.rand(64) + 1, torch.zeros(64)
    _run(_warpsum((1, 2, 4, 8, 8)), tmp_path, a, b)
    want = a.view(2, 32).double().sum(1, keepdim=True).expand(2, 32).reshape(-1)
    assert (b.double() - want).abs().min() > 1e-3


def test_shuffle_from_lane_outside_mask_fails(tmp_path):
    with pytest.raises(SimError, match="not in the mask"):
        _run(halfmask, tmp_path, torch.randn(32), torch.zeros(32))


def test_store_past_end_fails(tmp_path):
    with pytest.raises(SimError, match=r"past the end of argument #1"):
        _run(store_past_end, tmp_path, torch.randn(64), torch.zeros(64))


def test_load_before_start_fails(tmp_path):
    with pytest.raises(SimError, match=r"before the start of argument #0"):
        _run(load_before_start, tmp_path, torch.randn(64), torch.zeros(64))


def test_shared_index_past_end_fails(tmp_path):
    with pytest.raises(SimError, match=r"out of the bounds of a local or __shared__ array"):
        _run(shared_past_end, tmp_path, torch.randn(64), torch.zeros(64))


def test_divergent_barrier_fails(tmp_path):
    with pytest.raises(SimError, match="barrier divergence"):
        _run(divergent_barrier, tmp_path, torch.randn(64), torch.zeros(64))


def test_unimplemented_intrinsic_is_named(tmp_path):
    with pytest.raises(RuntimeError, match=r"`__no_such_intrinsic`.*does not implement"):
        _build(unknown_intrinsic, tmp_path)


def test_dynamic_shared_memory(tmp_path):
    a, b = torch.randn(N), torch.zeros(N)
    built = _run(dyn_shared_reverse, tmp_path, a, b)
    assert "extern __shared__" in built.source
    torch.testing.assert_close(b, a.flip(0), rtol=0, atol=0)


def test_bfloat16_rounds_to_nearest_even(tmp_path):
    a = torch.randn(4096) * torch.logspace(-3, 3, 4096)
    a[:4] = torch.tensor([1.00390625, 1.01171875, float("inf"), float("nan")])  # ties: to even, both ways
    b = torch.zeros(4096, dtype=torch.bfloat16)
    _run(to_bf16, tmp_path, a, b)
    want = a.to(torch.bfloat16)
    assert torch.equal(b.view(torch.int16)[:3], want.view(torch.int16)[:3])
    assert torch.isnan(b[3])
    assert torch.equal(b[4:].view(torch.int16), want[4:].view(torch.int16))


def test_sincospif_matches_float64(tmp_path):
    """The harness's sincospif: within 1 float32 ulp of float64 sin / cos(pi x) up to |x| = 1e5, and exact
    (+-0, +-1) at integers and half-integers (its quadrant reduction is exact, as CUDA's)."""
    a = torch.cat([torch.randn(1000) * torch.logspace(-3, 5, 1000), torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 1.5,
                   7.0, -2.5, 12345.5, 1e9, 0.25, -0.75] + [3.0] * 12)])
    b = torch.zeros(2, 1024)
    _run(sincospi_f32, tmp_path, a, b)
    x = a.double()
    want = torch.stack([torch.sin(torch.pi * torch.remainder(x, 2.0)), torch.cos(torch.pi * torch.remainder(x, 2.0))])
    assert (b.double() - want).abs().max().item() <= 2 ** -24
    exact = (2 * a).round() == 2 * a
    assert torch.equal(b[:, exact].abs(), want[:, exact].round().abs().float())


def test_source_is_build_checks_after_postproc(tmp_path):
    """What the harness compiles is exactly what build-check gives nvcc, postproc hook included."""
    from tvm_mamba.cli import _configs
    from tvm_mamba.runtime import KernelKey, dispatch
    from tvm_mamba.runtime.cache import compile_module

    op, direction, static, dtypes = next(iter(_configs(["rmsnorm_gated"])))
    sim_key = KernelKey.make(op, direction, dtypes, static, "cudasim-sm_90")
    gpu_key = KernelKey.make(op, direction, dtypes, static, "cuda-sm_90")
    with postproc(lambda code, target: code + "\n// postproc was here\n"):
        sim = compile_module(sim_key, dispatch.schedule(sim_key))
        gpu = compile_module(gpu_key, dispatch.schedule(gpu_key))
    nvcc_source = gpu.mod.imports[0].inspect_source("cuda")
    assert sim.source == nvcc_source
    assert sim.source.endswith("// postproc was here\n")


def test_harness_is_built_once_per_flag_set(tmp_path, monkeypatch):
    """The harness runtime object and precompiled header are built once per flag set into the cache; a kernel
    compiled against them holds none of the runtime (the scheduler, the checker), uses the PCH (``-H`` marks it
    with "!"), and links into a library that runs; a damaged .gch costs a compile from the header, not a failed
    build."""
    import subprocess

    monkeypatch.setenv("TVM_MAMBA_CACHE_DIR", str(tmp_path / "cache"))
    flags = cudasim.compile_flags("sm_90")
    h = cudasim.harness("g++", flags)
    assert h.runtime.is_file() and h.header is not None and h.header.with_suffix(".h.gch").is_file()
    stamp = h.runtime.stat().st_mtime_ns
    assert cudasim.harness("g++", flags) == h and h.runtime.stat().st_mtime_ns == stamp
    assert cudasim.harness("g++", cudasim.compile_flags("sm_80")).runtime.parent != h.runtime.parent
    assert cudasim.harness("g++", [*flags, *cudasim.CHECK_FLAGS]).runtime.parent != h.runtime.parent
    src = tmp_path / "k.cc"
    src.write_text("__global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n")
    cmd = cudasim._with_header(["g++", *flags, "-H", "-c", "-o", str(tmp_path / "k.o"), str(src)], h.header)
    used = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert used.returncode == 0 and f"! {h.header}.gch" in used.stderr
    symbols = subprocess.run(["nm", "-C", str(tmp_path / "k.o")], capture_output=True, text=True).stdout
    assert "resolve_warp" not in symbols and "run_block" not in symbols and "k(float*)" in symbols
    assert "resolve_warp" in subprocess.run(["nm", "-C", str(h.runtime)], capture_output=True, text=True).stdout
    h.header.with_suffix(".h.gch").write_bytes(b"not a precompiled header")
    fallback = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert fallback.returncode == 0 and f"! {h.header}.gch" not in fallback.stderr
    h.runtime.chmod(0o664)  # the cache's trust model (docs/design.md): nobody else may write what is linked
    with pytest.raises(PermissionError, match="runtime.o"):
        cudasim.harness("g++", flags)
