"""Mamba-3 SISO (mamba_ssm 2.3.2.post1 ``mamba3_siso_combined`` / ``mamba3_siso_step``), written from the math in
plain PyTorch (no TVM): a sequential recurrence, float64 by default, differentiable by autograd.

Per (batch, head h; its Q/K head hq = h // (nheads // nheads_qk)), time step t (docs/mamba3.md has the derivation):

    theta_t = (theta_{t-1} + pi tanh(Angles_t) DT_t) mod 2 pi              (angle state, headdim_angles values)
    q_t = R(theta_t) (Q_t[hq] + Q_bias[h]);  k_t = R(theta_t) (K_t[hq] + K_bias[h])
    alpha_t = exp(ADT_t);  lam_t = sigmoid(Trap_t);  beta_t = alpha_t DT_t (1 - lam_t);  gamma_t = DT_t lam_t
    h_t = alpha_t h_{t-1} + beta_t v_{t-1} k_{t-1}^T + gamma_t v_t k_t^T   (h: (headdim_v, headdim_qk))
    y_t = h_t q_t + D v_t;  out_t = y_t * silu(Z_t)

R(theta) rotates the interleaved pairs (2i, 2i+1), i < headdim_angles, by theta[i]: (x0, x1) ->
(x0 cos - x1 sin, x0 sin + x1 cos); pairs past headdim_angles pass through. (k_{-1}, v_{-1}) are the input
K / V states (zeros without input states): the trapezoid's left end of the first step.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TWO_PI = 2.0 * math.pi


def rotate_pairs(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """x: (..., headdim_qk), theta: (..., headdim_angles), headdim_angles <= headdim_qk // 2 -> x with its
    pairs (2i, 2i+1), i < headdim_angles, rotated by theta[..., i] (upstream's interleaved rotary)."""
    S = theta.shape[-1]
    head, tail = x[..., :2 * S], x[..., 2 * S:]
    x0, x1 = head[..., 0::2], head[..., 1::2]
    c, s = torch.cos(theta), torch.sin(theta)
    rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return torch.cat((rot, tail), dim=-1)


def angle_step(theta: torch.Tensor, angles: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """theta: (..., S) previous angle state; angles: (..., S) raw rates; dt: (...,) ->
    (theta + pi tanh(angles) dt) mod 2 pi (upstream's angle_dt cumsum, one step)."""
    return torch.remainder(theta + math.pi * torch.tanh(angles) * dt[..., None], TWO_PI)


def _coefficients(adt, dt, trap):
    """(alpha, beta, gamma) of one step: exp(ADT), exp(ADT) DT (1 - sigmoid(Trap)), DT sigmoid(Trap)."""
    lam = torch.sigmoid(trap)
    alpha = torch.exp(adt)
    return alpha, alpha * dt * (1 - lam), dt * lam


def _zero_states(batch, nheads, headdim_qk, headdim_v, headdim_angles, dtype, device):
    z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
    return (z(batch, nheads, headdim_angles), z(batch, nheads, headdim_v, headdim_qk),
            z(batch, nheads, headdim_qk), z(batch, nheads, headdim_v))


def _recurrence(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, states):
    """The sequential recurrence on one batch of equal-length sequences (all tensors already in the
    computation dtype; layouts of ``mamba3_siso_combined``) -> (out, (theta, h, k, v) after the last step)."""
    batch, seqlen, nheads_qk, _ = Q.shape
    nheads = V.shape[2]
    rep = nheads // nheads_qk
    theta, h, k_prev, v_prev = states
    outs = []
    for t in range(seqlen):
        theta = angle_step(theta, Angles[:, t], DT[:, :, t])
        q = rotate_pairs(Q[:, t].repeat_interleave(rep, dim=1) + Q_bias, theta)  # (batch, nheads, headdim_qk)
        k = rotate_pairs(K[:, t].repeat_interleave(rep, dim=1) + K_bias, theta)
        v = V[:, t]  # (batch, nheads, headdim_v)
        alpha, beta, gamma = _coefficients(ADT[:, :, t], DT[:, :, t], Trap[:, :, t])
        h = (alpha[..., None, None] * h + beta[..., None, None] * v_prev[..., :, None] * k_prev[..., None, :]
             + gamma[..., None, None] * v[..., :, None] * k[..., None, :])
        y = torch.einsum("bhpn,bhn->bhp", h, q)
        if D is not None:
            y = y + D[:, None] * v
        if Z is not None:
            y = y * F.silu(Z[:, t])
        outs.append(y)
        k_prev, v_prev = k, v
    out = torch.stack(outs, dim=1) if outs else V.new_zeros(V.shape)
    return out, (theta, h, k_prev, v_prev)


def mamba3_siso_combined_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None,
                             chunk_size=64, return_final_states=False, cu_seqlens=None, dtype=torch.float64):
    """Q, K: (batch, seqlen, nheads_qk, headdim_qk); V, Z: (batch, seqlen, nheads, headdim_v);
    ADT, DT, Trap: (batch, nheads, seqlen); Q_bias, K_bias: (nheads, headdim_qk);
    Angles: (batch, seqlen, nheads, headdim_angles); D: (nheads,);
    Input_States: (angle (nseq, nheads, headdim_angles), ssm (nseq, nheads, headdim_v, headdim_qk),
    k (nseq, nheads, headdim_qk), v (nseq, nheads, headdim_v)); cu_seqlens: (nseq + 1,) with batch == 1
    -> out: (batch, seqlen, nheads, headdim_v) [, final angle, ssm, k, v states (nseq, ...)].

    The recurrence of the module docstring, step by step in ``dtype``; ``chunk_size`` is accepted for the
    signature and ignored (a sequential reference has no chunks). Trap is the pre-sigmoid logit, as upstream.
    Final k / v states are the last step's rotated, biased K and its V. Everything is returned in ``dtype``.
    """
    del chunk_size
    batch, seqlen, nheads_qk, headdim_qk = Q.shape
    nheads, headdim_v = V.shape[2], V.shape[3]
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    args = [cast(t) for t in (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z)]
    nseq = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    states = (tuple(cast(s) for s in Input_States) if Input_States is not None else
              _zero_states(nseq, nheads, headdim_qk, headdim_v, Angles.shape[-1], dtype, Q.device))
    if cu_seqlens is None:
        out, final = _recurrence(*args, states)
    else:
        if batch != 1:
            raise ValueError(f"cu_seqlens: needs batch == 1, got batch {batch}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        outs, finals = [], []
        for i in range(nseq):
            lo, hi = bounds[i], bounds[i + 1]
            piece = [None if a is None else _time_slice(a, j, lo, hi) for j, a in enumerate(args)]
            o, f = _recurrence(*piece, tuple(s[i:i + 1] for s in states))
            outs.append(o)
            finals.append(f)
        out = torch.cat(outs, dim=1)
        final = tuple(torch.cat(parts, dim=0) for parts in zip(*finals))
    return (out, *final) if return_final_states else out


# argument position -> its time axis in mamba3_siso_combined's layouts (None: no time axis)
_TIME_AXIS = (1, 1, 1, 2, 2, 2, None, None, 1, None, 1)


def _time_slice(t, position, lo, hi):
    axis = _TIME_AXIS[position]
    return t if axis is None else t.narrow(axis, lo, hi - lo)


def mamba3_siso_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None,
                         dtype=torch.float64):
    """One decode step. Q, K: (batch, nheads_qk, headdim_qk); V, Z: (batch, nheads, headdim_v);
    ADT, DT, Trap: (batch, nheads); Q_bias, K_bias: (nheads, headdim_qk); Angles: (batch, nheads, headdim_angles);
    D: (nheads,); Input_States: (angle (batch, nheads, headdim_angles), ssm (batch, nheads, headdim_v, headdim_qk),
    k (batch, nheads, headdim_qk), v (batch, nheads, headdim_v))
    -> (out: (batch, nheads, headdim_v), [angle, ssm, k, v]: the new states; v is V, as upstream).

    theta' = (theta + pi tanh(Angles) DT) mod 2 pi; q, k = R(theta') (Q + Q_bias), R(theta') (K + K_bias);
    h' = exp(ADT) h + exp(ADT) DT (1 - sigmoid(Trap)) v_state k_state^T + DT sigmoid(Trap) V k^T;
    out = (h' q + D V) * silu(Z). Computed in ``dtype``; new states returned (inputs untouched).
    """
    rep = V.shape[1] // Q.shape[1]
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    theta0, h0, k0, v0 = (c(s) for s in Input_States)
    dt, v = c(DT), c(V)
    theta = angle_step(theta0, c(Angles), dt)
    q = rotate_pairs(c(Q).repeat_interleave(rep, dim=1) + c(Q_bias), theta)
    k = rotate_pairs(c(K).repeat_interleave(rep, dim=1) + c(K_bias), theta)
    alpha, beta, gamma = _coefficients(c(ADT), dt, c(Trap))
    h = (alpha[..., None, None] * h0 + (beta[..., None] * v0)[..., :, None] * k0[..., None, :]
         + (gamma[..., None] * v)[..., :, None] * k[..., None, :])
    y = (h * q[..., None, :]).sum(-1)
    if D is not None:
        y = y + c(D)[:, None] * v
    if Z is not None:
        y = y * F.silu(c(Z))
    return y, [theta, h, k, v]


def _chunks(t: torch.Tensor, axis: int, chunk: int) -> torch.Tensor:
    """t with its time axis zero-padded to whole chunks and split into (nchunks, chunk) there."""
    axis %= t.dim()
    pad = -t.shape[axis] % chunk
    t = F.pad(t, (0, 0) * (t.dim() - 1 - axis) + (0, pad))
    return t.unflatten(axis, (-1, chunk))


def mamba3_siso_chunked_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None,
                            chunk_size=64, return_final_states=False, dtype=None):
    """``mamba3_siso_combined_ref``'s arguments and results (no cu_seqlens), computed chunk by chunk in ``dtype``
    (None: V's): the PyTorch composition the benchmarks time (vectorised over batch, heads and positions; a
    loop over chunks only for the state passing), and an independent formulation tested against the recurrence.

    theta is a cumsum (then mod 2 pi); v_s k_s^T enters with gamma_s at s and DT_{s+1} (1 - lam_{s+1}) at s + 1,
    so with scale_s = gamma_s + DT_{s+1} (1 - lam_{s+1}) (0 past the end) and cs the chunk-local cumsum of ADT:
    out_l = sum_{s<l} e^{cs_l - cs_s} scale_s (q_l . k_s) v_s + gamma_l (q_l . k_l) v_l + e^{cs_l} q_l . h_in
    (+ D v_l, * silu(Z_l)); a chunk's state S_c = sum_s e^{cs_last - cs_s} scale_s v_s k_s^T, h_in of the next
    chunk = e^{cs_last} h_in + S_c, starting from h_{-1} + DT_0 (1 - lam_0) v_{-1} k_{-1}^T (the input states).
    """
    c = lambda t: None if t is None else t.to(dtype or V.dtype)  # noqa: E731
    Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z = (c(t) for t in (Q, K, V, ADT, DT, Trap, Q_bias, K_bias,
                                                                          Angles, D, Z))
    (b, L, hq, N), (H, P), S, Qc = Q.shape, V.shape[2:], Angles.shape[-1], chunk_size
    theta0, h0, k0, v0 = (tuple(c(t) for t in Input_States) if Input_States is not None else
                          _zero_states(b, H, N, P, S, V.dtype, V.device))
    theta = torch.remainder(theta0[:, None] + torch.cumsum(math.pi * torch.tanh(Angles) * DT.transpose(1, 2)[..., None],
                                                           dim=1), TWO_PI)  # (b, L, H, S)
    q = rotate_pairs(Q.repeat_interleave(H // hq, dim=2) + Q_bias, theta)  # (b, L, H, N)
    k = rotate_pairs(K.repeat_interleave(H // hq, dim=2) + K_bias, theta)
    lam = torch.sigmoid(Trap)
    gamma, left = DT * lam, DT * (1 - lam)  # (b, H, L): the weights of a step's right and left ends
    scale = gamma + F.pad(left[..., 1:], (0, 1))
    h = h0 + left[..., 0, None, None] * v0[..., :, None] * k0[..., None, :]  # (b, H, P, N)
    qc, kc, vc = _chunks(q, 1, Qc), _chunks(k, 1, Qc), _chunks(V, 1, Qc)  # (b, nc, Qc, H, .)
    cs = torch.cumsum(_chunks(ADT, -1, Qc), dim=-1)  # (b, H, nc, Qc)
    sc, gc = _chunks(scale, -1, Qc), _chunks(gamma, -1, Qc)
    below = torch.ones(Qc, Qc, dtype=torch.bool, device=V.device).tril(-1)
    decay = torch.exp(torch.where(below, cs[..., :, None] - cs[..., None, :], -math.inf))  # (b, H, nc, l, s)
    w = decay * sc[..., None, :] + torch.diag_embed(gc)
    scores = torch.einsum("bclhn,bcshn->bhcls", qc, kc) * w
    y = torch.einsum("bhcls,bcshp->bclhp", scores, vc)
    states = torch.einsum("bhcs,bcshp,bcshn->bchpn", torch.exp(cs[..., -1:] - cs) * sc, vc, kc)
    h_in = []
    for c in range(cs.shape[2]):
        h_in.append(h)
        h = torch.exp(cs[:, :, c, -1])[..., None, None] * h + states[:, c]
    y = y + torch.einsum("bclhn,bchpn->bclhp", qc, torch.stack(h_in, 1)) * torch.exp(cs).permute(0, 2, 3, 1)[..., None]
    y = y.flatten(1, 2)[:, :L]
    if D is not None:
        y = y + D[:, None] * V
    if Z is not None:
        y = y * F.silu(Z)
    return (y, theta[:, -1], h, k[:, -1], V[:, -1]) if return_final_states else y


DA_MIN = -110.0  # the SSD pieces' lowest decay step (compute/ssd/common.py DA_MIN), the preprocess's clamp


def _segment_cumsum(x: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """x: (batch, seqlen, ...) -> its cumsum over seqlen restarting where seq_idx (batch, seqlen) changes."""
    cs = torch.cumsum(x, dim=1)
    pos = torch.arange(x.shape[1], device=x.device).expand(seq_idx.shape)
    new = torch.ones_like(seq_idx, dtype=torch.bool)
    new[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    start = torch.cummax(torch.where(new, pos, torch.zeros_like(pos)), dim=1).values  # each position's first
    before = F.pad(cs, (0, 0) * (x.dim() - 2) + (1, 0))  # before[:, t] = sum of positions < t
    idx = start.reshape(*start.shape, *(1,) * (x.dim() - 2)).expand_as(x)
    return cs - torch.gather(before, 1, idx)


def _per_sequence_last(theta: torch.Tensor, seq_idx: torch.Tensor, nseq: int) -> torch.Tensor:
    """theta (1, seqlen, ...) -> (nseq, ...): row i = theta at sequence i's last position (0 if it has none)."""
    sid = seq_idx[0].long()
    out = theta.new_zeros(nseq, *theta.shape[2:])
    last = torch.ones_like(sid, dtype=torch.bool)
    last[:-1] = sid[1:] != sid[:-1]
    return out.index_put((sid[last],), theta[0, last])


def mamba3_siso_preprocess_ref(Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Input_States=None,
                               chunk_size=64, dtype=torch.float64, seq_idx=None, nseq=None):
    """The chunked forward's preprocess (compute/mamba3/preprocess.py) from the math, differentiable.
    Q, K: (batch, seqlen, nheads_qk, headdim_qk); ADT, DT, Trap: (batch, nheads, seqlen); Q_bias, K_bias:
    (nheads, headdim_qk); Angles: (batch, seqlen, nheads, headdim_angles); D: (nheads,); Input_States: (angle
    (batch, nheads, headdim_angles), ssm (batch, nheads, headdim_v, headdim_qk), k (batch, nheads, headdim_qk),
    v (batch, nheads, headdim_v)) -> (q, k: (batch, seqlen, nheads, headdim_qk); dA_cs, scale, skip: (batch,
    nheads, nchunks, chunk_size); angle_out: (batch, nheads, headdim_angles); init: (batch, nheads, headdim_v,
    headdim_qk), or None without input states), all in ``dtype``.

    X, Y = Q + Q_bias, K + K_bias per head; theta a cumsum of pi tanh(Angles) DT (mod 2 pi) from the angle
    state; q, k = R(theta) X, R(theta) Y; lam = sigmoid(Trap), gamma = DT lam, nu = DT (1 - lam);
    dA_cs = chunk-local cumsum of clamp(ADT, DA_MIN) (slots past seqlen repeat the chunk's last value);
    scale_s = gamma_s + nu_{s+1} (nu_seqlen = 0), skip_s = D + gamma_s X_s . Y_s (both 0 past seqlen);
    init = ssm + nu_0 v_state k_state^T.

    Packed sequences: seq_idx (1, seqlen) int (non-decreasing sequence ids), no Input_States: theta's cumsum
    restarts at each sequence's first position, nu_{s+1} enters scale_s only within s's sequence, and
    angle_out is (nseq, nheads, headdim_angles) (nseq: default max id + 1): each sequence's theta at its last
    position, rows of sequences without positions 0."""
    if seq_idx is not None and (Input_States is not None or Q.shape[0] != 1):
        raise ValueError("seq_idx: packed sequences need batch 1 and no Input_States")
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, D = (c(t) for t in (Q, K, ADT, DT, Trap, Q_bias, K_bias, Angles, D))
    (batch, L, hq, _), H = Q.shape, ADT.shape[1]
    theta0 = c(Input_States[0]) if Input_States is not None else Angles.new_zeros(batch, H, Angles.shape[-1])
    rate = math.pi * torch.tanh(Angles) * DT.transpose(1, 2)[..., None]
    cum = torch.cumsum(rate, dim=1) if seq_idx is None else _segment_cumsum(rate, seq_idx)
    theta = torch.remainder(theta0[:, None] + cum, TWO_PI)  # (batch, seqlen, nheads, headdim_angles)
    X, Y = Q.repeat_interleave(H // hq, dim=2) + Q_bias, K.repeat_interleave(H // hq, dim=2) + K_bias
    lam = torch.sigmoid(Trap)
    gamma, nu = DT * lam, DT * (1 - lam)
    nxt = F.pad(nu[..., 1:], (0, 1))
    if seq_idx is not None:  # the next step's left term only within the sequence
        nxt = nxt * F.pad((seq_idx[:, 1:] == seq_idx[:, :-1]).to(nxt.dtype), (0, 1))[:, None]
    scale = gamma + nxt
    skip = gamma * torch.einsum("blhn,blhn->bhl", X, Y) + (D[:, None] if D is not None else 0)
    cs = torch.cumsum(_chunks(ADT.clamp(min=DA_MIN), -1, chunk_size), dim=-1)
    init = None
    if Input_States is not None:
        ssm, kst, vst = (c(t) for t in Input_States[1:])
        init = ssm + nu[..., 0, None, None] * vst[..., :, None] * kst[..., None, :]
    aout = ((theta[:, -1] if L else theta0) if seq_idx is None else
            _per_sequence_last(theta, seq_idx, nseq or int(seq_idx.max()) + 1))
    return (rotate_pairs(X, theta), rotate_pairs(Y, theta), cs, _chunks(scale, -1, chunk_size),
            _chunks(skip, -1, chunk_size), aout, init)
