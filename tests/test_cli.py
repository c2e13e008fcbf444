"""The command line: info (a checked kernel call) and build-check (CUDA codegen + nvcc, no GPU)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "tvm_mamba", *args], capture_output=True, text=True, timeout=timeout)


def test_info_runs_a_checked_kernel():
    proc = _run("info")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cpu target:" in proc.stdout and '"kind":"llvm"' in proc.stdout.replace(" ", "")
    assert re.search(r"check: .* = \d\.\d+e-\d+ \(ok", proc.stdout)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_build_check_causal_conv1d_is_clean(arch):
    proc = _run("build-check", "--target", "cuda", "--arch", arch, "--ops", "causal_conv1d")
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"build-check: (\d+) kernels, (\d+) failed, (\d+) spilling \(cuda {arch}\)", last)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert int(m.group(1)) >= 10 and m.group(2) == "0" and m.group(3) == "0"
    assert proc.returncode == 0
    assert "regs" in proc.stdout
