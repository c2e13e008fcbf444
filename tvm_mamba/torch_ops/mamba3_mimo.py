"""mamba3_mimo: mamba_ssm 2.3.2.post1's Mamba-3 MIMO chunked scan (``ops/tilelang/mamba3/mamba3_mimo.py``,
forward and backward) on the SISO chunked kernels (``mamba3_siso_fwd`` / ``mamba3_siso_bwd``), through
virtual heads. The math: tvm_mamba/reference/mamba3_mimo.py and docs/mamba3.md.

Why virtual heads. The MIMO state of a head, h_t = alpha_t h_{t-1} + beta_t sum_r' x_{t-1,r'} k_{t-1,r'}^T
+ gamma_t sum_r' x_{t,r'} k_{t,r'}^T (x_r' = V * MIMO_V[h, r']), is linear in its R inputs, and the outputs
are y_r = h_t q_r: so y_r = sum_r' Y^(r,r') with Y^(r,r') the SISO scan of a head with Q = q_r, K = k_r',
V = x_r' and the head's own ADT, DT, Trap and Angles. SISO's per-position diagonal term gamma_t (q_t . k_t) v_t
is then exactly MIMO's same-step R x R block (a step sees all R inputs of its own step). MIMO rotates the
halved pairs (i, i + N/2), SISO the interleaved (2i, 2i+1): one fixed permutation of the headdim_qk axis
(``pair_order``) maps one onto the other and leaves every q . k unchanged, so Q, K and the biases are permuted
on the way in and the final ssm / k states permuted back. D, the Z gate (silu(Z * MIMO_Z[h, r])) and the
down projection (sum_r MIMO_Out[h, r] y_r) are elementwise torch ops after the scan, differentiated by autograd
like the (expand / permute) layout ops before it; the scan's gradient is the SISO op's backward.

Cost (what a fused MIMO kernel would save, issue #19): nheads R^2 SISO heads, so Q, K and V are materialised R^2
times (V in float32) and each (r, r') pair's chunk states are computed once per r (R times the necessary state
work); the intra-chunk work, R^2 (q . k) blocks per step pair, is what MIMO needs anyway.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dlpack import FLOATS, check_shape, check_tensor
from .mamba3 import last_v_rows, mamba3_siso_combined

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
    if R < 1 or Hqk < 1 or H % Hqk:
        raise ValueError(f"Q: nheads_qk={Hqk} must divide nheads={H} (V's heads) and mimo_rank={R} be >= 1")
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


def _virtual(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, Angles, perm):
    """The SISO arguments of the nheads R^2 virtual heads (h, r, r'): Q = q_r, K = k_r' (headdim_qk permuted),
    V = x_r' = V * MIMO_V[h, r'] (float32), the head's ADT / DT / Trap / Angles -> a dict for
    mamba3_siso_combined, and x (batch, seqlen, nheads, R, headdim_v)."""
    R, Hqk, H = Q.shape[2], Q.shape[3], V.shape[2]
    heads = torch.arange(H, device=V.device) // (H // Hqk)
    per_head = lambda t: t[..., perm].transpose(2, 3).index_select(2, heads)  # noqa: E731  (b, L, H, R, N)
    x = V.to(F32)[:, :, :, None] * MIMO_V.to(F32)  # (b, L, H, R', P)

    def pairs(t, at):  # (.., H, R, ..) -> (.., H R R', ..): t's rank axis becomes r (at = -2) or r' (at = -3)
        t = t.unsqueeze(at)
        shape = list(t.shape)
        shape[at] = R
        return t.expand(shape).flatten(-4, -2)

    time = lambda t, dim: t.to(F32).repeat_interleave(R * R, dim=dim)  # noqa: E731  the head's own values
    return dict(Q=pairs(per_head(Q), -2), K=pairs(per_head(K), -3), V=pairs(x, -3),
                ADT=time(ADT, 1), DT=time(DT, 1), Trap=time(Trap, 1),
                Q_bias=pairs(Q_bias.to(F32)[..., perm], -2), K_bias=pairs(K_bias.to(F32)[..., perm], -3),
                Angles=time(Angles, 2)), x


def _finals(finals, V, R, inv, cu_seqlens):
    """The SISO final states of the virtual heads -> MIMO's (angle (nseq, nheads, S), ssm (nseq, nheads,
    headdim_v, headdim_qk) = sum_r' state(r = 0, r') (each driven by x_r'), k (nseq, R, nheads, headdim_qk), v),
    detached (upstream's are non-differentiable side outputs)."""
    angle, ssm, k = (t.detach() for t in finals)
    nseq, H = angle.shape[0], V.shape[2]
    angle = angle.view(nseq, H, R * R, -1)[:, :, 0]
    ssm = ssm.view(nseq, H, R, R, *ssm.shape[2:])[:, :, 0].sum(2)[..., inv]
    k = k.view(nseq, H, R, R, -1)[:, :, 0].transpose(1, 2)[..., inv]
    return angle.contiguous(), ssm.contiguous(), k.contiguous(), last_v_rows(V.detach(), cu_seqlens)


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
    chunk_size: time steps per chunk, 1 .. 256 (upstream's recommendation, 64 / R, suits these kernels too);
    rotary_dim_divisor: 2 or 4; dtype: the activations' dtype (Q, K, V, Z are cast to it, as upstream's kernels
    read them in it; out is in it); cu_seqlens: (nseq + 1,) with batch 1, packed sequences from zero states
    -> out (batch, seqlen, nheads, headdim_v) (without MIMO_Out: (batch, seqlen, R, nheads, headdim_v)), and
    with return_state (out, angle (nseq, nheads, S), ssm (nseq, nheads, headdim_v, headdim_qk), k (nseq, R,
    nheads, headdim_qk), v (nseq, nheads, headdim_v)): float32 states (v in dtype), not differentiable.
    """
    _check(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z, chunk_size,
           rotary_dim_divisor, dtype)
    Q, K, V = Q.to(dtype), K.to(dtype), V.to(dtype)
    R, N = Q.shape[2], Q.shape[4]
    perm = pair_order(N, V.device)
    siso, x = _virtual(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, Angles, perm)
    res = mamba3_siso_combined(**siso, chunk_size=chunk_size, return_final_states=return_state,
                               cu_seqlens=cu_seqlens)
    yv = res[0] if return_state else res
    batch, L, H, P = V.shape
    y = yv.view(batch, L, H, R, R, P).sum(4)  # (b, L, H, R, P): sum over the input ranks r'
    if D is not None:
        y = y + D.to(F32)[:, None, None] * x
    if Z is not None:
        y = y * F.silu(Z.to(dtype).to(F32)[:, :, :, None] * MIMO_Z.to(F32))
    out = (y * MIMO_Out.to(F32)).sum(3) if MIMO_Out is not None else y.transpose(2, 3)
    out = out.to(dtype)
    if not return_state:
        return out
    return (out, *_finals(res[1:4], V, R, torch.argsort(perm), cu_seqlens))
