"""The compile notice (runtime/progress.py): once a process has compiled for NOTICE_S, one line on stderr
naming the kernel and the cache; silenced by TVM_MAMBA_QUIET or the logger's level; nothing for cached
kernels."""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time

import pytest

from tvm_mamba.runtime import progress


class _Err(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.fixture
def err(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    progress.reset()
    stream = _Err(tty=False)
    monkeypatch.setattr(progress, "_stream", lambda: stream)  # not sys.stderr: pytest resets it per phase
    yield stream
    progress.reset()


def _compile(seconds: float, name="ssd.chunk_scan"):
    with progress.compiling(name, "llvm-znver3", "/cache/here"):
        time.sleep(seconds)


def test_short_compiles_say_nothing_until_they_add_up(err, monkeypatch):
    monkeypatch.setattr(progress, "NOTICE_S", 0.3)
    _compile(0.05)
    _compile(0.05)
    assert err.getvalue() == ""
    for _ in range(6):
        _compile(0.05, "linear.fwd")
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines  # the notice once; progress only every REPORT_S off a terminal
    assert "compiling kernels for llvm-znver3" in lines[0] and "linear.fwd" in lines[0]
    assert "/cache/here" in lines[0] and progress.ENV in lines[0]


def test_one_long_compile_is_announced_while_it_runs(err, monkeypatch):
    monkeypatch.setattr(progress, "NOTICE_S", 0.1)
    with progress.compiling("selective_scan.fwd", "llvm-znver3", "/c"):
        time.sleep(0.4)
        assert "selective_scan.fwd" in err.getvalue()  # written by the timer, before the compile ends
    assert err.getvalue().count("compiling kernels") == 1


def test_progress_rewrites_one_line_on_a_terminal(err, monkeypatch):
    err.tty = True
    monkeypatch.setattr(progress, "NOTICE_S", 0.0)
    for _ in range(3):
        _compile(0.01)
    text = err.getvalue()
    assert text.count("compiling kernels") == 1
    assert "compiled 3 kernels" in text and text.endswith("\r")


@pytest.mark.parametrize("how", ["env", "logger"])
def test_silenced(err, monkeypatch, how):
    monkeypatch.setattr(progress, "NOTICE_S", 0.0)
    if how == "env":
        monkeypatch.setenv(progress.ENV, "1")
    else:
        progress.log.setLevel(logging.WARNING)  # setLevel, not the attribute: the logger caches its answer
    try:
        _compile(0.01)
        _compile(0.01)
    finally:
        progress.log.setLevel(logging.INFO)
    assert err.getvalue() == ""


@pytest.mark.cold_start
def test_a_cold_process_says_so_and_a_warm_one_does_not(tmp_path):
    """A real kernel build (fresh cache) prints the notice; the next process loads it and prints nothing."""
    code = ("from tvm_mamba.runtime import progress; progress.NOTICE_S = 0.0\n"
            "import torch, tvm_mamba\n"
            "x = torch.randn(1, 24, 40); w = torch.randn(24, 4)\n"
            "tvm_mamba.causal_conv1d_fn(x, w, activation='silu')\n")
    env = dict(os.environ, TVM_MAMBA_CACHE_DIR=str(tmp_path))
    env.pop(progress.ENV, None)
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert "tvm_mamba: compiling kernels for llvm-" in runs[0].stderr and "causal_conv1d.fwd" in runs[0].stderr
    assert str(tmp_path) in runs[0].stderr
    assert "tvm_mamba:" not in runs[1].stderr
