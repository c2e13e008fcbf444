"""SSD per-chunk backward kernel (every gradient of one (batch, chunk, head) in one pass; see the package docstring).

With g = dy * silu(z), K[l, s] = exp(dA_cs[l] - dA_cs[s]) (s <= l, same sequence), CB = C B^T,
GX = g x^T, e[l] = exp(dA_cs[l]) (carried-state mask), w[s] = dt[s] exp(dA_cs[Q-1] - dA_cs[s]) (chunk-state
mask), Sin the state entering the chunk and dSo the gradient of the state leaving it:

    dx[s]    = sum_{l>=s} CB K dt[s] g[l] + w[s] dSo B_s + D g[s]
    dC[l]    = e[l] g_l Sin + sum_{s<=l} GX K dt[s] B_s
    dB[s]    = sum_{l>=s} GX K dt[s] C_l + w[s] x_s dSo
    d dt[s]  = sum_l GX CB K + exp(dA_cs[Q-1]-dA_cs[s]) <x_s, dSo B_s>
    d dA_step[s] = sum_{l>=s>k} G[l, k] + sum_{l>=s} e[l] <g_l, C_l Sin> + sum_{k<s} w[k] dt[k] <x_k, dSo B_k>
    dD       = sum_l g x  (per (batch, chunk) partial)

with G = GX CB K dt: the gradient of the chunk's decay steps dA_step = dt' A themselves (dA_cs[l] is the sum of
the steps s <= l), within the chunk (the state-passing term is added by ssd_chunk_cumsum_bwd). Crossing-pairs
form: step s lies inside the segment from k to l of each pair it sums, so x_k enters only steps s > k and g_l
only steps s <= l -- a non-finite x / dy never reaches another position's step through a cancelling
difference (upstream's rows - columns of G, reverse-cumsummed, did: x_t non-finite made every step of t's
chunk non-finite). Rows from the last up: R[k] = sum_{l'>=l} G[l', k] (a vector update of row l, as the old
column sums), then d dA_step[l] += sum_{k<l} R[k] (a row-length reduction, as the old row sums): O(Q^2).
"""
from __future__ import annotations

from tvm.script import tirx as T

from .. import _math
from .._common import stamp
from .._math import Math
from .mm import DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, lower_cols, matmul, vblock, zero
from .common import F32, I32, gate, ld, seg_exp
from .dims import ScanBwdDims, dims_of

_m = Math()  # the CPU loop nests' math: the vectorizable polynomials


