"""CPU rule for the norm kernels (gated RMSNorm / LayerNorm, fused residual-add norm): hand-written loop
nests (parallel over rows, vectorized over hidden).

Same parameters as the TE compute (tvm_mamba/compute/rmsnorm_gated.py). Hidden and group_size are static,
so every vectorized loop runs over full vectors (no tail); the vector width is the largest of 16/8/4/2/1
dividing group_size. Sums of squares are float64 (as in the TE compute: no overflow for any float32 input),
one partial sum per vector lane (field guide §10), added horizontally once per group; LayerNorm makes one
more pass over the group (the float64 mean first, then the centred squares; the group is in L1 by then).
SiLU uses the vectorizable exp of compute/_math.py (llvm.exp is scalarized).

Backward: rows are split into ``nparts`` contiguous parts (nparts = the partial buffer's first dim, chosen
by the torch op from the row count only, so results do not depend on the thread count); each part
accumulates its weight/bias partial sums in a fixed row order (stage 1), and a second loop adds the parts
in order (stage 2): deterministic, no atomics.
Knobs: ``vector`` (lane count, default the largest dividing group_size).
"""
from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from tvm_mamba.compute import _math
from tvm_mamba.compute.rmsnorm_gated import NormDims, dropout_keep
from tvm_mamba.schedules import rule

KERNELS = ("rmsnorm_gated_fwd", "rmsnorm_gated_bwd")


def _f32(v):
    """Widen a load to float32 (a float32 -> float32 cast is dropped by the simplifier)."""
    return v.astype("float32")


def _f64(v):
    """Widen to float64 (the forward's sum of squares)."""
    return v.astype("float64")


def _dropout(v, seeds, r, h, p: float):
    """upstream's dropout of one float32 element: kept ones scaled by 1 / (1 - p), the mask from the row seed."""
    return T.Select(dropout_keep(seeds[r], h, p), v / T.float32(1.0 - p), T.float32(0))


