"""schedules/ is the package's tvm_mamba.schedules through the tvm_mamba/schedules link (in a wheel, a copy);
the wheel ships it and tuning_logs/ as data."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wheel_contains_schedules_and_tuning_logs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(tmp_path.glob("tvm_mamba-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "tvm_mamba/schedules/rule.py" in names
    assert "tvm_mamba/schedules/cpu/causal_conv1d.py" in names
    assert "tvm_mamba/schedules/cuda/causal_conv1d.py" in names
    logs = [p.relative_to(ROOT).as_posix() for p in (ROOT / "tuning_logs").rglob("*") if p.is_file()]
    assert len(logs) > 5
    missing = [p for p in logs if "tvm_mamba/" + p not in names]
    assert not missing, missing  # every tuning record ships (records.jsonl included)
    assert "tvm_mamba/compute/causal_conv1d/__init__.py" in names
    assert "tvm_mamba/runtime/cudasim_include/tvm_mamba_cudasim.h" in names  # the CUDA execution harness
    assert "tvm_mamba/runtime/cudasim_include/cuda/std/cstdint" in names
    # every module of the source tree ships: pyproject lists the packages one by one, and a new subpackage
    # missing from that list is absent from the wheel while an editable install still finds it
    sources = [f"tvm_mamba/{f.relative_to(ROOT / 'tvm_mamba').as_posix()}" for f in (ROOT / "tvm_mamba").rglob("*.py")]
    sources += [f"tvm_mamba/schedules/{f.relative_to(ROOT / 'schedules').as_posix()}"
                for f in (ROOT / "schedules").rglob("*.py")]
    missing = [f for f in sources if "__pycache__" not in f and f not in names]
    assert not missing, missing
    # the vLLM plugin's entry point (vLLM loads every vllm.general_plugins entry in each of its processes)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]\ntvm_mamba = tvm_mamba.vllm_plugin:register" in text


def test_schedules_link_serves_a_checkout(tmp_path):
    """tvm_mamba/schedules is a relative link to the repository's schedules/, so a checkout imported through
    PYTHONPATH (a git worktree, the GPU machine's copy) uses its own schedules, with nothing mapped at import."""
    link = ROOT / "tvm_mamba" / "schedules"
    assert link.is_symlink() and link.readlink() == pathlib.Path("..") / "schedules"
    code = "import tvm_mamba.schedules.cpu.ssd as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    where = pathlib.Path(out.stdout.strip()).resolve()
    assert where == (ROOT / "schedules" / "cpu" / "ssd.py").resolve()
