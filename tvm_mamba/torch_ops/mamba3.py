"""mamba3_siso_step and mamba3_siso_combined (forward and backward): mamba_ssm 2.3.2.post1's Mamba-3 SISO decode step
(ops/triton/mamba3/mamba3_siso_step.py) and chunked forward (mamba3_siso_combined.py) on the TVM kernels of
compute/mamba3 and compute/ssd (docs/mamba3.md).

Ops (namespace ``tvm_mamba``), each with a fake (meta) implementation: ``mamba3_siso_step`` -> (out, new angle
state, new ssm state, new k state); no autograd: upstream's step kernel has none either (it serves decoding).
``mamba3_siso_fwd`` -> (out, final angle, ssm and k states, y_pre): the preprocess kernel, then the SSD pieces
bmm_chunk (q . k per head), chunk_state (scale as dt'), state_passing and chunk_scan (``diag_skip``); its
autograd formula is ``mamba3_siso_bwd``: the forward's pieces before the chunk scan recomputed (nothing but
y_pre is kept), the SSD pieces' backward (chunk_scan_bwd_dstates, state_passing_bwd, chunk_scan_bwd with
``diag_skip``), then the preprocess's backward kernel; per-head q / k gradients summed over each Q/K group
by ssd_head_sum, batch / chunk partials by fixed-order torch sums.

Dtypes: Q and K one float dtype, V (and out) a float dtype, Z, the K state and the V state any float
(read in their dtypes). ADT, DT, Trap, Q_bias, K_bias, Angles, D and the angle / ssm states are widened
to float32 (a copy only when they are not float32 already: upstream's module passes them in float32, except
Trap in the model dtype, (batch, nheads) values). New states are float32, as upstream's. float64 V runs the
float64 kernel and needs every tensor float64.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from ..compute.mamba3.dims import PAIR_STEPS, PreDims, StepDims
from ..compute.ssd.dims import (BmmDims, DstatesDims, HeadSumDims, PassingBwdDims, PassingDims, ScanBwdDims, ScanDims,
                                 StateDims, VarlenDims)
from ._dlpack import FLOATS, check_shape, check_size, check_tensor, dummy, kernel_for, prepare, run_op, tvm_dtype
from ._packed_pad import PackedPad
from .ssd import seq_idx_of, validate_cu_seqlens

OP = "mamba3"
F32 = torch.float32


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


def _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, states, seq: bool, nstates=None) -> None:
    """TypeError / ValueError naming the argument for a wrong type, dtype, shape or device. ``seq``: the
    chunked forward's layouts (a seqlen axis: Q, K, V, Z, Angles (batch, seqlen, ...); ADT, DT, Trap (batch,
    nheads, seqlen); no float64), else the decode step's. ``nstates``: the states' rows (packed sequences:
    nseq; default batch)."""
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
    rows = batch if nstates is None else nstates
    shapes = ((rows, nheads, S), (rows, nheads, P, N), (rows, nheads, N), (rows, nheads, P))
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


# --- the SISO chunked forward (mamba3_siso_combined) and its backward ----------------------------------------

class _Chunked:
    """One chunked call's dims and the forward pieces both directions run: the preprocess (rotated per-head q, k;
    dA_cs, scale, skip; the initial state), q . k per chunk, the chunk states and the states entering each
    chunk. The SSD pieces see x = V, B = k, C = q with one "group" per head (the biases make q, k per head).
    Packed sequences (seq_idx (1, seqlen) int32 and cu_seqlens (nseq + 1,) int32 given): every kernel masks
    across sequences with seq_idx, and the final states are per sequence (nseq rows). ``step_group`` > 1
    (Mamba-3 MIMO, torch_ops/mamba3_mimo.py: V is then the flattened (step, rank) x): the chunk scan and its
    backward sum over strictly earlier step groups (``ScanDims.step_group``)."""

    def __init__(self, Q, V, Angles, D, angle_state, k_state, v_state, chunk_size, seq_idx=None, cu_seqlens=None,
                 step_group=1):
        (self.batch, self.seqlen, self.H, self.P), self.N, self.Qc = V.shape, Q.shape[3], chunk_size
        self.nchunks, self.dev, self.has_init = -(-self.seqlen // chunk_size), V.device, angle_state is not None
        self.has_seq, self.cu = seq_idx is not None, cu_seqlens
        self.nseq = cu_seqlens.shape[0] - 1 if self.has_seq else self.batch
        self.pre = PreDims.cached(
            nheads=self.H, nheads_qk=Q.shape[2], headdim_qk=self.N, headdim_v=self.P, headdim_angles=Angles.shape[3],
            chunk_size=chunk_size, has_D=D is not None, has_init=self.has_init, qk_dtype=tvm_dtype(Q),
            vstate_dtype=tvm_dtype(v_state) if self.has_init else "float32",
            kstate_dtype=tvm_dtype(k_state) if self.has_init and k_state.dtype != F32 else None,
            has_seq_idx=self.has_seq)
        self.chunk = dict(nheads=self.H, ngroups=self.H, headdim=self.P, dstate=self.N, chunk_size=chunk_size,
                          has_seq_idx=self.has_seq, x_dtype=tvm_dtype(V), bc_dtype="float32")
        self.seq = prepare(seq_idx) if self.has_seq else dummy(self.dev, torch.int32, 2)
        self.grouped = dict(step_group=step_group) if step_group > 1 else {}  # ScanDims' (omitted at 1)

    def kernel(self, direction, dims, op="ssd"):
        return kernel_for(op, direction, self.dev, dims, batch=self.batch, seqlen=self.seqlen)

    def new(self, *shape, dtype=F32):
        return torch.empty(shape, device=self.dev, dtype=dtype)

    def opt(self, t, ndim, dtype=F32):
        return prepare(t) if t is not None else dummy(self.dev, dtype, ndim)

    def passing(self, **flags):
        return dict(nheads=self.H, headdim=self.P, dstate=self.N, chunk_size=self.Qc, has_init=self.has_init,
                    has_seq_idx=self.has_seq, **flags)

    def last_rows(self):
        """Packed sequences: (each sequence's last position (nseq,) int64, 1 / 0 per sequence: non-empty)."""
        ends = self.cu[1:].long()
        return (ends - 1).clamp(min=0), (ends > self.cu[:-1].long())

    def forward_pieces(self, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, angle_state, ssm_state, k_state,
                       v_state, aout, final=None):
        """The pieces before the chunk scan; writes the final angle states into ``aout`` (nseq, nheads,
        headdim_angles) and, when ``final`` is given, the final ssm states into it (nseq, nheads, headdim_v,
        headdim_qk) -> p with q, k (batch, seqlen, nheads, headdim_qk), dA_cs / scale / skip (batch, nheads,
        nchunks, chunk), cb, states_in (batch, nchunks, nheads, headdim_v, headdim_qk), all float32."""
        p = self.preprocess(Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, D, angle_state, ssm_state, k_state,
                            v_state, aout)
        return self.ssd_pieces(p, V, final)

    def preprocess(self, Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, D, angle_state, ssm_state, k_state, v_state,
                   aout):
        """The preprocess kernel (final angle states into ``aout``) -> p with q, k, dA_cs, scale, skip and init
        (the initial ssm state, or a placeholder), float32 (layouts: ``forward_pieces``)."""
        b, L, H, N, Qc, nc = self.batch, self.seqlen, self.H, self.N, self.Qc, self.nchunks
        p = SimpleNamespace(q=self.new(b, L, H, N), k=self.new(b, L, H, N), dA_cs=self.new(b, H, nc, Qc),
                            scale=self.new(b, H, nc, Qc), skip=self.new(b, H, nc, Qc))
        p.init = self.new(b, H, self.P, N) if self.has_init else dummy(self.dev, F32, 4)
        self.kernel("siso_preprocess", self.pre, OP)(
            prepare(Q), prepare(K), prepare(ADT), prepare(DT), prepare(Trap), prepare(Q_bias), prepare(K_bias),
            prepare(Angles), self.opt(D, 1), self.opt(angle_state, 3), self.opt(ssm_state, 4), self.opt(k_state, 3),
            self.opt(v_state, 3), p.q, p.k, p.dA_cs, p.scale, p.skip, aout, p.init, self.seq)
        return p

    def ssd_pieces(self, p, V, final=None):
        """The SSD pieces before the chunk scan on p's q, k, dA_cs, scale and init (x = V): adds p.cb and
        p.states_in; the final ssm states into ``final`` when given (``forward_pieces``)."""
        b, H, N, Qc, nc, init = self.batch, self.H, self.N, self.Qc, self.nchunks, p.init
        p.cb = self.new(b, nc, H, Qc, Qc)
        self.kernel("bmm_chunk", BmmDims.cached(H, N, Qc, "float32"))(p.k, p.q, p.cb)
        states, p.states_in = self.new(b, nc, H, self.P, N), self.new(b, nc, H, self.P, N)
        self.kernel("chunk_state", StateDims.cached(**self.chunk))(prepare(V), p.k, p.scale, p.dA_cs, self.seq, states)
        last = final if final is not None and not self.has_seq else self.new(b, H, self.P, N)
        self.kernel("state_passing", PassingDims.cached(**self.passing()))(states, p.dA_cs, init, self.seq,
                                                                            p.states_in, last)
        if final is not None and self.has_seq:  # each packed sequence's final state (ssd_chunk_state_varlen)
            self.kernel("chunk_state_varlen", VarlenDims.cached(**self.chunk))(
                prepare(V)[0], p.k[0], p.scale[0], p.dA_cs[0], p.states_in[0], self.cu, self.seq[0], final)
        return p


def _fwd_outputs(V: Tensor, Q: Tensor, Angles: Tensor, Z, cu_seqlens) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised (out, final angle, ssm, k states (a row per sequence: batch, or nseq with cu_seqlens; the
    angle states zeroed), y_pre) of the chunked forward (also the fake's results); y_pre (the output before
    the gate, for dZ) is V-shaped with Z, else (0,)."""
    (batch, _, nheads, P), N, S = V.shape, Q.shape[3], Angles.shape[3]
    nseq = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (V.new_empty(V.shape), V.new_zeros((nseq, nheads, S), dtype=F32),
            V.new_empty((nseq, nheads, P, N), dtype=F32), V.new_empty((nseq, nheads, N), dtype=F32),
            V.new_empty(V.shape) if Z is not None else V.new_empty((0,)))


@torch.library.custom_op("tvm_mamba::mamba3_siso_fwd", mutates_args=())
def mamba3_siso_fwd_op(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
                       K_bias: Tensor, Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor],
                       angle_state: Optional[Tensor], ssm_state: Optional[Tensor], k_state: Optional[Tensor],
                       v_state: Optional[Tensor], chunk_size: int, seq_idx: Optional[Tensor] = None,
                       cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Layouts as the public function's; ADT .. Angles, D, angle_state and ssm_state float32, Z in V's dtype,
    seqlen >= 1; packed sequences: seq_idx (1, seqlen) and cu_seqlens (nseq + 1,) int32, no input states
    -> (out (batch, seqlen, nheads, headdim_v) in V's dtype, final angle, ssm, k states f32 (per batch row, or
    per sequence), y_pre)."""
    out, aout, final, kfin, y_pre = _fwd_outputs(V, Q, Angles, Z, cu_seqlens)
    if V.shape[0] == 0:
        return out, aout, final, kfin, y_pre
    c = _Chunked(Q, V, Angles, D, angle_state, k_state, v_state, chunk_size, seq_idx, cu_seqlens)
    p = c.forward_pieces(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, angle_state, ssm_state, k_state,
                         v_state, aout, final)
    chunk_scan(c, p, V, Z, out, y_pre)
    if c.has_seq:
        last, filled = c.last_rows()
        torch.mul(p.k[0].index_select(0, last), filled[:, None, None], out=kfin)
    else:
        kfin.copy_(p.k[:, c.seqlen - 1])
    return out, aout, final, kfin, y_pre


def chunk_scan(c: _Chunked, p, V, Z, out, y_pre) -> None:
    """The chunk scan (diag_skip; c's step_group) at x = V, B = k, C = q into out (and y_pre with Z)."""
    scan = ScanDims.cached(**c.chunk, has_D=True, has_z=Z is not None, has_init=c.has_init, diag_skip=True,
                           **c.grouped)
    c.kernel("chunk_scan", scan)(prepare(V), c.opt(Z, 4, V.dtype), p.cb, p.q, p.scale, p.dA_cs, p.states_in, p.skip,
                                 c.seq, out, y_pre if Z is not None else dummy(c.dev, V.dtype, 4))


@mamba3_siso_fwd_op.register_fake
def _(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, chunk_size,
      seq_idx=None, cu_seqlens=None):
    return _fwd_outputs(V, Q, Angles, Z, cu_seqlens)


def _ssd_bwd(c: _Chunked, p, dout, V, Z, y_pre, dfinal):
    """The SSD pieces' backward at x = V, B = k, C = q (diag_skip) -> g with dV, dZ (or None), dq, dk
    (per head), dscale, ddA_step, dskip, ddecay and dinit (or None)."""
    b, H, P, N, Qc, nc, xd = c.batch, c.H, c.P, c.N, c.Qc, c.nchunks, V.dtype
    has_z, g = Z is not None, SimpleNamespace()
    dy, Vc, z = prepare(dout.to(xd)), prepare(V), c.opt(Z, 4, xd)
    dsl = c.new(b, nc, H, P, N)
    g.dZ = torch.empty_like(Vc) if has_z else None
    c.kernel("chunk_scan_bwd_dstates", DstatesDims.cached(**c.chunk, has_z=has_z))(
        dy, z, prepare(y_pre) if has_z else dummy(c.dev, xd, 4), p.q, p.dA_cs, c.seq, dsl,
        g.dZ if has_z else dummy(c.dev, xd, 4))
    dso, g.ddecay = c.new(b, nc, H, P, N), c.new(b, H, nc)
    g.dinit = c.new(b, H, P, N) if c.has_init else None
    c.kernel("state_passing_bwd", PassingBwdDims.cached(**c.passing(has_dfinal=dfinal is not None)))(
        p.states_in, dsl, p.dA_cs, c.opt(dfinal, 4), c.seq, dso, c.opt(g.dinit, 4), g.ddecay)
    g.dV = torch.empty_like(Vc)
    g.dq, g.dk = c.new(b, c.seqlen, H, N), c.new(b, c.seqlen, H, N)
    g.dscale, g.ddA, g.dskip = (c.new(b, H, nc, Qc) for _ in range(3))
    dims = ScanBwdDims.cached(**c.chunk, has_D=True, has_z=has_z, diag_skip=True, **c.grouped)
    c.kernel("chunk_scan_bwd", dims)(
        Vc, z, dy, p.k, p.q, p.cb, p.scale, p.dA_cs, p.states_in, dso, p.skip, c.seq, g.dV, g.dk, g.dq, g.dscale,
        g.ddA, g.dskip, c.new(b, nc, H, Qc, Qc))  # workspace: (g x^T) K scale, one "group" per head
    return g


def _group_sum(c: _Chunked, per_head: Tensor, like: Tensor) -> Tensor:
    """(batch, seqlen, nheads, headdim_qk) f32 per-head gradients -> summed over each Q/K group's heads in head
    order, in ``like``'s dtype (Q / K)."""
    HQ = like.shape[2]
    if HQ == c.H and like.dtype == F32:
        return per_head
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    c.kernel("head_sum", HeadSumDims.cached(c.H, HQ, c.N, tvm_dtype(like)))(per_head, out)
    return out


_GRADS = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z", "angle_state", "ssm_state",
          "k_state", "v_state")


