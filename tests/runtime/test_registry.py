"""runtime/registry.py: the one table from an op's name to its compute module and its two rules."""
from __future__ import annotations

import pathlib

import pytest

from tvm_mamba.runtime import registry, rules
from tvm_mamba.runtime.key import KernelKey

COMPUTE = pathlib.Path(registry.__file__).resolve().parents[1] / "compute"


def _compute_ops_on_disk() -> set[str]:
    """The packages of tvm_mamba.compute: one per op (compute/<op>/, its dims.py beside its definitions); the
    modules at the root are what the ops share (strategy.py, _math.py, _common.py, ...)."""
    return {p.parent.name for p in COMPUTE.glob("*/__init__.py") if not p.parent.name.startswith("_")}


def test_every_op_package_has_its_dims():
    for name in _compute_ops_on_disk():
        assert (COMPUTE / name / "dims.py").is_file(), name


def test_every_compute_module_has_a_row():
    """A new op's compute module without a registry row is never built: fail here instead."""
    assert set(registry.ops()) == _compute_ops_on_disk()
    assert list(registry.ops()) == sorted(registry.ops()) == rules.compute_ops()
    for name in registry.ops():
        assert registry.op(name).compute.__name__ == f"tvm_mamba.compute.{name}"


@pytest.mark.parametrize("op", registry.ops())
def test_every_typed_kernel_has_a_builder(op):
    """Every direction with typed dims has a builder (KERNELS), and each builder is one of the module's own
    functions named after its kernel (the compiled symbol ``<op>_<direction>``)."""
    row = registry.op(op)
    dims = getattr(row.compute, "DIMS", None)
    if isinstance(dims, dict):
        assert set(dims) <= set(row.compute.KERNELS), set(dims) - set(row.compute.KERNELS)
    for direction, build in row.compute.KERNELS.items():
        assert callable(build) and build.__name__ == f"{op}_{direction}", (direction, build)
        assert row.builder(direction) is build


def test_unknown_names_are_errors_that_list_the_choices():
    with pytest.raises(KeyError, match="unknown op 'mamba4'.*selective_scan"):
        registry.op("mamba4")
    with pytest.raises(KeyError, match="ssd: no kernel 'fwd'.*chunk_scan"):
        registry.op("ssd").builder("fwd")
    key = KernelKey.make("causal_conv1d", "sideways", {"x": "float32"}, {"dim": 8}, "llvm")
    with pytest.raises(KeyError, match="causal_conv1d: no kernel 'sideways'"):
        rules.build_func(key)


def test_a_key_builds_through_its_row():
    """build_func goes key -> row -> typed dims -> builder: the PrimFunc is the one the builder makes."""
    from tvm_mamba.compute.linear import LinearDims, linear_fwd

    key = KernelKey.make("linear", "fwd", {"x": "float32", "weight": "float32"},
                         {"in_features": 32, "out_features": 16, "has_bias": False}, "llvm")
    assert registry.op("linear").dims("fwd") is LinearDims
    func = rules.build_func(key)
    expected = linear_fwd(LinearDims.from_key(key.static, key.dtype))
    assert func.script() == expected.script()


def test_every_op_has_a_sim_check():
    """sim-check finds each op's check through one table (tools/simcheck/ops.py), and it covers every op a key
    can name; an unknown op is a KeyError naming the choices."""
    from tvm_mamba.tools.simcheck import ops as simcheck_ops

    assert set(simcheck_ops.CHECKS) == set(registry.ops())
    with pytest.raises(KeyError, match="no check for op 'nope'"):
        simcheck_ops.run_config("nope", "fwd", {}, {}, "sm_90")


def test_a_key_lays_out_through_its_rule():
    """rules.apply hands the key's typed dims to the target's rule: the CPU rule's template, laid out once."""
    from tvm_mamba.runtime import cpu_target, target_key
    from tvm_mamba.schedules.rule import Decisions

    key = KernelKey.make("linear", "fwd", {"x": "float32", "weight": "float32"},
                         {"in_features": 32, "out_features": 16, "has_bias": False}, target_key(cpu_target()))
    mod = rules.apply(key, Decisions())
    assert list(mod.functions.keys())[0].name_hint == "linear_fwd"
    assert "T.parallel" in mod.script() or "T.vectorized" in mod.script()
    assert "tvm_mamba.static" not in mod.script()  # no static-dims stamp: the rule is handed the dims
