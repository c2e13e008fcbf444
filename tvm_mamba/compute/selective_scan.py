"""Mamba-1 selective scan (mamba_ssm 2.3.x semantics) as TVMScript loop nests: forward, backward, decode step.

    dt = softplus?(delta + delta_bias);  h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t;
    y_t = C_t . h_t + D u_t;  out = y * silu(z)

A recurrence cannot be TE (``te.scan`` is rejected by ``create_prim_func``), so every kernel here is a
loop-nest *template*: a pure function of static dims, dtypes and layout knobs that returns a stamped
PrimFunc. ``selective_scan_<direction>(...)`` returns the generic version (serial lanes, scalar dstate
loop); the schedule rules call the same templates with their knobs (CPU: ``T.parallel`` lanes and
``T.vectorized`` dstate; CUDA: lanes bound to blockIdx/threadIdx). One lane = one (batch, channel) pair;
its state h (dstate values) lives in a lane-local buffer, time runs serially.

Kernel layouts (the torch op builds them with views/transposes):
- u, delta, z, out: (batch, dim, seqlen); A: (dim, dstate); D, delta_bias: (dim,); states (batch, dim, dstate).
- B, C: ``groups == 0``: time-invariant (dim, dstate); else (batch, groups, seqlen, dstate) — mamba_ssm's
  (batch, groups, dstate, seqlen) transposed so one step reads dstate contiguous values.
- checkpoints: (batch, dim, nchunk, dstate), nchunk = ceil(seqlen / chunk): the state *before* each chunk.
  The backward recomputes the states of one chunk at a time from them (memory O(seqlen / chunk)).
- ``acc``: accumulation dtype, float32 (float32/16/bf16 inputs) or float64 (float64 inputs, for gradcheck).
  A, D, delta_bias and all states are in ``acc``. float32 uses the vectorizable exp of ``_math``.
Absent optional inputs are (1,)*ndim placeholders flagged by ``has_*`` static dims.
No cumulative products or divisions by running decays: only the step recurrence (stable at any length).
"""
from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from . import _math
from ._common import check_dtype, stamp
from ._selective_scan_dims import block_size, chunk_size  # noqa: F401  (re-exported)

IO_DTYPES = ("float32", "float16", "bfloat16", "float64")


_Math = _math.Math  # the target math (one definition: compute/_math.py)


def acc_dtype(u_dtype: str) -> str:
    return "float64" if u_dtype == "float64" else "float32"


def vector_width(dstate: int, want: int = 16) -> int:
    """Largest power of two <= want dividing dstate (the dstate vector of one step)."""
    v = 1
    while v * 2 <= want and dstate % (v * 2) == 0:
        v *= 2
    return v


def _check(dim, dstate, b_groups, c_groups, chunk, u_dtype, B_dtype, C_dtype):
    if dim < 1 or dstate < 1:
        raise ValueError(f"dim/dstate: must be >= 1, got dim={dim}, dstate={dstate}")
    for name, g in (("B", b_groups), ("C", c_groups)):
        if g < 0 or (g and dim % g):
            raise ValueError(f"{name}: groups must divide dim={dim}, got {g}")
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {chunk}")
    for name, dt in (("u", u_dtype), ("B", B_dtype), ("C", C_dtype)):
        check_dtype(name, dt, IO_DTYPES)


def _lanes(mode: str, threads: int):
    """(outer loop, inner loop, lanes per outer iteration, scope of lane-local buffers) for ``mode``:
    generic: serial; cpu: parallel lanes, stack buffers; cuda: blockIdx x threadIdx, registers/local."""
    if mode == "cuda":
        return (functools.partial(T.thread_binding, thread="blockIdx.x"),
                functools.partial(T.thread_binding, thread="threadIdx.x"), threads, "local")
    return (T.parallel if mode == "cpu" else T.serial), T.serial, 1, "global"


def _vec_loop(mode: str):
    return T.vectorized if mode == "cpu" else T.serial


