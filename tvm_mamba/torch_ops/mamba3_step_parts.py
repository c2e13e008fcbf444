"""The Mamba-3 decode step's two passes as functions of their own, upstream's two-function path (mamba_ssm
2.3.2.post1's ``Mamba3.step``: Triton ``apply_rotary_qk_inference_fwd``, then CuTe ``mamba3_step_fn``), on the
kernels of the ONE step template (compute/mamba3/step.py, directions ``step_rotate`` and ``step_update``;
docs/mamba3.md, "The MIMO decode step").

Ops (namespace ``tvm_mamba``), each with a fake implementation; no autograd (decoding, as upstream's):
``mamba3_step_rotate`` -> (q_out, k_out, angle_out) (new tensors; ``inplace`` copies them back in the public
function); ``mamba3_step_update`` writes ``out`` and the new ssm state (into ``state`` itself when
``state_out`` is None: the kernel's ``inplace`` flag), so it declares ``state``, ``state_out`` and ``out`` in
``mutates_args``. CPU and CUDA tensors (upstream: CUDA only).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute.mamba3.dims import MimoStepDims
from ._dlpack import FLOATS, check_shape, check_tensor, dummy, kernel_for, prepare, run_op, tvm_dtype

OP = "mamba3"
F64 = torch.float64


def _acc(t: Tensor) -> torch.dtype:
    return F64 if t.dtype == F64 else torch.float32


def _acc_name(t: Tensor) -> str:
    return "float64" if t.dtype == F64 else "float32"


# --- apply_rotary_qk_inference_fwd ---------------------------------------------------------------------------

def _rotate_outputs(q: Tensor, angle_state: Tensor, nheads: int) -> tuple[Tensor, Tensor, Tensor]:
    batch, R, _, N = q.shape
    return (q.new_empty(batch, R, nheads, N), q.new_empty(batch, R, nheads, N),
            q.new_empty(angle_state.shape, dtype=_acc(q)))


@torch.library.custom_op("tvm_mamba::mamba3_step_rotate", mutates_args=())
def mamba3_step_rotate_op(q: Tensor, k: Tensor, angle_state: Tensor, angle_proj: Tensor, dt: Tensor,
                          bias_q: Optional[Tensor], bias_k: Optional[Tensor], conjugate: bool,
                          rotate_pairwise: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q, k: (batch, R, nheads_qk, headdim) (nheads_qk divides nheads: head h reads h // (nheads / nheads_qk));
    angle_state, angle_proj: (batch, nheads, S); dt: (batch, nheads); bias_q, bias_k: (R, nheads, headdim);
    all but q / k in the accumulation dtype -> (q_out, k_out (batch, R, nheads, headdim) in q's dtype,
    angle_out (batch, nheads, S) acc)."""
    nheads = angle_state.shape[1]
    q_out, k_out, aout = _rotate_outputs(q, angle_state, nheads)
    if q.shape[0] == 0:
        return q_out, k_out, aout
    batch, R, HQ, N = q.shape
    dims = MimoStepDims.cached(
        nheads=nheads, nheads_qk=HQ, headdim_qk=N, headdim_v=1, headdim_angles=angle_state.shape[2],
        qk_dtype=tvm_dtype(q), v_dtype=_acc_name(q), mimo_rank=R, has_outproj=False, pairwise=rotate_pairwise,
        angle_mod=False, conjugate=conjugate, rank_major=True, has_qbias=bias_q is not None,
        has_kbias=bias_k is not None)  # headdim_v, D, Z, MIMO_*: not read by this pass (one kernel for all)
    opt = lambda t: prepare(t) if t is not None else dummy(q.device, _acc(q), 3)  # noqa: E731
    kernel_for(OP, "step_rotate", q.device, dims)(
        prepare(q), prepare(k), prepare(dt), opt(bias_q), opt(bias_k), prepare(angle_proj), prepare(angle_state),
        aout, k_out, q_out)
    return q_out, k_out, aout


