"""Int8 dot schedule rules: VNNI on CPU (vpdpbusd in the assembly), int8 tensor cores (wmma) or dp4a on CUDA
(clean on sm_90/sm_80)."""
from __future__ import annotations

import pytest
import tvm

from tvm_mamba.compute import int8_dot as C
from tvm_mamba.runtime import cpu_target, cuda_target, dispatch
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.runtime.key import KernelKey
from tvm_mamba.runtime.nvcc import ptxas_stats
from tvm_mamba.schedules.cpu import int8_dot as cpu_rule
from tvm_mamba.schedules.cuda import int8_dot as cuda_rule
from tvm_mamba.schedules.rule import Decisions


def test_rules_return_none_on_foreign_funcs():
    d = C.DIMS["pack"].of(16)
    for kernel in ("no_such_kernel", "fwd"):  # a name no op has; another op's kernel (rmsnorm_gated's)
        assert cpu_rule.lay_out(kernel, d, cpu_target(), Decisions()) is None
        assert cuda_rule.lay_out(kernel, d, cuda_target("sm_90"), Decisions()) is None
    assert cpu_rule.lay_out("pack", d, cuda_target("sm_90"), Decisions()) is None  # the other target family
    assert cuda_rule.lay_out("pack", d, cpu_target(), Decisions()) is None


def test_cpu_matmul_uses_vnni():
    """Compiled for a VNNI CPU (any x86 host can cross-compile it): vpdpbusd in the assembly."""
    target = cpu_target("cascadelake")
    sch = cpu_rule.lay_out("matmul", C.DIMS["matmul"].of(16, 256), target, Decisions())
    asm = tvm.compile(sch.mod, target=target).mod.inspect_source("asm")
    assert "vpdpbusd" in asm


def test_cpu_matmul_without_vnni_is_left_to_llvm():
    assert cpu_rule.lay_out("matmul", C.DIMS["matmul"].of(16, 256), cpu_target("haswell"), Decisions()) is None


def test_cuda_matmul_without_k_multiple_of_4_falls_back():
    assert cuda_rule.lay_out("matmul", C.DIMS["matmul"].of(16, 6), cuda_target("sm_90"), Decisions()) is None


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_build_check_configs_compile_clean(arch):
    for direction, static, dtypes in C.build_check_configs():
        key = KernelKey.make("int8_dot", direction, dtypes, static, f"cuda-{arch}")
        src = compile_module(key, dispatch.schedule(key)).mod.imports[0].inspect_source("cuda")
        on_tc = static.get("N", 1) % 16 == 0 and static.get("K", 1) % 16 == 0
        body = src[src.index('extern "C" __global__'):]  # the kernels, not the headers' declarations
        if direction == "matmul":  # int8 tensor cores where N and K are multiples of 16, else dp4a
            assert ("wmma::mma_sync" in body) == on_tc and ("__dp4a" in body) == (not on_tc)
        if direction in ("dgrad", "wgrad"):  # bf16 tensor cores (float32 g in three parts) where they fit
            assert ("wmma::mma_sync" in body) == on_tc and ("nv_bfloat16" in body) == on_tc
        stats = ptxas_stats(src, arch)
        assert stats["ok"], stats["error"]
        for k in stats["kernels"]:
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (direction, static, k)


@pytest.mark.parametrize("knobs", [{"row_tile": 0}, {"row_tile": 64, "k_vectors": 2}, {"row_tile": 256, "k_vectors": 8}])
def test_cpu_wgrad_knobs_against_float64(knobs):
    """The wgrad template's knobs (loop order over row tiles, register tile) at a shape with a ragged last
    part (1100 rows in 3 parts of 367), ragged row tiles and K % 16 columns: same sums as float64, and every
    row tiling bitwise equal to the untiled order."""
    import torch

    H, CH, M, N, K, nparts = 2, 1, 1100, 8, 72, 3
    sch = cpu_rule.lay_out("wgrad", C.DIMS["wgrad"].of(H, CH, N, K), cpu_target(), Decisions(knobs))
    fn = tvm.compile(sch.mod, target=cpu_target())["int8_dot_wgrad"]
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (CH, M, N), dtype=torch.int8, generator=gen)
    g = torch.randn(H, M, K, generator=gen)
    out, part = torch.empty(H, N, K), torch.empty(nparts, H, N, K)
    fn(codes, g, torch.tensor([0.5]), out, part)
    ref = 0.5 * torch.einsum("mn,hmk->hnk", codes[0].double(), g.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * M, rtol=1e-5)
    untiled = cpu_rule.lay_out("wgrad", C.DIMS["wgrad"].of(H, CH, N, K), cpu_target(),
                              Decisions(dict(knobs, row_tile=0)))
    out0 = torch.empty(H, N, K)
    tvm.compile(untiled.mod, target=cpu_target())["int8_dot_wgrad"](codes, g, torch.tensor([0.5]), out0, part)
    assert torch.equal(out, out0)


@pytest.mark.parametrize("knobs", [{"k_tile": 64, "row_chunk": 32}, {"k_tile": 128, "rows": 8, "row_chunk": 64}])
def test_cpu_dgrad_staged_codes_against_float64(knobs):
    """dgrad with the codes staged as float per (column block, k tile): ragged k tiles (K = 200), a ragged row
    chunk and register tile (M = 77), N % 16 columns: same sums as float64, bitwise equal to one k tile."""
    import torch

    H, M, N, K = 2, 77, 40, 200
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(H, M, K, generator=gen)
    codes = torch.randint(-128, 128, (H, K, N), dtype=torch.int8, generator=gen)
    outs = []
    for d in (knobs, dict({k: v for k, v in knobs.items() if k == "rows"}, k_tile=256, row_chunk=128)):
        sch = cpu_rule.lay_out("dgrad", C.DIMS["dgrad"].of(H, N, K), cpu_target(), Decisions(d))
        out = torch.empty(H, M, N)
        tvm.compile(sch.mod, target=cpu_target())["int8_dot_dgrad"](g, codes, torch.tensor([0.3]), out)
        outs.append(out)
    ref = 0.3 * torch.einsum("hmk,hkn->hmn", g.double(), codes.double())
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-4 * K, rtol=1e-5)
    assert torch.equal(outs[0], outs[1])
