"""Gated RMSNorm schedule rules: CPU rule contract; CUDA build-check configs compile clean (no GPU needed)."""
from __future__ import annotations

import pytest
import tvm

from tvm_mamba.compute import rmsnorm_gated as C
from tvm_mamba.runtime import cpu_target, cuda_target, dispatch
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.runtime.key import KernelKey
from tvm_mamba.runtime.nvcc import ptxas_stats
from tvm_mamba.schedules.cpu import rmsnorm_gated as cpu_rule
from tvm_mamba.schedules.cuda import rmsnorm_gated as cuda_rule
from tvm_mamba.schedules.rule import Decisions
from tests.schedules._cuda_source import cuda_source, kernels


def test_rules_return_none_on_foreign_funcs():
    d = C.DIMS["fwd"].of(16, 16)
    for kernel in ("no_such_kernel", "pack"):  # a name no op has; int8_dot's kernel
        assert cpu_rule.lay_out(kernel, d, cpu_target(), Decisions()) is None
        assert cuda_rule.lay_out(kernel, d, cuda_target("sm_90"), Decisions()) is None
    assert cpu_rule.lay_out("fwd", d, cuda_target("sm_90"), Decisions()) is None  # the other target family
    assert cuda_rule.lay_out("fwd", d, cpu_target(), Decisions()) is None


@pytest.mark.parametrize("gs,width", [(48, 16), (24, 8), (6, 2), (5, 1)])
def test_cpu_vector_width_divides_group(gs, width):
    d = Decisions()
    sch = cpu_rule.lay_out("fwd", C.DIMS["fwd"].of(gs * 2, gs, has_z=True), cpu_target(), d)
    assert sch is not None and d.used["vector"] == width


@pytest.mark.parametrize("mcpu,reg", [("skylake-avx512", "zmm"), ("haswell", "ymm")])
def test_cpu_forward_is_vectorized(mcpu, reg):
    """Compiled for a named x86 CPU (any host can cross-compile): its widest vector registers, and the SiLU's
    exp inline rather than a libm call."""
    target = cpu_target(mcpu)
    sch = cpu_rule.lay_out("fwd", C.DIMS["fwd"].of(256, 64, has_z=True), target, Decisions())
    asm = tvm.compile(sch.mod, target=target).mod.inspect_source("asm")
    assert reg in asm and "expf" not in asm


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_build_check_configs_compile_clean(arch):
    for direction, static, dtypes in C.build_check_configs():
        key = KernelKey.make("rmsnorm_gated", direction, dtypes, static, f"cuda-{arch}")
        src = compile_module(key, dispatch.schedule(key)).mod.imports[0].inspect_source("cuda")
        stats = ptxas_stats(src, arch)
        assert stats["ok"], stats["error"]
        for k in stats["kernels"]:
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (direction, static, k)


@pytest.mark.parametrize("has_z,nbg", [(True, False), (False, True)])
def test_cuda_backward_is_hand_scheduled(has_z, nbg):
    # one block per row with a cross-thread (warp shuffle) reduction, not the dlight Fallback
    dims = C.DIMS["bwd"].of(512, 128, 1e-5, True, has_z, nbg, "bfloat16", "float32")
    d = Decisions()
    sch = cuda_rule.lay_out("bwd", dims, cuda_target("sm_90"), d)
    assert sch is not None and d.used["threads"] == 128
    with cuda_target("sm_90"):
        src = tvm.compile(sch.mod, target=cuda_target("sm_90")).mod.imports[0].inspect_source("cuda")
    (body,) = [b for b in kernels(src) if "dxdz_v0_ptr[" in b or "dx_ptr[" in b]
    assert "__shfl_down_sync" in body and "partial_ptr[" in body  # row reduction and stage 1 in one pass
    stats = ptxas_stats(src, "sm_90")
    assert stats["ok"] and all(k["spill_stores"] == 0 for k in stats["kernels"])