@mamba3_step_rotate_op.register_fake
def _(q, k, angle_state, angle_proj, dt, bias_q, bias_k, conjugate, rotate_pairwise):
    return _rotate_outputs(q, angle_state, angle_state.shape[1])


def _check_rotate(q, k, angle_state, angle_proj, dt, bias_q, bias_k) -> None:
    """Upstream's asserts as TypeError / ValueError naming the argument."""
    check_tensor("q", q, ndim=4, dtypes=FLOATS + (F64,))
    (batch, R, nheads, headdim), dev = q.shape, q.device
    anyf = (F64,) if q.dtype == F64 else FLOATS + (F64,)
    if headdim % 2 or headdim > 256:
        raise ValueError(f"q: headdim must be even and at most 256 (upstream's limit), got {headdim}")
    check_tensor("k", k, dtypes=(q.dtype,), device=dev)
    check_shape("k", k, q.shape)
    check_tensor("angle_state", angle_state, ndim=3, dtypes=anyf, device=dev)
    S = angle_state.shape[2]
    if not 1 <= S <= headdim // 2:
        raise ValueError(f"angle_state: rotary_dim = 2 * {S} must be in [2, headdim = {headdim}]")
    check_shape("angle_state", angle_state, (batch, nheads, S))
    check_tensor("angle_proj", angle_proj, dtypes=anyf, device=dev)
    check_shape("angle_proj", angle_proj, angle_state.shape)
    check_tensor("dt", dt, dtypes=anyf, device=dev)
    check_shape("dt", dt, (batch, nheads))
    for name, b in (("bias_q", bias_q), ("bias_k", bias_k)):
        if b is not None:
            check_tensor(name, b, dtypes=anyf, device=dev)
            check_shape(name, b, (R, nheads, headdim))


