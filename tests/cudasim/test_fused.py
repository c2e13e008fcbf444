"""The fused layer paths (mamba_inner_fn, mamba_split_conv1d_scan_combined) with every kernel they compose run
as CUDA in the CPU execution harness (tvm_mamba.simulate_cuda): forward and every gradient against the
float64 references, on the tiny shapes of tests/torch_ops/test_mamba_inner.py / test_mamba_split.py."""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.conftest import ATOL, assert_close_to_ref
from tests.torch_ops import test_mamba_inner as inner
from tests.torch_ops import test_mamba_split as split
from tvm_mamba.reference.blocks import mamba_inner_ref, mamba_split_conv1d_scan_ref


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # the output gradients come from the global generator


def _ops(used) -> set:
    return {k.op for k, _ in used}


@pytest.mark.parametrize("lvl", [0, 1])
def test_mamba_inner_every_gradient(sim, lvl):
    t = inner._inputs(seed=7, extras=("bias", "rms"))
    dout = torch.randn(inner.BATCH, inner.SEQLEN, inner.DOUT)
    out, grads = inner._run(tvm_mamba.mamba_inner_fn, t, dout, checkpoint_lvl=lvl)
    ref, rgrads = inner._run(mamba_inner_ref, t, dout, cast=torch.float64)
    assert {"causal_conv1d", "selective_scan", "rmsnorm_gated"} <= _ops(sim)
    assert_close_to_ref(out, ref, atol=1e-5, name="out")
    for name, g in grads.items():
        assert_close_to_ref(g, rgrads[name], atol=2e-5 * max(1.0, rgrads[name].abs().max().item()), name=name)


@pytest.mark.parametrize("given", [None, {"B": "const", "C": "var"}], ids=["projected", "given"])
def test_mamba_inner_complex_A_every_gradient(sim, given):
    """Complex A: the complex scan's CUDA kernels (fwd_complex / bwd_complex) under the fused path."""
    inner.check_complex_fp32(inner.complex_inputs(seed=13, given=given))
    assert {("selective_scan", "fwd_complex"), ("selective_scan", "bwd_complex")} <= {(k.op, k.direction)
                                                                                      for k, _ in sim}


def test_mamba_split_every_gradient(sim):
    t = split._inputs(seed=8, ngroups=2, d_nonssm=2)
    douts = split._douts(t, split.DOUT)
    kw = dict(seq_idx=split.SEQ_IDX, ngroups=2, norm_before_gate=False, dt_limit=(0.0, 4.0))
    (out, final), grads = split._run(tvm_mamba.mamba_split_conv1d_scan_combined, t, douts, **kw)
    (ref, rfinal), rgrads = split._run(mamba_split_conv1d_scan_ref, t, douts, cast=torch.float64, **kw)
    assert {"causal_conv1d", "ssd", "rmsnorm_gated"} <= _ops(sim)
    assert_close_to_ref(out, ref, atol=1e-5, name="out")
    assert_close_to_ref(final, rfinal, atol=1e-5, name="final_states")
    for name, g in grads.items():
        assert_close_to_ref(g, rgrads[name], atol=2e-5 * max(1.0, rgrads[name].abs().max().item()), name=name)


def test_mamba_split_bf16_gate_path(sim):
    """bf16, rmsnorm_weight None (the z gate inside the SSD kernel), no out_proj: mamba_ssm's drift rule."""
    t = split._inputs(seed=9, dtype=torch.bfloat16, rms=False, outproj=False)
    douts = split._douts(t, split.DIM, torch.bfloat16)
    (out, final), grads = split._run(tvm_mamba.mamba_split_conv1d_scan_combined, t, douts)
    (ref, rfinal), g64 = split._run(mamba_split_conv1d_scan_ref, t, douts, cast=torch.float64)
    (low, lfinal), glow = split._run(mamba_split_conv1d_scan_ref, t, douts)
    assert_close_to_ref(out, ref, low, name="out")
    assert_close_to_ref(final, rfinal, lfinal.float(), atol=ATOL[torch.bfloat16], name="final_states")
    for name, g in grads.items():  # weight gradients sum over tokens: the bf16 atol relative to their size
        scale = 1.0 if name == "zxbcdt" else max(1.0, g64[name].abs().max().item())
        assert_close_to_ref(g, g64[name], glow[name], atol=ATOL[torch.bfloat16] * scale, name=name)
