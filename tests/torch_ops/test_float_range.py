"""Inputs near the ends of the float32 range (issue #16): |x| ~ 1e20-1e36 and tiny 1e-30, forward and backward,
against the float64 references, on the CPU kernels and (a few cases) on the CUDA kernels in the CPU harness.

What these caught: RMSNorm squared in float32 (x^2 overflows above |x| ~ 1.8e19: rstd = 0, out garbage; now a
float64 sum of squares), and the CPU selective scan's silu'(z) was 7e12 at z = 1e20 (x * sigmoid(x) with a
Newton reciprocal that returns 1 - 6e-8 for 1; now SiLU through tanh, which saturates to exactly +-1).
causal_conv1d (+ silu) and the decode steps were already right.

Errors are normwise per tensor, max|got - ref| / max|ref| over the entries where the reference is finite and
within float32, and every such entry must be finite in the kernel's result. The CUDA kernels are built as shipped,
with --use_fast_math, whose -ftz=true flushes every result below float32's smallest normal (2^-126) to zero (the
harness does the same): there each entry may be off by 2^-126 absolute (at x ~ 1e36 RMSNorm's dx is ~1e-36, and
its smallest entries are subnormal). Tolerances: float32 1e-5 (the
kernels reach ~1e-7 here), bfloat16 2e-2 (one bf16 rounding of inputs/outputs is 4e-3).
"""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from tvm_mamba.reference.rmsnorm_gated import rmsnorm_gated_ref
from tvm_mamba.reference.selective_scan import selective_scan_ref, selective_state_update_ref

F32MAX = torch.finfo(torch.float32).max
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SCALES = (1e20, 1e30, 1e36)
DTYPES = (torch.float32, torch.bfloat16)


F32TINY = torch.finfo(torch.float32).tiny


def _close(name, got, ref, dtype, ftz=False):
    got, ref = got.detach().double(), ref.detach().double()
    keep = torch.isfinite(ref) & (ref.abs() <= F32MAX)
    assert keep.any(), f"{name}: no finite reference entries"
    bad = int((keep & ~torch.isfinite(got)).sum())
    assert bad == 0, f"{name}: {bad} non-finite entries where the float64 reference is finite"
    scale = ref[keep].abs().max()
    diff = (got - ref).abs()
    if ftz:  # a flushed subnormal result: off by less than the smallest normal
        diff = (diff - F32TINY).clamp(min=0.0)
    err = (diff[keep].max() / scale).item() if scale > 0 else 0.0
    assert err <= TOL[dtype], f"{name}: normwise relative error {err:.2e} > {TOL[dtype]:g}"


def _leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_(True)


def _ref_leaves(*ts):
    return [None if t is None else _leaf(t, torch.float64) for t in ts]


def _rmsnorm(dtype, xs, zs=None, norm_before_gate=True, group_size=None, ftz=False):
    g = torch.Generator().manual_seed(0)
    rows, hidden = 8, 64
    x = _leaf(torch.randn(rows, hidden, generator=g, dtype=torch.float64) * xs, dtype)
    w = _leaf(torch.randn(hidden, generator=g, dtype=torch.float64), torch.float32)
    z = _leaf(torch.randn(rows, hidden, generator=g, dtype=torch.float64) * zs, dtype) if zs else None
    dout = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    out = tvm_mamba.rmsnorm_fn(x, w, None, z, 1e-5, group_size, norm_before_gate)
    out.backward(dout.to(dtype))
    xr, wr, zr = _ref_leaves(x, w, z)
    ref = rmsnorm_gated_ref(xr, wr, None, zr, 1e-5, group_size, norm_before_gate)
    ref.backward(dout)
    _close("out", out, ref, dtype, ftz)
    _close("dx", x.grad, xr.grad, dtype, ftz)
    _close("dweight", w.grad, wr.grad, dtype, ftz)
    if z is not None:
        _close("dz", z.grad, zr.grad, dtype, ftz)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES + (1e-30,), ids=lambda s: f"{s:g}")
def test_rmsnorm_huge_and_tiny_x(scale, dtype):
    """x^2 overflows float32 above 1.8e19; at 1e-30 the eps term dominates and everything stays finite."""
    _rmsnorm(dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:g}")
def test_rmsnorm_gated_huge(scale, dtype):
    """Huge z: silu(z) ~ z for z > 0 and 0 for z < 0; gating before the norm makes u = x silu(z) huge;
    huge x with the gate after the norm."""
    _rmsnorm(dtype, 1.0, zs=scale, norm_before_gate=True)
    _rmsnorm(dtype, 1.0, zs=scale, norm_before_gate=False, group_size=16)
    _rmsnorm(dtype, scale, zs=1.0, norm_before_gate=False)


