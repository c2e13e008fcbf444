"""The vLLM benchmarks run (marker ``vllm``): ``bench.py --vs vllm --quick`` (each row checks that both
libraries agree before timing) and ``bench_vllm.py --quick`` (an engine with and without the plugin, same
tokens)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def _run(*args: str, timeout: int = 900) -> str:
    run = subprocess.run([sys.executable, str(SCRIPTS / args[0]), *args[1:]], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def test_bench_vs_vllm_quick_rows_agree_and_time():
    out = _run("bench.py", "--vs", "vllm", "--quick")
    for op in ("selective_state_update (decode)", "causal_conv1d_update (decode)", "causal_conv1d_fn (prefill)",
               "mamba_chunk_scan_combined_varlen (prefill)"):
        assert op in out


def test_bench_vllm_quick_same_tokens_with_and_without_the_plugin(tmp_path):
    out = _run("bench_vllm.py", "--quick", "--cache", str(tmp_path))
    row = [ln for ln in out.splitlines() if ln.startswith("mamba2-tiny")]
    assert row and row[0].split()[-1] == "True", out
