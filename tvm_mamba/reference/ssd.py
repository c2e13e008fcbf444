"""Mamba-2 SSD (state-space duality) scan written from the math in plain PyTorch (no TVM).

Two references with mamba_ssm 2.3.x ``mamba_chunk_scan_combined`` semantics:

* :func:`ssd_recurrence_ref` — the test oracle: a step-by-step recurrence over time (run it in float64),
  h_t = exp(dt_t A) h_{t-1} + dt_t x_t (x) B_t,  y_t = h_t C_t + D x_t,  y <- y * silu(z);
  the state restarts from zero where seq_idx changes (the id "before" position 0 is 0, so initial_states
  belong to the sequence with id 0, as upstream's kernels read it).
* :func:`ssd_chunked_ref` — the benchmark baseline: the chunked einsum algorithm the way upstream's
  reference (``ssd_minimal_discrete`` / ``chunk_scan_ref``) is written: segment sums, intra-chunk
  C B^T L x, chunk states, inter-chunk recurrence, state -> output.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """dt: (batch, seqlen, nheads) -> dt': same shape. dt' = clamp(softplus(dt + dt_bias), *dt_limit)
    (softplus only when asked, clamp only when dt_limit != (0, inf), as upstream)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)  # threshold 20, like upstream's kernels
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def ssd_recurrence_ref(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                       dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """x, z: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A: (nheads,);
    B, C: (batch, seqlen, ngroups, dstate); D: (nheads,) or (nheads, headdim); dt_bias: (nheads,);
    initial_states: (batch, nheads, headdim, dstate); seq_idx: (batch, seqlen) int
    -> y: (batch, seqlen, nheads, headdim) [, final_states: (batch, nheads, headdim, dstate)].

    Step by step: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T; y_t = h_t C_t + D x_t; y *= silu(z).
    Computed in x's dtype (pass float64 tensors for the oracle); differentiable by autograd.
    """
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    rep = nheads // ngroups
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh = B.repeat_interleave(rep, dim=2)  # (batch, seqlen, nheads, dstate)
    Ch = C.repeat_interleave(rep, dim=2)
    h = (initial_states.to(x.dtype) if initial_states is not None
         else x.new_zeros(batch, nheads, headdim, dstate))
    prev_id = None if seq_idx is None else torch.zeros(batch, dtype=seq_idx.dtype, device=x.device)
    ys = []
    for t in range(seqlen):
        if seq_idx is not None:
            keep = (seq_idx[:, t] == prev_id).to(x.dtype)[:, None, None, None]
            h = h * keep
            prev_id = seq_idx[:, t]
        dA = torch.exp(dt[:, t] * A.to(x.dtype))  # (batch, nheads)
        h = dA[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    y = _skip_and_gate(torch.stack(ys, dim=1), x, D, z, x.dtype)
    return (y, h) if return_final_states else y


def _skip_and_gate(y, x, D, z, D_dtype):
    """y + D x (D: (nheads,) or (nheads, headdim), cast to D_dtype), then times silu(z): both references'
    output step. y, x, z: (batch, seqlen, nheads, headdim)."""
    if D is not None:
        Dx = D.to(D_dtype)[:, None] if D.dim() == 1 else D.to(D_dtype)
        y = y + x * Dx
    if z is not None:
        y = y * F.silu(z)
    return y


def segsum(x):
    """x: (..., T) -> (..., T, T): out[..., i, j] = sum_{j < k <= i} x[..., k] for j <= i, -inf above the
    diagonal. Exponentials of segment sums computed as differences of masked cumulative sums (stable)."""
    T = x.size(-1)
    xr = x[..., None].expand(*x.shape, T)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    xr = xr.masked_fill(~mask, 0)
    xs = torch.cumsum(xr, dim=-2)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=0)
    return xs.masked_fill(~mask, -math.inf)


def ssd_chunked_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                    dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, state_dtype=None):
    """Shapes as :func:`ssd_recurrence_ref` (no seq_idx). The chunked SSD algorithm in einsums, after
    upstream's ``ssd_minimal_discrete``: Y = Y_diag (C B^T * exp(segsum) * dt, times x) + Y_off (C times
    the carried chunk states); the states pass between chunks through exp(segsum of chunk totals).
    seqlen is zero-padded up to a multiple of chunk_size (padding has dt = 0: no decay, no input).
    state_dtype: the states entering each chunk (what Y_off reads) are rounded to it (mamba_ssm's
    ``state_dtype``: chunk states stored in that dtype); the final state is not rounded.
    """
    batch, seqlen, nheads, headdim = x.shape
    ngroups = B.shape[2]
    rep = nheads // ngroups
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    pad = (-seqlen) % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    nchunks = x.shape[1] // chunk_size
    Bh = B.repeat_interleave(rep, dim=2)
    Ch = C.repeat_interleave(rep, dim=2)

    def chunk(t):  # (b, l, ...) -> (b, c, l, ...)
        return t.reshape(batch, nchunks, chunk_size, *t.shape[2:])

    X = chunk(x * dt[..., None])  # discretized input
    Aa = chunk(dt * A.to(dt.dtype)).permute(0, 3, 1, 2)  # (b, h, c, l)
    Bc, Cc = chunk(Bh), chunk(Ch)
    A_cumsum = torch.cumsum(Aa, dim=-1)
    L = torch.exp(segsum(Aa))  # (b, h, c, l, s)
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, L, X)
    decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, decay_states, X)
    init = (initial_states.to(states.dtype) if initial_states is not None
            else torch.zeros_like(states[:, 0]))
    states = torch.cat([init[:, None], states], dim=1)  # (b, c+1, h, p, n)
    decay_chunk = torch.exp(segsum(F.pad(A_cumsum[..., -1], (1, 0))))  # (b, h, c+1, c+1)
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    if state_dtype is not None:
        states = states.to(state_dtype).to(new_states.dtype)
    state_decay_out = torch.exp(A_cumsum)
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, states, state_decay_out)
    y = (Y_diag + Y_off).reshape(batch, nchunks * chunk_size, nheads, headdim)[:, :seqlen]
    y = _skip_and_gate(y, x[:, :seqlen], D, z, y.dtype)
    return (y, final_state) if return_final_states else y


