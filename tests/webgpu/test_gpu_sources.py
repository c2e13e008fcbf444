"""build-check --target webgpu | opencl | metal (tvm_mamba/tools/gpu_sources.py): every kernel configuration's
source in each language, the WGSL validated by wgpu's naga, the OpenCL C parsed by clang (libclang), Metal
generated; and the OpenCL check itself catches what OpenCL C lacks."""
from __future__ import annotations

import pytest

from tvm_mamba.runtime import registry
from tvm_mamba.tools import gpu_sources

pytestmark = [pytest.mark.webgpu]

CONFIGS = [(op, *c) for op in registry.ops() for c in registry.op(op).compute.build_check_configs()]


@pytest.mark.parametrize("kind", ["webgpu", "opencl", "metal"])
def test_every_kernel_in_each_gpu_language(kind, capsys, request):
    if kind == "webgpu":
        request.getfixturevalue("adapter")
    if kind == "opencl":
        pytest.importorskip("clang.cindex")
    assert gpu_sources.run(CONFIGS, kind) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    checked = {"webgpu": "WGSL validated by naga", "opencl": "OpenCL C parsed by clang", "metal": "generated"}[kind]
    assert last.startswith("build-check: ") and " 0 failed" in last and checked in last


def test_opencl_check_catches_what_opencl_lacks():
    pytest.importorskip("clang.cindex")
    checker = gpu_sources._Checker("opencl")
    ok = "__kernel void k(__global float* x, __local float* y) { vstore4(vload4(0, x), 0, y); x[0] = exp(x[1]); }"
    checker.check(ok, {})
    with pytest.raises(RuntimeError, match="log1pf"):
        checker.check(ok.replace("exp(", "log1pf("), {})  # CUDA's libm name, not OpenCL's
