"""Every float32 configuration build-check builds, run on WebGPU through sim-check's own checks
(tvm_mamba/tools/simcheck/<op>.py): small inputs at the configuration's model dims, the op's public function
(forward and, for a backward direction, every gradient), each output against its float64 reference, and the
configuration's own kernel (target ``webgpu``) seen serving the call. WGSL has no 16-bit or 64-bit types here,
so the bf16 / fp16 configurations are CUDA's alone."""
from __future__ import annotations

import pytest

from tvm_mamba.runtime import registry
from tvm_mamba.tools.simcheck import WEBGPU, on_webgpu
from tvm_mamba.tools.simcheck import ops as simcheck_ops

pytestmark = [pytest.mark.webgpu, pytest.mark.usefixtures("adapter")]


CONFIGS = [(op, direction, static, dtypes) for op in registry.ops()
           for direction, static, dtypes in registry.op(op).compute.build_check_configs() if on_webgpu(dtypes)]


def _id(config) -> str:
    op, direction, static, _ = config
    same = [c for c in CONFIGS if c[:2] == (op, direction)]
    return f"{op}-{direction}-{same.index(config)}"


@pytest.mark.parametrize("config", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_kernel_on_webgpu_against_float64_reference(config):
    op, direction, static, dtypes = config
    simcheck_ops.run_config(op, direction, static, dtypes, WEBGPU)


def test_every_op_has_a_float32_configuration():
    assert {op for op, *_ in CONFIGS} == set(registry.ops())
