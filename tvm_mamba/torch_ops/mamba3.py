"""mamba3_siso_step: mamba_ssm 2.3.2.post1's Mamba-3 SISO decode step (ops/triton/mamba3/mamba3_siso_step.py)
on the TVM kernel of compute/mamba3 (docs/mamba3.md).

Op (namespace ``tvm_mamba``): ``mamba3_siso_step`` -> (out, new angle state, new ssm state, new k state),
with a fake (meta) implementation. No autograd: upstream's step kernel has none either (it serves decoding).

Dtypes: Q and K one float dtype, V (and out) a float dtype, Z, the K state and the V state any float
(read in their dtypes). ADT, DT, Trap, Q_bias, K_bias, Angles, D and the angle / ssm states are widened
to float32 (a copy only when they are not float32 already: upstream's module passes them in float32, except
Trap in the model dtype, (batch, nheads) values). New states are float32, as upstream's. float64 V runs the
float64 kernel and needs every tensor float64.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute._mamba3_dims import StepDims
from ._dlpack import FLOATS, check_shape, check_tensor, dummy, kernel_for, prepare, run_op, tvm_dtype

OP = "mamba3"


def _acc(V: Tensor) -> torch.dtype:
    return torch.float64 if V.dtype == torch.float64 else torch.float32


def _step_dims(Q: Tensor, V: Tensor, Angles: Tensor, D, Z, k_state: Tensor, v_state: Tensor) -> StepDims:
    """The step's typed dims: z / kstate / vstate dtypes stay None at their defaults (V's; acc; V's)."""
    other = lambda t, default: tvm_dtype(t) if t is not None and t.dtype != default else None  # noqa: E731
    return StepDims.cached(
        nheads=V.shape[1], nheads_qk=Q.shape[1], headdim_qk=Q.shape[2], headdim_v=V.shape[2],
        headdim_angles=Angles.shape[2], has_D=D is not None, has_z=Z is not None, qk_dtype=tvm_dtype(Q),
        v_dtype=tvm_dtype(V), z_dtype=other(Z, V.dtype), kstate_dtype=other(k_state, _acc(V)),
        vstate_dtype=other(v_state, V.dtype))


