"""One nvcc flag set: build-check / the roofline (nvcc.ptxas_stats) and the shipped pack (TVM's CUDA codegen
through tvm_callback_cuda_compile) run the same nvcc command on the same source (runtime/nvcc.py)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tvm_mamba.runtime import nvcc

NEEDS = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("gcc") is None, reason="needs nvcc and gcc")
CONFIG = ("causal_conv1d", "fwd", dict(dim=24, width=4, activation="silu", has_bias=True, has_seq_idx=False,
                                       has_init=False, return_final=False), {"x": "float32", "weight": "float32"})

# Logs each call's argv (one line, NUL-separated) and copies the .cu it compiles, then runs the real nvcc.
FAKE_NVCC = """#!/bin/bash
n=$(ls "$NVCC_LOG" | wc -l)
printf '%s\\0' "$@" > "$NVCC_LOG/$n.argv"
for a in "$@"; do case "$a" in *.cu) cp "$a" "$NVCC_LOG/$n.cu";; esac; done
exec {real} "$@"
"""

# A pack of one configuration built the way `aot --target cuda` builds it: a stub libcuda.so.1 so TVM's CUDA
# module exists, its codegen then calling tvm_callback_cuda_compile for the cubin.
PACK = """
import sys, pathlib
from tvm_mamba.tools.aot import build_pack
from tvm_mamba.runtime import pack
folder = build_pack([], sys.argv[1], "cuda", "sm_90", seqlens=(512,), batches=(1,), configs=[{config!r}])
assert not build_pack.failed, build_pack.failed
print("files", len(list(folder.glob("*.so"))))
"""

BUILD_CHECK = """
import sys
from tvm_mamba.runtime import KernelKey, cuda_target, dispatch, target_key
from tvm_mamba.runtime.cache import compile_module
from tvm_mamba.runtime.nvcc import ptxas_stats
op, direction, static, dtypes = {config!r}
key = KernelKey.make(op, direction, dtypes, static, target_key(cuda_target("sm_90")), {{"batch": 1, "seqlen": 512}})
src = compile_module(key, dispatch.schedule(key)).mod.imports[0].inspect_source("cuda")
stats = ptxas_stats(src, "sm_90")
assert stats["ok"] and stats["kernels"], stats
print("kernels", len(stats["kernels"]))
"""


def _normalized(argv_file: pathlib.Path) -> list[str]:
    """The argv with its temporary file paths replaced by their role."""
    args = argv_file.read_bytes().split(b"\0")[:-1]
    out = []
    for a in (x.decode() for x in args):
        out.append("<src>" if a.endswith(".cu") else "<out>" if a.endswith((".cubin", ".fatbin")) else a)
    return out


def _run(script: str, tmp: pathlib.Path, name: str, env: dict, *args) -> list[pathlib.Path]:
    log = tmp / f"log-{name}"
    log.mkdir()
    proc = subprocess.run([sys.executable, "-c", script, *args], env=dict(env, NVCC_LOG=str(log)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return sorted(log.glob("*.argv"))


@NEEDS
def test_pack_and_build_check_run_the_same_nvcc_command_on_the_same_source(tmp_path):
    from tvm_mamba.runtime import pack

    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text(FAKE_NVCC.format(real=nvcc.nvcc_path()))
    fake.chmod(0o755)
    stub = pack.make_stub_driver(tmp_path / "stub")
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
               TVM_MAMBA_CACHE_DIR=str(tmp_path / "cache"))
    checked = _run(BUILD_CHECK.format(config=CONFIG), tmp_path, "check", env)
    packed = _run(PACK.format(config=CONFIG), tmp_path, "pack",
                  dict(env, TVM_CUDA_COMPILE_MODE="nvcc",
                       LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(stub.parent),
                                                                     os.environ.get("LD_LIBRARY_PATH")]))),
                  str(tmp_path / "pack"))
    assert len(checked) == 1 and len(packed) == 1, (checked, packed)
    cmd = _normalized(checked[0])
    assert _normalized(packed[0]) == cmd
    assert cmd == nvcc.nvcc_command("sm_90", "<src>", "<out>")[1:]  # the log holds the arguments, not argv[0]
    assert ("--use_fast_math" in cmd) == nvcc.FAST_MATH
    assert checked[0].with_suffix(".cu").read_text() == packed[0].with_suffix(".cu").read_text()
    blob = next((tmp_path / "pack").glob("*.so")).read_bytes()
    assert b"nv.info" in blob and b"__global__" not in blob  # the pack holds the cubin, not source


def test_install_replaces_tvms_hook():
    import tvm_ffi

    nvcc.install_cuda_compile_hook()
    hook = tvm_ffi.get_global_func("tvm_callback_cuda_compile")
    with pytest.raises(RuntimeError, match="outside `with target:`"):
        hook("extern \"C\" __global__ void k() {}")


def test_nvcc_command_rejects_a_bad_arch():
    with pytest.raises(ValueError, match="arch"):
        nvcc.nvcc_command("90", "k.cu", "k.cubin")
