"""Mamba-3 MIMO (mamba_ssm 2.3.2.post1 ``mamba3_mimo`` (TileLang) and the MIMO decode step (CuTe
``mamba3_step_fn`` after ``apply_rotary_qk_inference_fwd``)), written from the math in plain PyTorch (no TVM):
a sequential recurrence, float64 by default, differentiable by autograd.

Per (batch, head h; its Q/K head hq = h // (nheads // nheads_qk)), time step t, rank r = 0 .. R-1 (R = mimo_rank):

    theta_t = (theta_{t-1} + pi tanh(Angles_t) DT_t) mod 2 pi                    (angle state, S values)
    q_{t,r} = Rh(theta_t) (Q_{t,r}[hq] + Q_bias[h, r]);  k_{t,r} = Rh(theta_t) (K_{t,r}[hq] + K_bias[h, r])
    x_{t,r} = V_t * MIMO_V[h, r]                      (elementwise over headdim_v: the rank-r "up projection")
    alpha_t = exp(ADT_t);  lam_t = sigmoid(Trap_t);  beta_t = alpha_t DT_t (1 - lam_t);  gamma_t = DT_t lam_t
    h_t = alpha_t h_{t-1} + beta_t sum_r x_{t-1,r} k_{t-1,r}^T + gamma_t sum_r x_{t,r} k_{t,r}^T
    y_{t,r} = h_t q_{t,r} + D x_{t,r};  y_{t,r} *= silu(Z_t * MIMO_Z[h, r])      (with Z)
    out_t = sum_r MIMO_Out[h, r] * y_{t,r}      (with MIMO_Out; without it out is y, (.., R, nheads, headdim_v))

Rh(theta) rotates the *halved* pairs (i, i + headdim_qk / 2), i < S = headdim_angles, by theta[i] (MIMO's
layout; SISO rotates the interleaved pairs (2i, 2i+1)); dimensions of no pair pass through. h is
(headdim_v, headdim_qk) per head: rank-R inputs and outputs share one state, which is what raises the
arithmetic intensity of a decode step. (k_{-1,r}, v_{-1}) are the input K / V states (zeros at a sequence start).
Upstream's decode step is two functions, each with a reference here: ``apply_rotary_qk_inference_ref`` (the
rotation, angle not reduced) and ``mamba3_step_fn_ref`` (the update from rotated B / C, trap a probability).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .mamba3 import _coefficients, angle_step, rotate_pairs


def rotate_halves(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """x: (..., headdim_qk), theta: (..., S), S <= headdim_qk // 2 -> x with the pairs (i, i + headdim_qk / 2),
    i < S, rotated by theta[..., i]: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)."""
    half, S = x.shape[-1] // 2, theta.shape[-1]
    x0, x1 = x[..., :half], x[..., half:]
    c = torch.cat((torch.cos(theta), theta.new_ones(*theta.shape[:-1], half - S)), dim=-1)
    s = torch.cat((torch.sin(theta), theta.new_zeros(*theta.shape[:-1], half - S)), dim=-1)
    return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)


def zero_mimo_states(batch, rank, nheads, headdim_qk, headdim_v, headdim_angles, dtype, device):
    """(angle (batch, nheads, S), ssm (batch, nheads, headdim_v, headdim_qk), k (batch, R, nheads, headdim_qk),
    v (batch, nheads, headdim_v)) zeros: upstream's cache layout for a MIMO layer."""
    z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
    return (z(batch, nheads, headdim_angles), z(batch, nheads, headdim_v, headdim_qk),
            z(batch, rank, nheads, headdim_qk), z(batch, nheads, headdim_v))


