"""Chunked (parallel-in-time) forward of the Mamba-1 selective scan, for long sequences with little
batch x dim parallelism (split out of selective_scan.py, whose helpers it uses).

Same parameters and outputs as ``selective_scan_fwd`` (out, last_state, and the checkpoints = the state
before every ``chunk`` steps, which the backward recomputes from), in three passes:

1. local scans, parallel over (lane, chunk): from a zero state, S_c = the chunk's end state, and
   L_c = sum_t dt_t A (the log of the chunk's decay; exp(L_c) may underflow to 0, which is exact enough:
   no division by a running decay anywhere, so it is stable at any length);
2. carry, parallel over lanes, serial over chunks: H_0 = initial state, checkpoint_c = H_c,
   H_{c+1} = exp(L_c) * H_c + S_c (the recurrence is linear in h), last_state = H_nchunk;
3. fix-up, parallel over (lane, chunk): rerun each chunk from its checkpoint and write the outputs.

The recurrence runs twice, spread over lanes x chunks instead of lanes (1.5x the core time of the
dstate-layout sequential scan, 2.5x that of the channels layout, measured): it pays when batch x dim lanes
cannot keep the cores busy (the torch op dispatches on that, torch_ops/selective_scan.py). CPU only
(dstate-vectorized lanes); CUDA uses the sequential scan.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._common import stamp
from .selective_scan import _check, _fwd_step_fns, _lanes, _Math, _static, _vec_loop, acc_dtype


def selective_scan_fwd_chunked_template(dim: int, dstate: int, b_groups: int, c_groups: int, has_D: bool,
                                        has_z: bool, has_delta_bias: bool, delta_softplus: bool, has_init: bool,
                                        chunk: int, u_dtype: str, B_dtype: str, C_dtype: str,
                                        mode: str = "generic", vec: int = 1, tvec: int = 16) -> tirx.PrimFunc:
    """The three-pass loop nest (``mode`` "generic": serial, "cpu": parallel passes, dstate vectors of
    ``vec``, the per-step scalar math — softplus, SiLU: two exps each — vectorized over ``tvec`` steps)."""
    N, V, TV = dstate, vec, tvec
    NV = N // V
    ACC = acc_dtype(u_dtype)
    m = _Math(ACC)
    OUTER = _lanes(mode, 1)[0]
    VEC = _vec_loop(mode)
    VARB, VARC = b_groups > 0, c_groups > 0
    bval, cval, dt_of, finish = _fwd_step_fns(m, dim, b_groups, c_groups, has_delta_bias, delta_softplus, has_D,
                                              has_z, u_dtype)

    @T.prim_func
    def fwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, out_h: T.handle, last_h: T.handle, ck_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunk = T.meta_var((seqlen + chunk - 1) // chunk)
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
        # pass 1 writes S_c into ck[c] and L_c into logdec[c]; pass 2 turns ck into the checkpoints in place
        logdec = T.alloc_buffer((batch, dim, nchunk, N), ACC)
        for lc in OUTER(batch * dim * nchunk):
            h = T.alloc_buffer((N,), ACC)
            lg = T.alloc_buffer((N,), ACC)
            s = T.alloc_buffer((2,), ACC)
            dtb = T.alloc_buffer((chunk,), ACC)
            b = T.meta_var(lc // (dim * nchunk))
            d = T.meta_var(lc // nchunk % dim)
            c = T.meta_var(lc % nchunk)
            NT = T.min(seqlen - c * chunk, chunk)  # a let: bound analysis of the meta_var form overflows
            for no in range(NV):
                for ni in VEC(V):
                    h[no * V + ni] = m.zero
                    lg[no * V + ni] = m.zero
            for io in range(NT // TV):
                for ii in VEC(TV):
                    dtb[io * TV + ii] = dt_of(delta, db, b, d, c * chunk + io * TV + ii)
            for i in range(NT // TV * TV, NT):
                dtb[i] = dt_of(delta, db, b, d, c * chunk + i)
            for i in range(NT):
                s[0] = dtb[i]
                s[1] = s[0] * m.cast(u[b, d, c * chunk + i])
                for no in range(NV):
                    for ni in VEC(V):
                        h[no * V + ni] = (m.exp(s[0] * A[d, no * V + ni]) * h[no * V + ni]
                                          + s[1] * bval(Bm, b, d, c * chunk + i, no * V + ni))
                        lg[no * V + ni] = lg[no * V + ni] + s[0] * A[d, no * V + ni]
            for no in range(NV):
                for ni in VEC(V):
                    ck[b, d, c, no * V + ni] = h[no * V + ni]
                    logdec[b, d, c, no * V + ni] = lg[no * V + ni]
        for lane in OUTER(batch * dim):
            hc = T.alloc_buffer((N,), ACC)
            loc = T.alloc_buffer((N,), ACC)
            b = T.meta_var(lane // dim)
            d = T.meta_var(lane % dim)
            for no in range(NV):
                for ni in VEC(V):
                    hc[no * V + ni] = init[b, d, no * V + ni] if has_init else m.zero
            for c in range(nchunk):
                for no in range(NV):
                    for ni in VEC(V):
                        loc[no * V + ni] = ck[b, d, c, no * V + ni]
                        ck[b, d, c, no * V + ni] = hc[no * V + ni]
                        hc[no * V + ni] = m.exp(logdec[b, d, c, no * V + ni]) * hc[no * V + ni] + loc[no * V + ni]
            for no in range(NV):
                for ni in VEC(V):
                    last[b, d, no * V + ni] = hc[no * V + ni]
        for lc in OUTER(batch * dim * nchunk):
            h = T.alloc_buffer((N,), ACC)
            yv = T.alloc_buffer((V,), ACC)
            s = T.alloc_buffer((3,), ACC)
            dtb = T.alloc_buffer((chunk,), ACC)
            yb = T.alloc_buffer((chunk,), ACC)
            b = T.meta_var(lc // (dim * nchunk))
            d = T.meta_var(lc // nchunk % dim)
            c = T.meta_var(lc % nchunk)
            NT = T.min(seqlen - c * chunk, chunk)  # a let: bound analysis of the meta_var form overflows
            for no in range(NV):
                for ni in VEC(V):
                    h[no * V + ni] = ck[b, d, c, no * V + ni]
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

    return fwd


def selective_scan_fwd_chunked(dim: int, dstate: int, b_groups: int = 0, c_groups: int = 0, has_D: bool = False,
                               has_z: bool = False, has_delta_bias: bool = False, delta_softplus: bool = False,
                               has_init: bool = False, chunk: int = 64, u_dtype: str = "float32",
                               B_dtype: str = "float32", C_dtype: str = "float32") -> tirx.PrimFunc:
    """Shapes and outputs exactly as :func:`selective_scan_fwd` (out, last_state, checkpoints); computed by
    local scans per chunk, a carry pass over chunk boundaries and a fix-up pass (module docstring)."""
    _check(dim, dstate, b_groups, c_groups, chunk, u_dtype, B_dtype, C_dtype)
    static = _static(dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init,
                     chunk, u_dtype, B_dtype, C_dtype)
    return stamp(selective_scan_fwd_chunked_template(**static), "selective_scan_fwd_chunked", static)
