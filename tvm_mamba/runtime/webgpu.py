"""WebGPU: the package's GPU kernels as WGSL, run through wgpu (``pip install wgpu``) on any adapter it finds:
Vulkan, Metal or D3D12 GPUs, and on a machine without one Mesa's llvmpipe (``WGPU_BACKEND_TYPE=OpenGL``).

``with tvm_mamba.webgpu():`` every kernel call on CPU tensors runs the kernel built for
:func:`~.target.webgpu_target` (the GPU rules at WebGPU's limits) instead of the CPU kernel; the kernel keys
say ``webgpu`` and ``explain()`` names the WGSL entry points that ran. Tensors stay on the CPU: each call
copies its tensors into wgpu buffers and the buffers a kernel writes back (wgpu buffers are not DLPack).

TVM generates the WGSL (one compute shader per device kernel: its storage buffers in parameter order, then a
uniform ``PODArgs`` of its scalar parameters and ``packGridDimX``) and a host function that TVM's own WebGPU
runtime (JavaScript) would run. Here :class:`Launcher` runs that host function itself, read from the lowered
module right after ``SplitHostDevice``: its parameters are the kernel's buffers, its statements bind scalars
(``Bind``), declare views (``DeclBuffer``) and launch device kernels (``call_ffi_kernel`` with the kernel's
arguments, then its launch extents, tagged ``blockIdx.*`` / ``threadIdx.*``). Everything it evaluates is
integer arithmetic over the buffers' shapes and strides, bound from the tensors and checked as TVM's packed
API would check them (a mismatch is a ValueError naming the argument, before anything runs).

A built kernel is one JSON file in the kernel cache (:class:`Build`): the WGSL of each device kernel with its
parameters and launch tags, and the host function (``tvm.ir.save_json``).
"""
from __future__ import annotations

import contextlib
import json
import re

from .webgpu_launch import Launcher, adapter_info, device  # noqa: F401 (the public names of the backend)

# (TVM's compiler is imported where a kernel is built or loaded: runtime/target.py imports this module for
# ``active``, also on a machine with only the TVM runtime)

TARGET_KEY = "webgpu"
_active: list[bool] = []


@contextlib.contextmanager
def use():
    """``with use():`` CPU tensors run the WebGPU kernels (``tvm_mamba.webgpu``)."""
    _active.append(True)
    try:
        yield
    finally:
        _active.pop()


def active() -> bool:
    return bool(_active)


def is_webgpu(target_key: str) -> bool:
    return target_key == TARGET_KEY


# ---- build -----------------------------------------------------------------------------------------------------
def _after_split():
    """A pass instrument keeping the module right after ``SplitHostDevice`` (``.mod``): host function and
    device kernels, before the host is lowered to TVM's packed calling convention."""
    from tvm.ir.instrument import pass_instrument

    @pass_instrument
    class AfterSplit:
        def __init__(self):
            self.mod = None

        def run_after_pass(self, mod, info):
            if info.name == "tirx.SplitHostDevice":
                self.mod = mod

    return AfterSplit()


_FUNCTION = re.compile(r"^// Function: (\S+)\n//-+\n", re.M)


def wgsl_by_kernel(source: str) -> dict[str, str]:
    """The WGSL of each kernel in TVM's concatenated source (each shader headed by ``// Function: name``, the
    header written twice)."""
    marks = list(_FUNCTION.finditer(source))
    out: dict[str, str] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(source)
        body = source[m.end():end]
        if body.strip():
            out[m.group(1)] = body
    return out


class Build:
    """What ``compile_module`` returns for the WebGPU target: ``export_library(path)`` writes the JSON file."""

    def __init__(self, entry: str, host_json: str, kernels: dict):
        self.entry, self.host_json, self.kernels = entry, host_json, kernels

    def export_library(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"entry": self.entry, "host": self.host_json, "kernels": self.kernels}, f)


def build(mod, target, label: str = "") -> Build:
    """Compile ``mod`` (an IRModule, one entry function) for ``target`` (webgpu_target): TVM's WGSL of each
    device kernel and the host function that launches them."""
    import tvm

    grab = _after_split()
    with tvm.transform.PassContext(instruments=[grab]):
        ex = tvm.compile(mod, target=target)
    wgsl = wgsl_by_kernel(ex.mod.imports[0].inspect_source("")) if ex.mod.imports else {}
    hosts, kernels = [], {}
    for gv, func in grab.mod.functions.items():
        if func.attrs.get("tirx.is_global_func"):
            params = [(p.name, "ptr" if "handle" in str(p.ty) else str(p.ty)) for p in func.params]
            kernels[gv.name_hint] = {"wgsl": wgsl[gv.name_hint], "params": params,
                                     "launch": list(func.attrs.get("tirx.kernel_launch_params", ()))}
        else:
            hosts.append((gv.name_hint, func))
    if len(hosts) != 1:
        raise RuntimeError(f"webgpu: {label}: expected one host function, got {[h for h, _ in hosts]}")
    name, host = hosts[0]
    return Build(name, tvm.ir.save_json(host), kernels)


class Module:
    """A loaded WebGPU kernel file: ``module[name]`` is its :class:`Launcher` (called with torch tensors)."""

    def __init__(self, data: dict):
        self.data = data
        self._launcher: Launcher | None = None

    def __getitem__(self, name: str):
        if name != self.data["entry"]:
            raise KeyError(f"webgpu: this module holds {self.data['entry']!r}, not {name!r}")
        if self._launcher is None:
            import tvm

            self._launcher = Launcher(tvm.ir.load_json(self.data["host"]), self.data["kernels"])
        return self._launcher


def load(path: str) -> Module:
    with open(path) as f:
        return Module(json.load(f))


