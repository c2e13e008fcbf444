"""Typed static dims (compute._common.Dims subclasses, each op's ``DIMS``): the KernelKey they make is the
one the op made before they existed, so the committed tuning records and the kernel cache still match.

Every key the repository holds for these ops (the committed tuning records, the build-check and tuning
workloads) is rebuilt through its op's dims class and must come back with the same maps; the builder
called with the dims makes the same PrimFunc as with the field form."""
from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib

import pytest
from tvm import ir

from tvm_mamba.compute._common import Dims
from tvm_mamba.runtime import KernelKey, cpu_target, target_key
from tvm_mamba.runtime.rules import dims_of

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS = ("causal_conv1d", "rmsnorm_gated", "int8_dot", "mamba3")


def _dims_classes(op):
    dims = importlib.import_module(f"tvm_mamba.compute.{op}").DIMS
    return dims if isinstance(dims, dict) else {None: dims}


def _committed_keys(op):
    for path in sorted((ROOT / "tuning_logs").glob(f"*/{op}/records.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield KernelKey.from_json(json.loads(line)["key"])


def _config_keys(op):
    mod = importlib.import_module(f"tvm_mamba.compute.{op}")
    for direction, static, dtypes in [*mod.build_check_configs(), *getattr(mod, "tuning_configs", list)()]:
        yield KernelKey.make(op, direction, dtypes, static, target_key(cpu_target()))


@pytest.mark.parametrize("op", OPS)
def test_every_known_key_round_trips(op):
    keys = [*_committed_keys(op), *_config_keys(op)]
    assert len(keys) > 3
    for key in keys:
        dims = dims_of(key)
        assert isinstance(dims, Dims), key
        again = KernelKey.of(key.op, key.direction, dims, key.target, dict(key.shape_bucket))
        assert again == key, f"{key}\n  -> {again}"


# (op, direction, fields, the argument the ValueError names)
BAD = [("causal_conv1d", "fwd", dict(dim=8, width=9), "width"),
       ("causal_conv1d", "update", dict(dim=8, width=4, state_len=2), "conv_state"),
       ("causal_conv1d", "varlen_states", dict(dim=8, state_len=3, x_dtype="int8"), "x"),
       ("rmsnorm_gated", "fwd", dict(hidden=64, group_size=24), "group_size"),
       ("rmsnorm_gated", "bwd", dict(hidden=64, group_size=64, dout_dtype="int8"), "dout"),
       ("int8_dot", "wgrad", dict(heads=4, code_heads=2, N=8, K=8), "code_heads"),
       ("int8_dot", "matmul", dict(N=0, K=8), "N"),
       ("mamba3", "siso_step", dict(nheads=4, nheads_qk=3, headdim_qk=8, headdim_v=4, headdim_angles=2), "nheads_qk"),
       ("mamba3", "siso_step", dict(nheads=4, nheads_qk=1, headdim_qk=7, headdim_v=4, headdim_angles=2), "headdim_qk"),
       ("mamba3", "siso_step", dict(nheads=4, nheads_qk=1, headdim_qk=8, headdim_v=4, headdim_angles=5),
        "headdim_angles"),
       ("mamba3", "siso_step", dict(nheads=4, nheads_qk=1, headdim_qk=8, headdim_v=4, headdim_angles=2,
                                    qk_dtype="int8"), "qk")]


@pytest.mark.parametrize("op", OPS)
def test_dims_are_frozen(op):
    for cls in _dims_classes(op).values():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls


@pytest.mark.parametrize("op, direction, fields, name", BAD)
def test_bad_dims_name_the_argument(op, direction, fields, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        _dims_classes(op)[direction](**fields)


@pytest.mark.parametrize("op", OPS)
def test_builder_takes_dims_or_fields(op):
    """``<op>_<direction>(dims)`` and the field form ``<op>_<direction>(**fields)`` build the same kernel."""
    mod = importlib.import_module(f"tvm_mamba.compute.{op}")
    for direction, static, dtypes in mod.build_check_configs()[:4]:
        cls = _dims_classes(op)[direction]
        dims = cls.from_key(static, dtypes)
        build = getattr(mod, f"{op}_{direction}")
        ir.assert_structural_equal(build(dims), build(**dims.static()))
