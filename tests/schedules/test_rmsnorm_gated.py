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


def test_rules_return_none_on_foreign_funcs():
    from tvm_mamba.compute.int8_dot import int8_dot_pack

    foreign = int8_dot_pack(8)
    assert cpu_rule.apply(foreign, cpu_target(), Decisions()) is None
    assert cuda_rule.apply(foreign, cuda_target("sm_90"), Decisions()) is None


@pytest.mark.parametrize("gs,width", [(48, 16), (24, 8), (6, 2), (5, 1)])
def test_cpu_vector_width_divides_group(gs, width):
    d = Decisions()
    sch = cpu_rule.apply(C.rmsnorm_gated_fwd(gs * 2, gs, has_z=True), cpu_target(), d)
    assert sch is not None and d.used["vector"] == width


@pytest.mark.parametrize("mcpu,reg", [("skylake-avx512", "zmm"), ("haswell", "ymm")])
def test_cpu_forward_is_vectorized(mcpu, reg):
    """Compiled for a named x86 CPU (any host can cross-compile): its widest vector registers, and the SiLU's
    exp inline rather than a libm call."""
    target = cpu_target(mcpu)
    sch = cpu_rule.apply(C.rmsnorm_gated_fwd(256, 64, has_z=True), target, Decisions())
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
    func = C.rmsnorm_gated_bwd(512, 128, 1e-5, True, has_z, nbg, "bfloat16", "float32")
    d = Decisions()
    sch = cuda_rule.apply(func, cuda_target("sm_90"), d)
    assert sch is not None and d.used["threads"] == 128
    with cuda_target("sm_90"):
        src = tvm.compile(sch.mod, target=cuda_target("sm_90")).mod.imports[0].inspect_source("cuda")
    assert "__shfl_down_sync" in src and "blockIdx.y" in src  # row reduction; stage-1 parts on y
    stats = ptxas_stats(src, "sm_90")
    assert stats["ok"] and all(k["spill_stores"] == 0 for k in stats["kernels"])
