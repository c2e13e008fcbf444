"""mamba3_siso_step and mamba3_siso_combined (forward): mamba_ssm 2.3.2.post1's Mamba-3 SISO decode step
(ops/triton/mamba3/mamba3_siso_step.py) and chunked forward (mamba3_siso_combined.py) on the TVM kernels of
compute/mamba3 and compute/ssd (docs/mamba3.md).

Ops (namespace ``tvm_mamba``), each with a fake (meta) implementation: ``mamba3_siso_step`` -> (out, new angle
state, new ssm state, new k state); no autograd: upstream's step kernel has none either (it serves decoding).
``mamba3_siso_fwd`` -> (out, final angle, ssm and k states): the preprocess kernel, then the SSD pieces
bmm_chunk (q . k per head), chunk_state (scale as dt'), state_passing and chunk_scan (``diag_skip``). Its
backward is not implemented yet: the public function refuses inputs that require grad.

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

from ..compute._mamba3_dims import PreDims, StepDims
from ..compute._ssd_dims import BmmDims, PassingDims, ScanDims, StateDims
from ._dlpack import FLOATS, check_shape, check_size, check_tensor, dummy, kernel_for, prepare, run_op, tvm_dtype

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


def _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, states, seq: bool) -> None:
    """TypeError / ValueError naming the argument for a wrong type, dtype, shape or device. ``seq``: the
    chunked forward's layouts (a seqlen axis: Q, K, V, Z, Angles (batch, seqlen, ...); ADT, DT, Trap (batch,
    nheads, seqlen); no float64), else the decode step's."""
    check_tensor("V", V, ndim=4 if seq else 3, dtypes=FLOATS if seq else FLOATS + (torch.float64,))
    batch, nheads, P = V.shape[0], V.shape[-2], V.shape[-1]
    L = (V.shape[1],) if seq else ()  # the time axis of the activations
    wide = V.dtype == torch.float64
    io = (torch.float64,) if wide else FLOATS
    anyf = io + (() if wide else (torch.float64,))  # widened to the accumulation dtype
    check_tensor("Q", Q, ndim=V.dim(), dtypes=io, device=V.device)
    nheads_qk, N = Q.shape[-2], Q.shape[-1]
    if tuple(Q.shape[:-2]) != (batch, *L):
        raise ValueError(f"Q: expected batch{', seqlen' if seq else ''} {(batch, *L)} (V's), got shape {tuple(Q.shape)}")
    if nheads_qk < 1 or nheads % nheads_qk:
        raise ValueError(f"Q: nheads_qk={nheads_qk} must divide nheads={nheads} (V's heads)")
    if N % 2 or N < 2:
        raise ValueError(f"Q: headdim_qk={N} must be even (rotary pairs)")
    check_tensor("K", K, dtypes=(Q.dtype,), device=V.device)
    check_shape("K", K, Q.shape)
    for name, t in (("ADT", ADT), ("DT", DT), ("Trap", Trap)):
        check_tensor(name, t, dtypes=anyf, device=V.device)
        check_shape(name, t, (batch, nheads, *L))
    for name, t in (("Q_bias", Q_bias), ("K_bias", K_bias)):
        check_tensor(name, t, dtypes=anyf, device=V.device)
        check_shape(name, t, (nheads, N))
    check_tensor("Angles", Angles, ndim=V.dim(), dtypes=anyf, device=V.device)
    S = Angles.shape[-1]
    if not 1 <= S <= N // 2:
        raise ValueError(f"Angles: headdim_angles={S} must be in [1, headdim_qk // 2 = {N // 2}]")
    check_shape("Angles", Angles, (batch, *L, nheads, S))
    if D is not None:
        check_tensor("D", D, dtypes=anyf, device=V.device)
        check_shape("D", D, (nheads,))
    if Z is not None:
        check_tensor("Z", Z, dtypes=io, device=V.device)
        check_shape("Z", Z, V.shape)
    if states is None and seq:
        return
    if not isinstance(states, (tuple, list)) or len(states) != 4:
        raise TypeError("Input_States: expected (angle_state, ssm_state, k_state, v_state) or None")
    shapes = ((batch, nheads, S), (batch, nheads, P, N), (batch, nheads, N), (batch, nheads, P))
    for name, t, shape, dts in zip(("angle_state", "ssm_state", "k_state", "v_state"), states, shapes,
                                   (anyf, anyf, anyf if seq else io, io)):
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
    _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States, seq=False)
    acc = _acc(V)
    w = lambda t: None if t is None else t.to(acc)  # noqa: E731
    angle_state, ssm_state, k_state, v_state = Input_States
    out, aout, h_out, kout = run_op(mamba3_siso_step_op, Q, K, V, w(ADT), w(DT), w(Trap), w(Q_bias), w(K_bias),
                                    w(Angles), w(D), Z, w(angle_state), w(ssm_state), k_state, v_state)
    return out, [aout, h_out, kout, V]