def _step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z, states):
    """One step in the computation dtype. Q, K (batch, R, nheads_qk, N); V, Z (batch, nheads, P); ADT, DT, Trap
    (batch, nheads); Q_bias, K_bias (nheads, R, N); MIMO_* (nheads, R, P); Angles (batch, nheads, S); D (nheads,)
    -> (out, (theta, h, k (batch, R, nheads, N), v))."""
    theta, h, k_prev, v_prev = states
    rep = V.shape[1] // Q.shape[2]
    theta = angle_step(theta, Angles, DT)
    heads = lambda t, bias: t.repeat_interleave(rep, dim=2) + bias.transpose(0, 1)  # noqa: E731  (b, R, H, N)
    q = rotate_halves(heads(Q, Q_bias), theta[:, None])
    k = rotate_halves(heads(K, K_bias), theta[:, None])
    x = V[:, None] * MIMO_V.transpose(0, 1)  # (batch, R, nheads, P)
    x_prev = v_prev[:, None] * MIMO_V.transpose(0, 1)
    alpha, beta, gamma = _coefficients(ADT, DT, Trap)
    h = (alpha[..., None, None] * h + beta[..., None, None] * torch.einsum("brhp,brhn->bhpn", x_prev, k_prev)
         + gamma[..., None, None] * torch.einsum("brhp,brhn->bhpn", x, k))
    y = torch.einsum("bhpn,brhn->brhp", h, q)
    if D is not None:
        y = y + D[:, None] * x
    if Z is not None:
        y = y * F.silu(Z[:, None] * MIMO_Z.transpose(0, 1))
    out = torch.einsum("brhp,hrp->bhp", y, MIMO_Out) if MIMO_Out is not None else y
    return out, (theta, h, k, V)


def mamba3_mimo_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D=None, Z=None,
                         Input_States=None, dtype=torch.float64):
    """One MIMO decode step. Q, K: (batch, R, nheads_qk, headdim_qk); V, Z: (batch, nheads, headdim_v);
    ADT, DT, Trap: (batch, nheads) (Trap pre-sigmoid); Q_bias, K_bias: (nheads, R, headdim_qk); MIMO_V, MIMO_Z,
    MIMO_Out: (nheads, R, headdim_v) (MIMO_Out None: no down projection); Angles: (batch, nheads, S); D: (nheads,);
    Input_States: (angle, ssm, k, v) in ``zero_mimo_states``' layout, None = zeros
    -> (out (batch, nheads, headdim_v) or (batch, R, nheads, headdim_v), [angle, ssm, k, v]) in ``dtype``."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    args = [cast(t) for t in (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z)]
    batch, R, _, N = Q.shape
    H, P = V.shape[1], V.shape[2]
    states = (tuple(cast(s) for s in Input_States) if Input_States is not None else
              zero_mimo_states(batch, R, H, N, P, Angles.shape[-1], dtype, Q.device))
    out, new = _step(*args, states)
    return out, list(new)


def _recurrence(args, states):
    """The steps of one batch of equal-length sequences (tensors in the chunked layouts, computation dtype)."""
    Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z = args
    outs = [V.new_zeros(V.shape[0], 0, *((Q.shape[2],) if MIMO_Out is None else ()), *V.shape[2:])]
    for t in range(Q.shape[1]):
        out, states = _step(Q[:, t], K[:, t], V[:, t], ADT[:, :, t], DT[:, :, t], Trap[:, :, t], Q_bias, K_bias,
                            MIMO_V, MIMO_Z, MIMO_Out, Angles[:, t], D, None if Z is None else Z[:, t], states)
        outs.append(out[:, None])
    return torch.cat(outs, dim=1), states


_TIME_AXIS = (1, 1, 1, 2, 2, 2, None, None, None, None, None, 1, None, 1)  # per argument of _recurrence


def mamba3_mimo_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D=None, Z=None,
                    return_state=False, cu_seqlens=None, dtype=torch.float64):
    """The chunked MIMO forward's math, step by step. Q, K: (batch, seqlen, R, nheads_qk, headdim_qk); V, Z:
    (batch, seqlen, nheads, headdim_v); ADT, DT, Trap: (batch, nheads, seqlen); Q_bias, K_bias, MIMO_*: as the
    step's; Angles: (batch, seqlen, nheads, S); cu_seqlens (nseq + 1,) with batch 1: packed sequences, each from
    zero states -> out (batch, seqlen, nheads, headdim_v) (or (batch, seqlen, R, nheads, headdim_v) without
    MIMO_Out) [, final angle, ssm (nseq, nheads, headdim_v, headdim_qk), k (nseq, R, nheads, headdim_qk), v]."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    args = [cast(t) for t in (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z)]
    batch, _, R, _, N = Q.shape
    H, P, S = V.shape[2], V.shape[3], Angles.shape[-1]
    bounds = [0, Q.shape[1]] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens: needs batch == 1, got batch {batch}")
    outs, finals = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        piece = [a if ax is None or a is None else a.narrow(ax, lo, hi - lo) for a, ax in zip(args, _TIME_AXIS)]
        out, final = _recurrence(piece, zero_mimo_states(batch, R, H, N, P, S, dtype, Q.device))
        outs.append(out)
        finals.append(final)
    out = torch.cat(outs, dim=1)
    if not return_state:
        return out
    return (out, *(torch.cat(parts, dim=0) for parts in zip(*finals)))


