"""Decode step of the Mamba-1 selective scan (``selective_state_update``), both layouts, as a loop-nest
template (split out of selective_scan.py, which it shares helpers with).

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

from ._common import SERIAL_WORK, check_dtype, stamp
from .selective_scan import IO_DTYPES, _lanes, _Math, _vec_loop, acc_dtype

INDEX_DTYPES = ("int32", "int64")


def selective_scan_update_template(nheads: int, headdim: int, dstate: int, ngroups: int, has_D: bool,
                                   has_z: bool, has_dt_bias: bool, dt_softplus: bool, x_dtype: str,
                                   B_dtype: str, C_dtype: str, state_dtype: str | None = None,
                                   dt_dtype: str | None = None, z_dtype: str | None = None,
                                   idx_dtype: str | None = None, mode: str = "generic",
                                   tie_hdim: bool = False, vec: int = 1, threads: int = 64) -> tirx.PrimFunc:
    """The decode-step loop nest: one lane per (batch, head, headdim) row, state updated in place.
    tie_hdim: A (nheads,), dt (batch, nheads), D / dt_bias (nheads,) (one value per head)."""
    H, P, N, G, V = nheads, headdim, dstate, ngroups, vec
    NV = N // V
    HPG = H // G
    ACC = acc_dtype(x_dtype)
    ST, DT, ZT = state_dtype or ACC, dt_dtype or x_dtype, z_dtype or x_dtype
    IDX = idx_dtype is not None
    m = _Math(ACC)
    OUTER, INNER, TPB, SCOPE = _lanes(mode, threads)
    VEC = _vec_loop(mode)
    CPU = mode == "cpu"
    TIE = tie_hdim

    def per_head(v, hh, p):  # D / dt_bias: (nheads,) tied, else (nheads, headdim)
        return v[hh] if TIE else v[hh, p]

    def to_state(v):
        return v if ST == ACC else v.astype(ST)

    @T.macro
    def row(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, sb, hh, p):
        yv = T.alloc_buffer((V,), ACC, scope=SCOPE)
        hv = T.alloc_buffer((V,), ACC, scope=SCOPE)  # the new state in ACC (rounded once when stored)
        s = T.alloc_buffer((5,), ACC, scope=SCOPE)  # dt', dt' x, y, dt + dt_bias, exp(dt' A) (tied)
        s[3] = m.cast(dt[b, hh] if TIE else dt[b, hh, p]) + (per_head(dtb, hh, p) if has_dt_bias else m.zero)
        s[0] = m.softplus(s[3]) if dt_softplus else s[3]
        s[1] = s[0] * m.cast(x[b, hh, p])
        if TIE:
            s[4] = m.exp(s[0] * A[hh])
        for ni in VEC(V):
            yv[ni] = m.zero
        for no in range(NV):
            for ni in VEC(V):
                hv[ni] = ((s[4] if TIE else m.exp(s[0] * A[hh, p, no * V + ni]))
                          * m.cast(state[sb, hh, p, no * V + ni])
                          + s[1] * m.cast(Bm[b, hh // HPG, no * V + ni]))
                state[sb, hh, p, no * V + ni] = to_state(hv[ni])
                yv[ni] = yv[ni] + m.cast(Cm[b, hh // HPG, no * V + ni]) * hv[ni]
        s[2] = (per_head(Dv, hh, p) * m.cast(x[b, hh, p])) if has_D else m.zero
        for ni in range(V):
            s[2] = s[2] + yv[ni]
        if has_z:
            out[b, hh, p] = (s[2] * m.silu(m.cast(z[b, hh, p]))).astype(x_dtype)
        else:
            out[b, hh, p] = s[2].astype(x_dtype)

    @T.macro
    def lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lane_o):
        for lane_i in INNER(TPB):
            if lane_o * TPB + lane_i < batch * H * P:
                lane = T.meta_var(lane_o * TPB + lane_i)
                b = T.meta_var(lane // (H * P))
                hh = T.meta_var(lane // P % H)
                p = T.meta_var(lane % P)
                if IDX:
                    if sidx[b] < T.Cast(idx_dtype, 0):  # padding row (mamba_ssm: skip it, out = 0)
                        out[b, hh, p] = m.zero.astype(x_dtype)
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
        x = T.match_buffer(x_h, (batch, H, P), x_dtype)
        dt = T.match_buffer(dt_h, (batch, H) if TIE else (batch, H, P), DT)
        A = T.match_buffer(A_h, (H,) if TIE else (H, P, N), ACC)
        Bm = T.match_buffer(B_h, (batch, G, N), B_dtype)
        Cm = T.match_buffer(C_h, (batch, G, N), C_dtype)
        Dv = T.match_buffer(D_h, ((H,) if TIE else (H, P)) if has_D else (1, 1), ACC)
        z = T.match_buffer(z_h, (batch, H, P) if has_z else (1, 1, 1), ZT)
        dtb = T.match_buffer(dtb_h, ((H,) if TIE else (H, P)) if has_dt_bias else (1, 1), ACC)
        sidx = T.match_buffer(sidx_h, (batch,) if IDX else (1,), idx_dtype or "int32")
        out = T.match_buffer(out_h, (batch, H, P), x_dtype)
        if CPU:
            if batch * H * P * N <= SERIAL_WORK:  # decode-size: on the calling thread, no pool launch
                for lane_o in T.serial((batch * H * P + TPB - 1) // TPB):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lane_o)
            else:
                for lane_o in OUTER((batch * H * P + TPB - 1) // TPB):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lane_o)
        else:
            for lane_o in OUTER((batch * H * P + TPB - 1) // TPB):
                lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lane_o)

    return update


def selective_scan_update(nheads: int, headdim: int, dstate: int, ngroups: int = 1, has_D: bool = False,
                          has_z: bool = False, has_dt_bias: bool = False, dt_softplus: bool = False,
                          x_dtype: str = "float32", B_dtype: str = "float32", C_dtype: str = "float32",
                          state_dtype: str | None = None, dt_dtype: str | None = None, z_dtype: str | None = None,
                          idx_dtype: str | None = None, tie_hdim: bool = False) -> tirx.PrimFunc:
    """Decode step (Mamba-2 head layout; Mamba-1 is nheads=dim, headdim=1).
    state: (nstate, nheads, headdim, dstate) in ``state_dtype`` (default: the accumulation dtype), updated in
    place; x, out: (batch, nheads, headdim); dt, z: the same shape in ``dt_dtype`` / ``z_dtype`` (default x's);
    A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads, headdim);
    state_batch_indices: (batch,) ``idx_dtype`` (int32/int64; absent when None: nstate = batch, row b -> slot b).
    tie_hdim: one A / dt / D / dt_bias per head (mamba_ssm's TIE_HDIM): A: (nheads,), dt: (batch, nheads),
    D, dt_bias: (nheads,).

    dt' = softplus?(dt + dt_bias); s = slot of the row; state[s] = exp(dt' A) state[s] + dt' B x;
    out = (C . state[s] + D x) * silu(z); a row with a negative slot only writes out = 0.
    The optional dtypes are None by default and tie_hdim False (and then absent from the kernel key: the
    committed tuning records of the fp32-state decode step keep matching).
    """
    if min(nheads, headdim, dstate, ngroups) < 1 or nheads % ngroups:
        raise ValueError(f"ngroups: must divide nheads={nheads}, got {ngroups}")
    for name, dt in (("x", x_dtype), ("B", B_dtype), ("C", C_dtype), ("state", state_dtype), ("dt", dt_dtype),
                     ("z", z_dtype)):
        if dt is not None:
            check_dtype(name, dt, IO_DTYPES)
    if idx_dtype is not None:
        check_dtype("state_batch_indices", idx_dtype, INDEX_DTYPES)
    if (acc_dtype(x_dtype) == "float64") != ((state_dtype or acc_dtype(x_dtype)) == "float64"):
        raise ValueError(f"state: a float64 kernel keeps a float64 state (x {x_dtype}, state {state_dtype})")
    static = dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups, has_D=has_D, has_z=has_z,
                  has_dt_bias=has_dt_bias, dt_softplus=dt_softplus, x_dtype=x_dtype, B_dtype=B_dtype,
                  C_dtype=C_dtype, state_dtype=state_dtype, dt_dtype=dt_dtype, z_dtype=z_dtype,
                  idx_dtype=idx_dtype)
    if tie_hdim:
        static["tie_hdim"] = True
    return stamp(selective_scan_update_template(**static), "selective_scan_update", static)
