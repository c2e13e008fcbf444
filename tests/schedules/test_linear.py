"""linear schedule rules: the CPU loop nest's knobs against float64 (every tile path), AVX-512 in its
assembly, the CUDA rule clean on sm_90 / sm_80 (no spills), None on foreign functions."""
from __future__ import annotations

import pytest
import torch
import tvm

from tvm_mamba.compute.linear import LinearDims, build_check_configs
from tvm_mamba.reference.linear import linear_ref
from tvm_mamba.runtime import cpu_target, cuda_target, dispatch
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.runtime.key import KernelKey
from tvm_mamba.runtime.nvcc import ptxas_stats
from tvm_mamba.schedules.cpu import linear as cpu_rule
from tvm_mamba.schedules.cuda import linear as cuda_rule
from tvm_mamba.schedules.rule import Decisions


def test_rules_return_none_on_foreign_funcs():
    d = LinearDims(16, 16)
    for kernel in ("no_such_kernel", "matmul"):  # a name no op has; int8_dot's kernel
        assert cpu_rule.lay_out(kernel, d, cpu_target(), Decisions()) is None
        assert cuda_rule.lay_out(kernel, d, cuda_target("sm_90"), Decisions()) is None
    assert cpu_rule.lay_out("fwd", d, cuda_target("sm_90"), Decisions()) is None  # the other target family
    assert cuda_rule.lay_out("fwd", d, cpu_target(), Decisions()) is None


def test_dims_validate_and_round_trip():
    d = LinearDims(768, 3072, True, "bfloat16", "int8")
    assert LinearDims.from_key(*d.key_parts()) == d and d.has_scale
    with pytest.raises(ValueError, match="in_features"):
        LinearDims(0, 4)
    with pytest.raises(ValueError, match="weight_dtype"):
        LinearDims(4, 4, weight_dtype="int4")


# (vector, unroll, features, rows, task): every combination of full / ragged unrolled k steps, leftover
# vectors and scalar columns (K = 200 = 6 x 32 + 8 at vector 16 unroll 2; 200 = 25 x 8 at vector 8), feature
# tiles (N = 37, features capped by the accumulators at more rows) and row tiles (every M % rows remainder)
@pytest.mark.parametrize("knobs", [dict(vector=16, unroll=2, features=4, rows=2, task=16),
                                   dict(vector=8, unroll=4, features=2, rows=4, task=8),
                                   dict(vector=16, unroll=1, features=8, rows=4, task=16),
                                   dict(vector=16, unroll=1, features=1, rows=1, task=64)])
@pytest.mark.parametrize("wdt", ["float32", "bfloat16", "int8"])
def test_cpu_fwd_knobs_against_float64(knobs, wdt):
    d = LinearDims(200, 37, True, "float32", wdt)
    sch = cpu_rule.lay_out("fwd", d, cpu_target(), Decisions(knobs))
    fn = tvm.compile(sch.mod, target=cpu_target())["linear_fwd"]
    g = torch.Generator().manual_seed(3)
    if wdt == "int8":
        w, s = torch.randint(-127, 128, (37, 200), generator=g).to(torch.int8), torch.rand(37, generator=g)
    else:
        w, s = torch.randn(37, 200, generator=g).to(getattr(torch, wdt)), None
    b = torch.randn(37, generator=g)
    x8 = torch.randn(8, 200, generator=g)
    rows = {}
    for M in range(1, 9):
        x, y = x8[:M].clone(), torch.full((M, 37), float("nan"))
        fn(x, w, torch.zeros(1) if s is None else s, b, y)  # an absent scale: the (1,) placeholder
        ref = linear_ref(x, w, b, s)
        assert (y.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), M
        rows[M] = y
    for M in range(1, 8):  # a row's summation order does not depend on the tile it falls in: same bits
        assert torch.equal(rows[M], rows[8][:M]), M


def test_cpu_fwd_row_blocks():
    """Prefill-size calls run a task per (block of row_block rows, features): full and ragged blocks, every
    rows % 4 remainder in the last one, each row the same bits as in a 1-row call and close to float64."""
    d = LinearDims(200, 37, True, "float32", "float32")
    sch = cpu_rule.lay_out("fwd", d, cpu_target(), Decisions(dict(row_block=32, rows=4)))
    fn = tvm.compile(sch.mod, target=cpu_target())["linear_fwd"]
    g = torch.Generator().manual_seed(4)
    w, b, x = torch.randn(37, 200, generator=g), torch.randn(37, generator=g), torch.randn(99, 200, generator=g)
    one = torch.empty(1, 37)
    for M in (64, 97, 98, 99):
        y = torch.full((M, 37), float("nan"))
        fn(x[:M], w, torch.zeros(1), b, y)
        ref = linear_ref(x[:M], w, b)
        assert (y.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), M
        for m in (0, 31, 32, M - 1):
            fn(x[m:m + 1], w, torch.zeros(1), b, one)
            assert torch.equal(one[0], y[m]), (M, m)


@pytest.mark.parametrize("mcpu,reg", [("skylake-avx512", "zmm"), ("haswell", "ymm")])
def test_cpu_fwd_uses_the_targets_vectors(mcpu, reg):
    """Compiled for a named x86 CPU (any host can cross-compile): fused multiply-adds on its widest registers."""
    target = cpu_target(mcpu)
    sch = cpu_rule.lay_out("fwd", LinearDims(768, 64, weight_dtype="bfloat16"), target, Decisions())
    asm = tvm.compile(sch.mod, target=target).mod.inspect_source("asm")
    assert reg in asm and "vfmadd" in asm


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_build_check_configs_compile_clean(arch):
    for direction, static, dtypes in build_check_configs():
        key = KernelKey.make("linear", direction, dtypes, static, f"cuda-{arch}")
        src = compile_module(key, dispatch.schedule(key)).mod.imports[0].inspect_source("cuda")
        if direction == "fwd":
            assert "__shfl_down_sync" in src  # the warp's cross-lane sum
        stats = ptxas_stats(src, arch)
        assert stats["ok"], stats["error"]
        for k in stats["kernels"]:
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (direction, static, k)