def _new_states(V: Tensor, Q: Tensor, Angles: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised (out, angle, ssm, k) outputs of a step (also the fake implementation's results)."""
    (batch, nheads, P), N, S, acc = V.shape, Q.shape[2], Angles.shape[2], _acc(V)
    return (V.new_empty((batch, nheads, P)), V.new_empty((batch, nheads, S), dtype=acc),
            V.new_empty((batch, nheads, P, N), dtype=acc), V.new_empty((batch, nheads, N), dtype=acc))


@torch.library.custom_op("tvm_mamba::mamba3_siso_step", mutates_args=())
def mamba3_siso_step_op(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
                        K_bias: Tensor, Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor],
                        angle_state: Tensor, ssm_state: Tensor, k_state: Tensor,
                        v_state: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Kernel layouts as the public function's; ADT .. Angles, D, angle_state and ssm_state already in the
    accumulation dtype -> (out (batch, nheads, headdim_v), angle, ssm, k states)."""
    out, aout, h_out, kout = _new_states(V, Q, Angles)
    if V.shape[0] == 0:
        return out, aout, h_out, kout
    dims = _step_dims(Q, V, Angles, D, Z, k_state, v_state)
    kern = kernel_for(OP, "siso_step", V.device, dims)
    acc = _acc(V)
    kern(prepare(Q), prepare(K), prepare(V), prepare(ADT), prepare(DT), prepare(Trap), prepare(Q_bias),
         prepare(K_bias), prepare(Angles), prepare(D) if D is not None else dummy(V.device, acc, 1),
         prepare(Z) if Z is not None else dummy(V.device, V.dtype, 3), prepare(angle_state), prepare(ssm_state),
         prepare(k_state), prepare(v_state), out, aout, h_out, kout, torch.empty_like(kout))  # + rotated q
    return out, aout, h_out, kout


@mamba3_siso_step_op.register_fake
def _(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state):
    return _new_states(V, Q, Angles)


def _check_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, states) -> None:
    """TypeError / ValueError naming the argument for a wrong type, dtype, shape or device."""
    check_tensor("V", V, ndim=3, dtypes=FLOATS + (torch.float64,))
    batch, nheads, P = V.shape
    wide = V.dtype == torch.float64
    io = (torch.float64,) if wide else FLOATS
    anyf = io + (() if wide else (torch.float64,))  # widened to the accumulation dtype
    check_tensor("Q", Q, ndim=3, dtypes=io, device=V.device)
    nheads_qk, N = Q.shape[1], Q.shape[2]
    if Q.shape[0] != batch:
        raise ValueError(f"Q: expected batch {batch} (V's), got shape {tuple(Q.shape)}")
    if nheads_qk < 1 or nheads % nheads_qk:
        raise ValueError(f"Q: nheads_qk={nheads_qk} must divide nheads={nheads} (V's heads)")
    if N % 2 or N < 2:
        raise ValueError(f"Q: headdim_qk={N} must be even (rotary pairs)")
    check_tensor("K", K, dtypes=(Q.dtype,), device=V.device)
    check_shape("K", K, Q.shape)
    for name, t in (("ADT", ADT), ("DT", DT), ("Trap", Trap)):
        check_tensor(name, t, dtypes=anyf, device=V.device)
        check_shape(name, t, (batch, nheads))
    for name, t in (("Q_bias", Q_bias), ("K_bias", K_bias)):
        check_tensor(name, t, dtypes=anyf, device=V.device)
        check_shape(name, t, (nheads, N))
    check_tensor("Angles", Angles, ndim=3, dtypes=anyf, device=V.device)
    S = Angles.shape[2]
    if not 1 <= S <= N // 2:
        raise ValueError(f"Angles: headdim_angles={S} must be in [1, headdim_qk // 2 = {N // 2}]")
    check_shape("Angles", Angles, (batch, nheads, S))
    if D is not None:
        check_tensor("D", D, dtypes=anyf, device=V.device)
        check_shape("D", D, (nheads,))
    if Z is not None:
        check_tensor("Z", Z, dtypes=io, device=V.device)
        check_shape("Z", Z, V.shape)
    if not isinstance(states, (tuple, list)) or len(states) != 4:
        raise TypeError("Input_States: expected (angle_state, ssm_state, k_state, v_state) or None")
    shapes = ((batch, nheads, S), (batch, nheads, P, N), (batch, nheads, N), (batch, nheads, P))
    for name, t, shape, dts in zip(("angle_state", "ssm_state", "k_state", "v_state"), states, shapes,
                                   (anyf, anyf, io, io)):
        check_tensor(f"Input_States ({name})", t, dtypes=dts, device=V.device)
        check_shape(f"Input_States ({name})", t, shape)


def mamba3_siso_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None):
    """One Mamba-3 SISO decode step (mamba_ssm.ops.triton.mamba3.mamba3_siso_step, 2.3.2.post1's signature).

    Q, K: (batch, nheads_qk, headdim_qk); V, Z: (batch, nheads, headdim_v); ADT, DT, Trap: (batch, nheads);
    Q_bias, K_bias: (nheads, headdim_qk); Angles: (batch, nheads, headdim_angles), 1 <= headdim_angles <=
    headdim_qk // 2; D: (nheads,); Input_States: (angle (batch, nheads, headdim_angles),
    ssm (batch, nheads, headdim_v, headdim_qk), k (batch, nheads, headdim_qk), v (batch, nheads, headdim_v)),
    None = all zeros (an extension: upstream needs them). nheads % nheads_qk == 0.
    -> (out (batch, nheads, headdim_v) in V's dtype, [angle, ssm, k states (float32), V]).

    theta' = (theta + pi tanh(Angles) DT) mod 2 pi; q, k = R(theta') (Q + Q_bias), R(theta') (K + K_bias)
    (interleaved pairs); h' = exp(ADT) h + exp(ADT) DT (1 - sigmoid(Trap)) v_state k_state^T
    + DT sigmoid(Trap) V k^T; out = (h' q + D V) * silu(Z). The input states are not modified.
    """
    check_tensor("V", V, ndim=3, dtypes=FLOATS + (torch.float64,))
    if Input_States is None:
        acc = _acc(V)
        (batch, nheads, P), N = V.shape, Q.shape[-1] if isinstance(Q, Tensor) else 0
        S = Angles.shape[-1] if isinstance(Angles, Tensor) else 0
        Input_States = (V.new_zeros(batch, nheads, S, dtype=acc), V.new_zeros(batch, nheads, P, N, dtype=acc),
                        V.new_zeros(batch, nheads, N, dtype=acc), V.new_zeros(batch, nheads, P))
    _check_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States)
    acc = _acc(V)
    w = lambda t: None if t is None else t.to(acc)  # noqa: E731
    angle_state, ssm_state, k_state, v_state = Input_States
    out, aout, h_out, kout = run_op(mamba3_siso_step_op, Q, K, V, w(ADT), w(DT), w(Trap), w(Q_bias), w(K_bias),
                                    w(Angles), w(D), Z, w(angle_state), w(ssm_state), k_state, v_state)
    return out, [aout, h_out, kout, V]
