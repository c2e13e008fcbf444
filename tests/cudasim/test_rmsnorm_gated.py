"""rmsnorm_fn / layernorm_fn / RMSNormGated / LayerNorm with the CUDA kernels run on the CPU by the execution harness
(tvm_mamba.simulate_cuda), against the float64 reference written from the math (forward and every gradient).
Mirrors tests/torch_ops/test_rmsnorm_gated.py at small model dims.

The CUDA schedule gives each row block the largest of 32..512 threads (256 preferred) dividing group_size:
HIDDEN = 192 with group sizes 192 (64 threads: a 2-warp shared-memory reduction, 3 chunks a thread), 96
(32 threads: one warp, 3 chunks) and 16 (no candidate divides it: 1 thread) covers each reduction shape.
"""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.conftest import assert_close_to_ref
from tvm_mamba.compute.rmsnorm_gated import build_check_configs
from tvm_mamba.modules.rmsnorm_gated import LayerNorm, RMSNormGated
from tvm_mamba.reference.rmsnorm_gated import layernorm_gated_ref, rmsnorm_gated_ref
from tests.torch_ops.test_rmsnorm_gated import _inputs as _cpu_inputs, _run
from tvm_mamba.torch_ops.rmsnorm_gated import layernorm_fn, rmsnorm_fn

HIDDEN = 192
GATES = {"none": (False, True), "after": (True, True), "before": (True, False)}  # -> (has_z, norm_before_gate)


pytestmark = pytest.mark.usefixtures("sim")


def _inputs(shape, dtype, has_bias, has_z, seed=0, wdtype=torch.float32):
    return _cpu_inputs(shape, dtype, has_bias, has_z, seed=seed, wdtype=wdtype, hidden=HIDDEN)


def _names(has_bias, has_z):
    return ["out", "dx", "dweight"] + (["dbias"] if has_bias else []) + (["dz"] if has_z else [])


def _check_fp32(shape, has_bias, gate, group_size, seed=0):
    has_z, nbg = GATES[gate]
    x, w, b, z = _inputs(shape, torch.float32, has_bias, has_z, seed=seed)
    dout = torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=nbg)
    got = _run(rmsnorm_fn, x, w, b, z, dout, **kw)
    ref = _run(rmsnorm_gated_ref, x, w, b, z, dout.double(), dtype=torch.float64, **kw)
    for name, g, r in zip(_names(has_bias, has_z), got, ref):
        assert_close_to_ref(g, r, name=name, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("has_bias", [False, True])
def test_fp32_bias_and_gate_orders(has_bias, gate):
    """Every (bias, z, norm_before_gate) combination, group 96 (one warp, three chunks a thread); 7 rows."""
    _check_fp32((7,), has_bias, gate, 96)


@pytest.mark.parametrize("group_size,gate", [(None, "before"), (None, "none"), (16, "after")])
def test_fp32_group_sizes(group_size, gate):
    """group_size None (= hidden, 64 threads over two warps) and 16 (one thread a row block)."""
    _check_fp32((2, 3), True, gate, group_size, seed=1)


@pytest.mark.parametrize("rows", [64, 70, 129])
def test_weight_gradient_parts_with_ragged_rows(rows):
    """dweight / dbias sum ceil(rows / 32) parts of 32 rows (compute.rmsnorm_gated.PART_ROWS): 70 and 129 end
    in a short part, where the row walk must mask the missing rows."""
    _check_fp32((rows,), True, "after", 96, seed=2)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_bf16_within_twice_reference_drift(norm_before_gate):
    x, w, b, z = _inputs((4, 8), torch.bfloat16, True, True, seed=1)
    dout = torch.randn(4, 8, HIDDEN).to(torch.bfloat16)
    kw = dict(eps=1e-5, group_size=96, norm_before_gate=norm_before_gate)
    got = _run(rmsnorm_fn, x, w, b, z, dout, **kw)
    ref64 = _run(rmsnorm_gated_ref, x, w, b, z, dout.double(), dtype=torch.float64, **kw)
    low = _run(rmsnorm_gated_ref, x, w, b, z, dout, **kw)  # the reference itself in bf16 activations
    for name, g, r, lo in zip(_names(True, True), got, ref64, low):
        assert g.dtype == lo.dtype, name
        assert_close_to_ref(g, r, lo, name=name)


def test_bf16_weight_in_x_dtype():
    x, w, _, z = _inputs((5,), torch.bfloat16, False, True, seed=6, wdtype=torch.bfloat16)
    kw = dict(eps=1e-5, group_size=None, norm_before_gate=True)
    out = rmsnorm_fn(x, w, None, z, **kw)
    ref = rmsnorm_gated_ref(x.double(), w.double(), None, z.double(), **kw)
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, ref, rmsnorm_gated_ref(x, w, None, z, **kw))


@pytest.mark.parametrize("shape", [(), (5,), (2, 1, 3)])
def test_leading_dims_of_any_rank(shape):
    x, w, b, z = _inputs(shape, torch.float32, True, True, seed=2)
    out = rmsnorm_fn(x, w, b, z, 1e-5, 16, True)
    ref = rmsnorm_gated_ref(x.double(), w.double(), b.double(), z.double(), 1e-5, 16, True)
    assert out.shape == x.shape
    assert_close_to_ref(out, ref, atol=2e-4)


