"""mamba3_mimo_step: mamba_ssm 2.3.2.post1's Mamba-3 MIMO decode step (``Mamba3.step`` with ``is_mimo``: Triton
``apply_rotary_qk_inference_fwd`` then CuTe ``mamba3_step_fn``) on the TVM kernel of compute/mamba3/step.py, the
SISO step's template at rank R (docs/mamba3.md, "The MIMO decode step").

Op (namespace ``tvm_mamba``) with a fake (meta) implementation: ``mamba3_mimo_step`` -> (out, new angle state,
new ssm state, new k state); no autograd (a decode step, as upstream's). Dtypes as ``mamba3_siso_step``'s: Q and
K one float dtype, V (and out) a float dtype, Z and the K / V states any float (read in their dtypes); ADT, DT,
Trap, the biases, MIMO_V / MIMO_Z / MIMO_Out, Angles, D and the angle / ssm states are widened to the
accumulation dtype (float32; float64 for float64 V, which needs every tensor float64). New states float32.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute.mamba3.dims import MimoStepDims
from ._dlpack import FLOATS, check_shape, check_tensor, dummy, kernel_for, prepare, run_op
from .mamba3 import _acc, _check, _step_dims

OP = "mamba3"


def _outputs(V: Tensor, Q: Tensor, Angles: Tensor, split: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised (out, angle, ssm, k) outputs of a step (also the fake's results); ``split``: no MIMO_Out,
    out (batch, R, nheads, headdim_v)."""
    (batch, nheads, P), (R, N), S, acc = V.shape, (Q.shape[1], Q.shape[3]), Angles.shape[2], _acc(V)
    return (V.new_empty((batch, R, nheads, P) if split else (batch, nheads, P)),
            V.new_empty((batch, nheads, S), dtype=acc), V.new_empty((batch, nheads, P, N), dtype=acc),
            V.new_empty((batch, R, nheads, N), dtype=acc))


@torch.library.custom_op("tvm_mamba::mamba3_mimo_step", mutates_args=())
def mamba3_mimo_step_op(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
                        K_bias: Tensor, MIMO_V: Tensor, MIMO_Z: Optional[Tensor], MIMO_Out: Optional[Tensor],
                        Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor], angle_state: Tensor,
                        ssm_state: Tensor, k_state: Tensor,
                        v_state: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Layouts as the public function's; ADT .. Angles, MIMO_*, D, angle_state and ssm_state already in the
    accumulation dtype; MIMO_Z given with Z -> (out, angle, ssm, k states)."""
    out, aout, h_out, kout = _outputs(V, Q, Angles, MIMO_Out is None)
    if V.shape[0] == 0:
        return out, aout, h_out, kout
    siso = _step_dims(Q[:, 0], V, Angles, D, Z, k_state[:, 0], v_state)  # the dims the ranks share
    dims = MimoStepDims.cached(**siso.static(), mimo_rank=Q.shape[1], has_outproj=MIMO_Out is not None)
    acc = _acc(V)
    opt = lambda t, ndim: prepare(t) if t is not None else dummy(V.device, acc, ndim)  # noqa: E731
    kernel_for(OP, "mimo_step", V.device, dims)(
        prepare(Q), prepare(K), prepare(V), prepare(ADT), prepare(DT), prepare(Trap), prepare(Q_bias),
        prepare(K_bias), prepare(MIMO_V), opt(MIMO_Z if Z is not None else None, 3), opt(MIMO_Out, 3),
        prepare(Angles), opt(D, 1), prepare(Z) if Z is not None else dummy(V.device, V.dtype, 3),
        prepare(angle_state), prepare(ssm_state), prepare(k_state), prepare(v_state), out, aout, h_out, kout,
        torch.empty_like(kout))  # + rotated q
    return out, aout, h_out, kout


@mamba3_mimo_step_op.register_fake
def _(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z, angle_state, ssm_state,
      k_state, v_state):
    return _outputs(V, Q, Angles, MIMO_Out is None)


def _check_mimo(Q, K, V, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Z, states) -> None:
    """TypeError / ValueError naming the argument for what the rank axis adds (Q, K (batch, R, nheads_qk,
    headdim_qk), the biases (nheads, R, headdim_qk), MIMO_* (nheads, R, headdim_v), the K state (batch, R,
    nheads, headdim_qk)); the SISO step's checks (``mamba3.py``'s ``_check``) then see rank 0's slices."""
    check_tensor("V", V, ndim=3, dtypes=FLOATS + (torch.float64,))
    (batch, nheads, P), wide = V.shape, V.dtype == torch.float64
    anyf = (torch.float64,) if wide else FLOATS + (torch.float64,)
    check_tensor("Q", Q, ndim=4, dtypes=(torch.float64,) if wide else FLOATS, device=V.device)
    R, N = Q.shape[1], Q.shape[3]
    if Q.shape[0] != batch or R < 1:
        raise ValueError(f"Q: expected (batch={batch}, mimo_rank >= 1, nheads_qk, headdim_qk), got {tuple(Q.shape)}")
    check_tensor("K", K, dtypes=(Q.dtype,), device=V.device)
    check_shape("K", K, Q.shape)
    for name, t in (("Q_bias", Q_bias), ("K_bias", K_bias)):
        check_tensor(name, t, dtypes=anyf, device=V.device)
        check_shape(name, t, (nheads, R, N))
    for name, t in (("MIMO_V", MIMO_V), ("MIMO_Z", MIMO_Z), ("MIMO_Out", MIMO_Out)):
        if t is None and (name == "MIMO_V" or (name == "MIMO_Z" and Z is not None)):
            raise ValueError(f"{name}: required{' with Z' if name == 'MIMO_Z' else ''}, got None")
        if t is not None:
            check_tensor(name, t, dtypes=anyf, device=V.device)
            check_shape(name, t, (nheads, R, P))
    if not isinstance(states, (tuple, list)) or len(states) != 4:
        raise TypeError("Input_States: expected (angle_state, ssm_state, k_state, v_state) or None")
    check_tensor("Input_States (k_state)", states[2], dtypes=(torch.float64,) if wide else anyf, device=V.device)
    check_shape("Input_States (k_state)", states[2], (batch, R, nheads, N))


