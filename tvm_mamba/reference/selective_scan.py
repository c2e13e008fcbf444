"""Mamba-1 selective scan and its decode step, written from the math in plain PyTorch (no TVM).

Step-by-step recurrence (float64-capable), used by the tests and benchmarks as the independent reference;
autograd through it gives the reference gradients (including through ``last_state`` and ``initial_state``).
Semantics follow mamba_ssm 2.3.x ``selective_scan_ref`` / ``selective_state_update_ref``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _bc_at(M, t, batch, dim):
    """B or C at time t as (batch, dim, dstate): (dim, dstate), (batch, dstate, L) or (batch, g, dstate, L)."""
    if M.dim() == 2:
        return M[None].expand(batch, -1, -1)
    if M.dim() == 3:
        return M[:, None, :, t].expand(-1, dim, -1)
    groups = M.shape[1]
    return M[:, :, :, t].repeat_interleave(dim // groups, dim=1)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, initial_state=None, dtype=torch.float64):
    """u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (dim, dstate) | (batch, dstate, seqlen) |
    (batch, groups, dstate, seqlen); D, delta_bias: (dim,); initial_state: (batch, dim, dstate)
    -> out: (batch, dim, seqlen) [, last_state: (batch, dim, dstate)].

    dt = softplus?(delta + delta_bias); h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t; y_t = C_t . h_t + D u_t;
    out = y * silu(z). Computed step by step in ``dtype`` (float64 by default); out is cast to u's dtype.
    """
    batch, dim, seqlen = u.shape
    if A.is_complex():
        return _selective_scan_complex_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                           return_last_state, initial_state, dtype)
    uu, dt = u.to(dtype), delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[None, :, None]
    if delta_softplus:
        dt = F.softplus(dt)
    A_, B_, C_ = A.to(dtype), B.to(dtype), C.to(dtype)
    h = (initial_state.to(dtype) if initial_state is not None
         else torch.zeros(batch, dim, A.shape[1], dtype=dtype, device=u.device))
    ys = []
    for t in range(seqlen):
        dA = torch.exp(dt[:, :, t, None] * A_[None])
        h = dA * h + (dt[:, :, t] * uu[:, :, t])[..., None] * _bc_at(B_, t, batch, dim)
        ys.append((h * _bc_at(C_, t, batch, dim)).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + D.to(dtype)[None, :, None] * uu
    if z is not None:
        y = y * F.silu(z.to(dtype))
    out = y.to(u.dtype) if u.dtype != dtype and u.dtype != torch.float64 else y
    return (out, h) if return_last_state else out


def _as_complex_bc(M, cdtype):
    """B/C with a complex A (mamba_ssm's selective_scan_ref): a time-invariant (dim, dstate) is complex (a real
    one is taken as its real part); a varying (batch, [groups,] dstate, 2 seqlen) is real with (re, im)
    interleaved in time -> complex (batch, [groups,] dstate, seqlen)."""
    if M.dim() == 2:
        return M.to(cdtype)
    real = M.to(torch.float64 if cdtype == torch.complex128 else torch.float32)
    return torch.view_as_complex(real.reshape(*M.shape[:-1], M.shape[-1] // 2, 2).contiguous())


def _selective_scan_complex_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                                initial_state, dtype):
    """Complex A (dim, dstate): h complex; y_t = 2 Re(C_t . h_t) + D u_t (selective_scan_ref's ``y.real * 2``);
    last_state complex. ``dtype`` float64 -> complex128 math."""
    batch, dim, seqlen = u.shape
    cdt = torch.complex128 if dtype == torch.float64 else torch.complex64
    uu, dt = u.to(dtype), delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[None, :, None]
    if delta_softplus:
        dt = F.softplus(dt)
    A_, B_, C_ = A.to(cdt), _as_complex_bc(B, cdt), _as_complex_bc(C, cdt)
    h = (initial_state.to(cdt) if initial_state is not None
         else torch.zeros(batch, dim, A.shape[1], dtype=cdt, device=u.device))
    ys = []
    for t in range(seqlen):
        h = torch.exp(dt[:, :, t, None] * A_[None]) * h + (dt[:, :, t] * uu[:, :, t])[..., None] * _bc_at(B_, t, batch, dim)
        ys.append(2 * (h * _bc_at(C_, t, batch, dim)).sum(-1).real)
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + D.to(dtype)[None, :, None] * uu
    if z is not None:
        y = y * F.silu(z.to(dtype))
    out = y if dtype == torch.float64 else y.to(u.dtype)  # (a 16-bit dtype steps in complex64: y is float32)
    return (out, h) if return_last_state else out


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                               state_batch_indices=None, state_dtype=None):
    """One decode step; pure (returns (out, new_state)), float64 math.

    Mamba-1: state (batch, dim, dstate); x, dt, z: (batch, dim); A: (dim, dstate); B, C: (batch, dstate) or
    (batch, groups, dstate); D, dt_bias: (dim,).
    Mamba-2 heads: state (batch, nheads, headdim, dstate); x, dt, z: (batch, nheads, headdim);
    A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads, headdim).
    state_batch_indices: (batch,): row b reads and writes slot state_batch_indices[b] of a state pool
    (nslots, ...); a negative index is a padding row (out 0, no slot written) — mamba_ssm 2.3.2's Triton
    kernel. new_state is the whole pool (float64). state_dtype: round the new state to it (the storage of a
    16-bit state; out uses the unrounded value, as the Triton kernel) — for the low-precision drift bound.

    dt' = softplus?(dt + dt_bias); state' = exp(dt' A) state + dt' B x; out = (C . state' + D x) * silu(z).
    """
    f = torch.float64
    if state_batch_indices is not None:
        idx = state_batch_indices.long()
        live = idx >= 0
        pool = state.to(f).clone()
        out = torch.zeros(x.shape, dtype=f, device=x.device)
        if bool(live.any()):
            sel = lambda t: t[live] if t is not None else None  # noqa: E731
            o, new = selective_state_update_ref(pool[idx[live]], sel(x), sel(dt), A, sel(B), sel(C), D, sel(z),
                                                dt_bias, dt_softplus, state_dtype=state_dtype)
            out[live] = o
            pool[idx[live]] = new
        return out, pool
    if B.dim() == 2:  # Mamba-1 (batch, dstate): one group
        B, C = B[:, None], C[:, None]
    lead = x.shape[1]  # dim or nheads
    groups = B.shape[1]
    Bx = B.to(f).repeat_interleave(lead // groups, dim=1)  # (batch, lead, dstate)
    Cx = C.to(f).repeat_interleave(lead // groups, dim=1)
    if x.dim() == 3:  # heads: broadcast over headdim
        Bx, Cx = Bx[:, :, None], Cx[:, :, None]
    d = dt.to(f)
    if dt_bias is not None:
        d = d + dt_bias.to(f)
    if dt_softplus:
        d = F.softplus(d)
    new_state = torch.exp(d[..., None] * A.to(f)) * state.to(f) + (d * x.to(f))[..., None] * Bx
    out = (new_state * Cx).sum(-1)
    if state_dtype is not None:
        new_state = new_state.to(state_dtype).to(f)
    if D is not None:
        out = out + D.to(f) * x.to(f)
    if z is not None:
        out = out * F.silu(z.to(f))
    return out, new_state
