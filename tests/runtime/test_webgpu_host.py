"""The WebGPU build (runtime/webgpu.py) without an adapter: the kernel file's contents (each device kernel's
WGSL, parameters and launch tags; the host function) and the host-function evaluation the launcher runs
(runtime/webgpu_launch.py), TIR's integer semantics included. On an adapter: tests/webgpu."""
from __future__ import annotations

import json

import pytest
import torch
from tvm import tirx

from tvm_mamba.runtime import webgpu
from tvm_mamba.runtime.target import target_from_key, target_key, webgpu_target
from tvm_mamba.runtime.webgpu_launch import bind_params, evaluate
from tests.webgpu.kernels_tvmscript import bump_rows, module, scaled


def test_target_key_round_trip():
    t = webgpu_target()
    assert target_key(t) == "webgpu" and target_from_key("webgpu").kind.name == "webgpu"
    assert int(t.attrs["max_num_threads"]) == 256 and int(t.attrs["max_shared_memory_per_block"]) == 16384


def test_kernel_file_holds_wgsl_parameters_and_host(tmp_path):
    path = tmp_path / "k.json"
    webgpu.build(module(bump_rows), webgpu_target()).export_library(str(path))
    data = json.loads(path.read_text())
    assert data["entry"] == "bump_rows"
    (name, kernel), = data["kernels"].items()
    assert kernel["launch"] == ["blockIdx.x", "threadIdx.x"]
    assert [kind for _, kind in kernel["params"]][:2] == ["ptr", "ptr"]
    assert "@compute @workgroup_size(32, 1, 1)" in kernel["wgsl"] and f"fn {name}(" in kernel["wgsl"]
    assert "var<uniform> podArgs" in kernel["wgsl"]
    launcher = webgpu.load(str(path))["bump_rows"]
    with pytest.raises(KeyError):
        webgpu.load(str(path))["other"]
    assert [p.name for p in launcher.host.params] == ["s", "idx"]


def test_integer_semantics_are_tirs():
    a, b = tirx.Var("a", "int32"), tirx.Var("b", "int32")
    env = {a: -7, b: 2}
    assert evaluate(tirx.floordiv(a, b), env) == -4 and evaluate(tirx.floormod(a, b), env) == 1
    assert evaluate(tirx.Div(a, b), env) == -3 and evaluate(tirx.Mod(a, b), env) == -1  # C's truncation
    assert evaluate(tirx.Select(a < b, tirx.max(a, b), tirx.min(a, b)), env) == 2
    assert evaluate(tirx.Cast("float32", a), env) == -7.0
    with pytest.raises(RuntimeError, match="nothing bound"):
        evaluate(tirx.Var("c", "int32") + 1, env)


def test_parameters_bind_shapes_and_strides():
    host = webgpu.build(module(bump_rows), webgpu_target())
    func = webgpu.Module({"entry": host.entry, "host": host.host_json, "kernels": host.kernels})["bump_rows"].host
    env: dict = {}
    pool = torch.zeros(5, 48)[:, 8:40]
    data = bind_params(func, (pool, torch.zeros(3, dtype=torch.int32)), env)
    assert sorted((v.name, n) for v, n in env.items()) == [("dim", 32), ("pool", 5), ("rows", 3),
                                                           ("slot_stride", 48)]
    assert len(data) == 2
    with pytest.raises(TypeError, match="idx: expected int32, got float64"):
        bind_params(func, (pool, torch.zeros(3, dtype=torch.float64)), {})
    originals: dict = {}
    wide = torch.zeros(3, dtype=torch.int64)  # WGSL has no int64: bound as an int32 copy, written back if written
    data = bind_params(func, (pool, wide), {}, originals)
    (idx_param, backs), = originals.items()
    assert data[idx_param].dtype.name == "int32" and len(backs) == 1
    with pytest.raises(ValueError, match=r"s.stride\(1\): expected 1, got 2"):
        bind_params(func, (torch.zeros(5, 64)[:, ::2], torch.zeros(3, dtype=torch.int32)), {})
    with pytest.raises(TypeError, match="x: expected a tensor, got int"):
        bind_params(module(scaled)["scaled"], (1, torch.zeros(1)), {})