def _fwd_step_fns(m: "_Math", dim, b_groups, c_groups, has_delta_bias, delta_softplus, has_D, has_z, u_dtype):
    """The forward's per-step expressions, shared by the sequential and chunked templates:
    bval/cval: B_t[n], C_t[n] of channel d (time-invariant or per group); dt_of: softplus?(delta + bias);
    finish: out = (y + D u) * silu(z) in u's dtype, y read from the chunk's y buffer."""
    BPG = dim // b_groups if b_groups else 1  # channels per group
    CPG = dim // c_groups if c_groups else 1

    def bval(Bm, b, d, t, n):
        return m.cast(Bm[b, d // BPG, t, n]) if b_groups else m.cast(Bm[d, n])

    def cval(Cm, b, d, t, n):
        return m.cast(Cm[b, d // CPG, t, n]) if c_groups else m.cast(Cm[d, n])

    def dt_of(delta, db, b, d, t):
        x = m.cast(delta[b, d, t]) + (db[d] if has_delta_bias else m.zero)
        return m.softplus(x) if delta_softplus else x

    def finish(yb, u, Dv, z, b, d, t0, i):
        y = yb[i] + (Dv[d] * m.cast(u[b, d, t0 + i]) if has_D else m.zero)
        return (y * m.silu(m.cast(z[b, d, t0 + i])) if has_z else y).astype(u_dtype)

    return bval, cval, dt_of, finish


def selective_scan_fwd_template(dim: int, dstate: int, b_groups: int, c_groups: int, has_D: bool, has_z: bool,
                                has_delta_bias: bool, delta_softplus: bool, has_init: bool, chunk: int,
                                u_dtype: str, B_dtype: str, C_dtype: str, mode: str = "generic",
                                vec: int = 1, tvec: int = 16, threads: int = 64) -> tirx.PrimFunc:
    """The forward loop nest; ``mode`` "generic" (serial) or "cpu" (parallel lanes, dstate vectors of ``vec``,
    per-step scalar math in time vectors of ``tvec``)."""
    N, V, TV = dstate, vec, tvec
    NV = N // V
    ACC = acc_dtype(u_dtype)
    m = _Math(ACC)
    OUTER, INNER, TPB, SCOPE = _lanes(mode, threads)
    VEC = _vec_loop(mode)
    VARB, VARC = b_groups > 0, c_groups > 0
    bval, cval, dt_of, finish = _fwd_step_fns(m, dim, b_groups, c_groups, has_delta_bias, delta_softplus, has_D,
                                              has_z, u_dtype)

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
        for lane_o in OUTER((batch * dim + TPB - 1) // TPB):
            for lane_i in INNER(TPB):
                if lane_o * TPB + lane_i < batch * dim:
                    lane = T.meta_var(lane_o * TPB + lane_i)
                    h = T.alloc_buffer((N,), ACC, scope=SCOPE)
                    yv = T.alloc_buffer((V,), ACC, scope=SCOPE)
                    s = T.alloc_buffer((4,), ACC, scope=SCOPE)  # dt, dt*u, y
                    dtb = T.alloc_buffer((chunk,), ACC, scope=SCOPE)  # dt of each step of the chunk
                    yb = T.alloc_buffer((chunk,), ACC, scope=SCOPE)  # C.h of each step of the chunk
                    # pin the full extent: otherwise buffer compaction sizes these by the (symbolic) chunk length,
                    # which CUDA codegen rejects ("Can only handle constant size stack allocation")
                    dtb[chunk - 1] = m.zero
                    yb[chunk - 1] = m.zero
                    b = T.meta_var(lane // dim)
                    d = T.meta_var(lane % dim)
                    for no in range(NV):
                        for ni in VEC(V):
                            h[no * V + ni] = init[b, d, no * V + ni] if has_init else m.zero
                    for c in range(nchunk):
                        NT = T.meta_var(T.min(seqlen - c * chunk, chunk))  # steps in this chunk
                        for no in range(NV):
                            for ni in VEC(V):
                                ck[b, d, c, no * V + ni] = h[no * V + ni]
                        # per-step scalars (softplus, silu: two exps each) vectorized over time, then the serial scan
                        for io in range(NT // TV):
                            for ii in VEC(TV):
                                dtb[io * TV + ii] = dt_of(delta, db, b, d, c * chunk + io * TV + ii)
                        for i in range(NT // TV * TV, NT):
                            dtb[i] = dt_of(delta, db, b, d, c * chunk + i)
                        for i in range(NT):
                            s[0] = dtb[i]
                            s[1] = s[0] * m.cast(u[b, d, c * chunk + i])
                            for ni in VEC(V):
                                yv[ni] = m.zero
                            for no in range(NV):
                                for ni in VEC(V):
                                    h[no * V + ni] = (m.exp(s[0] * A[d, no * V + ni]) * h[no * V + ni]
                                                      + s[1] * bval(Bm, b, d, c * chunk + i, no * V + ni))
                                    yv[ni] = yv[ni] + cval(Cm, b, d, c * chunk + i, no * V + ni) * h[no * V + ni]
                            s[2] = m.zero
                            for ni in range(V):
                                s[2] = s[2] + yv[ni]
                            yb[i] = s[2]
                        for io in range(NT // TV):
                            for ii in VEC(TV):
                                out[b, d, c * chunk + io * TV + ii] = finish(yb, u, Dv, z, b, d, c * chunk, io * TV + ii)
                        for i in range(NT // TV * TV, NT):
                            out[b, d, c * chunk + i] = finish(yb, u, Dv, z, b, d, c * chunk, i)
                    for no in range(NV):
                        for ni in VEC(V):
                            last[b, d, no * V + ni] = h[no * V + ni]

    return fwd


def _static(dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk,
            u_dtype, B_dtype, C_dtype, **extra):
    return dict(dim=dim, dstate=dstate, b_groups=b_groups, c_groups=c_groups, has_D=has_D, has_z=has_z,
                has_delta_bias=has_delta_bias, delta_softplus=delta_softplus, has_init=has_init, chunk=chunk,
                u_dtype=u_dtype, B_dtype=B_dtype, C_dtype=C_dtype, **extra)


def selective_scan_fwd(dim: int, dstate: int, b_groups: int = 0, c_groups: int = 0, has_D: bool = False,
                       has_z: bool = False, has_delta_bias: bool = False, delta_softplus: bool = False,
                       has_init: bool = False, chunk: int = 64, u_dtype: str = "float32",
                       B_dtype: str = "float32", C_dtype: str = "float32") -> tirx.PrimFunc:
    """u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (dim, dstate) if groups == 0 else
    (batch, groups, seqlen, dstate); D, delta_bias: (dim,); initial_state: (batch, dim, dstate)
    -> out: (batch, dim, seqlen), last_state: (batch, dim, dstate), checkpoints: (batch, dim, nchunk, dstate).

    h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t; out_t = (C_t . h_t + D u_t) * silu(z_t); checkpoints[c] = h
    before step c*chunk.
    """
    _check(dim, dstate, b_groups, c_groups, chunk, u_dtype, B_dtype, C_dtype)
    static = _static(dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init,
                     chunk, u_dtype, B_dtype, C_dtype)
    func = selective_scan_fwd_template(**static)
    return stamp(func, "selective_scan_fwd", static)


def selective_scan_bwd_template(dim: int, dstate: int, b_groups: int, c_groups: int, has_D: bool, has_z: bool,
                                has_delta_bias: bool, delta_softplus: bool, has_init: bool, chunk: int,
                                u_dtype: str, B_dtype: str, C_dtype: str, block: int = 1,
                                mode: str = "generic", vec: int = 1, tvec: int = 16,
                                threads: int = 64) -> tirx.PrimFunc:
    """The backward loop nest. Stage 1: one lane per (batch, block of ``block`` channels) runs the reverse
    scan of each of its channels, chunk by chunk (states of the chunk recomputed from its checkpoint into a
    lane-local (chunk+1, dstate) buffer), and writes per-lane partial sums. Stage 2 reduces the partials in
    a fixed order (deterministic; no atomics)."""
    N, V, BLK, TV = dstate, vec, block, tvec
    NV = N // V
    NBLK = dim // BLK
    ACC = acc_dtype(u_dtype)
    m = _Math(ACC)
    OUTER, INNER, TPB, SCOPE = _lanes(mode, threads)
    VEC = _vec_loop(mode)
    BPG = dim // b_groups if b_groups else 1
    CPG = dim // c_groups if c_groups else 1
    VARB, VARC = b_groups > 0, c_groups > 0
    BBPG = BPG // BLK if VARB else 1  # channel blocks per B group
    CBPG = CPG // BLK if VARC else 1

    def bval(Bm, b, d, t, n):
        return m.cast(Bm[b, d // BPG, t, n]) if VARB else m.cast(Bm[d, n])

    def cval(Cm, b, d, t, n):
        return m.cast(Cm[b, d // CPG, t, n]) if VARC else m.cast(Cm[d, n])

    def pre_dt(delta, db, b, d, t):
        return m.cast(delta[b, d, t]) + (db[d] if has_delta_bias else m.zero)

    def dt_of(x):
        return m.softplus(x) if delta_softplus else x

    def sp_grad(x):
        return m.softplus_grad(x) if delta_softplus else m.one

    def z_silu(z, b, d, t):
        return m.silu(m.cast(z[b, d, t])) if has_z else m.one

    def z_silu_grad(z, b, d, t):
        return m.silu_grad(m.cast(z[b, d, t])) if has_z else m.one

    @T.prim_func
    def bwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, ck_h: T.handle, dout_h: T.handle, dlast_h: T.handle,
            du_h: T.handle, ddelta_h: T.handle, dA_h: T.handle, dB_h: T.handle, dC_h: T.handle, dD_h: T.handle,
            ddb_h: T.handle, dz_h: T.handle, dinit_h: T.handle,
            wsA_h: T.handle, wsB_h: T.handle, wsC_h: T.handle, wsS_h: T.handle):
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
        ck = T.match_buffer(ck_h, (batch, dim, nchunk, N), ACC)
        dout = T.match_buffer(dout_h, (batch, dim, seqlen), u_dtype)
        dlast = T.match_buffer(dlast_h, (batch, dim, N), ACC)
        du = T.match_buffer(du_h, (batch, dim, seqlen), u_dtype)
        ddelta = T.match_buffer(ddelta_h, (batch, dim, seqlen), u_dtype)
        dA = T.match_buffer(dA_h, (dim, N), ACC)
        dB = T.match_buffer(dB_h, (batch, b_groups, seqlen, N) if VARB else (dim, N), B_dtype)
        dC = T.match_buffer(dC_h, (batch, c_groups, seqlen, N) if VARC else (dim, N), C_dtype)
        dD = T.match_buffer(dD_h, (dim,) if has_D else (1,), ACC)
        ddb = T.match_buffer(ddb_h, (dim,) if has_delta_bias else (1,), ACC)
        dz = T.match_buffer(dz_h, (batch, dim, seqlen) if has_z else (1, 1, 1), u_dtype)
        dinit = T.match_buffer(dinit_h, (batch, dim, N) if has_init else (1, 1, 1), ACC)
        wsA = T.match_buffer(wsA_h, (batch, dim, N), ACC)
        wsB = T.match_buffer(wsB_h, (batch, NBLK, seqlen, N) if VARB else (batch, dim, N), ACC)
        wsC = T.match_buffer(wsC_h, (batch, NBLK, seqlen, N) if VARC else (batch, dim, N), ACC)
        wsS = T.match_buffer(wsS_h, (batch, dim, 2), ACC)
        for lane_o in OUTER((batch * NBLK + TPB - 1) // TPB):
            for lane_i in INNER(TPB):
                if lane_o * TPB + lane_i < batch * NBLK:
                    lane = T.meta_var(lane_o * TPB + lane_i)
                    hs = T.alloc_buffer((chunk + 1, N), ACC, scope=SCOPE)  # states of one chunk: hs[i] = h before step i
                    g = T.alloc_buffer((N,), ACC, scope=SCOPE)  # adjoint of h
                    gA = T.alloc_buffer((N,), ACC, scope=SCOPE)  # partial dA of this channel
                    gB = T.alloc_buffer((N,), ACC, scope=SCOPE)  # partial dB / dC of this channel (time-invariant kinds)
                    gC = T.alloc_buffer((N,), ACC, scope=SCOPE)
                    rv = T.alloc_buffer((2, V), ACC, scope=SCOPE)  # vector partials of the dstate sums
                    ex = T.alloc_buffer((2, V), ACC, scope=SCOPE)  # exp(dt A) and g h_{t-1} exp(dt A) of one dstate vector
                    s = T.alloc_buffer((12,), ACC, scope=SCOPE)  # scalars of one step
                    pb = T.alloc_buffer((4, chunk), ACC, scope=SCOPE)  # per step: dt, softplus'(.), silu(z), silu'(z)
                    hs[chunk, N - 1] = m.zero  # pin the full extents (see the forward)
                    pb[3, chunk - 1] = m.zero
                    b = T.meta_var(lane // NBLK)
                    blk = T.meta_var(lane % NBLK)
                    for ci in range(BLK):
                        d = T.meta_var(blk * BLK + ci)
                        s[8] = m.zero  # dD partial
                        s[9] = m.zero  # ddelta_bias partial
                        for no in range(NV):
                            for ni in VEC(V):
                                g[no * V + ni] = dlast[b, d, no * V + ni]
                                gA[no * V + ni] = m.zero
                                gB[no * V + ni] = m.zero
                                gC[no * V + ni] = m.zero
                        for cr in range(nchunk):
                            c = T.meta_var(nchunk - 1 - cr)
                            NT = T.meta_var(T.min(seqlen - c * chunk, chunk))  # steps in this chunk
                            for no in range(NV):
                                for ni in VEC(V):
                                    hs[0, no * V + ni] = ck[b, d, c, no * V + ni]
                            for io in range(NT // TV):  # per-step scalar math, vectorized over time
                                for ii in VEC(TV):
                                    pb[0, io * TV + ii] = dt_of(pre_dt(delta, db, b, d, c * chunk + io * TV + ii))
                                    pb[1, io * TV + ii] = sp_grad(pre_dt(delta, db, b, d, c * chunk + io * TV + ii))
                                    pb[2, io * TV + ii] = z_silu(z, b, d, c * chunk + io * TV + ii)
                                    pb[3, io * TV + ii] = z_silu_grad(z, b, d, c * chunk + io * TV + ii)
                            for i in range(NT // TV * TV, NT):
                                pb[0, i] = dt_of(pre_dt(delta, db, b, d, c * chunk + i))
                                pb[1, i] = sp_grad(pre_dt(delta, db, b, d, c * chunk + i))
                                pb[2, i] = z_silu(z, b, d, c * chunk + i)
                                pb[3, i] = z_silu_grad(z, b, d, c * chunk + i)
                            for i in range(NT):
                                s[0] = pb[0, i]
                                s[1] = s[0] * m.cast(u[b, d, c * chunk + i])
                                for no in range(NV):
                                    for ni in VEC(V):
                                        hs[i + 1, no * V + ni] = (m.exp(s[0] * A[d, no * V + ni]) * hs[i, no * V + ni]
                                                                  + s[1] * bval(Bm, b, d, c * chunk + i, no * V + ni))
                            for ir in range(T.min(seqlen - c * chunk, chunk)):
                                i = T.meta_var(T.min(seqlen - c * chunk, chunk) - 1 - ir)
                                t = T.meta_var(c * chunk + i)
                                s[0] = pb[0, i]
                                s[1] = m.cast(u[b, d, t])
                                s[3] = m.cast(dout[b, d, t])
                                if has_z:
                                    for ni in VEC(V):
                                        rv[0, ni] = m.zero
                                    for no in range(NV):
                                        for ni in VEC(V):
                                            rv[0, ni] = rv[0, ni] + cval(Cm, b, d, t, no * V + ni) * hs[i + 1, no * V + ni]
                                    s[2] = (Dv[d] * s[1]) if has_D else m.zero  # y
                                    for ni in range(V):
                                        s[2] = s[2] + rv[0, ni]
                                    dz[b, d, t] = (s[3] * s[2] * pb[3, i]).astype(u_dtype)
                                    s[3] = s[3] * pb[2, i]  # dy
                                if has_D:
                                    s[8] = s[8] + s[3] * s[1]
                                for ni in VEC(V):
                                    rv[0, ni] = m.zero
                                    rv[1, ni] = m.zero
                                for no in range(NV):
                                    for ni in VEC(V):
                                        gC[no * V + ni] = gC[no * V + ni] + s[3] * hs[i + 1, no * V + ni]
                                        if VARC:
                                            wsC[b, blk, t, no * V + ni] = T.Select(
                                                ci == 0, m.zero, wsC[b, blk, t, no * V + ni]) + s[3] * hs[i + 1, no * V + ni]
                                        g[no * V + ni] = g[no * V + ni] + s[3] * cval(Cm, b, d, t, no * V + ni)
                                        gB[no * V + ni] = gB[no * V + ni] + g[no * V + ni] * s[0] * s[1]
                                        if VARB:
                                            wsB[b, blk, t, no * V + ni] = T.Select(
                                                ci == 0, m.zero, wsB[b, blk, t, no * V + ni]) + g[no * V + ni] * s[0] * s[1]
                                        rv[0, ni] = rv[0, ni] + g[no * V + ni] * bval(Bm, b, d, t, no * V + ni)
                                        ex[0, ni] = m.exp(s[0] * A[d, no * V + ni])
                                        ex[1, ni] = g[no * V + ni] * hs[i, no * V + ni] * ex[0, ni]  # g h_{t-1} e^{dt A}
                                        rv[1, ni] = rv[1, ni] + ex[1, ni] * A[d, no * V + ni]
                                        gA[no * V + ni] = gA[no * V + ni] + s[0] * ex[1, ni]
                                        g[no * V + ni] = g[no * V + ni] * ex[0, ni]
                                s[5] = m.zero  # sum_n g B
                                s[6] = m.zero  # sum_n g h_{t-1} exp(dt A) A
                                for ni in range(V):
                                    s[5] = s[5] + rv[0, ni]
                                    s[6] = s[6] + rv[1, ni]
                                du[b, d, t] = ((s[3] * Dv[d] if has_D else m.zero) + s[0] * s[5]).astype(u_dtype)
                                s[7] = s[1] * s[5] + s[6]  # d dt
                                if delta_softplus:
                                    s[7] = s[7] * pb[1, i]
                                ddelta[b, d, t] = s[7].astype(u_dtype)
                                s[9] = s[9] + s[7]
                        for no in range(NV):
                            for ni in VEC(V):
                                wsA[b, d, no * V + ni] = gA[no * V + ni]
                                if has_init:
                                    dinit[b, d, no * V + ni] = g[no * V + ni]
                                if not VARB:
                                    wsB[b, d, no * V + ni] = gB[no * V + ni]
                                if not VARC:
                                    wsC[b, d, no * V + ni] = gC[no * V + ni]
                        wsS[b, d, 0] = s[8]
                        wsS[b, d, 1] = s[9]
        # stage 2: fixed-order sums over batch (and over the channel blocks of a group)
        for d_o in OUTER((dim + TPB - 1) // TPB):
            for d_i in INNER(TPB):
                if d_o * TPB + d_i < dim:
                    d = T.meta_var(d_o * TPB + d_i)
                    rs = T.alloc_buffer((4,), ACC, scope=SCOPE)
                    for n in range(N):
                        rs[0] = m.zero
                        rs[1] = m.zero
                        rs[2] = m.zero
                        for bb in range(batch):
                            rs[0] = rs[0] + wsA[bb, d, n]
                            if not VARB:
                                rs[1] = rs[1] + wsB[bb, d, n]
                            if not VARC:
                                rs[2] = rs[2] + wsC[bb, d, n]
                        dA[d, n] = rs[0]
                        if not VARB:
                            dB[d, n] = rs[1].astype(B_dtype)
                        if not VARC:
                            dC[d, n] = rs[2].astype(C_dtype)
                    rs[0] = m.zero
                    rs[1] = m.zero
                    for bb in range(batch):
                        rs[0] = rs[0] + wsS[bb, d, 0]
                        rs[1] = rs[1] + wsS[bb, d, 1]
                    if has_D:
                        dD[d] = rs[0]
                    if has_delta_bias:
                        ddb[d] = rs[1]
        if VARB:
            for row_o in OUTER((batch * b_groups * seqlen + TPB - 1) // TPB):
                for row_i in INNER(TPB):
                    if row_o * TPB + row_i < batch * b_groups * seqlen:
                        row = T.meta_var(row_o * TPB + row_i)
                        rb = T.alloc_buffer((V,), ACC, scope=SCOPE)
                        for no in range(NV):
                            for ni in VEC(V):
                                rb[ni] = m.zero
                            for k in range(BBPG):
                                for ni in VEC(V):
                                    rb[ni] = rb[ni] + wsB[row // (b_groups * seqlen),
                                                          (row // seqlen) % b_groups * BBPG + k, row % seqlen, no * V + ni]
                            for ni in VEC(V):
                                dB[row // (b_groups * seqlen), (row // seqlen) % b_groups, row % seqlen,
                                   no * V + ni] = rb[ni].astype(B_dtype)
        if VARC:
            for row_o in OUTER((batch * c_groups * seqlen + TPB - 1) // TPB):
                for row_i in INNER(TPB):
                    if row_o * TPB + row_i < batch * c_groups * seqlen:
                        row = T.meta_var(row_o * TPB + row_i)
                        rc = T.alloc_buffer((V,), ACC, scope=SCOPE)
                        for no in range(NV):
                            for ni in VEC(V):
                                rc[ni] = m.zero
                            for k in range(CBPG):
                                for ni in VEC(V):
                                    rc[ni] = rc[ni] + wsC[row // (c_groups * seqlen),
                                                          (row // seqlen) % c_groups * CBPG + k, row % seqlen, no * V + ni]
                            for ni in VEC(V):
                                dC[row // (c_groups * seqlen), (row // seqlen) % c_groups, row % seqlen,
                                   no * V + ni] = rc[ni].astype(C_dtype)

    return bwd


def selective_scan_bwd(dim: int, dstate: int, b_groups: int = 0, c_groups: int = 0, has_D: bool = False,
                       has_z: bool = False, has_delta_bias: bool = False, delta_softplus: bool = False,
                       has_init: bool = False, chunk: int = 64, block: int = 1, u_dtype: str = "float32",
                       B_dtype: str = "float32", C_dtype: str = "float32") -> tirx.PrimFunc:
    """Backward of :func:`selective_scan_fwd`.

    Inputs: the forward's inputs, checkpoints: (batch, dim, nchunk, dstate), dout: (batch, dim, seqlen),
    dlast: (batch, dim, dstate) (gradient flowing in through last_state; zeros when unused).
    Outputs: du, ddelta, dz: (batch, dim, seqlen); dA: (dim, dstate); dB, dC: B's/C's kernel layout;
    dD, ddelta_bias: (dim,); dinit: (batch, dim, dstate); float32 workspaces wsA: (batch, dim, dstate),
    wsB/wsC: (batch, dim // block, seqlen, dstate) for varying B/C else (batch, dim, dstate), wsS: (batch, dim, 2).

    g_t = dy_t C_t + exp(dt_{t+1} A) g_{t+1} (g_{L-1} also gets dlast); dB_t = g_t dt_t u_t; dC_t = dy_t h_t;
    d dt_t = sum_n g_t (B_t u_t + A exp(dt_t A) h_{t-1}); dA = sum_t g_t dt_t exp(dt_t A) h_{t-1};
    du_t = D dy_t + dt_t sum_n g_t B_t; dinit = exp(dt_0 A) g_0.
    """
    _check(dim, dstate, b_groups, c_groups, chunk, u_dtype, B_dtype, C_dtype)
    if block < 1 or (dim // max(b_groups, 1)) % block or (dim // max(c_groups, 1)) % block:
        raise ValueError(f"block: must divide the channels of every group, got {block}")
    static = _static(dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init,
                     chunk, u_dtype, B_dtype, C_dtype, block=block)
    func = selective_scan_bwd_template(**static)
    return stamp(func, "selective_scan_bwd", static)


# The decode step, the chunked (parallel-in-time) forward and the complex-A scan live in their own files,
# which import this module's helpers: they are loaded on first use of their names (PEP 562), so that any of
# the modules may be imported first.
_ELSEWHERE = {
    "selective_scan_update": "_selective_scan_update", "selective_scan_update_template": "_selective_scan_update",
    "selective_scan_fwd_chunked": "_selective_scan_chunked",
    "selective_scan_fwd_chunked_template": "_selective_scan_chunked",
    "selective_scan_fwd_complex": "selective_scan_complex", "selective_scan_bwd_complex": "selective_scan_complex",
}


def __getattr__(name: str):
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static dims, dtypes) built by ``python -m tvm_mamba build-check`` for CUDA: Mamba-130M's
    d_inner 1536 at dstate 16, 64, 128, 256; B/C time-varying (batch, dstate, L) as in Mamba-1, with D, z,
    delta_bias, softplus; fp32 and bf16; the complex-A scan; plus the decode step (and its serving form)."""
    out = []
    for dstate in (16, 64, 128, 256):
        for u_dtype in ("float32", "bfloat16"):
            dt = {"u": u_dtype, "B": u_dtype, "C": u_dtype}
            base = dict(dim=1536, dstate=dstate, b_groups=1, c_groups=1, has_D=True, has_z=True,
                        has_delta_bias=True, delta_softplus=True, has_init=False,
                        chunk=chunk_size(dstate))
            out.append(("fwd", base, dt))
            out.append(("bwd", dict(base, block=16), dt))
        out.append(("update", dict(nheads=1536, headdim=1, dstate=dstate, ngroups=1, has_D=True, has_z=True,
                                    has_dt_bias=True, dt_softplus=True),
                    {"x": "float32", "B": "float32", "C": "float32"}))
    # complex A (S4D-style): B varying as in Mamba-1, C time-invariant complex
    for u_dtype in ("float32", "bfloat16"):
        cplx = dict(dim=1536, dstate=16, b_groups=1, c_groups=0, has_D=True, has_z=True, has_delta_bias=True,
                    delta_softplus=True, has_init=False, chunk=chunk_size(32))
        dt = {"u": u_dtype, "B": u_dtype, "C": "float32"}
        out.append(("fwd_complex", cplx, dt))
        out.append(("bwd_complex", dict(cplx, block=block_size(1536, 1, 0)), dt))
    # serving: Mamba-2 heads, a bf16 state pool addressed by int32 state_batch_indices, bf16 activations
    out.append(("update", dict(nheads=24, headdim=64, dstate=128, ngroups=1, has_D=True, has_z=True,
                               has_dt_bias=True, dt_softplus=True),
                {"x": "bfloat16", "B": "bfloat16", "C": "bfloat16", "state": "bfloat16", "idx": "int32"}))
    # Mamba2.step's call: one A / dt / D / dt_bias per head (mamba_ssm's TIE_HDIM), fp32
    out.append(("update", dict(nheads=24, headdim=64, dstate=128, ngroups=1, has_D=True, has_z=True,
                               has_dt_bias=True, dt_softplus=True, tie_hdim=True),
                {"x": "float32", "B": "float32", "C": "float32"}))
    return out


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning workloads: each Mamba-1 preset's scan (d_inner channels, d_state, B/C varying, D, z,
    delta_bias, softplus; fwd and bwd, fp32) and each Mamba-2 preset's decode step (heads layout, untied
    and tied per head: the latter is what Mamba2.step runs)."""
    from ._presets import presets

    out = []
    f32 = {"u": "float32", "B": "float32", "C": "float32"}
    for _, dims in presets(preset):
        if "headdim" in dims:
            step = dict(nheads=dims["nheads"], headdim=dims["headdim"], dstate=dims["d_state"],
                        ngroups=dims["ngroups"], has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
            out.append(("update", step, {"x": "float32", "B": "float32", "C": "float32"}))
            out.append(("update", dict(step, tie_hdim=True), {"x": "float32", "B": "float32", "C": "float32"}))
            continue
        base = dict(dim=dims["d_inner"], dstate=dims["d_state"], b_groups=1, c_groups=1, has_D=True, has_z=True,
                    has_delta_bias=True, delta_softplus=True, has_init=False, chunk=chunk_size(dims["d_state"]))
        out.append(("fwd", base, f32))
        out.append(("bwd", dict(base, block=block_size(dims["d_inner"], 1, 1)), f32))
    return out