def mamba3_mimo_chunked_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D=None, Z=None,
                            chunk_size=16, dtype=torch.float32):
    """The same math chunk by chunk in vectorised torch (the benchmarks' PyTorch composition; zero input states,
    no cu_seqlens; layouts of ``mamba3_mimo_ref``) -> out. Per chunk, with cs the chunk-local cumsum of ADT and
    scale_s = gamma_s + DT_{s+1} (1 - lam_{s+1}) (0 past the end): out_{t,r} = sum_{s<t in chunk} exp(cs_t -
    cs_s) scale_s sum_r' (q_tr . k_sr') x_sr' + gamma_t sum_r' (q_tr . k_tr') x_tr' + exp(cs_t) q_tr h, then
    h <- exp(cs_last) h + sum_s exp(cs_last - cs_s) scale_s sum_r' x_sr' k_sr'^T (the carried state already
    holds each last step's trapezoid term of the next step)."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z = (
        cast(t) for t in (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z))
    (batch, L, _, Hqk, N), (H, P) = Q.shape, V.shape[2:]
    theta = torch.cumsum(torch.pi * torch.tanh(Angles) * DT.transpose(1, 2)[..., None], dim=1)  # (b, L, H, S)
    heads = lambda t, bias: t.repeat_interleave(H // Hqk, dim=3) + bias.transpose(0, 1)  # noqa: E731
    q = rotate_halves(heads(Q, Q_bias), theta[:, :, None])  # (b, L, R, H, N)
    k = rotate_halves(heads(K, K_bias), theta[:, :, None])
    x = V[:, :, None] * MIMO_V.transpose(0, 1)  # (b, L, R, H, P)
    lam = torch.sigmoid(Trap)
    gamma = DT * lam  # (b, H, L)
    scale = gamma + F.pad(DT[..., 1:] * (1 - lam[..., 1:]), (0, 1))
    h = V.new_zeros(batch, H, P, N)
    ys = []
    for c0 in range(0, L, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, L))
        cs = torch.cumsum(ADT[..., sl], dim=-1)  # (b, H, Qc)
        qc, kc, xc, n = q[:, sl], k[:, sl], x[:, sl], cs.shape[-1]
        below = torch.ones(n, n, dtype=torch.bool, device=V.device).tril(-1)
        w = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~below, -torch.inf)) * scale[..., None, sl]
        w = w + torch.diag_embed(gamma[..., sl])  # (b, H, t, s)
        a = w[:, :, :, None, :, None] * torch.einsum("btrhn,bsuhn->bhtrsu", qc, kc)
        y = torch.einsum("bhtrsu,bsuhp->btrhp", a, xc)
        y = y + torch.exp(cs).permute(0, 2, 1)[:, :, None, :, None] * torch.einsum("bhpn,btrhn->btrhp", h, qc)
        into = torch.exp(cs[..., -1:] - cs) * scale[..., sl]  # (b, H, s)
        h = torch.exp(cs[..., -1])[..., None, None] * h + torch.einsum("bhs,bsuhp,bsuhn->bhpn", into, xc, kc)
        ys.append(y)
    y = torch.cat(ys, dim=1)
    if D is not None:
        y = y + D[:, None] * x
    if Z is not None:
        y = y * F.silu(Z[:, :, None] * MIMO_Z.transpose(0, 1))
    return torch.einsum("btrhp,hrp->bthp", y, MIMO_Out) if MIMO_Out is not None else y


# --- upstream's two-function decode path (Mamba3.step): the rotary pass, then the state update -----------------

def apply_rotary_qk_inference_ref(q, k, angle_state, angle_proj, dt, bias_q=None, bias_k=None, conjugate=False,
                                  rotate_pairwise=True, dtype=torch.float64):
    """The decode step's rotary pass as upstream's ``apply_rotary_qk_inference_fwd`` returns it. q, k: (batch, R,
    nheads, headdim); angle_state, angle_proj: (batch, nheads, S); dt: (batch, nheads); bias_q, bias_k: (R,
    nheads, headdim) or None -> (q_out, k_out (batch, R, nheads, headdim), theta' (batch, nheads, S)) in ``dtype``.
    theta' = angle_state + pi tanh(angle_proj) dt (not reduced mod 2 pi); q_out = R(+-theta') (q + bias_q),
    k_out likewise: ``rotate_pairs`` with rotate_pairwise, else ``rotate_halves``; -theta' with conjugate."""
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    theta = c(angle_state) + math.pi * torch.tanh(c(angle_proj)) * c(dt)[..., None]
    rot = rotate_pairs if rotate_pairwise else rotate_halves
    sign = -1.0 if conjugate else 1.0
    out = [rot(c(t) + (c(b) if b is not None else 0.0), sign * theta[:, None]) for t, b in ((q, bias_q), (k, bias_k))]
    return out[0], out[1], theta


