"""The generated CUDA source of a CUDA rule's schedule, and its kernel definitions (for tests that pin a
schedule's design in the source)."""
from __future__ import annotations

import tvm

from tvm_mamba.runtime import cuda_target


def cuda_source(rule, kernel: str, dims, decisions, arch: str = "sm_90") -> str:
    """``rule.lay_out(kernel, dims)`` compiled for CUDA ``arch``: the device source."""
    target = cuda_target(arch)
    with target:
        return tvm.compile(rule.lay_out(kernel, dims, target, decisions).mod, target=target).mod.imports[0] \
            .inspect_source("cuda")


def kernels(src: str) -> list[str]:
    """The kernel definitions (not the declarations) of the generated CUDA source."""
    parts = src.split('extern "C" __global__ void ')[1:]
    return [p for p in parts if p.split("\n")[0].rstrip().endswith("{")]