def _cuda_source(kernel, dims, decisions):
    return cuda_source(cuda_rule, kernel, dims, decisions)


MAMBA2 = dict(eps=1e-5, has_z=True, norm_before_gate=False)  # Mamba-2's gated norm (one group here)


def test_cuda_forward_is_one_staged_pass():
    """The design: one kernel; a block walks rows_per_block (4) rows, each row's x and z requested from global
    memory once (one 128-bit copy statement each) into shared memory, the weight once per block; the sum of squares
    (shuffle tree) and out read the staged row, rstd goes through shared memory (4.0x -> 1.08x the minimum
    bytes at Mamba-2 130M)."""
    d = Decisions()
    src = _cuda_source("fwd", C.DIMS["fwd"].of(1024, 1024, **MAMBA2), d)
    assert d.used == {"threads": 256, "rows_per_block": 4} and d.space["rows_per_block"] == (1, 2, 4, 8)
    (body,) = kernels(src)
    for name in ("x", "z", "weight"):
        assert f"__shared__ alignas(64) float {name}_shared_ptr[1024]" in body
        assert body.count(f"(float4*)({name}_ptr + ") == 1 and f"{name}_ptr[" not in body  # one 128-bit copy
    assert "for (int r_m_1 = 0; r_m_1 < 4; ++r_m_1)" in body and "(float4*)(weight_ptr + " in body.split("r_m_1 = 0")[0]
    assert "__shfl_down_sync" in body and "rstd_shared_ptr" in body and "atomic" not in src


def test_cuda_backward_is_one_pass_with_the_weight_sums():
    """One pass: a block per part of PART_ROWS rows stages each row once (x, z, dout: one 128-bit copy statement
    each), the row's dot by a shuffle tree, dx / dz from the staged row, and each thread adds its features'
    dweight / dbias terms to the part's sums (shared memory here: they fit beside the staged row), written
    once per part; stage 2 adds the parts in order. No atomics, no re-read of the inputs for the sums."""
    src = _cuda_source("bwd", C.DIMS["bwd"].of(1024, 1024, has_bias=True, **MAMBA2), Decisions())
    assert "atomic" not in src
    ks = kernels(src)
    assert len(ks) == 3  # the pass; stage 2 of dweight and of dbias
    (body,) = [b for b in ks if "dxdz_v0_ptr[" in b]
    for name in ("x", "z", "dout"):
        assert f"{name}_shared_ptr[1024]" in body and body.count(f"(float4*)({name}_ptr + ") == 1
        assert f"{name}_ptr[" not in body
    assert "__shared__ alignas(64) float partial_local_shared_ptr[2048]" in body
    row_walk, after = body.split("for (int i0_1_m = 0; i0_1_m < 32; ++i0_1_m)")
    assert "partial_ptr[" not in row_walk and after.count("partial_ptr[") == 8  # 2 terms x 4 features a thread


def test_cuda_backward_sums_in_registers_when_shared_memory_is_full():
    """The parallel norm's backward (four weight terms, five staged rows and the vectors; build-check's
    configuration) leaves no room for the sums in shared memory: each thread keeps its (term, feature) sums
    in registers, without spilling."""
    dims = C.DIMS["bwd"].of(2048, 2048, 1e-5, has_bias=True, is_rms_norm=False, has_dresidual=True,
                            store_dresidual=True, has_weight1=True, has_bias1=True, has_x1=True, dropout_p=0.1)
    src = _cuda_source("bwd", dims, Decisions())
    (body,) = [b for b in kernels(src) if "partial_ptr[" in b and "_shared_ptr" in b]
    assert "float partial_local_ptr[32]" in body and "partial_local_shared" not in body
    stats = ptxas_stats(src, "sm_90")
    assert stats["ok"] and all(k["spill_stores"] == 0 for k in stats["kernels"])