@torch.library.custom_op("tvm_mamba::mamba3_siso_bwd", mutates_args=())
def mamba3_siso_bwd_op(dout: Tensor, daout: Optional[Tensor], dfinal: Optional[Tensor], dkfin: Optional[Tensor],
                       Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
                       K_bias: Tensor, Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor],
                       angle_state: Optional[Tensor], ssm_state: Optional[Tensor], k_state: Optional[Tensor],
                       v_state: Optional[Tensor], y_pre: Optional[Tensor], chunk_size: int,
                       seq_idx: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> list[Tensor]:
    """Gradients of mamba3_siso_fwd for dout and the final angle / ssm / k states' gradients (None: zero), in
    ``_GRADS`` order, each in its input's dtype ((0,) for an absent input). Recomputes the forward's pieces
    before the chunk scan, runs the SSD pieces' backward (chunk_scan_bwd with diag_skip), then the
    preprocess's backward (the rotation, angle cumsum, trapezoid and skip gradients). Packed sequences with a
    gradient of the final ssm states: ``_padded_bwd`` (the packed pieces have no backward of those states)."""
    if V.shape[0] == 0:
        return _bwd_outputs(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state,
                            v_state, zero=True)
    if seq_idx is not None and dfinal is not None:
        return _padded_bwd(dout, daout, dfinal, dkfin, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, y_pre,
                           chunk_size, cu_seqlens)
    c = _Chunked(Q, V, Angles, D, angle_state, k_state, v_state, chunk_size, seq_idx, cu_seqlens)
    b, H, S = c.batch, c.H, Angles.shape[3]
    p = c.forward_pieces(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, angle_state, ssm_state, k_state,
                         v_state, c.new(c.nseq, H, S), None if c.has_seq else c.new(b, H, c.P, c.N))
    g = _ssd_bwd(c, p, dout, V, Z, y_pre, dfinal)
    if dkfin is not None and c.has_seq:
        last, filled = c.last_rows()
        g.dk[0].index_add_(0, last, dkfin * filled[:, None, None])
    elif dkfin is not None:
        g.dk[:, c.seqlen - 1] += dkfin
    r = preprocess_bwd(c, g, Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, angle_state, k_state, v_state, daout)
    e = lambda: V.new_empty((0,))  # noqa: E731  (one per absent input: outputs may not alias)
    cast = lambda t, like: t.to(like.dtype) if like is not None else e()  # noqa: E731
    return [_group_sum(c, r.dQh, Q), _group_sum(c, r.dKh, K), g.dV, r.dADT, r.dDT, r.dTrap, r.dQb.sum((0, 1)),
            r.dKb.sum((0, 1)), r.dAngles, cast(g.dskip.sum((0, 2, 3)), D), g.dZ if Z is not None else e(),
            r.dangle if c.has_init else e(), g.dinit if c.has_init else e(),
            cast(r.dkst, k_state) if c.has_init else e(), cast(r.dvst, v_state) if c.has_init else e()]