def _fwd(d, x_dtype, w_dtype, res_dtype, rout_dtype, V):
    hidden, gs, eps, G, NV = d.hidden, d.group_size, d.eps, d.ngroups, d.group_size // V
    has_bias, has_res, store_res, rms = d.has_bias, d.has_residual, d.store_residual, d.is_rms_norm
    p, store_mask = d.dropout_p, d.store_dropout_mask
    inv_gs = 1.0 / gs

    def s(x, res, rsc, sd, r, h):
        v = _f32(x[r, h]) * rsc[r] if d.has_rowscale else _f32(x[r, h])
        v = _dropout(v, sd, r, h, p) if p > 0 else v
        return v + _f32(res[r, h]) if has_res else v

    def u(x, z, res, rsc, sd, r, h):
        v = s(x, res, rsc, sd, r, h)
        return v * _math.silu(_f32(z[r, h])) if d.gate_in else v

    def y(x, w, b, z, res, rsc, sd, mu, rs, r, h):
        c = u(x, z, res, rsc, sd, r, h)
        v = (c if rms else c - mu) * rs * _f32(w[h])
        if has_bias:
            v = v + _f32(b[h])
        if d.gate_out:
            v = v * _math.silu(_f32(z[r, h]))
        return v.astype(x_dtype)

    def centred(x, z, res, rsc, sd, mu, r, h):
        v = _f64(u(x, z, res, rsc, sd, r, h))
        return v if rms else v - mu[0]

    @T.macro
    def row(x, w, b, z, res, rsc, sd, out, rout, mask, mean, rstd, r):
        # float64 reductions, as the TE compute (u^2 overflows float32 above |u| ~ 1.8e19); LayerNorm
        # centres with the float64 group mean before squaring (a second pass over the group, in L1)
        acc = T.alloc_buffer((V,), "float64")
        tot = T.alloc_buffer((1,), "float64")
        mu = T.alloc_buffer((1,), "float64")
        rs = T.alloc_buffer((1,), "float32")
        for g in range(G):
            mu[0] = T.float64(0)
            if not rms:
                for i in T.vectorized(V):
                    acc[i] = T.float64(0)
                for j in range(NV):
                    for i in T.vectorized(V):
                        acc[i] = acc[i] + _f64(u(x, z, res, rsc, sd, r, g * gs + j * V + i))
                tot[0] = T.float64(0)
                for i in range(V):
                    tot[0] = tot[0] + acc[i]
                mu[0] = tot[0] * T.float64(inv_gs)
                mean[r, g] = mu[0].astype("float32")
            for i in T.vectorized(V):
                acc[i] = T.float64(0)
            for j in range(NV):
                for i in T.vectorized(V):
                    acc[i] = acc[i] + centred(x, z, res, rsc, sd, mu, r, g * gs + j * V + i) * \
                        centred(x, z, res, rsc, sd, mu, r, g * gs + j * V + i)
            tot[0] = T.float64(0)
            for i in range(V):
                tot[0] = tot[0] + acc[i]
            rs[0] = (T.float64(1) / T.sqrt(tot[0] * T.float64(inv_gs) + T.float64(eps))).astype("float32")
            rstd[r, g] = rs[0]
            for j in range(NV):
                for i in T.vectorized(V):
                    h = T.meta_var(g * gs + j * V + i)
                    out[r, h] = y(x, w, b, z, res, rsc, sd, mu[0].astype("float32"), rs[0], r, h)
                    if store_res:
                        rout[r, h] = s(x, res, rsc, sd, r, h).astype(rout_dtype)
                    if store_mask:
                        mask[r, h] = dropout_keep(sd[r], h, p).astype("uint8")

    @T.prim_func
    def rmsnorm_gated_fwd(x_h: T.handle, w_h: T.handle, b_h: T.handle, z_h: T.handle, res_h: T.handle,
                          rsc_h: T.handle, sd_h: T.handle, o_h: T.handle, ro_h: T.handle, mk_h: T.handle,
                          m_h: T.handle, r_h: T.handle):
        T.func_attr({"global_symbol": "rmsnorm_gated_fwd", "tirx.noalias": True})
        rows = T.int32()
        x = T.match_buffer(x_h, (rows, hidden), x_dtype)
        w = T.match_buffer(w_h, (hidden,), w_dtype)
        b = T.match_buffer(b_h, (hidden,) if has_bias else (1,), w_dtype)
        z = T.match_buffer(z_h, (rows, hidden) if d.has_z else (1, 1), x_dtype)
        res = T.match_buffer(res_h, (rows, hidden) if has_res else (1, 1), res_dtype)
        rsc = T.match_buffer(rsc_h, (rows,) if d.has_rowscale else (1,), "float32")
        sd = T.match_buffer(sd_h, (rows,) if p > 0 else (1,), "int32")
        out = T.match_buffer(o_h, (rows, hidden), x_dtype)
        rout = T.match_buffer(ro_h, (rows, hidden) if store_res else (1, 1), rout_dtype)
        mask = T.match_buffer(mk_h, (rows, hidden) if store_mask else (1, 1), "uint8")
        mean = T.match_buffer(m_h, (1, 1) if rms else (rows, G), "float32")
        rstd = T.match_buffer(r_h, (rows, G), "float32")
        if rows * hidden <= rule.SERIAL_WORK:  # decode-size: on the calling thread, no thread-pool launch
            for r in T.serial(rows):
                row(x, w, b, z, res, rsc, sd, out, rout, mask, mean, rstd, r)
        else:
            for r in T.parallel(rows):
                row(x, w, b, z, res, rsc, sd, out, rout, mask, mean, rstd, r)

    return rmsnorm_gated_fwd


