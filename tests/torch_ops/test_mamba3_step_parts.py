"""Upstream's two-function Mamba-3 decode path on the CPU (torch_ops/mamba3_step_parts.py: the step template's
``step_rotate`` and ``step_update`` kernels) against the float64 references (reference/mamba3_mimo.py
``apply_rotary_qk_inference_ref`` / ``mamba3_step_fn_ref``): fp32, bf16 (mamba_ssm's 2 * err(bf16 reference) +
atol rule) and float64; SISO (R = 1, interleaved pairs) and MIMO (R = 4, halved pairs), with and without
biases, conjugate, in place and not, expanded (stride-0) heads; with and without z / outproj, the state in place
or into state_out, a bf16 state; the two chained == mamba3_mimo_step; opcheck; torch.compile; bad input errors."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.mamba3_mimo import apply_rotary_qk_inference_ref, mamba3_step_fn_ref
from tvm_mamba.runtime.dispatch import record_keys
from tvm_mamba.torch_ops.mamba3_mimo_step import mamba3_mimo_step
from tvm_mamba.torch_ops.mamba3_step_parts import (apply_rotary_qk_inference_fwd, mamba3_step_fn,
                                                   mamba3_step_rotate_op, mamba3_step_update_op)

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
B_, H, N, P, S = 2, 4, 8, 4, 3


def _rand(*shape, seed, dtype=F32, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _rotate_inputs(dtype, R, bias, expanded, seed=0):
    """q, k (batch, R, nheads, headdim) in ``dtype`` (expanded: one head broadcast, as upstream's module passes
    B / C), float32 angle state (beyond 2 pi: not reduced) / proj / dt, biases (R, nheads, headdim) or None."""
    heads = 1 if expanded else H
    q, k = (_rand(B_, R, heads, N, seed=seed + i, dtype=dtype).expand(B_, R, H, N) for i in (0, 1))
    acc = F64 if dtype == F64 else F32
    return dict(q=q, k=k, angle_state=_rand(B_, H, S, seed=seed + 2, dtype=acc, scale=5.0),
                angle_proj=_rand(B_, H, S, seed=seed + 3, dtype=acc),
                dt=torch.rand(B_, H, generator=torch.Generator().manual_seed(seed + 4)).to(acc),
                bias_q=_rand(R, H, N, seed=seed + 5, dtype=acc, scale=0.3) if bias else None,
                bias_k=_rand(R, H, N, seed=seed + 6, dtype=acc, scale=0.3) if bias else None)


# (dtype, R, pairwise, biases, conjugate, inplace, expanded heads): SISO is R = 1 pairwise, MIMO R = 4 halved
ROTATE = [(F32, 1, True, True, False, False, True), (F32, 4, False, True, True, True, False),
          (F32, 4, False, False, False, False, True), (BF16, 1, True, False, True, True, False),
          (BF16, 4, False, True, False, False, True), (F64, 2, True, True, True, False, False)]


@pytest.mark.parametrize("dtype, R, pairwise, bias, conj, inplace, expanded", ROTATE)
def test_rotary_matches_reference(dtype, R, pairwise, bias, conj, inplace, expanded):
    a = _rotate_inputs(dtype, R, bias, expanded, seed=R)
    if inplace:
        a.update(q=a["q"].clone(), k=a["k"].clone(), angle_state=a["angle_state"].clone())
    given = {k: v.clone() for k, v in a.items() if v is not None}
    with record_keys() as used:
        q_out, k_out, angle = apply_rotary_qk_inference_fwd(**a, inplace=inplace, conjugate=conj,
                                                            rotate_pairwise=pairwise)
    key = used[0][0]
    assert (key.op, key.direction, dict(key.static)["nheads_qk"]) == ("mamba3", "step_rotate", 1 if expanded else H)
    ref = apply_rotary_qk_inference_ref(**given, conjugate=conj, rotate_pairwise=pairwise)
    low = apply_rotary_qk_inference_ref(**given, conjugate=conj, rotate_pairwise=pairwise, dtype=BF16) \
        if dtype == BF16 else (None,) * 3
    assert q_out.dtype == k_out.dtype == dtype and angle.dtype == a["angle_state"].dtype
    assert ref[2].abs().max() > 2 * math.pi  # the angle is not reduced mod 2 pi (upstream's)
    tol = 1e-12 if dtype == F64 else 1e-5
    for name, got, want, lo in zip(("q", "k", "angle"), (q_out, k_out, angle), ref, low):
        assert_close_to_ref(got, want, lo if name != "angle" else None, atol=tol if lo is None else None,
                            rtol=tol, name=name)
    if inplace:
        assert q_out is a["q"] and k_out is a["k"] and angle is a["angle_state"]
    else:
        assert all(torch.equal(a[n], given[n]) for n in ("q", "k", "angle_state"))


def _update_inputs(dtype, R, z, outproj, state_dtype=F32, seed=0):
    """mamba3_step_fn's arguments: B, C, Bstate, Xstate, x, z in ``dtype``; A < 0, dt, trap in (0, 1), D, the
    projections around upstream's init in float32 (float64 call: all float64); out allocated (x's dtype)."""
    acc = F64 if dtype == F64 else F32
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, dt=dtype, scale=1.0: (scale * torch.randn(*s, generator=g)).to(dt)  # noqa: E731
    proj = lambda: ((1 + 0.5 * torch.randn(R, H, P, generator=g)) / R).to(acc)  # noqa: E731
    a = dict(state=r(B_, H, P, N, dt=state_dtype, scale=0.5), Bstate=r(B_, R, H, N), Xstate=r(B_, H, P),
             A=-(torch.rand(B_, H, generator=g) + 0.1).to(acc), B=r(B_, R, H, N), C=r(B_, R, H, N), D=r(H, dt=acc),
             x=r(B_, H, P), dt=(0.5 * torch.rand(B_, H, generator=g)).to(acc), trap=torch.rand(B_, H, generator=g).to(acc),
             xproj=proj(), outproj=proj() if outproj else None, z=r(B_, H, P) if z else None,
             zproj=proj() if z else None)
    a["out"] = torch.empty((B_, H, P) if outproj else (B_, R, H, P), dtype=dtype)
    return a


# (dtype, R, z, outproj, state dtype, in place): upstream's SISO call (R = 1, ones projections), MIMO's two
# (with z and outproj; is_outproj_norm: neither, R outputs), a bf16 state, float64
UPDATE = [(F32, 1, True, True, F32, True), (F32, 4, True, True, F32, False), (F32, 4, False, False, F32, True),
          (BF16, 4, True, True, F32, True), (BF16, 1, False, False, BF16, False), (F64, 2, True, False, F64, True)]


@pytest.mark.parametrize("dtype, R, z, outproj, state_dtype, inplace", UPDATE)
def test_step_fn_matches_reference(dtype, R, z, outproj, state_dtype, inplace):
    a = _update_inputs(dtype, R, z, outproj, state_dtype, seed=R + 10 * z)
    state0 = a["state"].clone()
    state_out = None if inplace else torch.empty_like(a["state"])
    with record_keys() as used:
        assert mamba3_step_fn(**a, state_out=state_out) is None
    assert [(k.direction, dict(k.static).get("inplace", False)) for k, _ in used] == [("step_update", inplace)]
    args = {k: v for k, v in a.items() if k != "out"}
    args["state"] = state0
    out_ref, h_ref = mamba3_step_fn_ref(**args)
    out_low, h_low = mamba3_step_fn_ref(**args, dtype=BF16) if dtype == BF16 else (None, None)
    new = a["state"] if inplace else state_out
    if not inplace:
        assert torch.equal(a["state"], state0)
    tol = 1e-12 if dtype == F64 else 1e-5
    assert_close_to_ref(a["out"], out_ref, out_low, atol=tol if out_low is None else None, rtol=tol, name="out")
    if state_dtype == BF16:  # the float32 new state rounded to bf16 once
        assert_close_to_ref(new, h_ref, h_ref.to(BF16), atol=0.0, name="state")
    else:
        assert_close_to_ref(new, h_ref, atol=1e-4 if dtype == BF16 else tol, rtol=tol, name="state")


def test_two_functions_compose_to_the_fused_step():
    """rotary then step_fn (upstream's MIMO Mamba3.step) == mamba3_mimo_step (tvm_mamba's fused step, the same
    template's two passes) at rank 4, halved pairs, with Trap = logit(trap) and ADT = A dt."""
    a = _rotate_inputs(F32, 4, True, True, seed=7)
    u = dict(_update_inputs(F32, 4, True, True, seed=8), dt=a["dt"])
    state0 = u["state"].clone()
    q, k, angle = apply_rotary_qk_inference_fwd(**a, rotate_pairwise=False)
    mamba3_step_fn(**dict(u, B=k, C=q))  # the state in place
    rm = lambda t: t.transpose(0, 1)  # noqa: E731  (R, nheads, .) -> the fused op's (nheads, R, .)
    want, (ang, h, kst, _) = mamba3_mimo_step(
        a["q"][:, :, :1], a["k"][:, :, :1], u["x"], u["A"] * u["dt"], u["dt"], torch.logit(u["trap"]),
        rm(a["bias_q"]), rm(a["bias_k"]), rm(u["xproj"]), rm(u["zproj"]), rm(u["outproj"]), a["angle_proj"],
        u["D"], u["z"], Input_States=(a["angle_state"], state0, u["Bstate"], u["Xstate"]))
    for name, got, ref in (("out", u["out"], want), ("state", u["state"], h), ("k", k, kst),
                           ("cos angle", torch.cos(angle), torch.cos(ang))):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5, msg=name)