def preprocess_bwd(c: _Chunked, g, Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, angle_state, k_state, v_state,
                   daout) -> SimpleNamespace:
    """The preprocess's backward kernel from the SSD pieces' gradients g (dq, dk, dscale, ddA, dskip, ddecay,
    dinit, as ``_ssd_bwd`` gives them) and daout (the final angles' gradient, None: zero) -> r with dQh, dKh
    (per head), dADT, dDT, dTrap, dQb, dKb (parts per batch row and block of PAIR_STEPS steps, the caller sums
    them), dAngles and, with input states, dangle, dkst, dvst (float32)."""
    b, H, S, parts = c.batch, c.H, Angles.shape[3], -(-c.seqlen // PAIR_STEPS)
    r = SimpleNamespace(dQh=torch.empty_like(g.dq), dKh=torch.empty_like(g.dk), dAngles=c.new(*Angles.shape),
                        dQb=c.new(b, parts, H, c.N), dKb=c.new(b, parts, H, c.N))
    r.dADT, r.dDT, r.dTrap = (c.new(*ADT.shape) for _ in range(3))  # ADT may be a (transposed) view
    r.dangle, r.dkst, r.dvst = ((c.new(b, H, S), c.new(b, H, c.N), c.new(b, H, c.P)) if c.has_init
                                else (None, None, None))
    c.kernel("siso_preprocess_bwd", dataclasses.replace(c.pre, has_D=False), OP)(  # D is not read: one kernel
        prepare(Q), prepare(K), prepare(ADT), prepare(DT), prepare(Trap), prepare(Q_bias), prepare(K_bias),
        prepare(Angles), c.opt(angle_state, 3), c.opt(k_state, 3), c.opt(v_state, 3), g.dq, g.dk, g.dscale, g.ddA,
        g.dskip, g.ddecay, prepare(daout) if daout is not None else torch.zeros(c.nseq, H, S, device=c.dev),
        c.opt(g.dinit, 4), r.dQh, r.dKh, r.dADT, r.dDT, r.dTrap, r.dQb, r.dKb, r.dAngles, c.opt(r.dangle, 3),
        c.opt(r.dkst, 3), c.opt(r.dvst, 3), c.new(b, c.seqlen, H, S), c.new(b, H), c.seq)  # workspaces: gdt, c0
    return r


def _padded_bwd(dout, daout, dfinal, dkfin, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, y_pre, chunk_size,
                cu_seqlens) -> list[Tensor]:
    """mamba3_siso_bwd of packed sequences (no input states) with a gradient of their final ssm states
    (nseq, ...): the chunk_state_varlen piece that wrote those states has no backward kernel, so the backward
    runs on the left-padded batch (PackedPad: zeros are identity steps), whose rows end at each sequence's
    last position and so carry its final states, and the gradients are gathered back to the packed
    positions. Costs nseq x the longest sequence positions instead of seqlen."""
    pp = PackedPad(cu_seqlens, V.shape[1])
    t1 = lambda t: pp.pad(t, 1) if t is not None and t.numel() else t  # noqa: E731  (seqlen on axis 1)
    t2 = lambda t: pp.pad(t, 2)  # noqa: E731  (ADT, DT, Trap: seqlen on axis 2)
    g = mamba3_siso_bwd_op(t1(dout), daout, dfinal, dkfin, t1(Q), t1(K), t1(V), t2(ADT), t2(DT), t2(Trap), Q_bias,
                           K_bias, t1(Angles), D, t1(Z), None, None, None, None, t1(y_pre), chunk_size)
    u1 = lambda t: pp.unpad(t, 1).contiguous() if t.numel() else t  # noqa: E731
    u2 = lambda t: pp.unpad(t, 2).contiguous()  # noqa: E731
    return [u1(g[0]), u1(g[1]), u1(g[2]), u2(g[3]), u2(g[4]), u2(g[5]), g[6], g[7], u1(g[8]), g[9], u1(g[10]),
            *g[11:]]


def _packed_with_states(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, states, chunk_size, return_final,
                        cu_seqlens):
    """mamba3_siso_combined of packed sequences each from its own row of the input states, on the left-padded
    batch (PackedPad), differentiable through pad / unpad. The input K / V states' trapezoid term
    DT (1 - sigmoid(Trap)) v_state k_state^T belongs to the sequence's first step, which padding moves away
    from the row's first position: it is folded into the ssm state here (K / V states passed as zeros). An
    empty sequence's final states are its input states."""
    pp = PackedPad(cu_seqlens, V.shape[1])
    angle, ssm, kst, vst = states
    beta0 = pp.at_first(DT, 2).float() * (1 - torch.sigmoid(pp.at_first(Trap, 2).float())) * pp.nonempty[:, None]
    ssm = ssm.float() + beta0[..., None, None] * vst.float()[..., :, None] * kst.float()[..., None, :]
    t1, t2 = (lambda t: None if t is None else pp.pad(t, 1)), (lambda t: pp.pad(t, 2))
    out, aout, final, kfin, vfin = mamba3_siso_combined(
        t1(Q), t1(K), t1(V), t2(ADT), t2(DT), t2(Trap), Q_bias, K_bias, t1(Angles), D, t1(Z),
        (angle, ssm, torch.zeros_like(kst), torch.zeros_like(vst)), chunk_size, True)
    out = pp.unpad(out, 1)
    if not return_final:
        return out
    keep = pp.nonempty[:, None, None]
    return (out, aout, final, torch.where(keep, kfin, kst.to(kfin.dtype)), torch.where(keep, vfin, vst.to(vfin.dtype)))


def _bwd_outputs(*inputs, zero: bool = False) -> list[Tensor]:
    """Gradients shaped and typed like ``inputs`` (``_GRADS`` order; (0,) for None), empty or zero."""
    make = torch.zeros_like if zero else torch.empty_like
    return [make(t, memory_format=torch.contiguous_format) if t is not None else inputs[2].new_empty((0,))
            for t in inputs]


@mamba3_siso_bwd_op.register_fake
def _(dout, daout, dfinal, dkfin, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state,
      k_state, v_state, y_pre, chunk_size, seq_idx=None, cu_seqlens=None):
    return _bwd_outputs(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state,
                        v_state)


def _setup_context(ctx, inputs, output):
    *tensors, chunk_size, seq_idx, cu_seqlens = inputs
    y_pre = output[4]
    ctx.mark_non_differentiable(y_pre)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, y_pre if tensors[10] is not None else None, seq_idx, cu_seqlens)
    ctx.chunk_size = chunk_size


