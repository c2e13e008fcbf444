"""SSD varlen states (mamba_ssm 2.3.x ``chunk_state_varlen`` semantics): the final state of every sequence
packed into one row (batch 1) of ``mamba_chunk_scan_combined``, from the states entering each chunk and the
tokens of the sequence's last chunk. See the package docstring for the chunked algorithm.

For sequence i = [s, e) of the packed row (cu_seqlens[i] = s, cu_seqlens[i + 1] = e), last chunk c = (e-1) // Q,
l_e = e - 1 - c Q (its last position in the chunk):

    V_i[p, n] = sum_{l = max(s - cQ, 0)}^{l_e} x[cQ+l, p] dt'[c, l] exp(dA_cs[c, l_e] - dA_cs[c, l]) B[cQ+l, n]
              + [s < max(cQ, 1)] * m_c * exp(dA_cs[c, l_e]) Sin_c[p, n]

Sin_c is the state entering chunk c (ssd_state_passing); the carried term counts only when the sequence began
before chunk c (upstream's condition ``start < c * chunk_size``) or is the row's first sequence (s = 0), whose
state entering chunk 0 is initial_states (upstream drops initial_states for a first sequence ending in chunk 0;
this keeps V_0 equal to the state after y's last position, as the recurrence gives). m_c: with seq_idx, the
carried-state mask of ssd_chunk_scan at position e - 1 (initial_states belong to sequence id 0). An empty
sequence (s = e) gets zeros.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .. import _math
from .._common import stamp

from .common import F32, I32
from .dims import VarlenDims, dims_of


def carries(seq_idx, s, e, c, le, Q, has_seq_idx):
    """Whether sequence [s, e) (last chunk c, last position le in it) takes the state entering chunk c: it is
    not empty and began before chunk c or at position 0; with seq_idx also that state's sequence id is the
    id at e - 1 (the id of chunk c-1's last position, 0 before position 0: ssd_chunk_scan's carried mask)."""
    ok = tirx.all(le >= 0, s < tirx.max(c * Q, 1))
    if not has_seq_idx:
        return ok
    prev = tirx.if_then_else(c > 0, seq_idx[tirx.max(c * Q, 1) - 1], tirx.const(0, I32))
    return tirx.all(ok, seq_idx[tirx.max(e, 1) - 1] == prev)


def ssd_chunk_state_varlen(dims: VarlenDims | None = None, **kw) -> tirx.PrimFunc:
    """x: (seqlen, nheads, headdim); B: (seqlen, ngroups, dstate); dt_out, dA_cumsum: (nheads, nchunks,
    chunk_size) f32; states_in: (nchunks, nheads, headdim, dstate) in state_dtype; cu_seqlens: (num_seqs + 1,)
    int32 (validated by the caller: 0 = cu[0] <= cu[1] <= ... <= cu[-1] = seqlen); seq_idx: (seqlen,) int32
    -> varlen_states: (num_seqs, nheads, headdim, dstate) in out_dtype.

    V_i = sum over the last chunk's tokens of sequence i of x dt' exp(dA_cs[l_e] - dA_cs[l]) B^T, plus the
    carried state exp(dA_cs[l_e]) Sin_c where sequence i began before its last chunk (module docstring).
    """
    d = dims_of(VarlenDims, dims, kw)
    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    x_dtype, bc_dtype, state_dtype, out_dtype, has_seq_idx = d.x_dtype, d.bc_dtype, d.state_dtype, d.out_dtype, \
        d.has_seq_idx
    R = H // G

    @T.prim_func
    def func(x_h: T.handle, b_h: T.handle, dto_h: T.handle, dac_h: T.handle, sin_h: T.handle, cu_h: T.handle,
             s_h: T.handle, o_h: T.handle):
        seqlen = T.int32()
        nchunks = T.int32()
        ncu = T.int32()
        nseqs = T.int32()
        x = T.match_buffer(x_h, (seqlen, H, P), x_dtype)
        Bm = T.match_buffer(b_h, (seqlen, G, N), bc_dtype)
        dt_out = T.match_buffer(dto_h, (H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (H, nchunks, Q), F32)
        sin = T.match_buffer(sin_h, (nchunks, H, P, N), state_dtype)
        cu = T.match_buffer(cu_h, (ncu,), I32)
        seq_idx = T.match_buffer(s_h, (seqlen,) if has_seq_idx else (1,), I32)
        out = T.match_buffer(o_h, (nseqs, H, P, N), out_dtype)
        for ih in T.parallel(nseqs * H):
            i = T.meta_var(ih // H)
            h = T.meta_var(ih % H)
            iv = T.alloc_buffer((4,), I32)  # start, end, last chunk, last position in it (-1: empty)
            w = T.alloc_buffer((1,), F32)
            acc = T.alloc_buffer((P, N), F32)
            iv[0] = cu[i]
            iv[1] = cu[i + 1]
            iv[2] = T.max(iv[1] - 1, 0) // Q
            iv[3] = T.Select(iv[1] > iv[0], iv[1] - 1 - iv[2] * Q, -1)
            w[0] = T.float32(0)
            if carries(seq_idx, iv[0], iv[1], iv[2], iv[3], Q, has_seq_idx):
                w[0] = _math.exp(dA_cs[h, iv[2], iv[3]])
            for p in range(P):
                for n in T.vectorized(N):
                    acc[p, n] = w[0] * sin[iv[2], h, p, n].astype(F32)
            for l in range(Q):
                if l <= iv[3] and iv[2] * Q + l >= iv[0]:
                    w[0] = dt_out[h, iv[2], l] * _math.exp(dA_cs[h, iv[2], iv[3]] - dA_cs[h, iv[2], l])
                    for p in range(P):
                        for n in T.vectorized(N):
                            acc[p, n] = acc[p, n] + w[0] * x[iv[2] * Q + l, h, p].astype(F32) * Bm[
                                iv[2] * Q + l, h // R, n].astype(F32)
            for p in range(P):
                for n in T.vectorized(N):
                    out[i, h, p, n] = acc[p, n].astype(out_dtype)

    return stamp(func, "ssd_chunk_state_varlen", d.stamp_static())
