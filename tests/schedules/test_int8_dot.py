"""Int8 dot schedule rules: VNNI on CPU (vpdpbusd in the assembly), dp4a on CUDA (clean on sm_90/sm_80)."""
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
    from tvm_mamba.compute.rmsnorm_gated import rmsnorm_gated_fwd

    foreign = rmsnorm_gated_fwd(16, 16)
    assert cpu_rule.apply(foreign, cpu_target(), Decisions()) is None
    assert cuda_rule.apply(foreign, cuda_target("sm_90"), Decisions()) is None


def test_cpu_matmul_uses_vnni():
    if not cpu_rule._has_vnni(cpu_target()):
        pytest.skip("host CPU has no AVX512-VNNI")
    sch = cpu_rule.apply(C.int8_dot_matmul(16, 256), cpu_target(), Decisions())
    asm = tvm.compile(sch.mod, target=cpu_target()).mod.inspect_source("asm")
    assert "vpdpbusd" in asm


def test_cuda_matmul_without_k_multiple_of_4_falls_back():
    assert cuda_rule.apply(C.int8_dot_matmul(16, 6), cuda_target("sm_90"), Decisions()) is None


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_build_check_configs_compile_clean(arch):
    for direction, static, dtypes in C.build_check_configs():
        key = KernelKey.make("int8_dot", direction, dtypes, static, f"cuda-{arch}")
        src = compile_module(key, dispatch.schedule(key)).mod.imports[0].inspect_source("cuda")
        if direction == "matmul":
            assert "__dp4a" in src
        stats = ptxas_stats(src, arch)
        assert stats["ok"], stats["error"]
        for k in stats["kernels"]:
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (direction, static, k)
