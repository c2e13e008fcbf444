"""CPU schedules for the selective scan: the compute templates emitted as CPU loop nests.

Two forward layouts (knob ``layout``), measured on this 2-core znver5 box, single thread, CPU time
(forward, B/C varying, softplus, dim 256, dstate 16, seqlen 512): ``channels`` 1.29 ms, ``dstate`` 1.78 ms.
- ``channels`` (default when dim % 16 == 0): a lane is (batch, 16 channels); the state h[dstate, 16] is
  updated 16 channels at a time, so dt/softplus/silu are vector ops per step and y needs no horizontal sum.
  A (and time-invariant B/C) are transposed into the lane's stack once.
- ``dstate``: a lane is one (batch, channel); each step updates the dstate vector (``vector`` lanes) and
  sums C.h horizontally; per-step scalar math is vectorized over the time steps of a checkpoint chunk.
The backward and the decode step use the ``dstate`` layout. Lane-local buffers are stack allocas (default
scope; scope "local" would be a heap workspace call per lane). Vectorizing a scan *block* with s_tir gives
wrong numbers (field guide §10), so per-lane state is explicit and the loops are written by hand.

Knobs (``decisions``): ``layout`` (channels, dstate), ``vector`` — dstate lanes per step (powers of two
dividing dstate, <= 16). The backward's channel block and the checkpoint chunk are static dims (they shape
the workspaces the torch op allocates), chosen by the torch op.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute import selective_scan as compute
from ...compute import selective_scan_complex as complex_scan
from ...compute.selective_scan import _Math, acc_dtype
from ..rule import Decisions, kernel_attrs, schedule_of

CH = 16  # channels per vector in the channels layout (one zmm of fp32)

_TEMPLATES = {
    "selective_scan_fwd": compute.selective_scan_fwd_template,
    "selective_scan_fwd_chunked": compute.selective_scan_fwd_chunked_template,
    "selective_scan_bwd": compute.selective_scan_bwd_template,
    "selective_scan_update": compute.selective_scan_update_template,
    # complex A: one lane per (batch, channel) / (batch, channel block), the dstate pairs as the vector
    "selective_scan_fwd_complex": complex_scan.selective_scan_fwd_complex_template,
    "selective_scan_bwd_complex": complex_scan.selective_scan_bwd_complex_template,
}


def fwd_channels(dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk,
                 u_dtype, B_dtype, C_dtype):
    """Forward, one lane per (batch, 16 channels): h[dstate, 16] in the lane's stack."""
    N, NL = dstate, dim // CH
    ACC = acc_dtype(u_dtype)
    m = _Math(ACC)
    VARB, VARC = b_groups > 0, c_groups > 0
    BPG = dim // b_groups if VARB else 1
    CPG = dim // c_groups if VARC else 1

    def bval(Bm, bt, b, d, t, n, c):
        return m.cast(Bm[b, d // BPG, t, n]) if VARB else bt[n, c]

    def cval(Cm, ct, b, d, t, n, c):
        return m.cast(Cm[b, d // CPG, t, n]) if VARC else ct[n, c]

    def dt_of(delta, db, b, d, t):
        x = m.cast(delta[b, d, t]) + (db[d] if has_delta_bias else m.zero)
        return m.softplus(x) if delta_softplus else x

    @T.prim_func
    def fwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, out_h: T.handle, last_h: T.handle, ck_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunk = T.meta_var((seqlen + chunk - 1) // chunk)  # checkpoints: the state before each chunk
        u = T.match_buffer(u_h, (batch, dim, seqlen), u_dtype)
        delta = T.match_buffer(delta_h, (batch, dim, seqlen), u_dtype)
        A = T.match_buffer(A_h, (dim, N), ACC)
        Bm = T.match_buffer(B_h, (batch, b_groups, seqlen, N) if VARB else (dim, N), B_dtype)
        Cm = T.match_buffer(C_h, (batch, c_groups, seqlen, N) if VARC else (dim, N), C_dtype)
        Dv = T.match_buffer(D_h, (dim,) if has_D else (1,), ACC)
        z = T.match_buffer(z_h, (batch, dim, seqlen) if has_z else (1, 1, 1), u_dtype)
        db = T.match_buffer(db_h, (dim,) if has_delta_bias else (1,), ACC)
        init = T.match_buffer(init_h, (batch, dim, N) if has_init else (1, 1, 1), ACC)
        out = T.match_buffer(out_h, (batch, dim, seqlen), u_dtype)
        last = T.match_buffer(last_h, (batch, dim, N), ACC)
        ck = T.match_buffer(ck_h, (batch, dim, nchunk, N), ACC)
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
                    h[n, c] = init[b, d0 + c, n] if has_init else m.zero
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
                        v[0, c] = dt_of(delta, db, b, d0 + c, t)
                        v[1, c] = v[0, c] * m.cast(u[b, d0 + c, t])
                        v[2, c] = (Dv[d0 + c] * m.cast(u[b, d0 + c, t])) if has_D else m.zero
                    for n in range(N):
                        for c in T.vectorized(CH):
                            h[n, c] = m.exp(v[0, c] * at[n, c]) * h[n, c] + v[1, c] * bval(Bm, bt, b, d0 + c, t, n, c)
                            v[2, c] = v[2, c] + cval(Cm, ct, b, d0 + c, t, n, c) * h[n, c]
                    for c in T.vectorized(CH):
                        if has_z:
                            out[b, d0 + c, t] = (v[2, c] * m.silu(m.cast(z[b, d0 + c, t]))).astype(u_dtype)
                        else:
                            out[b, d0 + c, t] = v[2, c].astype(u_dtype)
            for n in range(N):
                for c in T.vectorized(CH):
                    last[b, d0 + c, n] = h[n, c]

    return fwd


def apply(func, target, decisions: Decisions):
    name, static = kernel_attrs(func)
    if target.kind.name != "llvm" or name not in _TEMPLATES:
        return None
    dstate = static["dstate"]
    if name == "selective_scan_fwd" and static["dim"] % CH == 0:
        if decisions.pick("layout", ("channels", "dstate"), "channels") == "channels":
            return schedule_of(compute.stamp(fwd_channels(**static), name, static), name=name)
    widths = [v for v in (1, 2, 4, 8, 16) if dstate % v == 0]
    vec = decisions.pick("vector", widths, compute.vector_width(dstate))
    loop = _TEMPLATES[name](**static, mode="cpu", vec=vec)
    return schedule_of(compute.stamp(loop, name, static), name=name)
