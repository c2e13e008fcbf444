"""The schedule-rule contract (schedules/rule.py) for every rule module: a kernel the rule does not know,
whether a name no op has or another op's kernel (with its dims), and a target without the rule's capability
(a CPU rule on a CUDA target, a CUDA rule on a CPU target) get None (never an exception, never a schedule), so
dispatch can offer any kernel to any rule. The CUDA target is a cross-compile target (no GPU needed)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import tvm_mamba.schedules.cpu
import tvm_mamba.schedules.cuda
from tvm_mamba.compute import causal_conv1d, int8_dot, linear, mamba3, rmsnorm_gated, selective_scan, ssd
from tvm_mamba.runtime import cpu_target, cuda_target, registry
from tvm_mamba.schedules.rule import Decisions


def _rule_modules():
    for package in (tvm_mamba.schedules.cpu, tvm_mamba.schedules.cuda):
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                yield f"{package.__name__}.{info.name}"


RULES = sorted(_rule_modules())

# one small kernel per op, (direction, dims), that both of the op's rules lay out on their own target family;
# a rule is offered those of the other ops (where the op has no kernel of that direction)
SAMPLES = {"causal_conv1d": lambda: ("varlen_states", causal_conv1d.DIMS["varlen_states"](dim=8, state_len=3)),
           "int8_dot": lambda: ("pack", int8_dot.DIMS["pack"].of(16)),
           "linear": lambda: ("fwd", linear.LinearDims(16, 8)),
           "mamba3": lambda: ("siso_step", mamba3.DIMS["siso_step"](nheads=2, nheads_qk=1, headdim_qk=8, headdim_v=4,
                                                                       headdim_angles=2)),
           "rmsnorm_gated": lambda: ("fwd", rmsnorm_gated.DIMS["fwd"].of(16, 16)),
           "selective_scan": lambda: ("update", selective_scan.DIMS["update"](nheads=2, headdim=4, dstate=8,
                                                                              ngroups=1)),
           "ssd": lambda: ("chunk_cumsum", ssd.DIMS["chunk_cumsum"](nheads=2, chunk_size=16))}
KERNELS = {op: registry.op(op).compute.KERNELS for op in registry.ops()}  # each op's kernel directions
TARGETS = {"cpu": cpu_target, "cuda-sm_90": lambda: cuda_target("sm_90")}


def test_every_op_has_rules_for_both_folders():
    """The rule modules on disk are the registry's (runtime/registry.py): a rule without a row is never used."""
    ops = {name.rsplit(".", 1)[1] for name in RULES}
    assert set(SAMPLES) <= ops, f"rule modules found: {RULES}"
    assert all(f"tvm_mamba.schedules.{kind}.{op}" in RULES for op in ops for kind in ("cpu", "cuda")), RULES
    assert set(registry.ops()) == ops
    for op in ops:
        for target, folder in ((cpu_target(), "cpu"), (cuda_target("sm_90"), "cuda")):
            assert registry.op(op).rule(target).__name__ == f"tvm_mamba.schedules.{folder}.{op}"


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("module", RULES)
def test_foreign_kernels_get_none(module, target):
    rule = importlib.import_module(module)
    folder, op = module.rsplit(".", 2)[1:]
    tgt = TARGETS[target]()
    mine = set(KERNELS[op])
    direction, dims = SAMPLES[op]()
    assert direction in mine
    own_family = "cpu" if "cpu" in tgt.keys else "cuda"
    laid_out = rule.lay_out(direction, dims, tgt, Decisions())
    if folder == own_family:  # the sample is this rule's: what the None below are checked against
        assert laid_out is not None, f"{module} did not lay out its own {direction} kernel"
    else:
        assert laid_out is None, f"{module} laid out a kernel for a {target} target"
    assert rule.lay_out("no_such_kernel", dims, tgt, Decisions()) is None, f"{module} laid out an unknown kernel"
    for other, sample in SAMPLES.items():
        if other == op:
            continue
        for name in sorted(set(KERNELS[other]) - mine):  # another op's kernel name, with this op's dims
            assert rule.lay_out(name, dims, tgt, Decisions()) is None, f"{module} laid out a {other}_{name} kernel"
        name, other_dims = sample()
        if name not in mine:  # another op's kernel with its own dims
            assert rule.lay_out(name, other_dims, tgt, Decisions()) is None, f"{module} scheduled a {other} kernel"


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
    from tvm_mamba.schedules.cpu import selective_scan as cpu_scan
    from tvm_mamba.schedules.cpu import ssd as cpu_ssd

    update = ss.UpdateDims(nheads=2, headdim=4, dstate=8, ngroups=1)
    cumsum = ssd.DIMS["chunk_cumsum"](nheads=2, chunk_size=16)
    for rule, kernel, dims in ((cpu_scan, "update", update), (cpu_ssd, "chunk_cumsum", cumsum)):
        assert rule.lay_out(kernel, dims, cpu_target(), Decisions()) is not None
        assert rule.lay_out(kernel, dims, Target("c"), Decisions()) is not None
        assert rule.lay_out(kernel, dims, cuda_target("sm_90"), Decisions()) is None
