"""CUDA template for ssd_chunk_state_varlen (tvm_mamba/compute/_ssd_varlen.py: the math and its semantics):
one thread per output element (sequence, head, headdim, dstate), the same parameter list as the CPU loop nest.
The sequence bounds are read once per thread into registers; the token sum runs over the sequence's part of its
last chunk only (at most chunk_size terms), so a call costs O(num_seqs x nheads x headdim x dstate x chunk).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute.ssd.varlen import carries
from ._ssd_common import F32, I32, _Ctx, _math


def _chunk_state_varlen(s, TH):
    k = _Ctx(s)
    H, G, P, N, Q = s["nheads"], s["ngroups"], s["headdim"], s["dstate"], s["chunk_size"]
    R = k.R
    xd, bcd, od, seq = s["x_dtype"], s["bc_dtype"], s["out_dtype"], s["has_seq_idx"]
    sd = s.get("state_dtype", F32)

    @T.prim_func
    def func(x_h: T.handle, b_h: T.handle, dto_h: T.handle, dac_h: T.handle, sin_h: T.handle, cu_h: T.handle,
             s_h: T.handle, o_h: T.handle):
        L = T.int32()
        NC = T.int32()
        NCU = T.int32()
        NS = T.int32()
        x = T.match_buffer(x_h, (L, H, P), xd)
        Bm = T.match_buffer(b_h, (L, G, N), bcd)
        dt_out = T.match_buffer(dto_h, (H, NC, Q), F32)
        dA_cs = T.match_buffer(dac_h, (H, NC, Q), F32)
        sin = T.match_buffer(sin_h, (NC, H, P, N), sd)
        cu = T.match_buffer(cu_h, (NCU,), I32)
        seq_idx = T.match_buffer(s_h, (L,) if seq else (1,), I32)
        out = T.match_buffer(o_h, (NS, H, P, N), od)
        for bx in k.loop(T.ceildiv(NS * H * P * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                st = T.alloc_buffer((1,), I32, scope=k.scope)  # sequence start
                en = T.alloc_buffer((1,), I32, scope=k.scope)  # sequence end
                ch = T.alloc_buffer((1,), I32, scope=k.scope)  # its last chunk
                le = T.alloc_buffer((1,), I32, scope=k.scope)  # its last position in that chunk (-1: empty)
                i = T.meta_var(bx * TH + tx)
                sq = T.meta_var(i // (H * P * N))
                h = T.meta_var(i // (P * N) % H)
                p = T.meta_var(i // N % P)
                n = T.meta_var(i % N)
                if i < NS * H * P * N:
                    st[0] = cu[sq]
                    en[0] = cu[sq + 1]
                    ch[0] = T.max(en[0] - 1, 0) // Q
                    le[0] = T.Select(en[0] > st[0], en[0] - 1 - ch[0] * Q, -1)
                    acc[0] = T.float32(0)
                    if carries(seq_idx, st[0], en[0], ch[0], le[0], Q, seq):
                        acc[0] = _math.exp(dA_cs[h, ch[0], le[0]]) * sin[ch[0], h, p, n].astype(F32)
                    for l in range(T.max(st[0] - ch[0] * Q, 0), le[0] + 1):
                        acc[0] = acc[0] + dt_out[h, ch[0], l] * _math.exp(
                            dA_cs[h, ch[0], le[0]] - dA_cs[h, ch[0], l]) * x[ch[0] * Q + l, h, p].astype(F32) * Bm[
                            ch[0] * Q + l, h // R, n].astype(F32)
                    out[sq, h, p, n] = acc[0].astype(od)

    return func
