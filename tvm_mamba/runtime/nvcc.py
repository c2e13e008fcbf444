"""Compile TVM-generated CUDA source with nvcc on a machine without a GPU and read ptxas's resource report.

``tvm.compile`` for a CUDA target only produces source here (no libcuda for TVM's CUDA sidecar; see the
field guide §5/§7), so the build check runs nvcc itself: ``nvcc --cubin -arch=sm_XY -Xptxas -v``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

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


def ptxas_stats(cuda_source: str, arch: str, timeout: float = 300) -> dict:
    """Compile ``cuda_source`` for ``arch`` and return {"ok", "error", "kernels": [{name, registers,
    spill_stores, spill_loads, smem, stack}]}."""
    nvcc = nvcc_path()
    if nvcc is None:
        return {"ok": False, "error": "nvcc not found", "kernels": []}
    with tempfile.TemporaryDirectory(prefix="tvm_mamba_nvcc_") as tmp:
        src = os.path.join(tmp, "k.cu")
        with open(src, "w") as f:
            f.write(cuda_source)
        cmd = [nvcc, "--cubin", "-O3", f"-arch={arch}", "-Xptxas", "-v", "-o", os.path.join(tmp, "k.cubin"), src]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"nvcc timed out after {timeout}s", "kernels": []}
    log = proc.stdout + proc.stderr
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
    ok = proc.returncode == 0
    err = "" if ok else "\n".join(l for l in log.splitlines() if "error" in l)[:2000] or log[-2000:]
    return {"ok": ok, "error": err, "kernels": kernels}