def ssd_chunk_scan_bwd(dims: ScanBwdDims | None = None, *, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS,
                       order: int = DEFAULT_ORDER, **kw):
    """x, z, dy: (batch, seqlen, nheads, headdim); B, C: (batch, seqlen, ngroups, dstate); cb: (batch, nchunks,
    ngroups, chunk_size, chunk_size) f32 (C.B^T, ssd_bmm_chunk); dt_out, dA_cumsum:
    (batch, nheads, nchunks, chunk_size) f32; states_in, dstates_out: (batch, nchunks, nheads, headdim,
    dstate) f32; D: (nheads,) / (nheads, headdim); seq_idx: (batch, seqlen)
    -> dx: (batch, seqlen, nheads, headdim); dB_parts, dC_parts: (batch, seqlen, gparts, dstate) f32;
    ddt_out, ddA_step: (batch, nheads, nchunks, chunk_size) f32; dD_part: (batch, nchunks, nheads, headdim);
    gsum (workspace, written then read): (batch, nchunks, gparts, chunk_size, chunk_size) f32.

    gparts = ngroups * hparts, hparts dividing nheads / ngroups (compute.ssd.head_parts): one parallel task per
    (batch, chunk, group, part) runs the part's heads in order and sums their dB / dC rows in that order
    (hparts = 1: the group's dB / dC themselves; the heads share the staged B / C rows). The intra-chunk
    terms of dB / dC multiply the group's C / B, so they run once per part on the sum over its heads of
    (g x^T) K dt (the workspace gsum, the causal blocks of each part's Q x Q rows: the CUDA layout writes it in
    one launch and reads it in the next two): two Q x Q x dstate products per part instead of per head (2 of the
    5 per-head matmuls). ``rows`` x ``cols`` x ``order``: the register block of the chunk matmuls (mm.py).
    """
    d = dims_of(ScanBwdDims, dims, kw)
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    x_dtype, bc_dtype, has_seq_idx = d.x_dtype, d.bc_dtype, d.has_seq_idx
    has_D, D_has_hdim, has_z = d.has_D, d.D_has_hdim, d.has_z
    R = H // G
    VB = vblock(Q)
    W2 = max(P, N)
    mm_qq = matmul(Q, Q, rows, cols, lower=True, order=order)
    mm_qp, mm_qn = matmul(Q, P, rows, cols, order=order), matmul(Q, N, rows, cols, order=order)
    # the triangular sums select their range per row (never 0 * a non-finite dy / x / B / C of another position)
    mm_qp_ge = matmul(Q, P, rows, cols, order=order, tri="ge")
    mm_qn_le, mm_qn_ge = (matmul(Q, N, rows, cols, order=order, tri=t) for t in ("le", "ge"))

    def dx_init(Dm, gl, h, s, p):  # D g[s, p]
        if has_D:
            return (Dm[h, p] if D_has_hdim else Dm[h]) * gl[s, p]
        return T.float32(0)

    zshape = (1, 1, 1, 1)

    @T.prim_func
    def func(x_h: T.handle, z_h: T.handle, dy_h: T.handle, b_h: T.handle, c_h: T.handle, cb_h: T.handle,
             dto_h: T.handle, dac_h: T.handle, sin_h: T.handle, dso_h: T.handle, d_h: T.handle, s_h: T.handle,
             dx_h: T.handle, db_h: T.handle, dc_h: T.handle, ddto_h: T.handle, ddac_h: T.handle, dd_h: T.handle,
             ws_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        gparts = T.int32()
        x = T.match_buffer(x_h, (batch, seqlen, H, P), x_dtype)
        z = T.match_buffer(z_h, (batch, seqlen, H, P) if has_z else zshape, x_dtype)
        dy = T.match_buffer(dy_h, (batch, seqlen, H, P), x_dtype)
        Bm = T.match_buffer(b_h, (batch, seqlen, G, N), bc_dtype)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), bc_dtype)
        cbg = T.match_buffer(cb_h, (batch, nchunks, G, Q, Q), F32)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        sin = T.match_buffer(sin_h, (batch, nchunks, H, P, N), F32)
        dso = T.match_buffer(dso_h, (batch, nchunks, H, P, N), F32)
        Dm = T.match_buffer(d_h, ((H, P) if D_has_hdim else (H,)) if has_D else (1,), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if has_seq_idx else (1, 1), I32)
        dx = T.match_buffer(dx_h, (batch, seqlen, H, P), x_dtype)
        dBp = T.match_buffer(db_h, (batch, seqlen, gparts, N), F32)
        dCp = T.match_buffer(dc_h, (batch, seqlen, gparts, N), F32)
        ddt_out = T.match_buffer(ddto_h, (batch, H, nchunks, Q), F32)
        ddA_step = T.match_buffer(ddac_h, (batch, H, nchunks, Q), F32)
        dD_part = T.match_buffer(dd_h, (batch, nchunks, H, P) if has_D else zshape, F32)
        ws = T.match_buffer(ws_h, (batch, nchunks, gparts, Q, Q), F32)
        for task in T.parallel(batch * nchunks * gparts):
            b = T.meta_var(task // (nchunks * gparts))
            c = T.meta_var(task // gparts % nchunks)
            g = T.meta_var(task % gparts // (gparts // G))
            part = T.meta_var(task % gparts % (gparts // G))
            per = T.meta_var(R // (gparts // G))  # heads per part
            acs = T.alloc_buffer((Q,), F32)
            dtl = T.alloc_buffer((Q,), F32)
            sid = T.alloc_buffer((Q,), I32)
            e = T.alloc_buffer((Q,), F32)
            wst = T.alloc_buffer((Q,), F32)
            xl = T.alloc_buffer((Q, P), F32)
            xt = T.alloc_buffer((P, Q), F32)
            gl = T.alloc_buffer((Q, P), F32)
            cl = T.alloc_buffer((Q, N), F32)
            bl = T.alloc_buffer((Q, N), F32)
            dsot = T.alloc_buffer((N, P), F32)
            cb = T.alloc_buffer((Q, Q), F32)
            gx = T.alloc_buffer((Q, Q), F32)
            gr = T.alloc_buffer((Q,), F32)
            kk = T.alloc_buffer((Q,), F32)
            dcar = T.alloc_buffer((Q,), F32)  # carried-state term of d dA_cs (reverse-cumsummed at the end)
            rsuf = T.alloc_buffer((Q,), F32)  # R[k] = sum_{l'>=l} G[l', k]: column sums of the rows done so far
            dd = T.alloc_buffer((Q,), F32)
            dac = T.alloc_buffer((Q,), F32)
            rp = T.alloc_buffer((P,), F32)
            t1 = T.alloc_buffer((Q, W2), F32)  # the two matmul products of dx, then dC, then dB
            t2 = T.alloc_buffer((Q, W2), F32)
            sc = T.alloc_buffer((2,), F32)  # scalar accumulators: [0] reductions, [1] chunk-state prefix
            dBa = T.alloc_buffer((Q, N), F32)  # the part's dB / dC rows, summed over its heads in order
            dCa = T.alloc_buffer((Q, N), F32)
            for l in range(Q):
                for sb in range(lower_cols(l, Q, VB) // VB):
                    for v in T.vectorized(VB):
                        ws[b, c, task % gparts, l, sb * VB + v] = T.float32(0)
            for l in range(Q):  # the group's B / C rows (zeros past seqlen), shared by the part's heads
                t = T.meta_var(T.min(c * Q + l, seqlen - 1))
                for n in T.vectorized(N):
                    cl[l, n] = ld(Cm, (b, t, g, n), seqlen, c * Q + l)
                    bl[l, n] = ld(Bm, (b, t, g, n), seqlen, c * Q + l)
                    dBa[l, n] = T.float32(0)
                    dCa[l, n] = T.float32(0)
            for hh in range(per):
                h = T.meta_var(g * R + part * per + hh)
                # -- stage the chunk (zeros past seqlen) --
                for l in range(Q):
                    t = T.meta_var(T.min(c * Q + l, seqlen - 1))
                    acs[l] = dA_cs[b, h, c, l]
                    dtl[l] = dt_out[b, h, c, l]
                    dd[l] = T.float32(0)
                    dac[l] = T.float32(0)
                    dcar[l] = T.float32(0)
                    rsuf[l] = T.float32(0)
                for l in range(Q):
                    t = T.meta_var(T.min(c * Q + l, seqlen - 1))
                    if has_seq_idx:
                        sid[l] = seq_idx[b, t]
                        e[l] = T.Select(seq_idx[b, t] == T.if_then_else(c > 0, seq_idx[b, T.max(c * Q, 1) - 1], 0),
                                        _math.exp(acs[l]), T.float32(0))
                        wst[l] = T.Select(seq_idx[b, t] == seq_idx[b, T.min(c * Q + Q, seqlen) - 1],
                                          _math.exp(acs[Q - 1] - acs[l]), T.float32(0))
                    else:
                        e[l] = _math.exp(acs[l])
                        wst[l] = _math.exp(acs[Q - 1] - acs[l])
                    for p in T.vectorized(P):
                        xl[l, p] = ld(x, (b, t, h, p), seqlen, c * Q + l)
                        gl[l, p] = gate(_m, dy, z, (b, t, h, p), seqlen, c * Q + l, has_z)
                    for p in range(P):
                        xt[p, l] = xl[l, p]
                for p in range(P):
                    for n in range(N):
                        dsot[n, p] = dso[b, c, h, p, n]
                # -- gx = g x^T (cb = C B^T comes from ssd_bmm_chunk, once per group) --
                mm_qq(lambda lo, hi: 0, lambda lo, hi: P, lambda l, p: gl[l, p], lambda p, s: xt[p, s], zero,
                      lambda l, s, v: T.buffer_store(gx, v, [l, s]))
                # -- masks, decays, d dt and d dA_step of the intra-chunk term --
                # (the causal blocks only: s < lower_cols(l); gx and cb right of them are never read unmasked;
                # rows from the last up, for the column suffix sums R of the crossing pairs)
                for lr in range(Q):
                    l = T.meta_var(Q - 1 - lr)
                    for sb in range(lower_cols(l, Q, VB) // VB):
                        for v in T.vectorized(VB):
                            s = T.meta_var(sb * VB + v)
                            kk[s] = seg_exp(_m, acs, sid, l, s, has_seq_idx)
                            # selected, not multiplied by kk = 0: gx[l, s > l] = g_l . x_s may be NaN / Inf
                            gr[s] = T.Select(s <= l, gx[l, s] * cbg[b, c, g, l, s] * kk[s], T.float32(0))
                            dd[s] = dd[s] + gr[s]
                            cb[l, s] = cbg[b, c, g, l, s] * kk[s] * dtl[s]
                            ws[b, c, task % gparts, l, s] = ws[b, c, task % gparts, l, s] + T.Select(s <= l, gx[l, s] * kk[s] * dtl[s], T.float32(0))
                            rsuf[s] = rsuf[s] + gr[s] * dtl[s]  # G[l, s] (0 for s > l)
                    # crossing pairs of step l: d dA_step[l] += sum_{k<l} sum_{l'>=l} G[l', k] (never a difference
                    # of sums: G[l', k] reaches the steps k < l <= l' only)
                    sc[0] = T.float32(0)
                    for s in range(l):
                        sc[0] = sc[0] + rsuf[s]
                    dac[l] = dac[l] + sc[0]
                # -- dx, and the chunk-state terms of d dt / d dA_step (prefix over k < s) --
                # t1[s] = D g[s] + sum_{l>=s} cb[l, s] g[l];  t2[s] = B_s dSo^T
                mm_qp_ge(lambda lo, hi: lo, lambda lo, hi: Q, lambda s, l: cb[l, s],
                      lambda l, p: gl[l, p], lambda s, p: dx_init(Dm, gl, h, s, p),
                      lambda s, p, v: T.buffer_store(t1, v, [s, p]))
                mm_qp(lambda lo, hi: 0, lambda lo, hi: N, lambda s, n: bl[s, n], lambda n, p: dsot[n, p], zero,
                      lambda s, p, v: T.buffer_store(t2, v, [s, p]))
                sc[1] = T.float32(0)
                for s in range(Q):
                    sc[0] = T.float32(0)
                    for p in range(P):
                        sc[0] = sc[0] + xl[s, p] * t2[s, p]
                    dd[s] = dd[s] + wst[s] * sc[0]
                    dac[s] = dac[s] + sc[1]
                    sc[1] = sc[1] + wst[s] * dtl[s] * sc[0]
                    if c * Q + s < seqlen:
                        for p in T.vectorized(P):
                            dx[b, c * Q + s, h, p] = (t1[s, p] + wst[s] * dtl[s] * t2[s, p]).astype(x_dtype)
                # -- dC, carried-state term: t1[l] = g_l Sin (the intra-chunk term is per part, below) --
                mm_qn(lambda lo, hi: 0, lambda lo, hi: P, lambda l, p: gl[l, p], lambda p, n: sin[b, c, h, p, n], zero,
                      lambda l, n, v: T.buffer_store(t1, v, [l, n]))
                for l in range(T.min(Q, seqlen - c * Q)):
                    sc[0] = T.float32(0)
                    for n in range(N):
                        sc[0] = sc[0] + cl[l, n] * t1[l, n]
                    dcar[l] = e[l] * sc[0]
                    for n in T.vectorized(N):
                        dCa[l, n] = dCa[l, n] + e[l] * t1[l, n]
                # -- dB, chunk-state term: t2[s] = x_s dSo --
                mm_qn(lambda lo, hi: 0, lambda lo, hi: P, lambda s, p: xl[s, p], lambda p, n: dso[b, c, h, p, n], zero,
                      lambda s, n, v: T.buffer_store(t2, v, [s, n]))
                for s in range(T.min(Q, seqlen - c * Q)):
                    for n in T.vectorized(N):
                        dBa[s, n] = dBa[s, n] + wst[s] * dtl[s] * t2[s, n]
                # -- dD partial --
                if has_D:
                    for p in T.vectorized(P):
                        rp[p] = T.float32(0)
                    for l in range(Q):
                        for p in T.vectorized(P):
                            rp[p] = rp[p] + gl[l, p] * xl[l, p]
                    for p in T.vectorized(P):
                        dD_part[b, c, h, p] = rp[p]
                sc[0] = T.float32(0)  # the carried-state term: d dA_cs[l] reaches the steps s <= l
                for lr in range(Q):
                    sc[0] = sc[0] + dcar[Q - 1 - lr]
                    ddt_out[b, h, c, Q - 1 - lr] = dd[Q - 1 - lr]
                    ddA_step[b, h, c, Q - 1 - lr] = dac[Q - 1 - lr] + sc[0]
            # -- the intra-chunk terms once per part (B, C are the group's): with G = sum over the part's heads
            # of gx K dt, dC[l] += sum_{s<=l} G[l, s] B_s and dB[s] += sum_{l>=s} G[l, s] C_l --
            mm_qn_le(lambda lo, hi: 0, lambda lo, hi: hi, lambda l, s: ws[b, c, task % gparts, l, s],
                  lambda s, n: bl[s, n], lambda l, n: dCa[l, n], lambda l, n, v: T.buffer_store(dCa, v, [l, n]))
            mm_qn_ge(lambda lo, hi: lo, lambda lo, hi: Q, lambda s, l: ws[b, c, task % gparts, l, s],
                  lambda l, n: cl[l, n], lambda s, n: dBa[s, n], lambda s, n, v: T.buffer_store(dBa, v, [s, n]))
            for l in range(T.min(Q, seqlen - c * Q)):
                for n in T.vectorized(N):
                    dBp[b, c * Q + l, task % gparts, n] = dBa[l, n]
                    dCp[b, c * Q + l, task % gparts, n] = dCa[l, n]

    return stamp(func, "ssd_chunk_scan_bwd", d.stamp_static())
