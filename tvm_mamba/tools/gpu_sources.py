"""``build-check --target webgpu|metal|opencl``: every build-check configuration laid out by the GPU rules for
another GPU language and compiled to its source by TVM, then checked where a checker is at hand:

- ``webgpu``: the WGSL of each compute shader validated by wgpu's shader compiler (naga) on the adapter wgpu
  finds (``pip install wgpu``); float32 configurations only (WGSL has no bf16, and f16 only with shader-f16);
- ``opencl``: the OpenCL C parsed by clang's front end through libclang (``pip install libclang``), with
  clang's declarations of the OpenCL builtins (the wheel has no ``opencl-c-base.h``: the few typedefs the
  kernels use from it are given here);
- ``metal``: generated only (Metal's compiler exists on macOS alone).

Per configuration one line (``ok`` / ``FAIL`` with the kernel, then its shaders and lines), and exactly one
last line ``build-check: N kernels, F failed, S skipped (<target>: <how checked>)``.
"""
from __future__ import annotations

import importlib.util

import tvm
from tvm.target import Target

from .simcheck import on_webgpu

# what clang's -fdeclare-opencl-builtins leaves to the header the libclang wheel lacks: the scalar and vector
# type names, size_t, the fence flags
_CL_SCALARS = {"char": "char", "uchar": "unsigned char", "short": "short", "ushort": "unsigned short",
               "int": "int", "uint": "unsigned int", "long": "long", "ulong": "unsigned long", "float": "float"}
_CL_PRELUDE = "".join(f"typedef {c} {n};\n" for n, c in _CL_SCALARS.items() if n != c) + "".join(
    f"typedef {c} {n}{w} __attribute__((ext_vector_type({w})));\n" for n, c in _CL_SCALARS.items()
    for w in (2, 3, 4, 8, 16)) + ("typedef __SIZE_TYPE__ size_t;\ntypedef __PTRDIFF_TYPE__ ptrdiff_t;\n"
                                   "typedef uint cl_mem_fence_flags;\n#define CLK_LOCAL_MEM_FENCE 0x01\n"
                                   "#define CLK_GLOBAL_MEM_FENCE 0x02\n")
# (the feature macro the header sets for OpenCL 1.2's per-address-space builtins: vload4 on a __global pointer)
_CL_ARGS = ["-x", "cl", "-cl-std=CL1.2", "-cl-no-stdinc", "-Xclang", "-fdeclare-opencl-builtins",
            "-D__opencl_c_named_address_space_builtins=1"]


def target_of(kind: str) -> Target:
    from ..runtime.target import webgpu_target

    if kind == "webgpu":
        return webgpu_target()
    if kind in ("metal", "opencl"):
        return Target(kind, host="llvm")
    raise ValueError(f"target: expected webgpu, metal or opencl, got {kind!r}")


class _Checker:
    """The checker of ``kind``'s sources here, or none (``how`` says which)."""

    def __init__(self, kind: str):
        self.kind, self.device, self.clang = kind, None, None
        if kind == "webgpu" and importlib.util.find_spec("wgpu") is not None:
            from ..runtime import webgpu

            if webgpu.adapter_info() is not None:
                self.device = webgpu.device()[1]
        if kind == "opencl" and importlib.util.find_spec("clang") is not None:
            import clang.cindex

            try:
                self.clang = clang.cindex.Index.create()
            except Exception:  # noqa: BLE001 - the bindings without their library: generated only
                self.clang = None

    @property
    def how(self) -> str:
        if self.device is not None:
            return "WGSL validated by naga"
        if self.clang is not None:
            return "OpenCL C parsed by clang"
        return "generated, not checked" + {"webgpu": " (no wgpu adapter)", "opencl": " (no libclang)",
                                           "metal": " (Metal's compiler is macOS's)"}[self.kind]

    def check(self, source: str, shaders: dict) -> None:
        """Raise with the checker's message where the source does not compile."""
        if self.device is not None:
            for name, wgsl in shaders.items():
                self.device.create_shader_module(code=wgsl, label=name)  # raises on a validation error
        if self.clang is not None:
            tu = self.clang.parse("kernel.cl", args=_CL_ARGS, unsaved_files=[("kernel.cl", _CL_PRELUDE + source)])
            errors = [d.spelling for d in tu.diagnostics if d.severity >= 3]
            if errors:
                raise RuntimeError("clang: " + "; ".join(errors[:3]))


def run(configs, kind: str) -> int:
    """Build and check ``configs`` ((op, direction, static, dtypes) each) for ``kind``; exit status."""
    from ..runtime import registry, rules, webgpu
    from ..schedules.rule import Decisions

    target, checker = target_of(kind), _Checker(kind)
    total = failed = skipped = 0
    for op, direction, static, dtypes in configs:
        label = f"{op}.{direction} {static} {dtypes}"
        if kind == "webgpu" and not on_webgpu(dtypes):
            skipped += 1
            continue
        total += 1
        try:
            dims = registry.op(op).dims(direction).from_key(static, dtypes)
            sch = rules.rule_module(target, op).lay_out(direction, dims, target, Decisions())
            if sch is None:
                raise RuntimeError("no GPU rule lays this kernel out")
            source = tvm.compile(sch.mod, target=target).mod.imports[0].inspect_source("")
            shaders = webgpu.wgsl_by_kernel(source) if kind == "webgpu" else {}
            checker.check(source, shaders)
            count = len(shaders) or source.count("__kernel ") or source.count("kernel void ")
            print(f"ok    {label}\n      {count} kernels, {len(source.splitlines())} lines", flush=True)
        except Exception as err:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            print(f"FAIL  {label}\n      {(lines[-1] if lines else type(err).__name__)[:300]}", flush=True)
    print(f"build-check: {total} kernels, {failed} failed, {skipped} skipped ({kind}: {checker.how})")
    return 1 if failed else 0
