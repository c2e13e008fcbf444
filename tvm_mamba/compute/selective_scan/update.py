"""Decode step of the Mamba-1 selective scan (``selective_state_update``), both layouts, as one template
laid out by a one-thread-per-lane ``Layout`` (serial, CPU vector lanes, a CUDA thread per row).

    dt = softplus?(dt + dt_bias); state <- exp(dt A) * state + dt * B * x; out = (C . state + D x) * silu(z)

state: (nstate, nheads, headdim, dstate) updated in place (Mamba-1 runs as nheads = dim, headdim = 1);
x, dt, z, out: (batch, nheads, headdim); A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate).
Tied per-head parameters (``tie_hdim``, mamba_ssm's TIE_HDIM layout: Mamba-2 has one A, dt, D, dt_bias per
head): A: (nheads,), dt: (batch, nheads), D, dt_bias: (nheads,), read once per row; exp(dt' A) is then one
value per row instead of one per state element. Same math.
Row b's state is slot ``state_batch_indices[b]`` of the pool when indices are given (continuous batching;
a negative index is a padding row: out = 0, no state touched, as mamba_ssm 2.3.2), else slot b.
A 16-bit state is loaded, updated in the accumulation dtype and rounded to its own dtype once per step;
the output reads the unrounded value (as mamba_ssm's Triton kernel, whose ``out`` uses the fp32 state).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._dims import UpdateDims
from ._layout import Layout
from ._step import ScanMath


def _row_macro(dims: UpdateDims, L: Layout):
    H, P, N, V = dims.nheads, dims.headdim, dims.dstate, L.V
    HPG, ACC, TIE, m, SCOPE = dims.nheads // dims.ngroups, dims.acc, dims.tie_hdim, L.math, L.scope
    ST = dims.state_dtype or ACC

    def per_head(v, hh, p):  # D / dt_bias: (nheads,) tied, else (nheads, headdim)
        return v[hh] if TIE else v[hh, p]

    def to_state(v):
        return v if ST == ACC else v.astype(ST)

    @T.macro
    def row(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, sb, hh, p):
        yv = T.alloc_buffer((1, V), ACC, scope=SCOPE)
        hv = T.alloc_buffer((V,), ACC, scope=SCOPE)  # the new state in ACC (rounded once when stored)
        s = T.alloc_buffer((5,), ACC, scope=SCOPE)  # dt', dt' x, y, dt + dt_bias, exp(dt' A) (tied)
        s[3] = m.cast(dt[b, hh] if TIE else dt[b, hh, p]) + (per_head(dtb, hh, p) if dims.has_dt_bias else m.zero)
        s[0] = m.softplus(s[3]) if dims.dt_softplus else s[3]
        s[1] = s[0] * m.cast(x[b, hh, p])
        if TIE:
            s[4] = m.exp(s[0] * A[hh])
        for ki in L.st_inner():
            yv[0, ki] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                hv[ki] = ScanMath.h_next(s[4] if TIE else m.exp(s[0] * A[hh, p, L.state(ko, ki, 0)]),
                                         m.cast(state[sb, hh, p, L.state(ko, ki, 0)]), s[1],
                                         m.cast(Bm[b, hh // HPG, L.state(ko, ki, 0)]))
                state[sb, hh, p, L.state(ko, ki, 0)] = to_state(hv[ki])
                yv[0, ki] = yv[0, ki] + m.cast(Cm[b, hh // HPG, L.state(ko, ki, 0)]) * hv[ki]
        L.reduce_plus(s, 2, yv, 0, (per_head(Dv, hh, p) * m.cast(x[b, hh, p])) if dims.has_D else m.zero)
        if dims.has_z:
            out[b, hh, p] = (s[2] * m.silu(m.cast(z[b, hh, p]))).astype(dims.x_dtype)
        else:
            out[b, hh, p] = s[2].astype(dims.x_dtype)

    return row


# a row's scalar work (softplus, SiLU, the dstate sum) in state-element equivalents, for the serial / parallel
# choice: Mamba-1's 16-state rows are dominated by it (d_inner 1536: 45 us on the calling thread, 25 us on two)
ROW_WORK = 64


def update_template(dims: UpdateDims, L: Layout) -> tirx.PrimFunc:
    """The decode-step loop nest: one lane per (batch, head, headdim) row, state updated in place."""
    H, P, N, G = dims.nheads, dims.headdim, dims.dstate, dims.ngroups
    ACC, TIE, IDX, idx_dtype = dims.acc, dims.tie_hdim, dims.idx_dtype is not None, dims.idx_dtype
    ST, DT, ZT = dims.state_dtype or ACC, dims.dt_dtype or dims.x_dtype, dims.z_dtype or dims.x_dtype
    m, serial_work = L.math, getattr(L, "serial_work", None)
    row = _row_macro(dims, L)

    @T.macro
    def lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo):
        for li in L.lane_inner():
            if L.lane_guard(lo, li, batch * H * P):
                lane = T.meta_var(L.lane_of(lo, li, batch * H * P))
                b = T.meta_var(lane // (H * P))
                hh = T.meta_var(lane // P % H)
                p = T.meta_var(lane % P)
                if IDX:
                    if sidx[b] < T.Cast(idx_dtype, 0):  # padding row (mamba_ssm: skip it, out = 0)
                        out[b, hh, p] = m.zero.astype(dims.x_dtype)
                    else:
                        row(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, T.Cast("int32", sidx[b]), hh, p)
                else:
                    row(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, b, hh, p)

    @T.prim_func
    def update(state_h: T.handle, x_h: T.handle, dt_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle,
               D_h: T.handle, z_h: T.handle, dtb_h: T.handle, sidx_h: T.handle, out_h: T.handle):
        batch = T.int32()
        nstate = T.int32()  # state slots in the pool (== batch without indices)
        state = T.match_buffer(state_h, (nstate if IDX else batch, H, P, N), ST)
        x = T.match_buffer(x_h, (batch, H, P), dims.x_dtype)
        dt = T.match_buffer(dt_h, (batch, H) if TIE else (batch, H, P), DT)
        A = T.match_buffer(A_h, (H,) if TIE else (H, P, N), ACC)
        Bm = T.match_buffer(B_h, (batch, G, N), dims.B_dtype)
        Cm = T.match_buffer(C_h, (batch, G, N), dims.C_dtype)
        Dv = T.match_buffer(D_h, ((H,) if TIE else (H, P)) if dims.has_D else (1, 1), ACC)
        z = T.match_buffer(z_h, (batch, H, P) if dims.has_z else (1, 1, 1), ZT)
        dtb = T.match_buffer(dtb_h, ((H,) if TIE else (H, P)) if dims.has_dt_bias else (1, 1), ACC)
        sidx = T.match_buffer(sidx_h, (batch,) if IDX else (1,), idx_dtype or "int32")
        out = T.match_buffer(out_h, (batch, H, P), dims.x_dtype)
        if serial_work is not None:
            if batch * H * P * (N + ROW_WORK) <= serial_work:  # decode-size: the calling thread, no pool launch
                for lo in T.serial((batch * H * P + L.TPB - 1) // L.TPB):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo)
            else:
                for lo in L.lane_outer(batch * H * P):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo)
        else:
            for lo in L.lane_outer(batch * H * P):
                lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo)

    return update
