"""Decode step of the Mamba-1 selective scan (``selective_state_update``), both layouts, as a loop-nest
template (split out of selective_scan.py, which it shares helpers with).

    dt = softplus?(dt + dt_bias); state <- exp(dt A) * state + dt * B * x; out = (C . state + D x) * silu(z)

state: (batch, nheads, headdim, dstate) updated in place (Mamba-1 runs as nheads = dim, headdim = 1);
x, dt, z, out: (batch, nheads, headdim); A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._common import SERIAL_WORK, check_dtype, stamp
from .selective_scan import IO_DTYPES, _lanes, _Math, _vec_loop, acc_dtype


def selective_scan_update_template(nheads: int, headdim: int, dstate: int, ngroups: int, has_D: bool,
                                   has_z: bool, has_dt_bias: bool, dt_softplus: bool, x_dtype: str,
                                   B_dtype: str, C_dtype: str, mode: str = "generic",
                                   vec: int = 1, threads: int = 64) -> tirx.PrimFunc:
    """The decode-step loop nest: one lane per (batch, head, headdim) row, state updated in place."""
    H, P, N, G, V = nheads, headdim, dstate, ngroups, vec
    NV = N // V
    HPG = H // G
    ACC = acc_dtype(x_dtype)
    m = _Math(ACC)
    OUTER, INNER, TPB, SCOPE = _lanes(mode, threads)
    VEC = _vec_loop(mode)
    CPU = mode == "cpu"

    @T.macro
    def lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, batch, lane_o):
        for lane_i in INNER(TPB):
            if lane_o * TPB + lane_i < batch * H * P:
                lane = T.meta_var(lane_o * TPB + lane_i)
                yv = T.alloc_buffer((V,), ACC, scope=SCOPE)
                s = T.alloc_buffer((4,), ACC, scope=SCOPE)
                b = T.meta_var(lane // (H * P))
                hh = T.meta_var(lane // P % H)
                p = T.meta_var(lane % P)
                s[3] = m.cast(dt[b, hh, p]) + (dtb[hh, p] if has_dt_bias else m.zero)
                s[0] = m.softplus(s[3]) if dt_softplus else s[3]
                s[1] = s[0] * m.cast(x[b, hh, p])
                for ni in VEC(V):
                    yv[ni] = m.zero
                for no in range(NV):
                    for ni in VEC(V):
                        state[b, hh, p, no * V + ni] = (
                            m.exp(s[0] * A[hh, p, no * V + ni]) * state[b, hh, p, no * V + ni]
                            + s[1] * m.cast(Bm[b, hh // HPG, no * V + ni]))
                        yv[ni] = yv[ni] + m.cast(Cm[b, hh // HPG, no * V + ni]) * state[b, hh, p, no * V + ni]
                s[2] = (Dv[hh, p] * m.cast(x[b, hh, p])) if has_D else m.zero
                for ni in range(V):
                    s[2] = s[2] + yv[ni]
                if has_z:
                    out[b, hh, p] = (s[2] * m.silu(m.cast(z[b, hh, p]))).astype(x_dtype)
                else:
                    out[b, hh, p] = s[2].astype(x_dtype)

    @T.prim_func
    def update(state_h: T.handle, x_h: T.handle, dt_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle,
               D_h: T.handle, z_h: T.handle, dtb_h: T.handle, out_h: T.handle):
        batch = T.int32()
        state = T.match_buffer(state_h, (batch, H, P, N), ACC)
        x = T.match_buffer(x_h, (batch, H, P), x_dtype)
        dt = T.match_buffer(dt_h, (batch, H, P), x_dtype)
        A = T.match_buffer(A_h, (H, P, N), ACC)
        Bm = T.match_buffer(B_h, (batch, G, N), B_dtype)
        Cm = T.match_buffer(C_h, (batch, G, N), C_dtype)
        Dv = T.match_buffer(D_h, (H, P) if has_D else (1, 1), ACC)
        z = T.match_buffer(z_h, (batch, H, P) if has_z else (1, 1, 1), x_dtype)
        dtb = T.match_buffer(dtb_h, (H, P) if has_dt_bias else (1, 1), ACC)
        out = T.match_buffer(out_h, (batch, H, P), x_dtype)
        if CPU:
            if batch * H * P * N <= SERIAL_WORK:  # decode-size: on the calling thread, no pool launch
                for lane_o in T.serial((batch * H * P + TPB - 1) // TPB):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, batch, lane_o)
            else:
                for lane_o in OUTER((batch * H * P + TPB - 1) // TPB):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, batch, lane_o)
        else:
            for lane_o in OUTER((batch * H * P + TPB - 1) // TPB):
                lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, batch, lane_o)

    return update


def selective_scan_update(nheads: int, headdim: int, dstate: int, ngroups: int = 1, has_D: bool = False,
                          has_z: bool = False, has_dt_bias: bool = False, dt_softplus: bool = False,
                          x_dtype: str = "float32", B_dtype: str = "float32",
                          C_dtype: str = "float32") -> tirx.PrimFunc:
    """Decode step (Mamba-2 head layout; Mamba-1 is nheads=dim, headdim=1).
    state: (batch, nheads, headdim, dstate), updated in place; x, dt, z: (batch, nheads, headdim);
    A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads, headdim)
    -> out: (batch, nheads, headdim).

    dt' = softplus?(dt + dt_bias); state = exp(dt' A) state + dt' B x; out = (C . state + D x) * silu(z).
    """
    if min(nheads, headdim, dstate, ngroups) < 1 or nheads % ngroups:
        raise ValueError(f"ngroups: must divide nheads={nheads}, got {ngroups}")
    for name, dt in (("x", x_dtype), ("B", B_dtype), ("C", C_dtype)):
        check_dtype(name, dt, IO_DTYPES)
    static = dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups, has_D=has_D, has_z=has_z,
                  has_dt_bias=has_dt_bias, dt_softplus=dt_softplus, x_dtype=x_dtype, B_dtype=B_dtype,
                  C_dtype=C_dtype)
    return stamp(selective_scan_update_template(**static), "selective_scan_update", static)
