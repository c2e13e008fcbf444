"""The command line: info (a checked kernel call) and build-check (CUDA codegen + nvcc, no GPU)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "tvm_mamba", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.smoke
def test_info_runs_a_checked_kernel():
    proc = _run("info")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cpu target:" in proc.stdout and '"kind":"llvm"' in proc.stdout.replace(" ", "")
    assert re.search(r"check: .* = \d\.\d+e-\d+ \(ok", proc.stdout)


def test_info_names_the_device_key_and_its_tuning_records(tmp_path):
    """``device key:`` and ``tuning:`` lines; a user record for this device is counted with its folder."""
    from tvm_mamba.runtime import cpu_target, target_key, tuning

    dev = tuning.device_key(target_key(cpu_target()))
    (tmp_path / dev).mkdir()
    (tmp_path / dev / "meta.json").write_text(json.dumps(tuning.running_meta()))
    env = dict(os.environ, **{tuning.ENV: str(tmp_path)})
    proc = subprocess.run([sys.executable, "-m", "tvm_mamba", "info"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"device key:  {dev}\n" in proc.stdout
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("tuning:")]
    shipped = any(tuning.package_logs_dir().glob(f"{dev}/*/records.jsonl"))
    if shipped:
        assert "shipped records for this device: " in line and f"user records: 0 ({tmp_path / dev})" in line
    elif tuning.stand_in(target_key(cpu_target())):
        assert "none for this device" in line and "serve (stand-in: the same ISA class)" in line
    else:
        assert "none for this device" in line and ("nearest: " in line or "no records" in line)


def test_tune_help_names_the_user_folder():
    proc = _run("tune", "--help", timeout=120)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "$XDG_CACHE_HOME/tvm_mamba/tuning_logs" in text and "$TVM_MAMBA_TUNING_LOGS" in text


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


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_sim_check_runs_what_build_check_builds(arch):
    """sim-check runs the same configurations as build-check (the counts match) through the CUDA harness."""
    from tvm_mamba.compute.rmsnorm_gated import build_check_configs

    proc = _run("sim-check", "--arch", arch, "--ops", "rmsnorm_gated")
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"sim-check: (\d+) kernels, (\d+) failed \(cuda {arch}\)", last)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert int(m.group(1)) == len(build_check_configs()) and m.group(2) == "0"
    assert proc.returncode == 0
    assert proc.stdout.count(" ok   ") == len(build_check_configs())
    n = len(build_check_configs())
    assert f"sim-check: compiled {n}/{n} (" in proc.stdout  # progress while the kernels compile


def test_build_check_cpu_generates_neon_for_an_arm_cpu():
    """build-check --target cpu --mcpu neoverse-v1: the CPU strategies through LLVM's AArch64 codegen (no
    linking), each kernel's vector FMAs counted; the linear kernels vectorize there."""
    proc = _run("build-check", "--target", "cpu", "--mcpu", "neoverse-v1", "--ops", "linear")
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"build-check: (\d+) kernels, (\d+) failed \(llvm neoverse-v1, aarch64-linux-gnu\)", last)
    assert m and proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    counts = [int(n) for n in re.findall(r"(\d+) vector FMAs", proc.stdout)]
    assert len(counts) == int(m.group(1)) >= 8 and m.group(2) == "0" and min(counts) > 0


def test_sim_and_build_check_refuse_bad_flags():
    for cmd in ("sim-check", "build-check"):
        proc = _run(cmd, "--ops", "no_such_op")
        assert proc.returncode == 2 and "valid: causal_conv1d" in proc.stderr
        proc = _run(cmd, "--arch", "sm_75")
        assert proc.returncode == 2 and "minimum is sm_80" in proc.stderr
