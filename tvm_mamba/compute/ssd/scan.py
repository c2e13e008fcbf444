"""SSD chunk-scan kernel (forward); see the package docstring for the algorithm.

Every kernel runs one (batch, chunk, head) per parallel iteration and stages the chunk in float32 stack
buffers (x, B, C, transposes), so each chunk-local matmul is a row update vectorized over its contiguous
static axis (headdim, dstate or chunk_size): acc[l, :] += a[l, k] * b[k, :].
Positions past seqlen are staged as zeros (their dt_out is 0 too), so the ragged last chunk needs no
special case inside the matmuls.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .. import _math
from .._common import stamp
from .._math import Math
from .mm import DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, lower_cols, matmul, vblock, zero

from .common import F32, I32, ld, seg_exp
from .dims import ScanDims, dims_of

_m = Math()  # the CPU loop nests' math: the vectorizable polynomials


def ssd_chunk_scan(dims: ScanDims | None = None, *, rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS,
                   order: int = DEFAULT_ORDER, **kw) -> tirx.PrimFunc:
    """x, z: (batch, seqlen, nheads, headdim); cb: (batch, nchunks, ngroups, chunk_size, chunk_size) f32 (C.B^T,
    ssd_bmm_chunk); C: (batch, seqlen, ngroups, dstate); dt_out, dA_cumsum: (batch, nheads, nchunks, chunk_size)
    f32; states_in: (batch, nchunks, nheads, headdim, dstate) in state_dtype; D: (nheads,) or (nheads, headdim) f32;
    seq_idx: (batch, seqlen) int32
    -> y: (batch, seqlen, nheads, headdim), y_pre: same (the pre-gate output, written only with z).

    y0[l] = sum_{s<=l} (C_l.B_s) exp(dA_cs[l]-dA_cs[s]) dt_out[s] x[s] + exp(dA_cs[l]) Sin C_l + D x[l];
    y = y0 * silu(z). ``rows`` x ``cols``: the register block of the chunk matmuls (mm.py).
    """
    d = dims_of(ScanDims, dims, kw)
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    x_dtype, bc_dtype, state_dtype, has_seq_idx = d.x_dtype, d.bc_dtype, d.state_dtype, d.has_seq_idx
    has_D, D_has_hdim, has_z = d.has_D, d.D_has_hdim, d.has_z
    R = H // G
    mm_qp = matmul(Q, P, rows, cols, order=order)
    mm_qp_le = matmul(Q, P, rows, cols, order=order, tri="le")  # sum_{s<=l}: causal (no 0 * x[s > l])
    VB = vblock(Q)

    def carried(e, Dm, xl, h, l, p, v):  # e[l] (C_l Sin)[l, p] + D x[l, p]
        if has_D:
            return e[l] * v + (Dm[h, p] if D_has_hdim else Dm[h]) * xl[l, p]
        return e[l] * v

    zshape = (1, 1, 1, 1)

    @T.prim_func
    def func(x_h: T.handle, z_h: T.handle, cb_h: T.handle, c_h: T.handle, dto_h: T.handle, dac_h: T.handle,
             sin_h: T.handle, d_h: T.handle, s_h: T.handle, y_h: T.handle, yp_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        x = T.match_buffer(x_h, (batch, seqlen, H, P), x_dtype)
        z = T.match_buffer(z_h, (batch, seqlen, H, P) if has_z else zshape, x_dtype)
        cbg = T.match_buffer(cb_h, (batch, nchunks, G, Q, Q), F32)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), bc_dtype)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        sin = T.match_buffer(sin_h, (batch, nchunks, H, P, N), state_dtype)
        Dm = T.match_buffer(d_h, ((H, P) if D_has_hdim else (H,)) if has_D else (1,), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if has_seq_idx else (1, 1), I32)
        y = T.match_buffer(y_h, (batch, seqlen, H, P), x_dtype)
        y_pre = T.match_buffer(yp_h, (batch, seqlen, H, P) if has_z else zshape, x_dtype)
        for bch in T.parallel(batch * nchunks * H):
            b = T.meta_var(bch // (nchunks * H))
            c = T.meta_var(bch // H % nchunks)
            h = T.meta_var(bch % H)
            g = T.meta_var(h // R)
            acs = T.alloc_buffer((Q,), F32)
            dtl = T.alloc_buffer((Q,), F32)
            sid = T.alloc_buffer((Q,), I32)
            e = T.alloc_buffer((Q,), F32)
            xl = T.alloc_buffer((Q, P), F32)
            cl = T.alloc_buffer((Q, N), F32)
            sint = T.alloc_buffer((N, P), F32)
            cb = T.alloc_buffer((Q, Q), F32)
            acc = T.alloc_buffer((Q, P), F32)
            for l in range(Q):
                t = T.meta_var(T.min(c * Q + l, seqlen - 1))
                acs[l] = dA_cs[b, h, c, l]
                dtl[l] = dt_out[b, h, c, l]
                if has_seq_idx:
                    sid[l] = seq_idx[b, t]
                    e[l] = T.Select(seq_idx[b, t] == T.if_then_else(c > 0, seq_idx[b, T.max(c * Q, 1) - 1], 0),
                                    _math.exp(acs[l]), T.float32(0))
                else:
                    e[l] = _math.exp(acs[l])
                for p in T.vectorized(P):
                    xl[l, p] = ld(x, (b, t, h, p), seqlen, c * Q + l)
                for n in T.vectorized(N):
                    cl[l, n] = ld(Cm, (b, t, g, n), seqlen, c * Q + l)
            for l in range(Q):  # cb[l, s] = (C_l . B_s) exp(segsum) dt[s] (after acs / sid / dtl are staged)
                for sb in range(lower_cols(l, Q, VB) // VB):  # the causal blocks; the rest is read masked
                    for v in T.vectorized(VB):
                        s = T.meta_var(sb * VB + v)
                        cb[l, s] = cbg[b, c, g, l, s] * seg_exp(_m, acs, sid, l, s, has_seq_idx) * dtl[s]
            for p in range(P):
                for n in range(N):
                    sint[n, p] = sin[b, c, h, p, n].astype(F32)
            # acc = e C Sin + D x, then += sum_{s<=l} cb[l, s] x[s]
            mm_qp(lambda lo, hi: 0, lambda lo, hi: N, lambda l, n: cl[l, n], lambda n, p: sint[n, p], zero,
                  lambda l, p, v: T.buffer_store(acc, carried(e, Dm, xl, h, l, p, v), [l, p]))
            mm_qp_le(lambda lo, hi: 0, lambda lo, hi: hi, lambda l, s: cb[l, s],
                  lambda s, p: xl[s, p], lambda l, p: acc[l, p], lambda l, p, v: T.buffer_store(acc, v, [l, p]))
            for l in range(T.min(Q, seqlen - c * Q)):
                for p in T.vectorized(P):
                    if has_z:
                        y_pre[b, c * Q + l, h, p] = acc[l, p].astype(x_dtype)
                        y[b, c * Q + l, h, p] = (acc[l, p] * _math.silu(
                            z[b, c * Q + l, h, p].astype(F32))).astype(x_dtype)
                    else:
                        y[b, c * Q + l, h, p] = acc[l, p].astype(x_dtype)

    return stamp(func, "ssd_chunk_scan", d.stamp_static())
