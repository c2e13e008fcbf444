"""The hand CUDA rules double as MetaSchedule design spaces (sampled knobs, default as initial decision)."""
from __future__ import annotations

import pytest
import tvm

from tvm_mamba.tools import metaschedule as msd
from tvm_mamba.compute.causal_conv1d import build_check_configs
from tvm_mamba.runtime import KernelKey, cuda_target, dispatch, target_key
from tvm_mamba.schedules.rule import Decisions


@pytest.fixture(scope="module")
def key():
    d, st, dt = build_check_configs()[0]
    return KernelKey.make("causal_conv1d", d, dt, st, target_key(cuda_target("sm_90")), {"batch": 2, "seqlen": 256})


def test_static_func_binds_the_bucket(key):
    func = msd.static_func(key)
    assert [int(v) for v in func.params[0].shape] == [2, 1536, 256]


def test_design_space_samples_the_rule_knobs_and_candidates_build(key):
    cands = msd.sample_candidates(key, 3)
    assert cands[0] == {"threads": 256, "tile": 1024}  # the hand defaults are the initial decisions
    assert len(cands) >= 2 and all(c["threads"] in (64, 128, 256, 512) and c["tile"] in (512, 1024) for c in cands)
    assert len({(c["threads"], c["tile"]) for c in cands}) == len(cands)
    target = cuda_target("sm_90")
    with target:
        ex = tvm.compile(dispatch.schedule(key, Decisions(cands[-1])), target=target)
    assert f"__launch_bounds__({cands[-1]['threads']})" in ex.mod.imports[0].inspect_source("cuda")