def test_opcheck():
    a = _rotate_inputs(F32, 2, True, False, seed=3)
    torch.library.opcheck(mamba3_step_rotate_op, (a["q"].contiguous(), a["k"].contiguous(), a["angle_state"],
                                                  a["angle_proj"], a["dt"], a["bias_q"], None, True, False),
                          test_utils=("test_schema", "test_faketensor"))
    u = _update_inputs(F32, 2, True, True, seed=4)
    torch.library.opcheck(mamba3_step_update_op, (u["state"], u["Bstate"], u["Xstate"], u["A"], u["B"], u["C"],
                                                  u["D"], u["x"], u["dt"], u["trap"], u["xproj"], u["outproj"],
                                                  None, u["out"], u["z"], u["zproj"]),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph():
    """Upstream's two calls under torch.compile(fullgraph=True) (the update op mutating the state and out) ==
    eager."""
    a = _rotate_inputs(F32, 4, True, True, seed=1)
    u = _update_inputs(F32, 4, True, True, seed=2)

    def decode(a, u):
        q, k, angle = apply_rotary_qk_inference_fwd(**a, rotate_pairwise=False)
        mamba3_step_fn(**dict(u, B=k, C=q))
        return angle

    fresh = lambda: dict(u, state=u["state"].clone(), out=torch.empty_like(u["out"]))  # noqa: E731
    eager, compiled = fresh(), fresh()
    angle = decode(a, eager)
    torch.testing.assert_close(torch.compile(decode, fullgraph=True)(a, compiled), angle, rtol=0, atol=0)
    for name in ("out", "state"):
        torch.testing.assert_close(compiled[name], eager[name], rtol=0, atol=0, msg=name)


def test_bad_input_names_the_argument():
    a = _rotate_inputs(F32, 2, True, False)
    with pytest.raises(ValueError, match="bias_q"):
        apply_rotary_qk_inference_fwd(**dict(a, bias_q=a["bias_q"].transpose(0, 1)))
    with pytest.raises(ValueError, match="dt"):
        apply_rotary_qk_inference_fwd(**dict(a, dt=a["dt"][:, :1]))
    with pytest.raises(TypeError, match="k"):
        apply_rotary_qk_inference_fwd(**dict(a, k=a["k"].to(BF16)))
    with pytest.raises(ValueError, match="q: inplace"):
        apply_rotary_qk_inference_fwd(**_rotate_inputs(F32, 2, True, True), inplace=True)
    u = _update_inputs(F32, 2, True, True)
    with pytest.raises(ValueError, match="xproj"):
        mamba3_step_fn(**dict(u, xproj=u["xproj"][:1]))
    with pytest.raises(ValueError, match="out"):
        mamba3_step_fn(**dict(u, out=torch.empty(B_, 2, H, P)))
    with pytest.raises(TypeError, match="out"):
        mamba3_step_fn(**dict(u, out=None))
    with pytest.raises(ValueError, match="zproj"):
        mamba3_step_fn(**dict(u, zproj=None))
    with pytest.raises(ValueError, match="state_out"):
        mamba3_step_fn(**u, state_out=torch.empty(B_, H, P, N + 2))
