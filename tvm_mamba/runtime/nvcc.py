"""The one nvcc command line every CUDA binary of this package is compiled with, and ptxas's resource report.

Three paths compile CUDA here and all three run :func:`nvcc_command` (docs/design.md, "Compiler flags"):

* ``build-check`` (cli.py) and the roofline report (roofline/measure.py): :func:`ptxas_stats`, which reads
  registers, spills and shared memory from ``-Xptxas -v``;
* the shipped packs and the kernel cache on a machine with TVM's CUDA module (``aot --target cuda``,
  cache.compile_module): TVM's codegen calls the global ``tvm_callback_cuda_compile`` with the CUDA source;
  :func:`install_cuda_compile_hook` replaces TVM's own hook (which adds its own flags: ``--use_fast_math``,
  ``--register-usage-level=10``, ...) with :func:`compile_cubin`, so the cubin that runs is the one whose
  registers and spills build-check printed.

``tvm.compile`` for a CUDA target without TVM's CUDA sidecar only produces source (field guide §5/§7), which is
why build-check runs nvcc itself. The CPU harness (cudasim.py) mirrors what these flags mean for numerics:
:data:`FAST_MATH` selects its fast-math emulation (cudasim_include/tvm_mamba_cudasim_fastmath.h).
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tempfile

# --use_fast_math: expf/logf/sinf/cosf/tanhf/sqrtf/rsqrtf and `/` become the MUFU approximations (ex2.approx,
# lg2.approx, tanh.approx, div.approx, ...), denormals flush to zero (-ftz=true). Kept, like upstream's CUDA
# builds (mamba_ssm, causal_conv1d pass it) and Triton kernels (tl.exp is ex2.approx); the reasons and the
# error bounds are in docs/design.md. ptxas keeps its default register policy: each kernel's
# __launch_bounds__ (TVM emits the block size) caps its registers; no -maxrregcount, no beta
# --register-usage-level.
FAST_MATH = True
NVCC_FLAGS: tuple[str, ...] = ("-O3", *(("--use_fast_math",) if FAST_MATH else ()), "-Xptxas", "-v")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, \d+ bytes cumulative stack size)?"
                   r"(?:, (\d+) bytes smem)?")


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc",):
        if os.path.exists(cand):
            return cand
    return None


def nvcc_command(arch: str, source_path: str, cubin_path: str, nvcc: str | None = None) -> list[str]:
    """The nvcc argv that compiles ``source_path`` (CUDA C from TVM's codegen) to an ``arch`` cubin (SASS only,
    what cuModuleLoadData takes) at ``cubin_path``: the one command of build-check, the roofline and packs."""
    if not (isinstance(arch, str) and arch.startswith("sm_") and arch[3:].isdigit()):
        raise ValueError(f"arch: expected a CUDA arch such as 'sm_90', got {arch!r}")
    return [nvcc or nvcc_path() or "nvcc", "--cubin", f"-arch={arch}", *NVCC_FLAGS, "-o", cubin_path, source_path]


def _run_nvcc(cuda_source: str, arch: str, timeout: float) -> tuple[int, str, bytes]:
    """(return code, nvcc + ptxas log, cubin bytes) of :func:`nvcc_command` on ``cuda_source``."""
    nvcc = nvcc_path()
    if nvcc is None:
        return 127, "nvcc not found", b""
    with tempfile.TemporaryDirectory(prefix="tvm_mamba_nvcc_") as tmp:
        src, out = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(cuda_source)
        try:
            proc = subprocess.run(nvcc_command(arch, src, out, nvcc), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, f"nvcc timed out after {timeout}s", b""
        cubin = pathlib.Path(out).read_bytes() if proc.returncode == 0 and os.path.exists(out) else b""
    return proc.returncode, proc.stdout + proc.stderr, cubin


def parse_ptxas(log: str) -> list[dict]:
    """[{name, arch, registers, spill_stores, spill_loads, smem, stack}] from ptxas -v's report."""
    kernels: list[dict] = []
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            kernels.append({"name": m.group(1), "arch": m.group(2), "registers": 0, "spill_stores": 0,
                            "spill_loads": 0, "smem": 0, "stack": 0})
            continue
        if not kernels:
            continue
        m = _SPILL.search(line)
        if m:
            kernels[-1].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _USED.search(line)
        if m:
            kernels[-1].update(registers=int(m.group(1)), smem=int(m.group(3) or 0))
    return kernels


def ptxas_stats(cuda_source: str, arch: str, timeout: float = 300) -> dict:
    """Compile ``cuda_source`` for ``arch`` and return {"ok", "error", "kernels": [{name, registers,
    spill_stores, spill_loads, smem, stack}]}."""
    rc, log, _ = _run_nvcc(cuda_source, arch, timeout)
    if rc in (124, 127):
        return {"ok": False, "error": log, "kernels": []}
    ok = rc == 0
    err = "" if ok else "\n".join(l for l in log.splitlines() if "error" in l)[:2000] or log[-2000:]
    return {"ok": ok, "error": err, "kernels": parse_ptxas(log)}


def compile_cubin(cuda_source: str, arch: str, timeout: float = 600) -> bytes:
    """The cubin of ``cuda_source`` for ``arch`` (:func:`nvcc_command`); RuntimeError with nvcc's log."""
    rc, log, cubin = _run_nvcc(cuda_source, arch, timeout)
    if rc != 0 or not cubin:
        raise RuntimeError(f"nvcc ({' '.join(NVCC_FLAGS)}) failed for {arch}:\n{log[-3000:]}")
    return cubin


def _current_arch() -> str:
    from tvm.target import Target

    target = Target.current(allow_none=True)
    arch = str(getattr(target, "arch", "") or "") if target is not None else ""
    if not arch.startswith("sm_"):
        raise RuntimeError("tvm_mamba: CUDA compile outside `with target:` (no sm_XY arch to compile for); "
                           f"current target: {target}")
    return arch


def _tvm_cuda_compile(code, *_rest):
    """TVM's ``tvm_callback_cuda_compile`` (called by its CUDA codegen with the kernel source, inside
    ``with target:``): the cubin of :func:`compile_cubin`."""
    return bytearray(compile_cubin(str(code), _current_arch()))


_hook_installed = False


def install_cuda_compile_hook() -> None:
    """Make TVM's CUDA codegen compile with :func:`nvcc_command` (replacing the hook ``import tvm`` registers;
    idempotent). Called before every CUDA ``tvm.compile`` (cache.compile_module)."""
    global _hook_installed
    if _hook_installed:
        return
    import tvm  # noqa: F401 - registers TVM's hook first, so ours is the one that stays
    import tvm_ffi

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _tvm_cuda_compile, override=True)
    _hook_installed = True
