"""CUDA templates for the SSD chunk-scan kernels (forward, bwd_dstates) (see ssd.py in this folder): one thread per output element.

The backward ssd_chunk_scan_bwd has one template for every target (tvm_mamba/compute/ssd/scan_bwd.py).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ._ssd_common import F32, I32, Z4, _Ctx, _math


def _dims(s):
    return s["nheads"], s["ngroups"], s["headdim"], s["dstate"], s["chunk_size"]


def _chunk_scan(s, TH):
    k = _Ctx(s)
    H, G, P, N, Q = _dims(s)
    R = k.R
    xd, bcd, seq = s["x_dtype"], s["bc_dtype"], s["has_seq_idx"]
    has_D, D_hd, has_z = s["has_D"], s["D_has_hdim"], s["has_z"]
    sd = s.get("state_dtype", F32)

    @T.prim_func
    def func(x_h: T.handle, z_h: T.handle, cb_h: T.handle, c_h: T.handle, dto_h: T.handle, dac_h: T.handle,
             sin_h: T.handle, d_h: T.handle, s_h: T.handle, y_h: T.handle, yp_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        x = T.match_buffer(x_h, (Bt, L, H, P), xd)
        z = T.match_buffer(z_h, (Bt, L, H, P) if has_z else Z4, xd)
        cbm = T.match_buffer(cb_h, (Bt, NC, G, Q, Q), F32)  # C_l . B_s (ssd_bmm_chunk)
        Cm = T.match_buffer(c_h, (Bt, L, G, N), bcd)
        dt_out = T.match_buffer(dto_h, (Bt, H, NC, Q), F32)
        dA_cs = T.match_buffer(dac_h, (Bt, H, NC, Q), F32)
        sin = T.match_buffer(sin_h, (Bt, NC, H, P, N), sd)
        Dm = T.match_buffer(d_h, ((H, P) if D_hd else (H,)) if has_D else (1,), F32)
        seq_idx = T.match_buffer(s_h, (Bt, L) if seq else (1, 1), I32)
        y = T.match_buffer(y_h, (Bt, L, H, P), xd)
        y_pre = T.match_buffer(yp_h, (Bt, L, H, P) if has_z else Z4, xd)
        for bx in k.loop(T.ceildiv(Bt * L * H * P, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                ib = T.alloc_buffer((1,), I32, scope=k.scope)  # symbolic floordiv/mod computed once
                it = T.alloc_buffer((1,), I32, scope=k.scope)  # (recomputed per use they spilled on sm_80)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(ib[0])
                t = T.meta_var(it[0])
                h = T.meta_var(i // P % H)
                p = T.meta_var(i % P)
                c = T.meta_var(t // Q)
                l = T.meta_var(t % Q)
                if i < Bt * L * H * P:
                    ib[0] = i // (L * H * P)
                    it[0] = i // (H * P) % L
                    acc[0] = T.float32(0)
                    for n in range(N):
                        acc[0] = acc[0] + Cm[b, t, h // R, n].astype(F32) * sin[b, c, h, p, n].astype(F32)
                    acc[0] = acc[0] * k.e(dA_cs, seq_idx, b, h, c, l, L)
                    if has_D:
                        acc[0] = acc[0] + (Dm[h, p] if D_hd else Dm[h]) * x[b, t, h, p].astype(F32)
                    for sp in range(l + 1):
                        acc[0] = acc[0] + cbm[b, c, h // R, l, sp] * k.seg(dA_cs, seq_idx, b, h, c, l, sp, L) * dt_out[b, h, c, sp] * x[
                            b, c * Q + sp, h, p].astype(F32)
                    if has_z:
                        y_pre[b, t, h, p] = acc[0].astype(xd)
                        y[b, t, h, p] = (acc[0] * _math.silu(z[b, t, h, p].astype(F32))).astype(xd)
                    else:
                        y[b, t, h, p] = acc[0].astype(xd)

    return func


def _chunk_scan_bwd_dstates(s, TH):
    k = _Ctx(s)
    H, G, P, N, Q = _dims(s)
    R = k.R
    xd, bcd, seq, has_z = s["x_dtype"], s["bc_dtype"], s["has_seq_idx"], s["has_z"]

    @T.prim_func
    def func(dy_h: T.handle, z_h: T.handle, yp_h: T.handle, c_h: T.handle, dac_h: T.handle, s_h: T.handle,
             dsl_h: T.handle, dz_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        dy = T.match_buffer(dy_h, (Bt, L, H, P), xd)
        z = T.match_buffer(z_h, (Bt, L, H, P) if has_z else Z4, xd)
        y_pre = T.match_buffer(yp_h, (Bt, L, H, P) if has_z else Z4, xd)
        Cm = T.match_buffer(c_h, (Bt, L, G, N), bcd)
        dA_cs = T.match_buffer(dac_h, (Bt, H, NC, Q), F32)
        seq_idx = T.match_buffer(s_h, (Bt, L) if seq else (1, 1), I32)
        dsl = T.match_buffer(dsl_h, (Bt, NC, H, P, N), F32)
        dz = T.match_buffer(dz_h, (Bt, L, H, P) if has_z else Z4, xd)
        for bx in k.loop(T.ceildiv(Bt * NC * H * P * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                ib = T.alloc_buffer((1,), I32, scope=k.scope)  # decomposed once: the symbolic floordiv/mod
                ic = T.alloc_buffer((1,), I32, scope=k.scope)  # index math, recomputed per use, spilled
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(ib[0])
                c = T.meta_var(ic[0])
                h = T.meta_var(i // (P * N) % H)
                p = T.meta_var(i // N % P)
                n = T.meta_var(i % N)
                if i < Bt * NC * H * P * N:
                    ib[0] = i // (NC * H * P * N)
                    ic[0] = i // (H * P * N) % NC
                    acc[0] = T.float32(0)
                    for l in range(T.min(Q, L - c * Q)):
                        acc[0] = acc[0] + k.e(dA_cs, seq_idx, b, h, c, l, L) * k.g(
                            dy, z, b, c * Q + l, h, p, L, has_z) * Cm[b, c * Q + l, h // R, n].astype(F32)
                    dsl[b, c, h, p, n] = acc[0]
        if has_z:
            for bx in k.loop(T.ceildiv(Bt * L * H * P, TH), "blockIdx.x"):
                for tx in k.loop(TH, "threadIdx.x"):
                    i = T.meta_var(bx * TH + tx)
                    if i < Bt * L * H * P:
                        b = T.meta_var(i // (L * H * P))
                        t = T.meta_var(i // (H * P) % L)
                        h = T.meta_var(i // P % H)
                        p = T.meta_var(i % P)
                        dz[b, t, h, p] = (dy[b, t, h, p].astype(F32) * y_pre[b, t, h, p].astype(F32)
                                          * _math.silu_grad(z[b, t, h, p].astype(F32))).astype(xd)

    return func