def mamba3_step_fn_ref(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj=None, z=None, zproj=None,
                       dtype=torch.float64):
    """The decode step's update as upstream's ``mamba3_step_fn`` computes it from rotated B (k) and C (q).
    state: (batch, nheads, hdim, dstate); Bstate, B, C: (batch, R, nheads, dstate); Xstate, x, z: (batch, nheads,
    hdim); A, dt, trap: (batch, nheads), trap a probability; D: (nheads,); xproj, zproj, outproj: (R, nheads,
    hdim) -> (out (batch, nheads, hdim), or (batch, R, nheads, hdim) without outproj; the new state) in ``dtype``.
    alpha = exp(A dt); beta = (1 - trap) dt alpha; gamma = trap dt; x_r = x xproj_r; h' = alpha h + beta sum_r
    (Xstate xproj_r) Bstate_r^T + gamma sum_r x_r B_r^T; y_r = (h' C_r + D x_r) silu(z zproj_r); out = sum_r
    outproj_r y_r."""
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    A, dt, trap = c(A), c(dt), c(trap)
    alpha = torch.exp(A * dt)
    beta, gamma = (1 - trap) * dt * alpha, trap * dt
    xr, xs = c(x)[:, None] * c(xproj), c(Xstate)[:, None] * c(xproj)  # (batch, R, nheads, hdim)
    h = (alpha[..., None, None] * c(state) + beta[..., None, None] * torch.einsum("brhp,brhn->bhpn", xs, c(Bstate))
         + gamma[..., None, None] * torch.einsum("brhp,brhn->bhpn", xr, c(B)))
    y = torch.einsum("bhpn,brhn->brhp", h, c(C)) + c(D)[:, None] * xr
    if z is not None:
        y = y * F.silu(c(z)[:, None] * c(zproj))
    return (torch.einsum("brhp,rhp->bhp", y, c(outproj)) if outproj is not None else y), h
