"""mamba3_mimo: mamba_ssm 2.3.2.post1's Mamba-3 MIMO chunked scan (``ops/tilelang/mamba3/mamba3_mimo.py``,
forward and backward): one SSD over the flattened (step, rank) positions with a step-grouped causal mask. The
math: tvm_mamba/reference/mamba3_mimo.py and docs/mamba3.md ("MIMO").

The MIMO state of a head, h_t = alpha_t h_{t-1} + beta_t sum_r' x_{t-1,r'} k_{t-1,r'}^T + gamma_t sum_r'
x_{t,r'} k_{t,r'}^T (x_r' = V * MIMO_V[h, r']), read at y_{t,r} = h_t q_{t,r}, is the SISO chunked form with
each step t split into R positions t R + r: C (SSD's "q") at (t, r) is the rotated q_{t,r}, B ("k") the rotated
k_{t,r}, x = x_{t,r}; the decay steps and scales are the step's, repeated R times (dA_step 0 inside a step:
decay exp(0) = 1), so bmm_chunk, chunk_state and state_passing run unchanged on chunk_size R positions per chunk
of steps. Only the chunk scan's intra-chunk sum changes: it runs over the pairs of strictly earlier steps,
s // R < l // R (``ScanDims.step_group`` = R, the strict form of diag_skip), and its backward likewise.

Custom ops (namespace ``tvm_mamba``, with fake implementations): ``mamba3_mimo_fwd`` -> the SSD part of y per
rank and the final angle / ssm / k states; its autograd formula ``mamba3_mimo_bwd`` recomputes the pieces before
the chunk scan, runs the SSD backward (step-grouped chunk_scan_bwd) and the preprocess's backward. The rotated
q, k, dA_cs and scales come from the SISO preprocess kernel run over R nheads *virtual heads*, rank-major (head
r nheads + h reads Q / K head r nheads_qk + hq: the preprocess's GQA indexing holds with nheads_qk R nheads_qk,
and its (batch, seqlen, R nheads, headdim_qk) output *is* the flattened (batch, seqlen R, nheads, headdim_qk)
layout); Angles, ADT, DT, Trap are tiled per rank (their gradients summed back). MIMO rotates the halved pairs
(i, i + N/2), the preprocess the interleaved (2i, 2i+1): one permutation of headdim_qk (``pair_order``) maps one
onto the other and leaves every q . k unchanged.

Around the op, small torch ops under autograd: x = V * MIMO_V (float32); the same-step R x R block,
y_{t,r} += gamma_t sum_r' ((Q_{t,r} + Qb_r) . (K_{t,r'} + Kb_r')) x_{t,r'} with gamma = DT sigmoid(Trap) (the
unrotated dot: a step's rotation is shared by its q and k), the MIMO analogue of SISO's per-position skip; D, the
Z gate silu(Z * MIMO_Z[h, r]) and the down projection sum_r MIMO_Out[h, r] y_r.

The kernels' chunk is min(chunk_size, 256 // R) steps (at most 256 flattened positions, the SSD kernels' limit;
upstream recommends 64 / R): the result does not depend on it beyond float32 rounding.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compute.mamba3.dims import mimo_chunk_steps
from ._dlpack import FLOATS, check_shape, check_tensor, run_op
from .mamba3 import _check_chunked, _Chunked, _group_sum, _ssd_bwd, chunk_scan, last_v_rows, preprocess_bwd
from .ssd import seq_idx_of, validate_cu_seqlens

F32 = torch.float32


def pair_order(N: int, device) -> Tensor:
    """(N,) int64: [0, N/2, 1, N/2 + 1, ...]; x[..., pair_order] puts the halved pair (i, i + N/2) at the
    interleaved slots (2i, 2i + 1)."""
    half = torch.arange(N // 2, device=device)
    return torch.stack((half, half + N // 2), dim=-1).flatten()


def _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z, chunk_size,
           rotary_dim_divisor, dtype) -> None:
    """TypeError / ValueError naming the argument, before anything runs."""
    if dtype not in FLOATS:
        raise TypeError(f"dtype: expected one of torch.float32 / float16 / bfloat16, got {dtype!r}")
    if rotary_dim_divisor not in (2, 4) or isinstance(rotary_dim_divisor, bool):
        raise ValueError(f"rotary_dim_divisor: must be 2 (full rotary) or 4 (half), got {rotary_dim_divisor!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 1 <= chunk_size <= 256:
        raise ValueError(f"chunk_size: must be an int in 1..256, got {chunk_size!r}")
    check_tensor("V", V, ndim=4, dtypes=FLOATS)
    batch, L, H, P = V.shape
    dev = V.device
    check_tensor("Q", Q, ndim=5, dtypes=FLOATS, device=dev)
    R, Hqk, N = Q.shape[2:]
    if tuple(Q.shape[:2]) != (batch, L):
        raise ValueError(f"Q: expected batch, seqlen {(batch, L)} (V's), got shape {tuple(Q.shape)}")
    if not 1 <= R <= 256 or Hqk < 1 or H % Hqk:
        raise ValueError(f"Q: nheads_qk={Hqk} must divide nheads={H} (V's heads) and mimo_rank={R} be in 1..256")
    if N % 2 or N < 2:
        raise ValueError(f"Q: headdim_qk={N} must be even (halved rotary pairs)")
    check_tensor("K", K, dtypes=(Q.dtype,), device=dev)
    check_shape("K", K, Q.shape)
    for name, t in (("ADT", ADT), ("DT", DT), ("Trap", Trap)):
        check_tensor(name, t, dtypes=FLOATS, device=dev)
        check_shape(name, t, (batch, H, L))
    for name, t in (("Q_bias", Q_bias), ("K_bias", K_bias)):
        check_tensor(name, t, dtypes=FLOATS, device=dev)
        check_shape(name, t, (H, R, N))
    for name, t in (("MIMO_V", MIMO_V), ("MIMO_Z", MIMO_Z), ("MIMO_Out", MIMO_Out)):
        if t is None and (name == "MIMO_V" or (name == "MIMO_Z" and Z is not None)):
            raise TypeError(f"{name}: a tensor (nheads, mimo_rank, headdim_v) is needed" +
                            (" with Z" if name == "MIMO_Z" else ""))
        if t is not None:
            check_tensor(name, t, dtypes=FLOATS, device=dev)
            check_shape(name, t, (H, R, P))
    check_tensor("Angles", Angles, dtypes=FLOATS, device=dev)
    check_shape("Angles", Angles, (batch, L, H, N // rotary_dim_divisor))
    if D is not None:
        check_tensor("D", D, dtypes=FLOATS, device=dev)
        check_shape("D", D, (H,))
    if Z is not None:
        check_tensor("Z", Z, dtypes=FLOATS, device=dev)
        check_shape("Z", Z, V.shape)


class _Fused:
    """One fused call's two views (module docstring): ``pre``, the preprocess over the R nheads rank-major
    virtual heads (chunks of ``mimo_chunk_steps`` steps), and ``flat``, the SSD over the (step, rank)
    positions (chunks of R times as many positions, step_group R). Inputs: Q, K (batch, seqlen, R, nheads_qk,
    headdim_qk) interleaved pairs; x (batch, seqlen, R, nheads, headdim_v) f32; ADT, DT, Trap (batch, nheads,
    seqlen), Q_bias, K_bias (nheads, R, headdim_qk), Angles (batch, seqlen, nheads, S), float32."""

    def __init__(self, Q, K, x, ADT, DT, Trap, Q_bias, K_bias, Angles, chunk_size, seq_idx, cu_seqlens):
        (b, L, R, Hqk, N), H, P = Q.shape, x.shape[3], x.shape[4]
        steps = mimo_chunk_steps(chunk_size, R)
        tile = lambda t: t.repeat(1, R, 1)  # noqa: E731  (batch, nheads, seqlen) -> (batch, R nheads, seqlen)
        bias = lambda t: t.transpose(0, 1).reshape(R * H, N)  # noqa: E731  (nheads, R, N) -> (R nheads, N)
        self.args = (Q.reshape(b, L, R * Hqk, N), K.reshape(b, L, R * Hqk, N), tile(ADT), tile(DT), tile(Trap),
                     bias(Q_bias), bias(K_bias), Angles.repeat(1, 1, R, 1))
        self.b, self.L, self.R, self.H, self.P, self.N = b, L, R, H, P, N
        self.x = x.reshape(b, L * R, H, P)
        self.pre = _Chunked(self.args[0], x.reshape(b, L, R * H, P), self.args[7], None, None, None, None, steps,
                            seq_idx, cu_seqlens)
        # the flat view's "Q": its shape and dtype only (q itself comes from the preprocess); one head per group
        self.flat = _Chunked(x.new_empty(()).expand(b, L * R, H, N), self.x, Angles, None, None, None, None,
                             steps * R, None if seq_idx is None else seq_idx.repeat_interleave(R, dim=1),
                             None if cu_seqlens is None else cu_seqlens * R, step_group=R)

    def pieces(self, aout, final=None):
        """The preprocess (final angles of the virtual heads into ``aout`` (nseq, R nheads, S)), then the SSD
        pieces before the chunk scan on the flattened positions (final ssm states into ``final``) -> (pre's
        p: q, k per virtual head, ...; the flat p: q, k, dA_cs, scale, zero skip, cb, states_in)."""
        pre, flat, b, L, R, H, N = self.pre, self.flat, self.b, self.L, self.R, self.H, self.N
        p = pre.preprocess(*self.args, None, None, None, None, None, aout)
        rep = lambda t: t[:, :H].repeat_interleave(R, dim=-1)  # noqa: E731  a step's values at its R positions
        fp = SimpleNamespace(q=p.q.view(b, L * R, H, N), k=p.k.view(b, L * R, H, N), dA_cs=rep(p.dA_cs),
                             scale=rep(p.scale), skip=flat.new(b, H, flat.nchunks, flat.Qc).zero_(), init=p.init)
        return p, flat.ssd_pieces(fp, self.x, final)

    def step_grads(self, g) -> SimpleNamespace:
        """The flat SSD gradients g (``_ssd_bwd``) as the virtual heads' (what ``preprocess_bwd`` reads): dq, dk
        (the same memory), dscale per position, d dA_step and the decay's gradient at rank 0 (a step's dA_step
        is its first position's; the other ranks' copies get 0), no skip gradient (the skip is zero)."""
        b, R, H, pre = self.b, self.R, self.H, self.pre
        nc, Qs = pre.nchunks, pre.Qc
        per_rank = lambda t: t.view(b, H, nc, Qs, R).permute(0, 4, 1, 2, 3).reshape(b, R * H, nc, Qs)  # noqa: E731
        zeros = lambda *s: pre.new(*s).zero_()  # noqa: E731
        v = SimpleNamespace(dq=g.dq.view(b, pre.seqlen, R * H, self.N), dk=g.dk.view(b, pre.seqlen, R * H, self.N),
                            dscale=per_rank(g.dscale), ddA=zeros(b, R * H, nc, Qs), dskip=zeros(b, R * H, nc, Qs),
                            ddecay=zeros(b, R * H, nc), dinit=None)
        v.ddA[:, :H] = g.ddA.view(b, H, nc, Qs, R)[..., 0]
        v.ddecay[:, :H] = g.ddecay
        return v


def _fwd_outputs(Q, x, Angles, cu_seqlens):
    """Uninitialised (y (batch, seqlen, R, nheads, headdim_v) f32, angle (nseq, nheads, S), ssm (nseq, nheads,
    headdim_v, headdim_qk), k (nseq, R, nheads, headdim_qk)) of the forward op (also the fake's results)."""
    (batch, _, R, _, N), H, P, S = Q.shape, x.shape[3], x.shape[4], Angles.shape[3]
    nseq = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (x.new_empty(x.shape), x.new_zeros(nseq, H, S), x.new_zeros(nseq, H, P, N), x.new_zeros(nseq, R, H, N))


@torch.library.custom_op("tvm_mamba::mamba3_mimo_fwd", mutates_args=())
def mamba3_mimo_fwd_op(Q: Tensor, K: Tensor, x: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
                       K_bias: Tensor, Angles: Tensor, chunk_size: int, seq_idx: Optional[Tensor] = None,
                       cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Layouts of ``_Fused`` (interleaved rotary pairs), seqlen >= 1; packed sequences: seq_idx (1, seqlen) and
    cu_seqlens (nseq + 1,) int32 -> (y: the SSD part of the pre-gate output per rank (batch, seqlen, R, nheads,
    headdim_v) f32, without the same-step block and D; the final angle, ssm and k states (``_fwd_outputs``),
    per batch row or per sequence)."""
    y, aout, final, kfin = _fwd_outputs(Q, x, Angles, cu_seqlens)
    if x.shape[0] == 0:
        return y.zero_(), aout, final, kfin
    f = _Fused(Q, K, x, ADT, DT, Trap, Q_bias, K_bias, Angles, chunk_size, seq_idx, cu_seqlens)
    pre, b, L, R, H, N = f.pre, f.b, f.L, f.R, f.H, f.N
    avirt = pre.new(pre.nseq, R * H, Angles.shape[3]).zero_()
    p, fp = f.pieces(avirt, final)
    chunk_scan(f.flat, fp, f.x, None, y.view(b, L * R, H, f.P), None)
    aout.copy_(avirt[:, :H])
    if pre.has_seq:
        last, filled = pre.last_rows()
        kfin.copy_((p.k[0].index_select(0, last) * filled[:, None, None]).view(-1, R, H, N))
    else:
        kfin.copy_(p.k[:, L - 1].view(b, R, H, N))
    return y, aout, final, kfin


@mamba3_mimo_fwd_op.register_fake
def _(Q, K, x, ADT, DT, Trap, Q_bias, K_bias, Angles, chunk_size, seq_idx=None, cu_seqlens=None):
    return _fwd_outputs(Q, x, Angles, cu_seqlens)


@torch.library.custom_op("tvm_mamba::mamba3_mimo_bwd", mutates_args=())
def mamba3_mimo_bwd_op(dy: Tensor, Q: Tensor, K: Tensor, x: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor,
                       Q_bias: Tensor, K_bias: Tensor, Angles: Tensor, chunk_size: int,
                       seq_idx: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> list[Tensor]:
    """The gradients of mamba3_mimo_fwd's y for dy (y's layout) -> [dQ, dK (Q's dtype), dx, dADT, dDT, dTrap,
    dQ_bias, dK_bias, dAngles (f32)]. Recomputes the pieces before the chunk scan (nothing is saved but the
    inputs), runs the flat SSD backward (step-grouped chunk_scan_bwd), then the preprocess's backward over the
    virtual heads, whose per-rank gradients of the tiled ADT / DT / Trap / Angles / biases are summed here (rank
    order). The final states are not differentiable (upstream's side outputs)."""
    if x.shape[0] == 0:
        return _bwd_outputs(Q, K, x, ADT, DT, Trap, Q_bias, K_bias, Angles, zero=True)
    f = _Fused(Q, K, x, ADT, DT, Trap, Q_bias, K_bias, Angles, chunk_size, seq_idx, cu_seqlens)
    pre, b, L, R, H, N = f.pre, f.b, f.L, f.R, f.H, f.N
    _, fp = f.pieces(pre.new(pre.nseq, R * H, Angles.shape[3]))
    g = _ssd_bwd(f.flat, fp, dy.reshape(b, L * R, H, f.P), f.x, None, None, None)
    r = preprocess_bwd(pre, f.step_grads(g), *f.args, None, None, None, None)
    per_rank = lambda t: t.view(b, R, H, L).sum(1)  # noqa: E731  (batch, R nheads, seqlen) -> summed over ranks
    bias = lambda t: t.sum((0, 1)).view(R, H, N).transpose(0, 1).contiguous()  # noqa: E731  (batch, step blocks)
    return [_group_sum(pre, r.dQh, f.args[0]).view(Q.shape), _group_sum(pre, r.dKh, f.args[1]).view(K.shape),
            g.dV.view(x.shape), per_rank(r.dADT), per_rank(r.dDT), per_rank(r.dTrap), bias(r.dQb), bias(r.dKb),
            r.dAngles.view(b, L, R, H, -1).sum(2)]


def _bwd_outputs(*inputs, zero: bool = False) -> list[Tensor]:
    """Gradients shaped and typed like ``inputs`` (the bwd op's order), empty or zero."""
    make = torch.zeros_like if zero else torch.empty_like
    return [make(t, memory_format=torch.contiguous_format) for t in inputs]


@mamba3_mimo_bwd_op.register_fake
def _(dy, Q, K, x, ADT, DT, Trap, Q_bias, K_bias, Angles, chunk_size, seq_idx=None, cu_seqlens=None):
    return _bwd_outputs(Q, K, x, ADT, DT, Trap, Q_bias, K_bias, Angles)


def _setup_context(ctx, inputs, output):
    *tensors, chunk_size, seq_idx, cu_seqlens = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, seq_idx, cu_seqlens)
    ctx.chunk_size = chunk_size


def _backward(ctx, dy, _daout, _dfinal, _dkfin):
    *tensors, seq_idx, cu_seqlens = ctx.saved_tensors
    if dy is None:
        return (None,) * 12
    grads = torch.ops.tvm_mamba.mamba3_mimo_bwd(dy, *tensors, ctx.chunk_size, seq_idx, cu_seqlens)
    return (*grads, None, None, None)


mamba3_mimo_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _same_step(Q, K, x, DT, Trap, Q_bias, K_bias) -> Tensor:
    """The same-step block (module docstring), torch ops under autograd: y_{t,r} = gamma_t sum_r' (q_{t,r} .
    k_{t,r'}) x_{t,r'} with the unrotated q, k (Q per head + Q_bias), gamma = DT sigmoid(Trap) -> (batch, seqlen,
    R, nheads, headdim_v) f32."""
    rep = x.shape[3] // Q.shape[3]
    q = Q.to(F32).repeat_interleave(rep, dim=3) + Q_bias.to(F32).transpose(0, 1)  # (b, L, R, H, N)
    k = K.to(F32).repeat_interleave(rep, dim=3) + K_bias.to(F32).transpose(0, 1)
    gamma = (DT.to(F32) * torch.sigmoid(Trap.to(F32))).transpose(1, 2)  # (b, L, H)
    scores = torch.einsum("blrhn,blshn->blhrs", q, k) * gamma[..., None, None]
    return torch.einsum("blhrs,blshp->blrhp", scores, x)


def mamba3_mimo(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
                K_bias: Tensor, MIMO_V: Tensor, MIMO_Z: Optional[Tensor], MIMO_Out: Optional[Tensor], Angles: Tensor,
                D: Optional[Tensor], Z: Optional[Tensor], chunk_size: int, rotary_dim_divisor: int,
                dtype: torch.dtype, return_state: bool = False, cu_seqlens: Optional[Tensor] = None):
    """Mamba-3 MIMO chunked scan (mamba_ssm.ops.tilelang.mamba3.mamba3_mimo.mamba3_mimo, 2.3.2.post1's
    signature), differentiable in every tensor argument.

    Q, K: (batch, seqlen, R, nheads_qk, headdim_qk), headdim_qk even; V, Z: (batch, seqlen, nheads,
    headdim_v); ADT, DT, Trap: (batch, nheads, seqlen) (Trap a logit); Q_bias, K_bias: (nheads, R, headdim_qk);
    MIMO_V, MIMO_Z, MIMO_Out: (nheads, R, headdim_v) (MIMO_Z may be None without Z; MIMO_Out None: no down
    projection); Angles: (batch, seqlen, nheads, headdim_qk // rotary_dim_divisor); D: (nheads,);
    chunk_size: time steps per chunk, 1 .. 256 (upstream's recommendation, 64 / R, suits these kernels too;
    the kernels use at most 256 // R); rotary_dim_divisor: 2 or 4; dtype: the activations' dtype (Q, K, V, Z
    are cast to it, as upstream's kernels read them in it; out is in it); cu_seqlens: (nseq + 1,) with batch 1,
    packed sequences from zero states
    -> out (batch, seqlen, nheads, headdim_v) (without MIMO_Out: (batch, seqlen, R, nheads, headdim_v)), and
    with return_state (out, angle (nseq, nheads, S), ssm (nseq, nheads, headdim_v, headdim_qk), k (nseq, R,
    nheads, headdim_qk), v (nseq, nheads, headdim_v)): float32 states (v in dtype), not differentiable.
    """
    _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z, chunk_size,
           rotary_dim_divisor, dtype)
    Q, K, V = Q.to(dtype), K.to(dtype), V.to(dtype)
    (batch, L, R, _, N), (H, P) = Q.shape, V.shape[2:]
    _check_chunked(V.new_empty(()).expand(batch, L * R, H, P), N, mimo_chunk_steps(chunk_size, R) * R)  # the flat sizes
    seq_idx = None
    if cu_seqlens is not None:
        cu_seqlens = validate_cu_seqlens(cu_seqlens, None, V)
        seq_idx = seq_idx_of(cu_seqlens, L)
    perm = pair_order(N, V.device)
    x = V.to(F32)[:, :, None] * MIMO_V.to(F32).transpose(0, 1)  # (b, L, R, H, P)
    w = lambda t: t.to(F32)  # noqa: E731
    y, angle, ssm, k = run_op(mamba3_mimo_fwd_op, Q[..., perm], K[..., perm], x, w(ADT), w(DT), w(Trap),
                              w(Q_bias)[..., perm], w(K_bias)[..., perm], w(Angles), chunk_size, seq_idx, cu_seqlens)
    y = y + _same_step(Q, K, x, DT, Trap, Q_bias, K_bias)
    if D is not None:
        y = y + D.to(F32)[:, None] * x
    if Z is not None:
        y = y * F.silu(Z.to(dtype).to(F32)[:, :, None] * MIMO_Z.to(F32).transpose(0, 1))
    out = (y * MIMO_Out.to(F32).transpose(0, 1)).sum(2) if MIMO_Out is not None else y
    out = out.to(dtype)
    if not return_state:
        return out
    inv = torch.argsort(perm)
    return out, angle, ssm[..., inv].contiguous(), k[..., inv].contiguous(), last_v_rows(V.detach(), cu_seqlens)