def test_cuda_knobs_in_the_harness():
    """rows_per_block 8 and 1 (the forward) with 64 threads on 13 rows (a ragged last block of rows; the
    backward's one part of 32 rows has 19 missing) and two groups: forward and backward through the CUDA
    harness against the float64 reference."""
    import tempfile

    import torch

    from tvm_mamba.reference.rmsnorm_gated import rmsnorm_gated_ref
    from tvm_mamba.runtime import cudasim

    torch.manual_seed(0)
    rows, hidden, gs = 13, 128, 64
    x, z, w, dout = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden), torch.randn(rows, hidden)
    leaves = [t.double().requires_grad_() for t in (x, w, z)]
    ref = rmsnorm_gated_ref(leaves[0], leaves[1], None, leaves[2], 1e-5, gs, False)
    (ref * dout.double()).sum().backward()
    e = torch.empty
    target = cuda_target("sm_90")
    for per_block in (8, 1):
        out, rstd, dx, dz, dw = e(rows, hidden), e(rows, 2), e(rows, hidden), e(rows, hidden), e(hidden)
        partial = e(1, 2, hidden)
        one, i1 = e(1), torch.zeros(1, dtype=torch.int32)
        runs = (("fwd", C.DIMS["fwd"].of(hidden, gs, **MAMBA2),
                 (x, w, one, z, e(1, 1), one, i1, e(1, 1), one, one, i1, out, e(1, 1),
                  torch.zeros(1, 1, dtype=torch.uint8), e(1, 1), torch.zeros(1, 1, dtype=torch.uint8), e(1, 1), rstd)),
                ("bwd", C.DIMS["bwd"].of(hidden, gs, **MAMBA2),
                 (x, w, one, z, dout, e(1, 1), rstd, e(1, 1), one, i1, one, e(1, 1), i1, dx, dz, dw, one, e(1, 1),
                  e(1, 1), one, one, partial)))
        for kernel, dims, args in runs:
            name = f"rmsnorm_gated_{kernel}"
            sch = cuda_rule.lay_out(kernel, dims, target, Decisions({"threads": 64, "rows_per_block": per_block,
                                                                     "part_threads": 64}))
            with tempfile.TemporaryDirectory() as tmp:
                cudasim.link(cudasim.build(sch.mod, target, label=name), f"{tmp}/k.so")
                module = cudasim.load(f"{tmp}/k.so")
                cudasim.call(module, module[name], args, label=name)
        assert (out - ref.detach()).abs().max() < 1e-4, per_block
        for got, leaf in ((dx, leaves[0]), (dz, leaves[2]), (dw, leaves[1])):
            assert (got - leaf.grad).abs().max() < 1e-4 * max(1.0, leaf.grad.abs().max().item()), per_block


def test_cuda_rule_replays_as_a_metaschedule_design_space():
    """The backward (the Mamba-2 tuning workload: dx and dz in one loop nest, so dz's block is used only as a
    staged copy's consumer) replays from its simplified trace, as MetaSchedule's search does (the simplifier
    once dropped that block's RV), with the knobs sampled in order, and the replay stages the rows."""
    from tvm import s_tir

    from tvm_mamba.tools import metaschedule as msd

    direction, static, dtypes = C.tuning_configs()[1]
    key = KernelKey.make("rmsnorm_gated", direction, dtypes, static, "cuda-sm_90", {"rows": 256})
    mod = tvm.IRModule({"main": msd.static_func(key)})
    sch = s_tir.Schedule(mod)
    d = msd.SampledDecisions(sch)
    with msd.on_schedule(sch):
        cuda_rule.lay_out(direction, dispatch.dims_of(key), cuda_target("sm_90"), d)
    assert direction == "bwd" and d.order == ["threads", "part_threads"]
    replay = s_tir.Schedule(mod)
    sch.trace.simplified(remove_postproc=True).apply_to_schedule(replay, remove_postproc=False)
    assert "x_shared" in replay.mod.script() and "dout_shared" in replay.mod.script()
