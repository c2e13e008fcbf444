"""The README's quick start runs as written (every op's example and the LM), in a fresh process."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n", text.index("## Quick start")) + len("```python\n")
    return text[start:text.index("```", start)]


def test_quick_start_runs(tmp_path):
    code = _quick_start()
    assert "causal_conv1d_fn" in code and "generate" in code and "int8_matmul" in code
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "schedule:" in proc.stdout  # explain() printed the kernels that served the call
