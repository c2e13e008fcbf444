"""CUDA template for the SSD chunk-scan backward (see ssd.py in this folder; the other SSD kernels are one template
for every target, compute/ssd/): one thread per output element.

Backward launch order inside ssd_chunk_scan_bwd (each launch reads only what earlier launches finished):
dx (per position), gsum = the part's sum of (g x^T) K dt into the workspace (once per head part, as the CPU
kernel), dB and dC (per position, from gsum: two matmul-shaped sums in the CPU kernel's order), then XB[s] = <x_s, dSo B_s> into ddt_out as scratch, then d dA_step in three
launches (the carried-state term per position, its reverse cumsum by one thread per chunk and head, then per
position the crossing pairs and the chunk-state prefix, which read every XB of the chunk), then d dt (overwrites
its own scratch entry), then the dD partials.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ._ssd_common import F32, I32, Z4, _Ctx, _math


def _dims(s):
    return s["nheads"], s["ngroups"], s["headdim"], s["dstate"], s["chunk_size"]


def _chunk_scan_bwd(s, TH):
    k = _Ctx(s)
    H, G, P, N, Q = _dims(s)
    R = k.R
    xd, bcd, seq = s["x_dtype"], s["bc_dtype"], s["has_seq_idx"]
    has_D, D_hd, has_z = s["has_D"], s["D_has_hdim"], s["has_z"]

    def X(x, b, c, s_, h, p, L):  # x at chunk position s_ (0 past seqlen)
        return k.ld(x, (b, T.min(c * Q + s_, L - 1), h, p), L, c * Q + s_)

    def BC(m, b, c, s_, h, n, L):
        return k.ld(m, (b, T.min(c * Q + s_, L - 1), h // R, n), L, c * Q + s_)

    def grad(dy, z, b, c, l, h, p, L):
        return k.g(dy, z, b, c * Q + l, h, p, L, has_z)

    def gx_in(dy, z, x, b, c, l, j, h, p):  # g_l[p] x_j[p], l and j inside the sequence: no bound checks
        # (with them, the crossing-pairs launch spilled 12-16 B on sm_80 / sm_90)
        v = dy[b, c * Q + l, h, p].astype(F32) * x[b, c * Q + j, h, p].astype(F32)
        return v * _math.silu(z[b, c * Q + l, h, p].astype(F32)) if has_z else v

    @T.prim_func
    def func(x_h: T.handle, z_h: T.handle, dy_h: T.handle, b_h: T.handle, c_h: T.handle, cb_h: T.handle,
             dto_h: T.handle, dac_h: T.handle, sin_h: T.handle, dso_h: T.handle, d_h: T.handle, s_h: T.handle,
             dx_h: T.handle, db_h: T.handle, dc_h: T.handle, ddto_h: T.handle, ddac_h: T.handle, dd_h: T.handle,
             ws_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        GP = T.int32()  # groups x parts of their heads (compute.ssd.head_parts)
        x = T.match_buffer(x_h, (Bt, L, H, P), xd)
        z = T.match_buffer(z_h, (Bt, L, H, P) if has_z else Z4, xd)
        dy = T.match_buffer(dy_h, (Bt, L, H, P), xd)
        Bm = T.match_buffer(b_h, (Bt, L, G, N), bcd)
        Cm = T.match_buffer(c_h, (Bt, L, G, N), bcd)
        cbm = T.match_buffer(cb_h, (Bt, NC, G, Q, Q), F32)  # C_l . B_s (ssd_bmm_chunk)
        dt_out = T.match_buffer(dto_h, (Bt, H, NC, Q), F32)
        dA_cs = T.match_buffer(dac_h, (Bt, H, NC, Q), F32)
        sin = T.match_buffer(sin_h, (Bt, NC, H, P, N), F32)
        dso = T.match_buffer(dso_h, (Bt, NC, H, P, N), F32)
        Dm = T.match_buffer(d_h, ((H, P) if D_hd else (H,)) if has_D else (1,), F32)
        seq_idx = T.match_buffer(s_h, (Bt, L) if seq else (1, 1), I32)
        dx = T.match_buffer(dx_h, (Bt, L, H, P), xd)
        dBp = T.match_buffer(db_h, (Bt, L, GP, N), F32)
        dCp = T.match_buffer(dc_h, (Bt, L, GP, N), F32)
        ddt_out = T.match_buffer(ddto_h, (Bt, H, NC, Q), F32)
        ddA_step = T.match_buffer(ddac_h, (Bt, H, NC, Q), F32)
        dD_part = T.match_buffer(dd_h, (Bt, NC, H, P) if has_D else Z4, F32)
        gsum = T.match_buffer(ws_h, (Bt, NC, GP, Q, Q), F32)  # workspace: sum over the part's heads of gx K dt
        # dx[s, p] = sum_{l>=s} (C_l.B_s) K dt[s] g[l, p] + w[s] dt[s] (dSo B_s)[p] + D g[s, p]
        for bx in k.loop(T.ceildiv(Bt * L * H * P, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((2,), F32, scope=k.scope)
                ib = T.alloc_buffer((1,), I32, scope=k.scope)  # symbolic floordiv/mod computed once
                it = T.alloc_buffer((1,), I32, scope=k.scope)  # (recomputed per use they spilled on sm_80)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(ib[0])
                t = T.meta_var(it[0])
                h = T.meta_var(i // P % H)
                p = T.meta_var(i % P)
                c = T.meta_var(t // Q)
                sq = T.meta_var(t % Q)
                if i < Bt * L * H * P:
                    ib[0] = i // (L * H * P)
                    it[0] = i // (H * P) % L
                    acc[0] = T.float32(0)
                    for n in range(N):
                        acc[0] = acc[0] + Bm[b, t, h // R, n].astype(F32) * dso[b, c, h, p, n]
                    acc[0] = acc[0] * k.w(dA_cs, seq_idx, b, h, c, sq, L) * dt_out[b, h, c, sq]
                    if has_D:
                        acc[0] = acc[0] + (Dm[h, p] if D_hd else Dm[h]) * grad(dy, z, b, c, sq, h, p, L)
                    for l in range(sq, T.min(Q, L - c * Q)):
                        acc[0] = acc[0] + cbm[b, c, h // R, l, sq] * k.seg(dA_cs, seq_idx, b, h, c, l, sq, L) * dt_out[
                            b, h, c, sq] * grad(dy, z, b, c, l, h, p, L)
                    dx[b, t, h, p] = acc[0].astype(xd)
        # gsum[l, s] = sum over the part's heads of (g_l.x_s) K[l, s] dt[s] (s <= l): g x^T once per head part,
        # as the CPU kernel; dB and dC below are two matmuls over it (no g.x recomputed per (l, n))
        for bx in k.loop(T.ceildiv(Bt * NC * GP * Q * Q, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                a0 = T.alloc_buffer((1,), F32, scope=k.scope)
                a1 = T.alloc_buffer((1,), F32, scope=k.scope)
                ib = T.alloc_buffer((1,), I32, scope=k.scope)  # the part's first head
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (NC * GP * Q * Q))
                c = T.meta_var(i // (GP * Q * Q) % NC)
                gp = T.meta_var(i // (Q * Q) % GP)
                lq = T.meta_var(i // Q % Q)
                sq = T.meta_var(i % Q)
                if i < Bt * NC * GP * Q * Q:
                    a0[0] = T.float32(0)
                    if sq <= lq:
                        ib[0] = gp // (GP // G) * R + gp % (GP // G) * (R // (GP // G))
                        for h in range(ib[0], ib[0] + R // (GP // G)):
                            a1[0] = T.float32(0)
                            for p in range(P):
                                a1[0] = a1[0] + grad(dy, z, b, c, lq, h, p, L) * X(x, b, c, sq, h, p, L)
                            a0[0] = a0[0] + a1[0] * k.seg(dA_cs, seq_idx, b, h, c, lq, sq, L) * dt_out[b, h, c, sq]
                    gsum[b, c, gp, lq, sq] = a0[0]
        # dB[s, n] = sum_h w[s] dt[s] (x_s dSo)[n] + sum_{l>=s} gsum[l, s] C[l, n]   (the CPU kernel's order)
        for bx in k.loop(T.ceildiv(Bt * L * GP * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((2,), F32, scope=k.scope)
                ib = T.alloc_buffer((1,), I32, scope=k.scope)  # symbolic floordiv/mod computed once
                it = T.alloc_buffer((1,), I32, scope=k.scope)  # (recomputed per use they spilled on sm_80)
                ih = T.alloc_buffer((1,), I32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(ib[0])
                t = T.meta_var(it[0])
                gp = T.meta_var(i // N % GP)
                n = T.meta_var(i % N)
                c = T.meta_var(t // Q)
                sq = T.meta_var(t % Q)
                if i < Bt * L * GP * N:
                    ib[0] = i // (L * GP * N)
                    it[0] = i // (GP * N) % L
                    acc[0] = T.float32(0)
                    ih[0] = gp // (GP // G) * R + gp % (GP // G) * (R // (GP // G))  # the part's first head
                    for h in range(ih[0], ih[0] + R // (GP // G)):
                        acc[1] = T.float32(0)
                        for p in range(P):
                            acc[1] = acc[1] + x[b, t, h, p].astype(F32) * dso[b, c, h, p, n]
                        acc[0] = acc[0] + k.w(dA_cs, seq_idx, b, h, c, sq, L) * dt_out[b, h, c, sq] * acc[1]
                    for l in range(sq, T.min(Q, L - c * Q)):
                        acc[0] = acc[0] + gsum[b, c, gp, l, sq] * Cm[b, c * Q + l, gp // (GP // G), n].astype(F32)
                    dBp[b, t, gp, n] = acc[0]
        # dC[l, n] = sum_h e[l] (g_l Sin)[n] + sum_{s<=l} gsum[l, s] B[s, n]   (the CPU kernel's order)
        for bx in k.loop(T.ceildiv(Bt * L * GP * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((2,), F32, scope=k.scope)
                ib = T.alloc_buffer((1,), I32, scope=k.scope)  # symbolic floordiv/mod computed once
                it = T.alloc_buffer((1,), I32, scope=k.scope)  # (recomputed per use they spilled on sm_80)
                ih = T.alloc_buffer((1,), I32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(ib[0])
                t = T.meta_var(it[0])
                gp = T.meta_var(i // N % GP)
                n = T.meta_var(i % N)
                c = T.meta_var(t // Q)
                lq = T.meta_var(t % Q)
                if i < Bt * L * GP * N:
                    ib[0] = i // (L * GP * N)
                    it[0] = i // (GP * N) % L
                    acc[0] = T.float32(0)
                    ih[0] = gp // (GP // G) * R + gp % (GP // G) * (R // (GP // G))  # the part's first head
                    for h in range(ih[0], ih[0] + R // (GP // G)):
                        acc[1] = T.float32(0)
                        for p in range(P):
                            acc[1] = acc[1] + grad(dy, z, b, c, lq, h, p, L) * sin[b, c, h, p, n]
                        acc[0] = acc[0] + k.e(dA_cs, seq_idx, b, h, c, lq, L) * acc[1]
                    for sp in range(lq + 1):
                        acc[0] = acc[0] + gsum[b, c, gp, lq, sp] * Bm[b, c * Q + sp, gp // (GP // G), n].astype(F32)
                    dCp[b, t, gp, n] = acc[0]
        # XB[s] = <x_s, dSo B_s> -> ddt_out (scratch)
        for bx in k.loop(T.ceildiv(Bt * NC * H * Q, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((2,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (NC * H * Q))
                c = T.meta_var(i // (H * Q) % NC)
                h = T.meta_var(i // Q % H)
                sq = T.meta_var(i % Q)
                if i < Bt * NC * H * Q:
                    acc[0] = T.float32(0)
                    for p in range(P):
                        acc[1] = T.float32(0)
                        for n in range(N):
                            acc[1] = acc[1] + BC(Bm, b, c, sq, h, n, L) * dso[b, c, h, p, n]
                        acc[0] = acc[0] + X(x, b, c, sq, h, p, L) * acc[1]
                    ddt_out[b, h, c, sq] = acc[0]
        # d dA_step[q] (the gradient of step q within the chunk), in three launches that never subtract sums:
        # (1) the carried-state term e[q] <g_q, C_q Sin> of d dA_cs[q]
        for bx in k.loop(T.ceildiv(Bt * NC * H * Q, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((3,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (NC * H * Q))
                c = T.meta_var(i // (H * Q) % NC)
                h = T.meta_var(i // Q % H)
                q = T.meta_var(i % Q)
                if i < Bt * NC * H * Q:
                    acc[0] = T.float32(0)
                    if c * Q + q < L:  # g is 0 past seqlen
                        acc[1] = T.float32(0)
                        for n in range(N):
                            acc[2] = T.float32(0)
                            for p in range(P):
                                acc[2] = acc[2] + grad(dy, z, b, c, q, h, p, L) * sin[b, c, h, p, n]
                            acc[1] = acc[1] + BC(Cm, b, c, q, h, n, L) * acc[2]
                        acc[0] = k.e(dA_cs, seq_idx, b, h, c, q, L) * acc[1]
                    ddA_step[b, h, c, q] = acc[0]
        # (2) one thread per (batch, chunk, head): its reverse cumsum in place (d dA_cs[l] reaches steps q <= l)
        for bx in k.loop(T.ceildiv(Bt * NC * H, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                if i < Bt * NC * H:
                    acc[0] = T.float32(0)
                    for qr in range(Q):
                        acc[0] = acc[0] + ddA_step[i // (NC * H), i % H, i // H % NC, Q - 1 - qr]
                        ddA_step[i // (NC * H), i % H, i // H % NC, Q - 1 - qr] = acc[0]
        # (3) + the crossing pairs sum_{l>=q>k} G[l, k], G = (g_l.x_k)(C_l.B_k) K dt[k] (x_k reaches steps q > k
        # only, g_l steps q <= l only), + the chunk-state prefix sum_{k<q} w[k] dt[k] XB[k]
        for bx in k.loop(T.ceildiv(Bt * NC * H * Q, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                a0 = T.alloc_buffer((1,), F32, scope=k.scope)  # one-element buffers, not one array of 3
                a1 = T.alloc_buffer((1,), F32, scope=k.scope)  # (as ssd._Slots: kept in registers)
                a2 = T.alloc_buffer((1,), F32, scope=k.scope)
                ib = T.alloc_buffer((1,), I32, scope=k.scope)  # symbolic floordiv/mod computed once
                ic = T.alloc_buffer((1,), I32, scope=k.scope)  # (recomputed per use they spilled on sm_80)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(ib[0])
                c = T.meta_var(ic[0])
                h = T.meta_var(i // Q % H)
                q = T.meta_var(i % Q)
                if i < Bt * NC * H * Q:
                    ib[0] = i // (NC * H * Q)
                    ic[0] = i // (H * Q) % NC
                    a0[0] = ddA_step[b, h, c, q]
                    for j in range(q):
                        a0[0] = a0[0] + k.w(dA_cs, seq_idx, b, h, c, j, L) * dt_out[b, h, c, j] * ddt_out[b, h, c, j]
                    for l in range(q, T.min(Q, L - c * Q)):  # g is 0 past seqlen
                        a1[0] = T.float32(0)  # sum_{k<q} G[l, k]
                        for j in range(q):
                            a2[0] = T.float32(0)
                            for p in range(P):
                                a2[0] = a2[0] + gx_in(dy, z, x, b, c, l, j, h, p)
                            a1[0] = a1[0] + a2[0] * cbm[b, c, h // R, l, j] * k.seg(
                                dA_cs, seq_idx, b, h, c, l, j, L) * dt_out[b, h, c, j]
                        a0[0] = a0[0] + a1[0]
                    ddA_step[b, h, c, q] = a0[0]
        # d dt[q] = sum_{l>=q} (g_l.x_q)(C_l.B_q) K + exp(dA_cs[Q-1]-dA_cs[q]) XB[q]
        for bx in k.loop(T.ceildiv(Bt * NC * H * Q, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((2,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (NC * H * Q))
                c = T.meta_var(i // (H * Q) % NC)
                h = T.meta_var(i // Q % H)
                q = T.meta_var(i % Q)
                if i < Bt * NC * H * Q:
                    acc[0] = k.w(dA_cs, seq_idx, b, h, c, q, L) * ddt_out[b, h, c, q]
                    for l in range(q, T.min(Q, L - c * Q)):  # g is 0 past seqlen
                        acc[1] = T.float32(0)
                        for p in range(P):
                            acc[1] = acc[1] + grad(dy, z, b, c, l, h, p, L) * X(x, b, c, q, h, p, L)
                        acc[0] = acc[0] + acc[1] * cbm[b, c, h // R, l, q] * k.seg(dA_cs, seq_idx, b, h, c, l, q, L)
                    ddt_out[b, h, c, q] = acc[0]
        if has_D:
            for bx in k.loop(T.ceildiv(Bt * NC * H * P, TH), "blockIdx.x"):
                for tx in k.loop(TH, "threadIdx.x"):
                    acc = T.alloc_buffer((1,), F32, scope=k.scope)
                    i = T.meta_var(bx * TH + tx)
                    b = T.meta_var(i // (NC * H * P))
                    c = T.meta_var(i // (H * P) % NC)
                    h = T.meta_var(i // P % H)
                    p = T.meta_var(i % P)
                    if i < Bt * NC * H * P:
                        acc[0] = T.float32(0)
                        for l in range(Q):
                            acc[0] = acc[0] + grad(dy, z, b, c, l, h, p, L) * X(x, b, c, l, h, p, L)
                        dD_part[b, c, h, p] = acc[0]

    return func