def ssd_varlen_states_ref(x, dt, A, B, C, chunk_size, cu_seqlens, dt_bias=None, initial_states=None,
                          seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """x: (1, seqlen, nheads, headdim); dt: (1, seqlen, nheads); B, C: (1, seqlen, ngroups, dstate);
    cu_seqlens: (num_seqs + 1,); initial_states: (1, nheads, headdim, dstate); seq_idx: (1, seqlen)
    -> varlen_states: (num_seqs, nheads, headdim, dstate), in x's dtype.

    mamba_ssm's ``chunk_state_varlen`` semantics, from the step-by-step recurrence: for sequence [s, e) whose
    last position lies in chunk c, the state of the same recurrence as y (``ssd_recurrence_ref``: resets where
    seq_idx changes, initial_states for id 0) after position e - 1 when the sequence began before chunk c or
    at position 0; otherwise (it began inside chunk c) the recurrence restarted from zero at s. With seq_idx
    consistent with cu_seqlens both are the sequence's own final state. An empty sequence gives zeros.
    """
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[3]
    out = x.new_zeros(len(cu_seqlens) - 1, nheads, headdim, dstate)
    bounds = [int(v) for v in cu_seqlens]
    kw = dict(D=None, z=None, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
              return_final_states=True)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e == s:
            continue
        c = (e - 1) // chunk_size
        if s < max(c * chunk_size, 1):  # the running state after e - 1
            _, h = ssd_recurrence_ref(x[:, :e], dt[:, :e], A, B[:, :e], C[:, :e], initial_states=initial_states,
                                      seq_idx=None if seq_idx is None else seq_idx[:, :e], **kw)
        else:  # the sequence alone, from zero
            _, h = ssd_recurrence_ref(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], **kw)
        out[i] = h[0]
    return out


def ssd_chunk_scan_strict_ref(x, B, C, dt, dA_step, D, states_in, z=None, step_group=1):
    """Mamba-3's chunk scan (ssd_chunk_scan / ssd_chunk_scan_bwd with ``diag_skip``) from the math, chunk by
    chunk, in the kernels' chunk layout: x, z: (batch, seqlen, nheads, headdim); B, C: (batch, seqlen, ngroups,
    dstate); dt, dA_step, D: (batch, nheads, nchunks, chunk_size) (dt', the decay steps dt' A and the
    per-position skip; dt' and the steps are 0 past seqlen); states_in: (batch, nchunks, nheads, headdim,
    dstate) (the state entering each chunk)
    -> y: (batch, seqlen, nheads, headdim); states: (batch, nchunks, nheads, headdim, dstate) (each chunk's own
    state at its end, ssd_chunk_state's S_c).

    With cs the cumsum of the steps within the chunk (cs[l] = sum_{s<=l} dA_step[s]):
    y0[l] = sum_{s<l} (C_l.B_s) exp(cs[l]-cs[s]) dt[s] x[s] + exp(cs[l]) C_l Sin + D[l] x[l],  y = y0 silu(z);
    S_c = sum_s exp(cs[Q-1]-cs[s]) dt[s] x_s B_s^T. The sum is strict (s < l): the diagonal is D's. step_group
    G > 1 (``ScanDims.step_group``, Mamba-3 MIMO's flattened (step, rank) positions): the sum runs over
    s // G < l // G, the strictly earlier groups of G positions.
    Computed in x's dtype; differentiable by autograd (run it in float64 for the kernels' gradients).
    """
    batch, seqlen, nheads, headdim = x.shape
    nchunks, Q = dt.shape[2], dt.shape[3]
    pad = nchunks * Q - seqlen

    def chunks(t):  # (b, seqlen, g, n) -> (b, c, l, h, n) per head, zero past seqlen
        t = F.pad(t.repeat_interleave(nheads // t.shape[2], dim=2), (0, 0, 0, 0, 0, pad))
        return t.reshape(batch, nchunks, Q, nheads, t.shape[-1])

    xc, Bc, Cc = chunks(x), chunks(B.to(x.dtype)), chunks(C.to(x.dtype))
    cs = torch.cumsum(dA_step, dim=-1)  # (b, h, c, l)
    pos = torch.arange(Q, device=x.device) // step_group
    strict = pos[None, :] < pos[:, None]  # [l, s]: s < l (s // G < l // G)
    seg = (cs[..., :, None] - cs[..., None, :]).masked_fill(~strict, -math.inf)
    w = torch.exp(seg) * dt[..., None, :]  # (b, h, c, l, s)
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, w, xc)
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, states_in.to(x.dtype), torch.exp(cs))
    y = y + D.permute(0, 2, 3, 1)[..., None] * xc
    y = y.reshape(batch, nchunks * Q, nheads, headdim)[:, :seqlen]
    if z is not None:
        y = y * F.silu(z)
    decay = torch.exp(cs[..., -1:] - cs) * dt  # (b, h, c, s)
    states = torch.einsum("bhcs,bcshp,bcshn->bchpn", decay, xc, Bc)
    return y, states