# --- the SISO chunked forward (mamba3_siso_combined) --------------------------------------------------------

def _fwd_outputs(V: Tensor, Q: Tensor, Angles: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised (out, final angle, ssm, k states) of the chunked forward (also the fake's results)."""
    (batch, _, nheads, P), N, S = V.shape, Q.shape[3], Angles.shape[3]
    f32 = torch.float32
    return (V.new_empty(V.shape), V.new_empty((batch, nheads, S), dtype=f32),
            V.new_empty((batch, nheads, P, N), dtype=f32), V.new_empty((batch, nheads, N), dtype=f32))


@torch.library.custom_op("tvm_mamba::mamba3_siso_fwd", mutates_args=())
def mamba3_siso_fwd_op(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
                       K_bias: Tensor, Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor],
                       angle_state: Optional[Tensor], ssm_state: Optional[Tensor], k_state: Optional[Tensor],
                       v_state: Optional[Tensor], chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Layouts as the public function's; ADT .. Angles, D, angle_state and ssm_state float32, Z in V's dtype,
    seqlen >= 1 -> (out (batch, seqlen, nheads, headdim_v) in V's dtype, final angle, ssm, k states f32)."""
    out, aout, final, kfin = _fwd_outputs(V, Q, Angles)
    if V.shape[0] == 0:
        return out, aout, final, kfin
    (batch, seqlen, H, P), N, Qc = V.shape, Q.shape[3], chunk_size
    nchunks, dev, f32, has_init = -(-seqlen // Qc), V.device, torch.float32, angle_state is not None
    pre = PreDims.cached(nheads=H, nheads_qk=Q.shape[2], headdim_qk=N, headdim_v=P, headdim_angles=Angles.shape[3],
                         chunk_size=Qc, has_D=D is not None, has_init=has_init, qk_dtype=tvm_dtype(Q),
                         vstate_dtype=tvm_dtype(v_state) if has_init else "float32",
                         kstate_dtype=tvm_dtype(k_state) if has_init and k_state.dtype != f32 else None)
    kern = lambda direction, dims, op="ssd": kernel_for(op, direction, dev, dims, batch=batch, seqlen=seqlen)  # noqa
    q, k = (V.new_empty((batch, seqlen, H, N), dtype=f32) for _ in range(2))
    dA_cs, scale, skip = (V.new_empty((batch, H, nchunks, Qc), dtype=f32) for _ in range(3))
    init = V.new_empty((batch, H, P, N), dtype=f32) if has_init else dummy(dev, f32, 4)
    opt = lambda t, dtype, ndim: prepare(t) if t is not None else dummy(dev, dtype, ndim)  # noqa: E731
    kern("siso_preprocess", pre, OP)(
        prepare(Q), prepare(K), prepare(ADT), prepare(DT), prepare(Trap), prepare(Q_bias), prepare(K_bias),
        prepare(Angles), opt(D, f32, 1), opt(angle_state, f32, 3), opt(ssm_state, f32, 4), opt(k_state, f32, 3),
        opt(v_state, f32, 3), q, k, dA_cs, scale, skip, aout, init)
    chunk = dict(nheads=H, ngroups=H, headdim=P, dstate=N, chunk_size=Qc, x_dtype=tvm_dtype(V), bc_dtype="float32")
    cb = V.new_empty((batch, nchunks, H, Qc, Qc), dtype=f32)
    kern("bmm_chunk", BmmDims.cached(H, N, Qc, "float32"))(k, q, cb)
    states, states_in = (V.new_empty((batch, nchunks, H, P, N), dtype=f32) for _ in range(2))
    seq = dummy(dev, torch.int32, 2)
    Vc = prepare(V)
    kern("chunk_state", StateDims.cached(**chunk))(Vc, k, scale, dA_cs, seq, states)
    kern("state_passing", PassingDims.cached(nheads=H, headdim=P, dstate=N, chunk_size=Qc, has_init=has_init))(
        states, dA_cs, init, seq, states_in, final)
    y_pre = torch.empty_like(out) if Z is not None else dummy(dev, V.dtype, 4)
    scan = ScanDims.cached(**chunk, has_D=True, has_z=Z is not None, has_init=has_init, diag_skip=True)
    kern("chunk_scan", scan)(Vc, opt(Z, V.dtype, 4), cb, q, scale, dA_cs, states_in, skip, seq, out, y_pre)
    kfin.copy_(k[:, seqlen - 1])
    return out, aout, final, kfin


@mamba3_siso_fwd_op.register_fake
def _(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, chunk_size):
    return _fwd_outputs(V, Q, Angles)


def _check_chunked(V: Tensor, N: int, chunk_size: int) -> None:
    """What the SSD pieces add to the argument checks: seqlen >= 1, headdim_qk (their dstate) and headdim_v
    (their headdim) up to 256, and every workspace within 32-bit indexing."""
    (batch, seqlen, nheads, P), nchunks = V.shape, -(-V.shape[1] // chunk_size)
    if seqlen == 0:
        raise ValueError("V: seqlen must be at least 1")
    for name, what, v in (("Q", "headdim_qk", N), ("V", "headdim_v", P)):
        if v > 256:
            raise ValueError(f"{name}: {what}={v}; the chunked forward supports up to 256")
    check_size("q / k workspace (batch x seqlen x nheads x headdim_qk)", batch * seqlen * nheads * N)
    check_size("chunk states (batch x nchunks x nheads x headdim_v x headdim_qk)", batch * nchunks * nheads * P * N)
    check_size("q . k per chunk (batch x nchunks x nheads x chunk_size^2)", batch * nchunks * nheads * chunk_size ** 2)


def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def mamba3_siso_combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None,
                         chunk_size=64, return_final_states=False, cu_seqlens=None):
    """Mamba-3 SISO chunked forward (mamba_ssm.ops.triton.mamba3.mamba3_siso_combined, 2.3.2.post1's signature).

    Q, K: (batch, seqlen, nheads_qk, headdim_qk); V, Z: (batch, seqlen, nheads, headdim_v); ADT, DT, Trap:
    (batch, nheads, seqlen) (Trap a logit); Q_bias, K_bias: (nheads, headdim_qk); Angles: (batch, seqlen,
    nheads, headdim_angles), 1 <= headdim_angles <= headdim_qk // 2; D: (nheads,); Input_States: (angle
    (batch, nheads, headdim_angles), ssm (batch, nheads, headdim_v, headdim_qk), k (batch, nheads, headdim_qk),
    v (batch, nheads, headdim_v)) or None (zeros); chunk_size: 1 .. 256; nheads % nheads_qk == 0
    -> out (batch, seqlen, nheads, headdim_v) in V's dtype, and with return_final_states the final angle, ssm,
    k states (float32) and v state (V's last position, V's dtype) too: (out, angle, ssm, k, v).

    The recurrence of tvm_mamba.reference.mamba3 (docs/mamba3.md), computed chunk by chunk. Not yet:
    cu_seqlens (NotImplementedError) and the backward (inputs requiring grad: NotImplementedError).
    """
    if cu_seqlens is not None:
        raise NotImplementedError("cu_seqlens: variable-length mamba3_siso_combined is not implemented yet")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 1 <= chunk_size <= 256:
        raise ValueError(f"chunk_size: must be an int in 1..256, got {chunk_size!r}")
    _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States, seq=True)
    _check_chunked(V, Q.shape[-1], chunk_size)
    states = tuple(Input_States) if Input_States is not None else (None,) * 4
    if _grad_needed(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, *states):
        raise NotImplementedError("mamba3_siso_combined: the backward is not implemented yet; call it with inputs "
                                  "that do not require grad (or under torch.no_grad())")
    w = lambda t: None if t is None else t.to(torch.float32)  # noqa: E731
    angle, ssm, kst, vst = states
    kst = kst.to(torch.float32) if kst is not None and kst.dtype == torch.float64 else kst
    out, aout, final, kfin = run_op(mamba3_siso_fwd_op, Q, K, V, w(ADT), w(DT), w(Trap), w(Q_bias), w(K_bias),
                                    w(Angles), w(D), None if Z is None else Z.to(V.dtype), w(angle), w(ssm), kst,
                                    vst, chunk_size)
    if not return_final_states:
        return out
    return out, aout, final, kfin, V[:, -1].clone(memory_format=torch.contiguous_format)
