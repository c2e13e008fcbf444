"""The call-time path (torch_ops/, modules/) imports on a runtime-only TVM, as on the GPU machine.

The GPU machine carries TVM without ``libtvm_compiler.so`` (scripts/gpu_bundle.sh's ``site/tvm``, run with
``TVM_USE_RUNTIME_LIB=1``): there ``import tvm`` works but TVMScript (``tvm.script.parser``, ``tvm.tirx.script``,
the CUDA kernel language ``tvm.backend.cuda.lang``) does not, and kernels come from an AOT pack. So every torch
op and module must reach its kernels' typed dims without importing a compute *builder* package (those write
their templates in TVMScript): the dims live in the TVM-free ``compute/_<op>_dims.py`` files.

``TVM_USE_RUNTIME_LIB=1`` alone reproduces that here, with the full wheel installed (TVMScript's import fails
the same way: ``cannot import name 'TCol'``); the probe below asserts it, so the test cannot pass vacuously.
"""
from __future__ import annotations

import os
import json
import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[1]
# what a runtime-only tvm cannot import (TVMScript, its builders, the CUDA kernel language, relax)
COMPILER_ONLY = ("tvm.script.parser", "tvm.script.ir_builder", "tvm.tirx.script", "tvm.tirx.lang",
                 "tvm.backend.cuda.lang", "tvm.relax")

_IMPORT_ALL = r"""
import importlib, importlib.util, json, pkgutil, sys
import tvm
assert tvm.base._RUNTIME_ONLY, tvm.__file__
errors, names = {}, ["tvm_mamba", "tvm_mamba.modules.lm"]
for layer in ("tvm_mamba.torch_ops", "tvm_mamba.modules"):  # listed from their folders, not imported
    names.append(layer)
    names += [i.name for i in pkgutil.iter_modules(importlib.util.find_spec(layer).submodule_search_locations,
                                                   layer + ".")]
for name in names:
    try:
        importlib.import_module(name)
    except Exception as err:  # every failing module is listed, not only the first
        errors[name] = f"{type(err).__name__}: {err}"
forbidden = sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[1].split(","))))
print(json.dumps({"imported": len(names), "errors": errors, "forbidden": forbidden}))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)


def test_call_time_path_imports_without_tvm_compiler():
    """Every torch_ops and modules module (tvm_mamba.modules.lm included) imports on a runtime-only TVM, and
    none of them imports TVMScript or another compiler-only part of TVM (not even partly: a failed import
    leaves its modules in sys.modules)."""
    probe = _run("import tvm; assert tvm.base._RUNTIME_ONLY, tvm.__file__; from tvm.script import tirx")
    assert probe.returncode != 0 and "ImportError" in probe.stderr, (
        "TVMScript imports on a runtime-only tvm here: this host no longer reproduces the GPU machine\n"
        + probe.stderr[-1500:])
    out = _run(_IMPORT_ALL, ",".join(COMPILER_ONLY))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["imported"] > 20, report
    assert report["errors"] == {}, f"modules that do not import on a runtime-only tvm: {report['errors']}"
    assert report["forbidden"] == [], f"compiler-only modules imported at call time: {report['forbidden']}"
