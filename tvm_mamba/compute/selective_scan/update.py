"""Decode step of the Mamba-1 selective scan (``selective_state_update``), both layouts, as one template
laid out by a one-thread-per-lane ``Layout`` (serial, CPU vector lanes, a CUDA thread per row).

    dt = softplus?(dt + dt_bias); state <- exp(dt A) * state + dt * B * x; out = (C . state + D x) * silu(z)

state: (nstate, nheads, headdim, dstate) updated in place (Mamba-1 runs as nheads = dim, headdim = 1);
x, dt, z, out: (batch, nheads, headdim); A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate).
``mamba1_layout`` takes Mamba-1's tensors without the unit axes (x (batch, dim), ...: UpdateDims) and reads
them through head-layout buffers declared over the same memory: one loop nest for both.
Tied per-head parameters (``tie_hdim``, mamba_ssm's TIE_HDIM layout: Mamba-2 has one A, dt, D, dt_bias per
head): A, D, dt_bias, dt in their untied shapes but of any strides, read at headdim (and dstate) index 0: the
expanded views mamba_ssm's Mamba2.step passes, taken as they come (a view of each step's new dt, and a check
of each parameter's, would cost a decode call more than the kernel's head loop). A lane then runs
``head_rows`` rows of one head (the layout's choice: the whole head on the CPU, one row per CUDA thread) after
computing the head's
softplus(dt + dt_bias) and exp(dt' A) once: 1,536 times a layer -> 24 at Mamba-2 130M's (1, 24, 64, 128) on
the CPU, 32-35 -> 21-26 us a layer in its decode step (2 threads). Each row's arithmetic is unchanged (same
bits). Same math.
Row b's state is slot ``state_batch_indices[b]`` of the pool when indices are given (continuous batching;
a negative index is a padding row: out = 0, no state touched, as mamba_ssm 2.3.2), else slot b. Slots may lie
any distance apart (the slot stride is the tensor's own; each slot compact): a server's pool pages hold a
layer's conv state and SSM state together, and the kernel updates the SSM state in place there.
A 16-bit state is loaded, updated in the accumulation dtype and rounded to its own dtype once per step;
the output reads the unrounded value (as mamba_ssm's Triton kernel, whose ``out`` uses the fp32 state).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import UpdateDims
from ._layout import Layout
from ._step import ScanMath
from ..strategy import slot_checks


def _scalars_macro(dims: UpdateDims, L: Layout):
    """dt' = softplus?(dt + dt_bias) into hs[1] (hs[0]: dt + dt_bias) and, tied, exp(dt' A) into hs[2]: for
    row (b, hh, p), or with ``tie_hdim`` for head (b, hh) (p unused), computed once for the rows that share it."""
    TIE, m = dims.tie_hdim, L.math

    @T.macro
    def scalars(hs, dt, A, dtb, b, hh, p, j):
        L.uniform(hs, 0, m.cast(dt[b, hh, 0 if TIE else p]) + (
            dtb[hh, 0 if TIE else p] if dims.has_dt_bias else m.zero), j)
        hs[1] = m.softplus(hs[0]) if dims.dt_softplus else hs[0]
        if TIE:
            L.uniform(hs, 2, hs[1] * A[hh, 0, 0], j)  # the exp's argument bound first: its polynomial reads it ~20x
            hs[2] = m.exp(hs[2])

    return scalars


def _if_ok(ok, value, zero):
    """``value``, or ``zero`` on a clamped lane (``ok`` false; Python True: every lane is real). A clamped
    lane runs the row only to join its warp's shuffles; reading the state there would read the last real
    row's state while that row's own lane updates it in place: a read-write race (the value was discarded,
    but the harness's checker and a GPU race detector see it). The guarded load is not issued."""
    return value if ok is True else tirx.if_then_else(ok, value, zero)


def _row_macro(dims: UpdateDims, L: Layout):
    """One (batch, head, headdim row p) row given its dt' (hs[1]) and, tied, its head's exp(dt' A) (hs[2]), on
    lane thread ``j`` (its states n = L.state(ko, ki, j)); B / C from ``bc`` when the layout stages them
    (``stage_bc``: bc[0 / 1, L.reg(ko, ki)], loaded once per lane), else from global memory. Writes only
    where ``ok`` (a clamped warp lane computes but does not store); out by the lane's leader."""
    N, V = dims.dstate, L.V
    HPG, ACC, TIE, m, SCOPE = dims.nheads // dims.ngroups, dims.acc, dims.tie_hdim, L.math, L.scope
    ST, STAGE = dims.state_dtype or ACC, L.stage_bc

    def per_head(v, hh, p):  # D: (nheads, headdim), tied: read at headdim 0
        return v[hh, 0 if TIE else p]

    def to_state(v):
        return v if ST == ACC else v.astype(ST)

    @T.macro
    def row(state, x, A, Bm, Cm, Dv, z, out, b, sb, hh, p, hs, bc, j, ok):
        yv = T.alloc_buffer((1, V), ACC, scope=SCOPE)
        hv = T.alloc_buffer((V,), ACC, scope=SCOPE)  # the new state in ACC (rounded once when stored)
        s = T.alloc_buffer((3,), ACC, scope=SCOPE)  # dt' x, y, x (then z)
        L.uniform(s, 2, m.cast(x[b, hh, p]), j)
        s[0] = hs[1] * s[2]
        for ki in L.st_inner():
            yv[0, ki] = m.zero
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                if not TIE:  # exp(dt' A[n]), its argument bound first (as the tied head's)
                    hv[ki] = hs[1] * A[hh, p, L.state(ko, ki, j)]
                hv[ki] = ScanMath.h_next(hs[2] if TIE else m.exp(hv[ki]),
                                         _if_ok(ok, m.cast(state[sb, hh, p, L.state(ko, ki, j)]), m.zero), s[0],
                                         bc[0, L.reg(ko, ki)] if STAGE
                                         else m.cast(Bm[b, hh // HPG, L.state(ko, ki, j)]))
                if ok:
                    state[sb, hh, p, L.state(ko, ki, j)] = to_state(hv[ki])
                yv[0, ki] = yv[0, ki] + (bc[1, L.reg(ko, ki)] if STAGE
                                         else m.cast(Cm[b, hh // HPG, L.state(ko, ki, j)])) * hv[ki]
        L.reduce_plus_lead(s, 1, yv, 0, (per_head(Dv, hh, p) * s[2]) if dims.has_D else m.zero, L.leader(ok, j))
        if L.leader(ok, j):
            if dims.has_z:
                s[2] = m.cast(z[b, hh, p])  # bound first: SiLU's rational function reads it ~20 times
                out[b, hh, p] = (s[1] * m.silu(s[2])).astype(dims.x_dtype)
            else:
                out[b, hh, p] = s[1].astype(dims.x_dtype)

    return row


def head_rows(dims: UpdateDims, L: Layout) -> int:
    """Rows (headdim entries p) of one head a lane runs: the layout's ``head_rows``; None: the whole head when
    tied (its rows then share one softplus and one exp), else 1 (untied rows each have their own dt; a CUDA
    lane of several still shares their B / C)."""
    R = L.head_rows or (dims.headdim if dims.tie_hdim else 1)
    if dims.headdim % R:
        raise ValueError(f"head_rows: {R} must divide headdim={dims.headdim}")
    return R


def _lane_macro(dims: UpdateDims, L: Layout):
    """One lane: ``R`` = head_rows consecutive rows p = pb R + r of head (b, hh), the slot-index test first
    (a padding row: out = 0, its state slot neither read nor written); thread ``j`` of the lane, its writes
    guarded by ``ok`` (see _row_macro)."""
    H, P, R, m, N = dims.nheads, dims.headdim, head_rows(dims, L), L.math, dims.dstate
    ACC, TIE, IDX, idx_dtype, SCOPE = dims.acc, dims.tie_hdim, dims.idx_dtype is not None, dims.idx_dtype, L.scope
    HPG, STAGE = dims.nheads // dims.ngroups, L.stage_bc
    # lanes of several threads (a CUDA warp split into dstate-wide lanes) meet in shuffles over the whole warp:
    # a padding row's threads must reach them too (a thread that skips a __shfl_xor_sync its mask names is
    # undefined behaviour), so its row runs with ``ok`` false, as a clamped lane's does
    SHARED = getattr(L, "W", 1) > 1
    scalars, row = _scalars_macro(dims, L), _row_macro(dims, L)

    @T.macro
    def rows_on(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, sb, hh, pb, bc, j, ok):
        hs = T.alloc_buffer((3,), ACC, scope=SCOPE)  # dt + dt_bias, dt', exp(dt' A) (tied: the head's)
        if TIE:
            scalars(hs, dt, A, dtb, b, hh, 0, j)
        for r in T.serial(R):
            if not TIE:
                scalars(hs, dt, A, dtb, b, hh, pb * R + r, j)
            row(state, x, A, Bm, Cm, Dv, z, out, b, sb, hh, pb * R + r, hs, bc, j, ok)

    @T.macro
    def rows(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, sb, hh, pb, j, ok):
        if STAGE:
            bc = T.alloc_buffer((2, L.regs(N)), ACC, scope=SCOPE)  # the lane's B / C states, loaded once
            for ko in L.st_outer(N):
                for ki in L.st_inner():
                    bc[0, L.reg(ko, ki)] = m.cast(Bm[b, hh // HPG, L.state(ko, ki, j)])
                    bc[1, L.reg(ko, ki)] = m.cast(Cm[b, hh // HPG, L.state(ko, ki, j)])
            rows_on(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, sb, hh, pb, bc, j, ok)
        else:
            rows_on(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, sb, hh, pb, Bm, j, ok)

    @T.macro
    def lane(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, li, j, ok):
        b = T.meta_var(li // (H * (P // R)))
        hh = T.meta_var(li // (P // R) % H)
        pb = T.meta_var(li % (P // R))
        if IDX and SHARED:  # padding rows run with their writes off: every thread reaches its warp's shuffles
            rows(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, T.Cast("int32", sidx[b]), hh, pb, j,
                 tirx.And(ok, sidx[b] >= T.Cast(idx_dtype, 0)))
            if sidx[b] < T.Cast(idx_dtype, 0):
                if L.leader(ok, j):
                    for r in T.serial(R):
                        out[b, hh, pb * R + r] = m.zero.astype(dims.x_dtype)
        elif IDX:
            if sidx[b] < T.Cast(idx_dtype, 0):  # padding row (mamba_ssm: skip it, out = 0)
                if L.leader(ok, j):
                    for r in T.serial(R):
                        out[b, hh, pb * R + r] = m.zero.astype(dims.x_dtype)
            else:
                rows(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, T.Cast("int32", sidx[b]), hh, pb, j, ok)
        else:
            rows(state, x, dt, A, Bm, Cm, Dv, z, dtb, out, b, b, hh, pb, j, ok)

    return lane


# a row's scalar work (softplus, SiLU, the dstate sum) in state-element equivalents, for the serial / parallel
# choice: Mamba-1's 16-state rows are dominated by it (d_inner 1536: 45 us on the calling thread, 25 us on two)
ROW_WORK = 64


def row_work(dims: UpdateDims) -> int:
    """A row's work in state-element equivalents: its dstate states plus its scalar work. A tied row's
    softplus and exp are its head's (once per lane), what is left (SiLU, the sum) is lost in the noise: tied,
    headdim 64, dstate 128, batch 1, 2 threads: 4 heads (32 K states) 4.1 us on the calling thread, 4.9 on two;
    8 heads 6.2 vs 4.7; 24 heads 15.1 vs 11.1."""
    return dims.dstate + (0 if dims.tie_hdim else ROW_WORK)


def update_template(dims: UpdateDims, L: Layout) -> tirx.PrimFunc:
    """The decode-step loop nest: one lane per ``head_rows`` rows of a (batch, head), state updated in place."""
    H, P, N, G = dims.nheads, dims.headdim, dims.dstate, dims.ngroups
    ACC, TIE, IDX, idx_dtype = dims.acc, dims.tie_hdim, dims.idx_dtype is not None, dims.idx_dtype
    ST, DT, ZT = dims.state_dtype or ACC, dims.dt_dtype or dims.x_dtype, dims.z_dtype or dims.x_dtype
    serial_work, PB, M1 = L.serial_work, P // head_rows(dims, L), dims.mamba1_layout
    lane = _lane_macro(dims, L)
    CHECK = IDX and L.checks_values
    check = slot_checks("state_batch_indices", "state", idx_dtype or "int32")

    @T.macro
    def lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo):
        for li in L.inner():
            if L.lane_guard(lo, li, batch * H * PB):
                lane(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, L.lane_of(lo, li, batch * H * PB),
                     L.thread(li), L.lane_ok(lo, li, batch * H * PB))

    @T.macro
    def body(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, nstate):
        if CHECK:  # before the first write: a refused call leaves the pool as it was
            check(sidx, batch, nstate)
        if serial_work is not None:
            if batch * H * P * row_work(dims) <= serial_work:  # decode-size: the calling thread, no pool launch
                for lo in T.serial(L.blocks(batch * H * PB)):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo)
            else:
                for lo in L.outer(batch * H * PB):
                    lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo)
        else:
            for lo in L.outer(batch * H * PB):
                lanes(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, lo)

    @T.prim_func
    def update(state_h: T.handle, x_h: T.handle, dt_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle,
               D_h: T.handle, z_h: T.handle, dtb_h: T.handle, sidx_h: T.handle, out_h: T.handle):
        batch = T.int32()
        nstate = T.int32()  # state slots in the pool (== batch without indices)
        slot_stride = T.int32()  # elements between slots: a serving pool's pages hold more than this state
        sidx = T.match_buffer(sidx_h, (batch,) if IDX else (1,), idx_dtype or "int32")
        if M1:  # Mamba-1's own tensors, read through head-layout buffers over the same memory
            state1 = T.match_buffer(state_h, (nstate if IDX else batch, H, N), ST, strides=(slot_stride, N, 1))
            x1 = T.match_buffer(x_h, (batch, H), dims.x_dtype)
            dt1 = T.match_buffer(dt_h, (batch, H), DT)
            A1 = T.match_buffer(A_h, (H, N), ACC)
            B1 = T.match_buffer(B_h, (batch, N), dims.B_dtype)
            C1 = T.match_buffer(C_h, (batch, N), dims.C_dtype)
            D1 = T.match_buffer(D_h, (H,) if dims.has_D else (1,), ACC)
            z1 = T.match_buffer(z_h, (batch, H) if dims.has_z else (1, 1), ZT)
            dtb1 = T.match_buffer(dtb_h, (H,) if dims.has_dt_bias else (1,), ACC)
            out1 = T.match_buffer(out_h, (batch, H), dims.x_dtype)
            state = T.decl_buffer((nstate if IDX else batch, H, 1, N), ST, data=state1.data,
                                  strides=(slot_stride, N, N, 1))
            x = T.decl_buffer((batch, H, 1), dims.x_dtype, data=x1.data)
            dt = T.decl_buffer((batch, H, 1), DT, data=dt1.data)
            A = T.decl_buffer((H, 1, N), ACC, data=A1.data)
            Bm = T.decl_buffer((batch, 1, N), dims.B_dtype, data=B1.data)
            Cm = T.decl_buffer((batch, 1, N), dims.C_dtype, data=C1.data)
            Dv = T.decl_buffer((H, 1) if dims.has_D else (1, 1), ACC, data=D1.data)
            z = T.decl_buffer((batch, H, 1) if dims.has_z else (1, 1, 1), ZT, data=z1.data)
            dtb = T.decl_buffer((H, 1) if dims.has_dt_bias else (1, 1), ACC, data=dtb1.data)
            out = T.decl_buffer((batch, H, 1), dims.x_dtype, data=out1.data)
            body(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, nstate)
        else:
            state = T.match_buffer(state_h, (nstate if IDX else batch, H, P, N), ST,
                                   strides=(slot_stride, P * N, N, 1))
            x = T.match_buffer(x_h, (batch, H, P), dims.x_dtype)
            # tied: dt, A, D, dt_bias are expanded views (stride 0 over headdim / dstate), taken as they come
            dt_sb, dt_sh, dt_sp = T.int32(), T.int32(), T.int32()
            A_sh, A_sp, A_sn = T.int32(), T.int32(), T.int32()
            D_sh, D_sp, dtb_sh, dtb_sp = T.int32(), T.int32(), T.int32(), T.int32()
            dt = T.match_buffer(dt_h, (batch, H, P), DT, strides=(dt_sb, dt_sh, dt_sp) if TIE else None)
            A = T.match_buffer(A_h, (H, P, N), ACC, strides=(A_sh, A_sp, A_sn) if TIE else None)
            Bm = T.match_buffer(B_h, (batch, G, N), dims.B_dtype)
            Cm = T.match_buffer(C_h, (batch, G, N), dims.C_dtype)
            Dv = T.match_buffer(D_h, (H, P) if dims.has_D else (1, 1), ACC, strides=(D_sh, D_sp) if TIE else None)
            z = T.match_buffer(z_h, (batch, H, P) if dims.has_z else (1, 1, 1), ZT)
            dtb = T.match_buffer(dtb_h, (H, P) if dims.has_dt_bias else (1, 1), ACC,
                                 strides=(dtb_sh, dtb_sp) if TIE else None)
            out = T.match_buffer(out_h, (batch, H, P), dims.x_dtype)
            body(state, x, dt, A, Bm, Cm, Dv, z, dtb, sidx, out, batch, nstate)

    return update