def _backward(ctx, dout, daout, dfinal, dkfin, _dy_pre):
    *tensors, y_pre, seq_idx, cu_seqlens = ctx.saved_tensors
    if dout is None and daout is None and dfinal is None and dkfin is None:
        return (None,) * 18
    V = tensors[2]
    dout = torch.zeros_like(V) if dout is None else dout
    grads = torch.ops.tvm_mamba.mamba3_siso_bwd(dout, daout, dfinal, dkfin, *tensors, y_pre, ctx.chunk_size,
                                                seq_idx, cu_seqlens)
    return (*(gr if t is not None else None for gr, t in zip(grads, tensors)), None, None, None)


mamba3_siso_fwd_op.register_autograd(_backward, setup_context=_setup_context)


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


def mamba3_siso_combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None,
                         chunk_size=64, return_final_states=False, cu_seqlens=None):
    """Mamba-3 SISO chunked scan (mamba_ssm.ops.triton.mamba3.mamba3_siso_combined, 2.3.2.post1's signature),
    differentiable in every tensor argument (the backward: ``mamba3_siso_bwd``).

    Q, K: (batch, seqlen, nheads_qk, headdim_qk); V, Z: (batch, seqlen, nheads, headdim_v); ADT, DT, Trap:
    (batch, nheads, seqlen) (Trap a logit); Q_bias, K_bias: (nheads, headdim_qk); Angles: (batch, seqlen,
    nheads, headdim_angles), 1 <= headdim_angles <= headdim_qk // 2; D: (nheads,); Input_States: (angle
    (batch, nheads, headdim_angles), ssm (batch, nheads, headdim_v, headdim_qk), k (batch, nheads, headdim_qk),
    v (batch, nheads, headdim_v)) or None (zeros); chunk_size: 1 .. 256; nheads % nheads_qk == 0
    -> out (batch, seqlen, nheads, headdim_v) in V's dtype, and with return_final_states the final angle, ssm,
    k states (float32) and v state (V's last position, V's dtype) too: (out, angle, ssm, k, v).

    cu_seqlens: (nseq + 1,) int32 / int64 with batch 1: the sequences packed end to end along seqlen, each
    from its row of Input_States ((nseq, ...) then) or zero states; the final states are then per sequence
    (nseq, ...). Input states, and a gradient through the final ssm states, run on a left-padded batch of
    the sequences (``_packed_with_states``, ``_padded_bwd``: nseq x the longest sequence positions).

    The recurrence of tvm_mamba.reference.mamba3 (docs/mamba3.md), computed chunk by chunk.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 1 <= chunk_size <= 256:
        raise ValueError(f"chunk_size: must be an int in 1..256, got {chunk_size!r}")
    _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, None, seq=True)
    _check_chunked(V, Q.shape[-1], chunk_size)
    seq_idx = None
    if cu_seqlens is not None:
        cu_seqlens = validate_cu_seqlens(cu_seqlens, None, V)
        seq_idx = seq_idx_of(cu_seqlens, V.shape[1])
    if Input_States is not None:
        _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States, seq=True,
               nstates=None if cu_seqlens is None else cu_seqlens.shape[0] - 1)
        if cu_seqlens is not None:
            return _packed_with_states(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, tuple(Input_States),
                                       chunk_size, return_final_states, cu_seqlens)
    states = tuple(Input_States) if Input_States is not None else (None,) * 4
    w = lambda t: None if t is None else t.to(torch.float32)  # noqa: E731
    angle, ssm, kst, vst = states
    kst = kst.to(torch.float32) if kst is not None and kst.dtype == torch.float64 else kst
    out, aout, final, kfin, _ = run_op(mamba3_siso_fwd_op, Q, K, V, w(ADT), w(DT), w(Trap), w(Q_bias), w(K_bias),
                                       w(Angles), w(D), None if Z is None else Z.to(V.dtype), w(angle), w(ssm),
                                       kst, vst, chunk_size, seq_idx, cu_seqlens)
    if not return_final_states:
        return out
    return out, aout, final, kfin, last_v_rows(V, cu_seqlens)


def last_v_rows(V: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    """The final V state: V[:, -1] (a copy), or with packed sequences each sequence's last row (nseq, nheads,
    headdim_v), zeros for an empty sequence."""
    if cu_seqlens is None:
        return V[:, -1].clone(memory_format=torch.contiguous_format)
    ends = cu_seqlens[1:].long()
    return V[0].index_select(0, (ends - 1).clamp(min=0)) * (ends > cu_seqlens[:-1].long()).to(V.dtype)[:, None, None]
