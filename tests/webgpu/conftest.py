"""The WebGPU tests: kernels built for tvm_mamba.runtime.target.webgpu_target and run through wgpu (an adapter
wgpu finds: a GPU, or Mesa's llvmpipe on a machine without one). Marker ``webgpu`` (.ci/run's WebGPU step;
deselected in the main run). Skipped where wgpu or an adapter is missing."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def adapter():
    pytest.importorskip("wgpu")
    from tvm_mamba.runtime import webgpu

    info = webgpu.adapter_info()
    if info is None:
        pytest.skip("wgpu found no adapter")
    return info
