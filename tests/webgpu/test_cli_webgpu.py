"""The command line on WebGPU: ``info --webgpu`` names the adapter and checks one call there; ``sim-check
--target webgpu`` runs an op's float32 configurations there and ends with its one summary line."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.webgpu, pytest.mark.usefixtures("adapter")]


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "tvm_mamba", *args], capture_output=True, text=True, timeout=timeout)


def test_info_names_the_adapter_and_checks_a_call_on_it(adapter):
    proc = _run("info", "--webgpu")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("webgpu:"))
    assert adapter["device"] in line and "workgroup memory" in line
    assert "the same call on WebGPU" in proc.stdout and "(ok;" in proc.stdout.split("on WebGPU")[-1]


def test_sim_check_on_webgpu():
    proc = _run("sim-check", "--target", "webgpu", "--ops", "causal_conv1d")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("sim-check: ") and " 0 failed (webgpu)" in last
    assert "@webgpu" in proc.stdout or "webgpu" in proc.stdout.splitlines()[0]


def test_sim_check_refuses_a_target_it_cannot_run():
    proc = _run("sim-check", "--target", "metal", "--ops", "causal_conv1d", timeout=120)
    assert proc.returncode != 0 and "metal" in proc.stderr