def _shared_heads(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """q, k as (batch, R, nheads_qk, headdim): an expanded (stride-0) head axis, as upstream's module passes B
    and C broadcast from one group to every head, becomes nheads_qk = 1 (read once, no copy per head)."""
    if q.shape[2] > 1 and q.stride(2) == 0 and k.stride(2) == 0:
        return q[:, :, :1], k[:, :, :1]
    return q, k


def apply_rotary_qk_inference_fwd(q, k, angle_state, angle_proj, dt, bias_q=None, bias_k=None, inplace=False,
                                  conjugate=False, rotate_pairwise=True):
    """Rotary embedding of q and k by one new angle per (batch, head, pair), and that angle (mamba_ssm.ops.triton.
    mamba3.mamba3_mimo_rotary_step.apply_rotary_qk_inference_fwd, 2.3.2.post1's signature and semantics).

    q, k: (batch, R, nheads, headdim) (any strides; an expanded head axis is read once); angle_state,
    angle_proj: (batch, nheads, rotary_dim / 2), rotary_dim <= headdim; dt: (batch, nheads); bias_q, bias_k:
    (R, nheads, headdim) or None -> (q_out, k_out (batch, R, nheads, headdim) in q's dtype, angle_state_out
    in angle_state's dtype); with ``inplace`` written into q, k, angle_state (returned).

    theta' = angle_state + tanh(angle_proj) dt pi (NOT reduced mod 2 pi); with c, s = cos theta'_i,
    sin theta'_i (s negated with ``conjugate``) each pair (a, b) of q + bias_q and k + bias_k becomes
    (a c - b s, a s + b c): pairs (2i, 2i+1) with ``rotate_pairwise``, else (i, i + headdim / 2); pairs
    i >= rotary_dim / 2 pass through. Math in float32 (float64 for float64 q)."""
    _check_rotate(q, k, angle_state, angle_proj, dt, bias_q, bias_k)
    if inplace:
        for name, t in (("q", q), ("k", k)):
            if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
                raise ValueError(f"{name}: inplace=True writes into it, but it is an expanded (stride-0) view "
                                 "(upstream: inplace is incompatible with nheads != num_bc_heads)")
    acc = _acc(q)
    w = lambda t: None if t is None else t.to(acc)  # noqa: E731
    qs, ks = _shared_heads(q, k)
    q_out, k_out, aout = run_op(mamba3_step_rotate_op, qs, ks, w(angle_state), w(angle_proj), w(dt), w(bias_q),
                                w(bias_k), bool(conjugate), bool(rotate_pairwise))
    if not inplace:
        return q_out, k_out, aout.to(angle_state.dtype)
    q.copy_(q_out)
    k.copy_(k_out)
    angle_state.copy_(aout)
    return q, k, angle_state


# --- mamba3_step_fn ---------------------------------------------------------------------------------------------

@torch.library.custom_op("tvm_mamba::mamba3_step_update", mutates_args=("state", "state_out", "out"))
def mamba3_step_update_op(state: Tensor, Bstate: Tensor, Xstate: Tensor, A: Tensor, B: Tensor, C: Tensor,
                          D: Tensor, x: Tensor, dt: Tensor, trap: Tensor, xproj: Tensor, outproj: Optional[Tensor],
                          state_out: Optional[Tensor], out: Tensor, z: Optional[Tensor],
                          zproj: Optional[Tensor]) -> None:
    """mamba3_step_fn's layouts; A, D, dt, trap, xproj, outproj, zproj already in the accumulation dtype; writes
    out and the new state (into ``state`` when ``state_out`` is None, else into ``state_out``)."""
    batch, nheads, P, N = state.shape
    if batch == 0:
        return
    acc = _acc(x)
    other = lambda t, default: tvm_dtype(t) if t.dtype != default else None  # noqa: E731
    dims = MimoStepDims.cached(
        nheads=nheads, nheads_qk=1, headdim_qk=N, headdim_v=P, headdim_angles=1, has_D=True, has_z=z is not None,
        qk_dtype=tvm_dtype(B), v_dtype=tvm_dtype(x), z_dtype=other(z, x.dtype) if z is not None else None,
        kstate_dtype=other(Bstate, acc), vstate_dtype=other(Xstate, x.dtype), mimo_rank=B.shape[1],
        has_outproj=outproj is not None, trap_logit=False, raw_a=True, inplace=state_out is None, rank_major=True,
        state_dtype=other(state, acc))  # nheads_qk, headdim_angles: not read by this pass
    opt = lambda t: prepare(t) if t is not None else dummy(x.device, acc, 3)  # noqa: E731
    target = state if state_out is None else state_out
    st, o = prepare(target) if state_out is None else _dest(state_out), _dest(out)
    h_args = (st,) if state_out is None else (prepare(state), st)  # in place: one buffer read and rewritten
    kernel_for(OP, "step_update", x.device, dims)(
        prepare(x), prepare(A), prepare(dt), prepare(trap), prepare(xproj), opt(zproj if z is not None else None),
        opt(outproj), prepare(D), prepare(z) if z is not None else dummy(x.device, x.dtype, 3), h_args[0],
        prepare(Bstate), prepare(Xstate), o, *h_args[1:], prepare(B), prepare(C))
    for dst, src in ((target, st), (out, o)):
        if src.data_ptr() != dst.data_ptr():  # a strided / unaligned destination: written back
            dst.copy_(src)


def _dest(t: Tensor) -> Tensor:
    """A destination the kernel may write: ``t`` itself when compact and aligned, else a fresh buffer."""
    return t if prepare(t) is t else torch.empty(t.shape, dtype=t.dtype, device=t.device)


@mamba3_step_update_op.register_fake
def _(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj):
    return None


def _check_update(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z,
                  zproj) -> None:
    """Upstream's asserts as TypeError / ValueError naming the argument (before anything runs)."""
    check_tensor("state", state, ndim=4, dtypes=FLOATS + (F64,))
    (batch, nheads, hdim, dstate), dev = state.shape, state.device
    check_tensor("x", x, dtypes=FLOATS + (F64,), device=dev)
    check_shape("x", x, (batch, nheads, hdim))
    wide = x.dtype == F64
    io, anyf = ((F64,), (F64,)) if wide else (FLOATS, FLOATS + (F64,))
    check_tensor("state", state, dtypes=io)
    check_tensor("Bstate", Bstate, ndim=4, dtypes=io, device=dev)
    R = Bstate.shape[1]
    for name, t, shape, dts in (("Bstate", Bstate, (batch, R, nheads, dstate), io), ("Xstate", Xstate, x.shape, io),
                                ("A", A, (batch, nheads), anyf), ("B", B, Bstate.shape, io),
                                ("C", C, Bstate.shape, (B.dtype,) if isinstance(B, Tensor) else io),
                                ("D", D, (nheads,), anyf), ("dt", dt, (batch, nheads), anyf),
                                ("trap", trap, (batch, nheads), anyf), ("xproj", xproj, (R, nheads, hdim), anyf)):
        check_tensor(name, t, dtypes=dts, device=dev)
        check_shape(name, t, shape)
    if dstate % 2:
        raise ValueError(f"state: dstate must be even (the step template's rotary pairs), got {dstate}")
    if (z is None) != (zproj is None):
        raise ValueError("zproj: z and zproj are given together (upstream: zproj is required with z)")
    for name, t, shape, dts in (("z", z, x.shape, io), ("zproj", zproj, (R, nheads, hdim), anyf),
                                ("outproj", outproj, (R, nheads, hdim), anyf),
                                ("state_out", state_out, state.shape, (state.dtype,))):
        if t is not None:
            check_tensor(name, t, dtypes=dts, device=dev)
            check_shape(name, t, shape)
    if not isinstance(out, Tensor):
        raise TypeError(f"out: expected a torch.Tensor to write the output into, got {type(out).__name__}")
    check_tensor("out", out, dtypes=(x.dtype,), device=dev)
    check_shape("out", out, (batch, nheads, hdim) if outproj is not None else (batch, R, nheads, hdim))
    for name, t in (("state", state if state_out is None else state_out), ("out", out)):
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"{name}: written by the step, but it is an expanded (stride-0) view")