def mamba3_mimo_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D=None, Z=None,
                     Input_States=None):
    """One Mamba-3 MIMO decode step (mamba_ssm's ``Mamba3.step`` with ``is_mimo``, its rotary and CuTe step
    kernels' math, tvm_mamba.reference.mamba3_mimo.mamba3_mimo_step_ref).

    Q, K: (batch, R, nheads_qk, headdim_qk); V, Z: (batch, nheads, headdim_v); ADT, DT, Trap: (batch, nheads);
    Q_bias, K_bias: (nheads, R, headdim_qk); MIMO_V, MIMO_Z, MIMO_Out: (nheads, R, headdim_v) (MIMO_Z needed with
    Z only; MIMO_Out None: no down projection); Angles: (batch, nheads, headdim_angles), 1 <= headdim_angles <=
    headdim_qk // 2; D: (nheads,); Input_States: (angle (batch, nheads, headdim_angles), ssm (batch, nheads,
    headdim_v, headdim_qk), k (batch, R, nheads, headdim_qk), v (batch, nheads, headdim_v)), None = zeros.
    nheads % nheads_qk == 0. -> (out (batch, nheads, headdim_v), or (batch, R, nheads, headdim_v) without
    MIMO_Out, in V's dtype; [angle, ssm, k states (float32), V]).

    theta' = (theta + pi tanh(Angles) DT) mod 2 pi; q_r, k_r = Rh(theta') (Q_r + Q_bias_r), Rh(theta') (K_r +
    K_bias_r) (halved pairs (i, i + headdim_qk / 2)); x_r = V MIMO_V_r; h' = exp(ADT) h + exp(ADT) DT
    (1 - sigmoid(Trap)) sum_r (v_state MIMO_V_r) k_state_r^T + DT sigmoid(Trap) sum_r x_r k_r^T;
    y_r = (h' q_r + D x_r) silu(Z MIMO_Z_r); out = sum_r MIMO_Out_r y_r. The input states are not modified.
    """
    if Input_States is None:
        check_tensor("V", V, ndim=3, dtypes=FLOATS + (torch.float64,))
        check_tensor("Q", Q, ndim=4)
        check_tensor("Angles", Angles, ndim=3)
        (batch, nheads, P), (R, N), S, acc = V.shape, (Q.shape[1], Q.shape[3]), Angles.shape[2], _acc(V)
        Input_States = (V.new_zeros(batch, nheads, S, dtype=acc), V.new_zeros(batch, nheads, P, N, dtype=acc),
                        V.new_zeros(batch, R, nheads, N, dtype=acc), V.new_zeros(batch, nheads, P))
    _check_mimo(Q, K, V, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Z, Input_States)
    angle_state, ssm_state, k_state, v_state = Input_States
    _check(Q[:, 0], K[:, 0], V, ADT, DT, Trap, Q_bias[:, 0], K_bias[:, 0], Angles, D, Z,
           (angle_state, ssm_state, k_state[:, 0], v_state), seq=False)
    acc = _acc(V)
    w = lambda t: None if t is None else t.to(acc)  # noqa: E731
    out, aout, h_out, kout = run_op(
        mamba3_mimo_step_op, Q, K, V, w(ADT), w(DT), w(Trap), w(Q_bias), w(K_bias), w(MIMO_V),
        w(MIMO_Z) if Z is not None else None, w(MIMO_Out), w(Angles), w(D), Z, w(angle_state), w(ssm_state),
        k_state, v_state)
    return out, [aout, h_out, kout, V]
