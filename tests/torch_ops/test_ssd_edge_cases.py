"""mamba_chunk_scan_combined edge cases of issue #16, on the CPU kernels and on the CUDA kernels through the CPU
harness (tvm_mamba.simulate_cuda), against the float64 step-by-step recurrence (tvm_mamba.reference.ssd):

* seq_idx that decreases along a row: ValueError naming seq_idx (upstream documents nondecreasing ids);
* a NaN / Inf in x (or in dy) at a position inside a chunk, not at its start: the finiteness masks of y and of
  every gradient (dx, d dt, dA, dB, dC, dD, dz, d dt_bias) equal the float64 recurrence's (causal: a
  non-finite x at t reaches y and d dt at >= t only; a non-finite dy at t reaches gradients at <= t only);
* A = -inf / -1e30 for one head: finite, equal to the recurrence (exp(dt A) = 0: the head keeps no state);
* C of another dtype than B: TypeError naming C (no silent cast).

One set of static dims and flags (chunk 16, every optional input but seq_idx on), so each target compiles
its kernels once (~10 s for the harness).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import tvm_mamba
from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.ssd import ssd_recurrence_ref
from tvm_mamba.torch_ops.ssd import mamba_chunk_scan_combined

H, G, P, N, Q = 4, 2, 8, 16, 16
BATCH, SEQLEN = 2, 37
T_BAD = 16 + 7  # chunk 1, position 7: the last row of a 4-row register block (rows 20..23 share a block)
GRADS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")
TARGETS = ("cpu", "cudasim")


def _target(name):
    return tvm_mamba.simulate_cuda("sm_90") if name == "cudasim" else contextlib.nullcontext()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    return dict(x=r(BATCH, SEQLEN, H, P), dt=r(BATCH, SEQLEN, H) - 1.0, A=-(torch.rand(H, generator=g) + 0.5),
                B=r(BATCH, SEQLEN, G, N, scale=0.5), C=r(BATCH, SEQLEN, G, N, scale=0.5), D=r(H, P),
                z=r(BATCH, SEQLEN, H, P), dt_bias=r(H, scale=0.5))


def _run(fn, t, dy, grads=GRADS):
    leaves = {k: v.clone().requires_grad_(k in grads) for k, v in t.items()}
    y = fn(**leaves)
    y.backward(dy.to(y.dtype))
    return y.detach(), {k: leaves[k].grad for k in grads}


def _ours(x, dt, A, B, C, **kw):
    return mamba_chunk_scan_combined(x, dt, A, B, C, Q, dt_softplus=True, **kw)


def _ref(x, dt, A, B, C, **kw):
    return ssd_recurrence_ref(x, dt, A, B, C, dt_softplus=True, **kw)


def _both(target, t, dy):
    with _target(target):
        got = _run(_ours, t, dy)
    ref = _run(_ref, {k: v.double() for k, v in t.items()}, dy.double())
    return got, ref


def _dy(seed=1):
    return torch.randn(BATCH, SEQLEN, H, P, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- validation (before any kernel runs)
def test_seq_idx_decreasing_refused():
    t = _inputs()
    seq = torch.zeros(BATCH, SEQLEN, dtype=torch.int32)
    seq[0, 10:20] = 1  # 0 .. 1 .. 0: a decrease at 20
    with pytest.raises(ValueError, match="seq_idx"):
        _ours(**t, seq_idx=seq)
    seq[0, 20:] = 1  # nondecreasing again: accepted
    _ours(**t, seq_idx=seq)


@pytest.mark.parametrize("c_dtype", [torch.float32, torch.float16])
def test_c_dtype_differs_from_b_refused(c_dtype):
    t = _inputs()
    t["B"] = t["B"].to(torch.bfloat16)
    t["C"] = t["C"].to(c_dtype)
    with pytest.raises(TypeError, match="C"):
        _ours(**t)


# ---------------------------------------------------------------- non-finite values stay causal
def _same_mask(got, ref, name):
    bad = torch.isfinite(got) != torch.isfinite(ref)
    assert not bad.any(), (f"{name}: finiteness differs from the float64 recurrence at "
                           f"{bad.nonzero()[:6].tolist()} (of {int(bad.sum())})")
    ok = torch.isfinite(ref)
    assert_close_to_ref(torch.where(ok, got.double(), 0.0), torch.where(ok, ref, 0.0), atol=1e-4, name=name)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_x_is_causal(target, bad):
    t = _inputs()
    t["x"][0, T_BAD, 1, 3] = bad
    (y, g), (y_ref, g_ref) = _both(target, t, _dy())
    assert torch.isfinite(y[:, :T_BAD]).all() and not torch.isfinite(y[0, T_BAD, 1, 3])
    _same_mask(y, y_ref, "y")
    # d dt stays finite before t in t's chunk (the crossing-pairs form of d dA_step; upstream's rows - columns,
    # reverse-cumsummed, made the whole chunk non-finite), non-finite from t on; dA, dD, ddt_bias: non-finite
    assert torch.isfinite(g["dt"][:, :T_BAD]).all() and not torch.isfinite(g["dt"][0, T_BAD:, 1]).any()
    for name in GRADS:
        _same_mask(g[name], g_ref[name], "d" + name)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_dy_is_causal(target, bad):
    dy = _dy()
    dy[0, T_BAD, 1, 3] = bad
    (y, g), (y_ref, g_ref) = _both(target, _inputs(), dy)
    assert torch.isfinite(g["x"][:, T_BAD + 1:]).all() and torch.isfinite(g["dt"][:, T_BAD + 1:]).all()
    for name in GRADS:
        _same_mask(g[name], g_ref[name], "d" + name)


# ---------------------------------------------------------------- A = -inf
@pytest.mark.parametrize("target", TARGETS)
def test_a_minus_inf_head(target):
    t = _inputs()
    t["A"][1] = float("-inf")
    t["A"][2] = -1e30
    (y, g), (y_ref, g_ref) = _both(target, t, _dy())
    assert torch.isfinite(y).all()
    assert_close_to_ref(y, y_ref, atol=1e-4, name="y")
    for name in GRADS:
        assert torch.isfinite(g[name]).all(), f"d{name} not finite"
        # the recurrence's d dt at A = -inf is A * exp(dt A) = -inf * 0 = NaN; ours is the limit, 0
        ok = torch.isfinite(g_ref[name])
        assert_close_to_ref(torch.where(ok, g[name].double(), 0.0), torch.where(ok, g_ref[name], 0.0), atol=1e-4,
                            name="d" + name)
    assert g["A"][1] == 0 and g["A"][2] == 0  # no gradient through an exactly-zero decay