def _bwd(d, x_dtype, w_dtype, dout_dtype, V):
    hidden, gs, G, NV, HV = d.hidden, d.group_size, d.ngroups, d.group_size // V, d.hidden // V
    has_bias, has_z, nbg, rms = d.has_bias, d.has_z, d.norm_before_gate, d.is_rms_norm
    has_dres, store_dres = d.has_dresidual, d.store_dresidual
    inv_gs = 1.0 / gs

    def zf(z, r, h):
        return _f32(z[r, h])

    def xhat(x, z, mu, rs, r, h):
        v = _f32(x[r, h])
        v = v * _math.silu(zf(z, r, h)) if d.gate_in else v
        return (v if rms else v - mu) * rs

    def dy(dd, z, r, h):
        v = _f32(dd[r, h])
        return v * _math.silu(zf(z, r, h)) if d.gate_out else v

    def du(x, w, z, dd, mu, rs, c1, c2, r, h):
        v = dy(dd, z, r, h) * _f32(w[h]) - xhat(x, z, mu, rs, r, h) * c1
        return rs * (v if rms else v - c2)

    def ds(x, w, z, dd, dr, mu, rs, c1, c2, r, h):
        v = du(x, w, z, dd, mu, rs, c1, c2, r, h)
        v = v * _math.silu(zf(z, r, h)) if d.gate_in else v
        return v + _f32(dr[r, h]) if has_dres else v

    def dx_val(x, w, z, dd, dr, rsc, sd, mu, rs, c1, c2, r, h):
        v = ds(x, w, z, dd, dr, mu, rs, c1, c2, r, h)
        v = _dropout(v, sd, r, h, d.dropout_p) if d.dropout_p > 0 else v
        return (v * rsc[r] if d.has_rowscale else v).astype(dout_dtype)

    def dz_val(x, w, b, z, dd, mu, rs, c1, c2, r, h):
        if nbg:
            yv = xhat(x, z, mu, rs, r, h) * _f32(w[h]) + (_f32(b[h]) if has_bias else T.float32(0))
            v = _f32(dd[r, h]) * yv * _math.silu_grad(zf(z, r, h))
        else:
            v = du(x, w, z, dd, mu, rs, c1, c2, r, h) * _f32(x[r, h]) * _math.silu_grad(zf(z, r, h))
        return v.astype(dout_dtype)

    @T.prim_func
    def rmsnorm_gated_bwd(x_h: T.handle, w_h: T.handle, b_h: T.handle, z_h: T.handle, d_h: T.handle,
                          m_h: T.handle, r_h: T.handle, dr_h: T.handle, rsc_h: T.handle, sd_h: T.handle,
                          dx_h: T.handle, dz_h: T.handle, dw_h: T.handle, db_h: T.handle, dri_h: T.handle,
                          p_h: T.handle):
        T.func_attr({"global_symbol": "rmsnorm_gated_bwd", "tirx.noalias": True})
        rows = T.int32()
        nparts = T.int32()
        x = T.match_buffer(x_h, (rows, hidden), x_dtype)
        w = T.match_buffer(w_h, (hidden,), w_dtype)
        b = T.match_buffer(b_h, (hidden,) if has_bias else (1,), w_dtype)
        z = T.match_buffer(z_h, (rows, hidden) if has_z else (1, 1), dout_dtype)
        dd = T.match_buffer(d_h, (rows, hidden), dout_dtype)
        mean = T.match_buffer(m_h, (1, 1) if rms else (rows, G), "float32")
        rstd = T.match_buffer(r_h, (rows, G), "float32")
        dr = T.match_buffer(dr_h, (rows, hidden) if has_dres else (1, 1), x_dtype)
        rsc = T.match_buffer(rsc_h, (rows,) if d.has_rowscale else (1,), "float32")
        sd = T.match_buffer(sd_h, (rows,) if d.dropout_p > 0 else (1,), "int32")
        dx = T.match_buffer(dx_h, (rows, hidden), dout_dtype)
        dz = T.match_buffer(dz_h, (rows, hidden) if has_z else (1, 1), dout_dtype)
        dw = T.match_buffer(dw_h, (hidden,), w_dtype)
        db = T.match_buffer(db_h, (hidden,) if has_bias else (1,), w_dtype)
        dri = T.match_buffer(dri_h, (rows, hidden) if store_dres else (1, 1), x_dtype)
        part = T.match_buffer(p_h, (nparts, 2, hidden), "float32")
        for p in T.parallel(nparts):
            acc = T.alloc_buffer((2, V), "float32")
            tot = T.alloc_buffer((2,), "float32")
            for j in range(HV):
                for i in T.vectorized(V):
                    part[p, 0, j * V + i] = T.float32(0)
                    part[p, 1, j * V + i] = T.float32(0)
            chunk = T.meta_var((rows + nparts - 1) // nparts)
            for q in range(T.max(T.min(chunk, rows - p * chunk), 0)):
                r = T.meta_var(p * chunk + q)
                for g in range(G):
                    rs = T.meta_var(rstd[r, g])
                    mu = T.meta_var(T.float32(0) if rms else mean[r, g])
                    for i in T.vectorized(V):
                        acc[0, i] = T.float32(0)
                        acc[1, i] = T.float32(0)
                    for j in range(NV):
                        for i in T.vectorized(V):
                            h = T.meta_var(g * gs + j * V + i)
                            acc[0, i] = acc[0, i] + dy(dd, z, r, h) * _f32(w[h]) * xhat(x, z, mu, rs, r, h)
                            if not rms:
                                acc[1, i] = acc[1, i] + dy(dd, z, r, h) * _f32(w[h])
                    tot[0] = T.float32(0)
                    tot[1] = T.float32(0)
                    for i in range(V):
                        tot[0] = tot[0] + acc[0, i]
                        tot[1] = tot[1] + acc[1, i]
                    tot[0] = tot[0] * T.float32(inv_gs)
                    tot[1] = tot[1] * T.float32(inv_gs)
                    for j in range(NV):
                        for i in T.vectorized(V):
                            h = T.meta_var(g * gs + j * V + i)
                            dx[r, h] = dx_val(x, w, z, dd, dr, rsc, sd, mu, rs, tot[0], tot[1], r, h)
                            if has_z:
                                dz[r, h] = dz_val(x, w, b, z, dd, mu, rs, tot[0], tot[1], r, h)
                            if store_dres:
                                dri[r, h] = ds(x, w, z, dd, dr, mu, rs, tot[0], tot[1], r, h).astype(x_dtype)
                            part[p, 0, h] = part[p, 0, h] + dy(dd, z, r, h) * xhat(x, z, mu, rs, r, h)
                            part[p, 1, h] = part[p, 1, h] + dy(dd, z, r, h)
        for j in T.parallel(HV):
            a2 = T.alloc_buffer((2, V), "float32")
            for i in T.vectorized(V):
                a2[0, i] = T.float32(0)
                a2[1, i] = T.float32(0)
            for p in range(nparts):
                for i in T.vectorized(V):
                    a2[0, i] = a2[0, i] + part[p, 0, j * V + i]
                    a2[1, i] = a2[1, i] + part[p, 1, j * V + i]
            for i in T.vectorized(V):
                dw[j * V + i] = a2[0, i].astype(w_dtype)
                if has_bias:
                    db[j * V + i] = a2[1, i].astype(w_dtype)

    return rmsnorm_gated_bwd


def apply(func, target, decisions: rule.Decisions):
    """Loop-nest schedule of a gated RMSNorm kernel, or None for a foreign PrimFunc."""
    name, st = rule.kernel_attrs(func)
    if name not in KERNELS:
        return None
    gs = st["group_size"]
    widths = tuple(v for v in (16, 8, 4, 2, 1) if gs % v == 0)
    V = decisions.pick("vector", widths, widths[0])
    d = NormDims(**{f.name: st[f.name] for f in dataclasses.fields(NormDims) if f.name in st})
    if name == "rmsnorm_gated_fwd":
        tmpl = _fwd(d, st["x_dtype"], st["weight_dtype"], st["residual_dtype"], st["residual_out_dtype"], V)
    else:
        tmpl = _bwd(d, st["x_dtype"], st["weight_dtype"], st["dout_dtype"], V)
    return rule.schedule_of(tmpl, name=name)
