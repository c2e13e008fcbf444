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

from .._common import stamp
from .common import F32, I32, prev_sid
from .dims import VarlenDims, dims_of
from .strategy import SERIAL, ChunkStrategy, unravel


def carries(seq_idx, s, e, c, le, Q, has_seq_idx):
    """Whether sequence [s, e) (last chunk c, last position le in it) takes the state entering chunk c: it is
    not empty and began before chunk c or at position 0; with seq_idx also that state's sequence id is the
    id at e - 1 (the id of chunk c-1's last position, 0 before position 0: ssd_chunk_scan's carried mask)."""
    ok = tirx.all(le >= 0, s < tirx.max(c * Q, 1))
    if not has_seq_idx:
        return ok
    return tirx.all(ok, seq_idx[tirx.max(e, 1) - 1] == prev_sid(seq_idx, c, Q))


def varlen_template(d: VarlenDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_chunk_state_varlen kernel laid out by ``S``: a task per (sequence, head) and block of headdim rows
    (all of them on a CPU, one on CUDA) with lanes of dstate (all on a CPU, one on CUDA); each output element
    takes the carried term, then the sequence's tokens of its last chunk in order."""
    H, G, P, N, Q, m, od = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size, S.math, d.out_dtype
    R = H // G
    V = S.lanes(N)  # dstate lanes of a task
    PB = P if S.vector else 1  # headdim rows of a task
    NT = (P // PB) * (N // V)  # tasks per (sequence, head)
    tasks = S.tasks()

    @T.macro
    def sequence(i, x, Bm, dt_out, dA_cs, sin, cu, seq_idx, out):
        st = T.alloc_buffer((1,), I32, scope=S.scope)  # sequence start
        en = T.alloc_buffer((1,), I32, scope=S.scope)  # sequence end
        ch = T.alloc_buffer((1,), I32, scope=S.scope)  # its last chunk
        le = T.alloc_buffer((1,), I32, scope=S.scope)  # its last position in that chunk (-1: empty)
        w = T.alloc_buffer((1,), F32, scope=S.scope)
        acc = T.alloc_buffer((PB, V), F32, scope=S.scope)
        sq, h, pb, nb = T.meta_var(unravel(i, (None, H, P // PB, N // V)))
        st[0] = cu[sq]
        en[0] = cu[sq + 1]
        ch[0] = T.max(en[0] - 1, 0) // Q
        le[0] = T.Select(en[0] > st[0], en[0] - 1 - ch[0] * Q, -1)
        w[0] = T.float32(0)
        if carries(seq_idx, st[0], en[0], ch[0], le[0], Q, d.has_seq_idx):
            w[0] = m.exp(dA_cs[h, ch[0], le[0]])
        for p in range(PB):
            for v in S.lane_loop(V):
                acc[p, v] = w[0] * sin[ch[0], h, pb * PB + p, nb * V + v].astype(F32)
        for l in range(T.max(st[0] - ch[0] * Q, 0), le[0] + 1):
            w[0] = dt_out[h, ch[0], l] * m.exp(dA_cs[h, ch[0], le[0]] - dA_cs[h, ch[0], l])
            for p in range(PB):
                for v in S.lane_loop(V):
                    acc[p, v] = acc[p, v] + w[0] * x[ch[0] * Q + l, h, pb * PB + p].astype(F32) * Bm[
                        ch[0] * Q + l, h // R, nb * V + v].astype(F32)
        for p in range(PB):
            for v in S.lane_loop(V):
                out[sq, h, pb * PB + p, nb * V + v] = acc[p, v].astype(od)

    @T.prim_func
    def func(x_h: T.handle, b_h: T.handle, dto_h: T.handle, dac_h: T.handle, sin_h: T.handle, cu_h: T.handle,
             s_h: T.handle, o_h: T.handle):
        seqlen = T.int32()
        nchunks = T.int32()
        ncu = T.int32()
        nseqs = T.int32()
        x = T.match_buffer(x_h, (seqlen, H, P), d.x_dtype)
        Bm = T.match_buffer(b_h, (seqlen, G, N), d.bc_dtype)
        dt_out = T.match_buffer(dto_h, (H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (H, nchunks, Q), F32)
        sin = T.match_buffer(sin_h, (nchunks, H, P, N), d.state_dtype)
        cu = T.match_buffer(cu_h, (ncu,), I32)
        seq_idx = T.match_buffer(s_h, (seqlen,) if d.has_seq_idx else (1,), I32)
        out = T.match_buffer(o_h, (nseqs, H, P, N), od)
        tasks(nseqs * H * NT, lambda i: sequence(i, x, Bm, dt_out, dA_cs, sin, cu, seq_idx, out))

    return func


def ssd_chunk_state_varlen(dims: VarlenDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """x: (seqlen, nheads, headdim); B: (seqlen, ngroups, dstate); dt_out, dA_cumsum: (nheads, nchunks,
    chunk_size) f32; states_in: (nchunks, nheads, headdim, dstate) in state_dtype; cu_seqlens: (num_seqs + 1,)
    int32 (validated by the caller: 0 = cu[0] <= cu[1] <= ... <= cu[-1] <= seqlen, the tail padding);
    seq_idx: (seqlen,) int32
    -> varlen_states: (num_seqs, nheads, headdim, dstate) in out_dtype.

    V_i = sum over the last chunk's tokens of sequence i of x dt' exp(dA_cs[l_e] - dA_cs[l]) B^T, plus the
    carried state exp(dA_cs[l_e]) Sin_c where sequence i began before its last chunk (module docstring).
    """
    d = dims_of(VarlenDims, dims, kw)
    return stamp(varlen_template(d, strategy), "ssd_chunk_state_varlen")