def test_zero_rows(sim):
    x, w, _, z = _inputs((0,), torch.float32, False, True)
    out = rmsnorm_fn(x, w, None, z, group_size=16)
    out.sum().backward()
    assert out.shape == (0, HIDDEN) and torch.equal(w.grad, torch.zeros_like(w))
    assert not sim  # no kernel for zero rows


def test_backward_is_deterministic():
    """Two backward passes (the harness runs each in two different thread / block orders) give the same bits."""
    x, w, b, z = _inputs((100,), torch.float32, True, True, seed=3)
    dout = torch.randn(100, HIDDEN)
    a = _run(rmsnorm_fn, x, w, b, z, dout, group_size=96, eps=1e-5)
    c = _run(rmsnorm_fn, x, w, b, z, dout, group_size=96, eps=1e-5)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


def test_module_forward_backward():
    m = RMSNormGated(HIDDEN, eps=1e-5, group_size=96, norm_before_gate=False)
    w = torch.randn(HIDDEN)
    m.load_state_dict({"weight": w})  # mamba_ssm's RMSNorm state_dict: just "weight"
    x, z = torch.randn(2, 5, HIDDEN, requires_grad=True), torch.randn(2, 5, HIDDEN)
    out = m(x, z)
    ref = rmsnorm_gated_ref(x.detach().double(), w.double(), None, z.double(), 1e-5, 96, False)
    assert_close_to_ref(out, ref, atol=2e-4)
    out.square().sum().backward()
    x64 = x.detach().double().requires_grad_()
    rmsnorm_gated_ref(x64, w.double(), None, z.double(), 1e-5, 96, False).square().sum().backward()
    assert_close_to_ref(x.grad, x64.grad, atol=2e-4, name="dx")
    assert m.weight.grad is not None


def test_sm80_forward_backward(sim):
    """The sm_80 source (a separate build) through forward and backward."""
    x, w, b, z = _inputs((6,), torch.float32, True, True, seed=7)
    dout = torch.randn(6, HIDDEN)
    kw = dict(eps=1e-5, group_size=96, norm_before_gate=True)
    with tvm_mamba.simulate_cuda("sm_80"):
        got = _run(rmsnorm_fn, x, w, b, z, dout, **kw)
    ref = _run(rmsnorm_gated_ref, x, w, b, z, dout.double(), dtype=torch.float64, **kw)
    assert {k.target for k, _ in sim} == {"cudasim-sm_80"}
    for name, g, r in zip(_names(True, True), got, ref):
        assert_close_to_ref(g, r, name=name, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("group_size,gate", [(96, "before"), (192, "after"), (16, "none")])
def test_layernorm_fp32(group_size, gate):
    """layernorm_fn: the mean and the centred squares as two cross-thread reductions per group in the
    statistics kernel, dot and sum(dxhat) in the backward row kernel; x offset from 0 so the mean matters."""
    has_z, nbg = GATES[gate]
    x, w, b, z = _inputs((5,), torch.float32, True, has_z, seed=4)
    x = (x.detach() + 2.0).requires_grad_()
    dout = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(5))
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=nbg)
    got = _run(layernorm_fn, x, w, b, z, dout, **kw)
    ref = _run(layernorm_gated_ref, x, w, b, z, dout.double(), dtype=torch.float64, **kw)
    for name, g, r in zip(_names(True, has_z), got, ref):
        assert_close_to_ref(g, r, name=name, atol=2e-4, rtol=1e-4)


def test_layernorm_module_bf16():
    m = LayerNorm(HIDDEN, eps=1e-5, group_size=96, norm_before_gate=False)
    x, z = torch.randn(3, HIDDEN).bfloat16(), torch.randn(3, HIDDEN).bfloat16()
    out = m(x, z)
    ref = layernorm_gated_ref(x.double(), m.weight.double(), m.bias.double(), z.double(), 1e-5, 96, False)
    low = layernorm_gated_ref(x, m.weight, m.bias, z, 1e-5, 96, False)
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, ref, low)


def _config_id(config):
    direction, static, dtypes = config
    gate = "nogate" if not static["has_z"] else ("nbg" if static["norm_before_gate"] else "gate-first")
    kind = ("rms" if static.get("is_rms_norm", True) else "ln") + \
        ("-res" if static.get("has_residual") or static.get("has_dresidual") else "")
    return f"{direction}-{kind}-{gate}-g{static['group_size']}-{dtypes['x']}"


@pytest.mark.parametrize("config", [c for c in build_check_configs() if "bfloat16" in c[2].values()
                                    and not (c[1].get("has_residual") or c[1].get("has_dresidual"))], ids=_config_id)
def test_simcheck_build_check_configs_bf16(config):
    """sim-check's own check on every bf16 gated build-check configuration (hidden 2048, 256 threads a row;
    the fused add-norm's are in tests/cudasim/test_layer_norm.py)."""
    from tvm_mamba.tools.simcheck import rmsnorm_gated as simcheck

    direction, static, dtypes = config
    simcheck.check(direction, static, dtypes, "sm_90")
