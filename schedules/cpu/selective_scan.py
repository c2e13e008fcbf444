"""CPU schedules for the selective scan: the compute templates laid out by ``CpuLayout``.

``CpuLayout``: lanes are ``T.parallel`` (one (batch, channel) each), a lane's dstate is visited in vectors
of ``vector`` states (``T.vectorized``; dstate sums as vector partials then one horizontal sum), per-step
scalar math (softplus, SiLU) is batched per checkpoint chunk and vectorized over time, exp is the
vectorizable polynomial of ``compute._math``. Lane-local buffers are stack allocas (default scope; scope
"local" would be a heap workspace call per lane). Vectorizing a scan *block* with s_tir gives wrong
numbers (field guide §10), so per-lane state is explicit and the loops come from the templates.

Two forward layouts (knob ``layout``; forward, B/C varying, softplus, dim 256, dstate 16, seqlen 512,
single thread: ``channels`` about 1.4x faster than ``dstate``):
- ``channels`` (default when dim % 16 == 0): ``fwd_channels`` below, a lane is (batch, 16 channels);
- ``dstate``: the forward template under ``CpuLayout``.
The backward, the chunked forward, the decode step and the complex-A scan use ``CpuLayout``.

Knobs (``decisions``): ``layout`` (channels, dstate), ``vector`` — dstate lanes per step (powers of two
dividing dstate, <= 16). The backward's channel block and the checkpoint chunk are static dims (they shape
the workspaces the torch op allocates), chosen by the torch op.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute import selective_scan as compute
from ...compute._math import Math
from ...compute.selective_scan import ScanDims
from ...compute.selective_scan._step import ScanMath
from ..rule import SERIAL_WORK, Decisions, kernel_attrs, schedule_of

CH = 16  # channels per vector in the channels layout (one zmm of fp32)


class CpuLayout(compute.Layout):
    """Parallel lanes, dstate vectors of ``vec``, time-batched per-step math, polynomial exp."""

    serial_work = SERIAL_WORK  # decode step: work up to this size runs on the calling thread (no pool launch)

    def outer_loop(self, n):
        return T.parallel(n)

    def vec_loop(self, n):
        return T.vectorized(n)


def fwd_channels(dims: ScanDims):
    """Forward, one lane per (batch, 16 channels): h[dstate, 16] in the lane's stack; dt, dt*u and y are
    16-channel vectors per step, so y needs no horizontal sum and A (and time-invariant B/C) are
    transposed into the lane's stack once.

    The one layout that is not the forward template: its vector axis is channels, not dstate, so every
    per-step scalar of the template (dt, dt*u, y) becomes a vector, dstate is the serial loop, and y
    starts from D u (out = (D u + sum_n C h) silu(z), the operation order its fp32 results have always had).
    The step's math is still ``_step.ScanMath``'s.
    """
    N, NL, ACC, UT, chunk = dims.dstate, dims.dim // CH, dims.acc, dims.u_dtype, dims.chunk
    m = Math(ACC)
    sm = ScanMath(dims, m)
    VARB, VARC = dims.varying_B, dims.varying_C

    def bval(Bm, bt, b, d, t, n, c):
        return sm.B(Bm, b, d, t, n) if VARB else bt[n, c]

    def cval(Cm, ct, b, d, t, n, c):
        return sm.C(Cm, b, d, t, n) if VARC else ct[n, c]

    @T.prim_func
    def fwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, out_h: T.handle, last_h: T.handle, ck_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunk = T.meta_var((seqlen + chunk - 1) // chunk)  # checkpoints: the state before each chunk
        u = T.match_buffer(u_h, (batch, dims.dim, seqlen), UT)
        delta = T.match_buffer(delta_h, (batch, dims.dim, seqlen), UT)
        A = T.match_buffer(A_h, (dims.dim, N), ACC)
        Bm = T.match_buffer(B_h, (batch, dims.b_groups, seqlen, N) if VARB else (dims.dim, N), dims.B_dtype)
        Cm = T.match_buffer(C_h, (batch, dims.c_groups, seqlen, N) if VARC else (dims.dim, N), dims.C_dtype)
        Dv = T.match_buffer(D_h, (dims.dim,) if dims.has_D else (1,), ACC)
        z = T.match_buffer(z_h, (batch, dims.dim, seqlen) if dims.has_z else (1, 1, 1), UT)
        db = T.match_buffer(db_h, (dims.dim,) if dims.has_delta_bias else (1,), ACC)
        init = T.match_buffer(init_h, (batch, dims.dim, N) if dims.has_init else (1, 1, 1), ACC)
        out = T.match_buffer(out_h, (batch, dims.dim, seqlen), UT)
        last = T.match_buffer(last_h, (batch, dims.dim, N), ACC)
        ck = T.match_buffer(ck_h, (batch, dims.dim, nchunk, N), ACC)
        for lane in T.parallel(batch * NL):
            h = T.alloc_buffer((N, CH), ACC)
            at = T.alloc_buffer((N, CH), ACC)
            bt = T.alloc_buffer((N if not VARB else 1, CH), ACC)
            ct = T.alloc_buffer((N if not VARC else 1, CH), ACC)
            v = T.alloc_buffer((3, CH), ACC)  # dt, dt*u, y of the 16 channels
            b = T.meta_var(lane // NL)
            d0 = T.meta_var(lane % NL * CH)
            for n in range(N):
                for c in T.vectorized(CH):
                    at[n, c] = A[d0 + c, n]
                    h[n, c] = init[b, d0 + c, n] if dims.has_init else m.zero
                    if not VARB:
                        bt[n, c] = m.cast(Bm[d0 + c, n])
                    if not VARC:
                        ct[n, c] = m.cast(Cm[d0 + c, n])
            for ci in range(nchunk):
                for n in range(N):
                    for c in T.vectorized(CH):
                        ck[b, d0 + c, ci, n] = h[n, c]
                for t in range(ci * chunk, T.min(seqlen, ci * chunk + chunk)):
                    for c in T.vectorized(CH):
                        v[0, c] = sm.dt_at(delta, db, b, d0 + c, t)
                        v[1, c] = v[0, c] * m.cast(u[b, d0 + c, t])
                        v[2, c] = sm.skip(Dv, u, b, d0 + c, t)
                    for n in range(N):
                        for c in T.vectorized(CH):
                            h[n, c] = sm.h_next(m.exp(v[0, c] * at[n, c]), h[n, c], v[1, c],
                                                bval(Bm, bt, b, d0 + c, t, n, c))
                            v[2, c] = v[2, c] + cval(Cm, ct, b, d0 + c, t, n, c) * h[n, c]
                    for c in T.vectorized(CH):
                        if dims.has_z:
                            out[b, d0 + c, t] = (v[2, c] * m.silu(sm.z_at(z, b, d0 + c, t))).astype(UT)
                        else:
                            out[b, d0 + c, t] = v[2, c].astype(UT)
            for n in range(N):
                for c in T.vectorized(CH):
                    last[b, d0 + c, n] = h[n, c]

    return fwd


def apply(func, target, decisions: Decisions):
    name, static = kernel_attrs(func)
    direction = name[len("selective_scan_"):] if name and name.startswith("selective_scan_") else None
    if target.kind.name != "llvm" or direction not in compute.TEMPLATES:
        return None
    dims = compute.DIMS[direction](**static)
    if direction == "fwd" and dims.dim % CH == 0:
        if decisions.pick("layout", ("channels", "dstate"), "channels") == "channels":
            return schedule_of(compute.stamp(fwd_channels(dims), name, static), name=name)
    widths = [v for v in (1, 2, 4, 8, 16) if dims.dstate % v == 0]
    vec = decisions.pick("vector", widths, compute.vector_width(dims.dstate))
    return schedule_of(compute.build(direction, dims, CpuLayout(Math(dims.acc), vec=vec)), name=name)
