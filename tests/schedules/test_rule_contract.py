"""The schedule-rule contract (schedules/rule.py) for every rule module: a PrimFunc the rule does not
know, whether a plain TE kernel with no tvm_mamba stamp or another op's stamped kernel, gets None (never
an exception, never a schedule), on a CPU and on a CUDA target, so dispatch can offer any kernel to any
rule. The CUDA target is a cross-compile target (no GPU needed)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest
from tvm import te

import tvm_mamba.schedules.cpu
import tvm_mamba.schedules.cuda
from tvm_mamba.compute.causal_conv1d import causal_conv1d_varlen_states
from tvm_mamba.compute.int8_dot import int8_dot_pack
from tvm_mamba.compute.mamba3 import mamba3_siso_step
from tvm_mamba.compute.rmsnorm_gated import rmsnorm_gated_fwd
from tvm_mamba.runtime import cpu_target, cuda_target
from tvm_mamba.schedules.rule import Decisions


def _rule_modules():
    for package in (tvm_mamba.schedules.cpu, tvm_mamba.schedules.cuda):
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                yield f"{package.__name__}.{info.name}"


RULES = sorted(_rule_modules())


def _plain():
    """A TE kernel no builder of the package made: no ``tvm_mamba.kernel`` attribute."""
    n = te.var("n")
    a = te.placeholder((n, 16), "float32", name="a")
    b = te.compute((n, 16), lambda i, j: a[i, j] * 2.0, name="b")
    return te.create_prim_func([a, b])


# one small stamped kernel per op; a rule is offered those of the other ops
STAMPED = {"causal_conv1d": lambda: causal_conv1d_varlen_states(dim=8, state_len=3),
           "int8_dot": lambda: int8_dot_pack(16),
           "mamba3": lambda: mamba3_siso_step(nheads=2, nheads_qk=1, headdim_qk=8, headdim_v=4, headdim_angles=2),
           "rmsnorm_gated": lambda: rmsnorm_gated_fwd(16, 16)}
TARGETS = {"cpu": cpu_target, "cuda-sm_90": lambda: cuda_target("sm_90")}


def test_every_op_has_rules_for_both_folders():
    """The rule modules on disk are the registry's (runtime/registry.py): a rule without a row is never used."""
    from tvm_mamba.runtime import registry

    ops = {name.rsplit(".", 1)[1] for name in RULES}
    assert set(STAMPED) <= ops, f"rule modules found: {RULES}"
    assert all(f"tvm_mamba.schedules.{kind}.{op}" in RULES for op in ops for kind in ("cpu", "cuda")), RULES
    assert set(registry.ops()) == ops
    for op in ops:
        for target, folder in ((cpu_target(), "cpu"), (cuda_target("sm_90"), "cuda")):
            assert registry.op(op).rule(target).__name__ == f"tvm_mamba.schedules.{folder}.{op}"


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("module", RULES)
def test_foreign_kernels_get_none(module, target):
    rule = importlib.import_module(module)
    op = module.rsplit(".", 1)[1]
    tgt = TARGETS[target]()
    assert rule.apply(_plain(), tgt, Decisions()) is None, f"{module} scheduled an unstamped TE kernel"
    for other, build in STAMPED.items():
        if other != op:
            assert rule.apply(build(), tgt, Decisions()) is None, f"{module} scheduled a {other} kernel"


@pytest.mark.parametrize("target, folder", [(cpu_target, "cpu"), (lambda: cuda_target("sm_90"), "cuda")])
def test_rules_are_chosen_by_capability(target, folder):
    """GPU rules for any target with the ``gpu`` key (CUDA today, ROCm / Metal / WebGPU codegen later), else CPU."""
    from tvm.target import Target

    from tvm_mamba.runtime import dispatch

    assert dispatch.rule_module(target(), "causal_conv1d").__name__ == f"tvm_mamba.schedules.{folder}.causal_conv1d"
    rocm = Target({"kind": "rocm", "mcpu": "gfx90a"}) if folder == "cuda" else target()
    assert "gpu" in rocm.keys or folder == "cpu"
    assert dispatch.rule_module(rocm, "int8_dot").__name__ == f"tvm_mamba.schedules.{folder}.int8_dot"
    if folder == "cuda":
        for kind in ("metal", "opencl", "webgpu"):
            assert dispatch.rule_module(Target(kind), "ssd").__name__ == "tvm_mamba.schedules.cuda.ssd", kind


def test_cpu_rules_decline_a_target_without_the_cpu_key():
    """A CPU rule offered its own kernel for a GPU target returns None, and lays it out for any target with
    the ``cpu`` key (TVM's C source target too): each checks that capability, never the target's kind name."""
    from tvm.target import Target

    from tvm_mamba.compute import selective_scan as ss
    from tvm_mamba.compute import ssd
    from tvm_mamba.schedules.cpu import selective_scan as cpu_scan
    from tvm_mamba.schedules.cpu import ssd as cpu_ssd

    update = ss.selective_scan_update(ss.UpdateDims(nheads=2, headdim=4, dstate=8, ngroups=1))
    cumsum = ssd.ssd_chunk_cumsum(nheads=2, chunk_size=16)
    for rule, func in ((cpu_scan, update), (cpu_ssd, cumsum)):
        assert rule.apply(func, cpu_target(), Decisions()) is not None
        assert rule.apply(func, Target("c"), Decisions()) is not None
        assert rule.apply(func, cuda_target("sm_90"), Decisions()) is None