def _conv1d(dtype, scale, ftz=False):
    g = torch.Generator().manual_seed(0)
    batch, dim, seqlen, width = 2, 16, 32, 4
    x = _leaf(torch.randn(batch, dim, seqlen, generator=g, dtype=torch.float64) * scale, dtype)
    w = _leaf(torch.randn(dim, width, generator=g, dtype=torch.float64), torch.float32)
    b = _leaf(torch.randn(dim, generator=g, dtype=torch.float64), torch.float32)
    dout = torch.randn(batch, dim, seqlen, generator=g, dtype=torch.float64)
    out = tvm_mamba.causal_conv1d_fn(x, w, b, activation="silu")
    out.backward(dout.to(dtype))
    xr, wr, br = _ref_leaves(x, w, b)
    ref = causal_conv1d_ref(xr, wr, br, activation="silu")
    ref.backward(dout)
    for name, got, r in (("out", out, ref), ("dx", x.grad, xr.grad), ("dweight", w.grad, wr.grad),
                         ("dbias", b.grad, br.grad)):
        _close(name, got, r, dtype, ftz)
    state = (torch.randn(batch, dim, width - 1, generator=g, dtype=torch.float64) * scale).to(dtype)
    xt = x.detach()[..., 0].clone()
    out_ref, state_ref = causal_conv1d_update_ref(xt.double(), state.double(), w.detach().double(),
                                                  b.detach().double(), "silu")
    out_t = tvm_mamba.causal_conv1d_update(xt, state, w.detach(), b.detach(), "silu")
    _close("update out", out_t, out_ref, dtype, ftz)
    _close("update conv_state", state, state_ref, dtype, ftz)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:g}")
def test_causal_conv1d_silu_huge_x(scale, dtype):
    _conv1d(dtype, scale)


def _scan(dtype, us, zs, ftz=False):
    g = torch.Generator().manual_seed(0)
    batch, dim, dstate, seqlen = 2, 8, 4, 16

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s

    u, delta, z = _leaf(rnd(batch, dim, seqlen, s=us), dtype), _leaf(rnd(batch, dim, seqlen, s=0.5), dtype), \
        _leaf(rnd(batch, dim, seqlen, s=zs), dtype)
    A = _leaf(-torch.rand(dim, dstate, generator=g, dtype=torch.float64) - 0.5, torch.float32)
    B, C = _leaf(rnd(batch, dstate, seqlen), dtype), _leaf(rnd(batch, dstate, seqlen), dtype)
    D, dbias = _leaf(rnd(dim), torch.float32), _leaf(rnd(dim, s=0.1), torch.float32)
    dout = rnd(batch, dim, seqlen)
    args = (u, delta, A, B, C, D, z, dbias)
    out = tvm_mamba.selective_scan_fn(*args, delta_softplus=True)
    out.backward(dout.to(dtype))
    refs = _ref_leaves(*args)
    ref = selective_scan_ref(*refs, delta_softplus=True)
    ref.backward(dout)
    _close("out", out, ref, dtype, ftz)
    for name, a, r in zip(("u", "delta", "A", "B", "C", "D", "z", "delta_bias"), args, refs):
        _close(f"d{name}", a.grad, r.grad, dtype, ftz)
    state0 = rnd(batch, dim, dstate, s=us).float()
    state = state0.clone()
    step = [t.detach()[..., 0].clone() for t in (u, delta, z, B, C)]
    xs, dts, zt, Bt, Ct = step
    out_t = tvm_mamba.selective_state_update(state, xs, dts, A.detach(), Bt, Ct, D.detach(), zt, dbias.detach(),
                                             dt_softplus=True)
    out_ref, state_ref = selective_state_update_ref(state0.double(), xs, dts, A.detach(), Bt, Ct, D.detach(), zt,
                                                    dbias.detach(), dt_softplus=True)
    _close("update out", out_t, out_ref, dtype, ftz)
    _close("update state", state, state_ref, torch.float32, ftz)  # the state is float32 for every dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:g}")
def test_selective_scan_huge_u_and_z(scale, dtype):
    """Huge u (out and the state scale with it) and, separately, huge z (silu(z) and silu'(z) saturate)."""
    _scan(dtype, scale, 1.0)
    _scan(dtype, 1.0, scale)


def test_cuda_kernels_in_harness():
    """The CUDA kernels (run on the CPU by the harness) at the extreme scales: RMSNorm (float64 sum of
    squares in the cross-thread reduction), conv1d + silu, and the scan with huge u and huge z."""
    with tvm_mamba.simulate_cuda("sm_90"):
        _rmsnorm(torch.float32, 1e36, ftz=True)
        _rmsnorm(torch.float32, 1e-30, ftz=True)
        _rmsnorm(torch.bfloat16, 1.0, zs=1e30, norm_before_gate=False, group_size=32, ftz=True)
        _conv1d(torch.float32, 1e36, ftz=True)
        _scan(torch.float32, 1e36, 1.0, ftz=True)
        _scan(torch.float32, 1.0, 1e30, ftz=True)
