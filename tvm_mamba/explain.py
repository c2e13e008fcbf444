"""``tvm_mamba.explain(fn, *args, **kwargs)``: which kernels, schedules and tuning records serve a call."""
from __future__ import annotations

import torch

from .runtime import cache, dispatch, webgpu


def explain(fn, *args, **kwargs) -> str:
    """Run ``fn(*args, **kwargs)`` (and, when its output requires grad, a backward with ones) while
    recording every kernel key used; return one readable paragraph per kernel: key, schedule source
    ("default" or "tuned: <file> (<time>)") and knob values; on WebGPU the WGSL compute shaders it ran."""
    with dispatch.record_keys() as keys:
        out = fn(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        roots = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
    if not keys:
        return "no tvm_mamba kernel was called"
    return "\n".join(dispatch.explain_key(k, served) + _wgsl(k) for k, served in keys)


def _wgsl(key) -> str:
    """For a WebGPU kernel: the WGSL compute shaders (entry points) its host function dispatches, in order."""
    if not webgpu.is_webgpu(key.target):
        return ""
    launcher = cache.build_and_load(key).fn
    return "\n    wgsl: " + ", ".join(launcher.specs)