def mamba3_step_fn(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj=None, state_out=None, out=None,
                   z=None, zproj=None, tile_D=64, num_warps=2):
    """One Mamba-3 decode step's state update and output from rotated B / C (mamba_ssm.ops.cute.mamba3.
    mamba3_step_fn.mamba3_step_fn, 2.3.2.post1's signature and semantics; SISO is R = 1).

    state: (batch, nheads, hdim, dstate), updated in place when state_out is None, else the new state goes to
    state_out (same shape and dtype); Bstate, B, C: (batch, R, nheads, dstate) (B, C rotated, as
    apply_rotary_qk_inference_fwd returns them); Xstate, x, z: (batch, nheads, hdim); A, dt, trap: (batch,
    nheads) (trap a probability, already sigmoided); D: (nheads,); xproj, zproj, outproj: (R, nheads, hdim);
    out: (batch, nheads, hdim), or (batch, R, nheads, hdim) without outproj, in x's dtype, written. Returns None.

    alpha = exp(A dt), beta = (1 - trap) dt alpha, gamma = trap dt; x_r = x xproj_r;
    h' = alpha h + beta sum_r (Xstate xproj_r) Bstate_r^T + gamma sum_r x_r B_r^T;
    y_r = (h' C_r + D x_r) silu(z zproj_r) (with z); out = sum_r outproj_r y_r (without outproj: out_r = y_r;
    upstream's reference gates it too, its CuTe kernel ignores z there). Math in float32 (float64 for float64
    x), the new state rounded to state's dtype. ``tile_D``, ``num_warps``: CuTe launch knobs, accepted and
    unused (tvm_mamba's schedules choose the layout)."""
    _check_update(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj)
    acc = _acc(x)
    w = lambda t: None if t is None else t.to(acc)  # noqa: E731
    run_op(mamba3_step_update_op, state, Bstate, Xstate, w(A), B, C, w(D), x, w(dt), w(trap), w(xproj),
           w(outproj), state_out, out, z, w(zproj))
