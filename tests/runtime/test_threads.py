"""The CPU kernels' parallel loops run on torch's OpenMP team (runtime/threads.py), give the same results as
on TVM's own pool, and TVM_MAMBA_CPU_POOL=tvm keeps TVM's pool."""
import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from tvm_mamba.runtime import cache, threads

_CHILD = r"""
import ctypes, json, os, sys
import torch
import tvm_mamba
from tvm_mamba.runtime import cache, threads
torch.manual_seed(0)
x, w, b = torch.randn(2, 256, 512), torch.randn(256, 4), torch.randn(256)
outs = [tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")]
torch.set_num_threads(1)   # the team's size follows torch: one thread now
outs.append(tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu"))
torch.set_num_threads(2)
(kern,) = [k for k in cache._memo.values() if k.key.op == "causal_conv1d" and k.key.direction == "fwd"]
lib = ctypes.CDLL(str(kern.path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
entry = ctypes.c_void_p.in_dll(lib, threads.SYMBOL).value
print(json.dumps({"routed": entry == threads._state.get("addr"), "sums": [float(o.double().sum()) for o in outs],
                  "bits": [o.view(torch.int32).sum().item() for o in outs]}))
"""


def _child(pool: str | None) -> dict:
    env = dict(os.environ)
    env.pop(threads.ENV, None)
    if pool is not None:
        env[threads.ENV] = pool
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_run_on_the_openmp_team_with_the_results_of_tvms_pool():
    routed, tvm_pool = _child(None), _child("tvm")
    assert routed["routed"] and not tvm_pool["routed"]
    # each output element is computed the same way whichever thread runs it: bitwise equal
    assert routed["bits"] == tvm_pool["bits"] and routed["bits"][0] == routed["bits"][1]


def test_the_launcher_runs_every_task_and_reports_a_lambda_error():
    """The launcher against a C lambda of TVM's signature: every task of the team runs once; an error code
    from any task comes back from the launch."""
    addr = threads.launcher_address(cache.cache_root())
    assert addr is not None
    env_t = type("Env", (ctypes.Structure,), {"_fields_": [("sync", ctypes.c_void_p), ("num_task", ctypes.c_int32)]})
    lam_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(env_t), ctypes.c_void_p)
    launch = ctypes.CFUNCTYPE(ctypes.c_int, lam_t, ctypes.c_void_p, ctypes.c_int)(addr)
    seen = []

    def body(task, penv, _):
        seen.append((task, penv.contents.num_task))
        return 7 if fail and task == 0 else 0

    for fail in (False, True):
        seen.clear()
        rc = launch(lam_t(body), None, 0)
        n = torch.get_num_threads()
        assert sorted(seen) == [(i, n) for i in range(n)] and rc == (7 if fail else 0)


def test_an_unknown_pool_name_is_a_value_error(monkeypatch):
    monkeypatch.setenv(threads.ENV, "tbb")
    with pytest.raises(ValueError, match=threads.ENV):
        threads.enabled()
