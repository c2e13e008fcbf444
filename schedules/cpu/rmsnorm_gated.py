"""CPU rule for the norm kernels (gated RMSNorm / LayerNorm, fused residual-add norm): hand-written loop
nests (parallel over rows, vectorized over hidden).

Same parameters as the TE compute (tvm_mamba/compute/rmsnorm_gated/), and the same per-element math: s, u,
xhat, the outputs, the backward's gradients and dropout are compute/rmsnorm_gated/values.py's (FwdMath /
BwdMath, under this file's MATH), shared with the TE definitions; this file gives only the loops (row tasks,
vectors, the group sums, the weight/bias partial sums). Hidden and group_size are static, so every vectorized
loop runs over full vectors (no tail); the vector width is the largest of 16/8/4/2/1 dividing group_size. Sums
of squares are float64 (as in the TE compute: no overflow for any float32 input), one partial sum per vector
lane (field guide §10), added horizontally once per group; LayerNorm makes one more pass over the group (the
float64 mean first, then the centred squares; the group is in L1 by then). SiLU uses the vectorizable exp of
compute/_math.py (llvm.exp is scalarized).

Backward: rows are split into parts of PART_ROWS contiguous rows (as the TE definition; their count, the partial
buffer's first dim, depends on the row count only, so results do not depend on the thread count); each part
accumulates its weight/bias partial sums in a fixed row order (stage 1), and a second loop adds the parts
in order (stage 2): deterministic, no atomics.
Knobs: ``vector`` (lane count, default the largest dividing group_size).
"""
from __future__ import annotations

from tvm.script import tirx as T

from tvm_mamba.compute._math import math_for
from tvm_mamba.compute.rmsnorm_gated import PART_ROWS, NormDims
from tvm_mamba.compute.rmsnorm_gated.values import BwdMath, FwdMath
from tvm_mamba.schedules import rule

MATH = math_for()  # float32, the vectorizable polynomials (llvm.exp is one libm call per lane)


def _fwd_row(d: NormDims, V: int, m: FwdMath, rout_dtype: str):
    """The forward's work on one row: per group, the statistics, then every output of the row."""
    gs, eps, G, NV, inv_gs = d.group_size, d.eps, d.ngroups, d.group_size // V, 1.0 / d.group_size
    store_res, rms, store_mask, has_x1, has_w1 = d.store_residual, d.is_rms_norm, d.store_dropout_mask, \
        d.has_x1, d.has_weight1
    s, u64, y, y1, keep_mask = m.s, m.u64, m.y, m.y1, m.keep_mask

    @T.macro
    def row(B, r):
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
                        acc[i] = acc[i] + u64(B, r, g * gs + j * V + i)
                tot[0] = T.float64(0)
                for i in range(V):
                    tot[0] = tot[0] + acc[i]
                mu[0] = tot[0] * T.float64(inv_gs)
                B["mean"][r, g] = mu[0].astype("float32")
            for i in T.vectorized(V):
                acc[i] = T.float64(0)
            for j in range(NV):
                for i in T.vectorized(V):
                    acc[i] = acc[i] + u64(B, r, g * gs + j * V + i, mu[0]) * u64(B, r, g * gs + j * V + i, mu[0])
            tot[0] = T.float64(0)
            for i in range(V):
                tot[0] = tot[0] + acc[i]
            rs[0] = (T.float64(1) / T.sqrt(tot[0] * T.float64(inv_gs) + T.float64(eps))).astype("float32")
            B["rstd"][r, g] = rs[0]
            for j in range(NV):
                for i in T.vectorized(V):
                    h = T.meta_var(g * gs + j * V + i)
                    B["out"][r, h] = y(B, mu[0].astype("float32"), rs[0], r, h)
                    if store_res:
                        B["residual_out"][r, h] = s(B, r, h).astype(rout_dtype)
                    if store_mask:
                        B["mask"][r, h] = keep_mask(B["seeds"], r, h)
                    if has_w1:
                        B["out1"][r, h] = y1(B, mu[0].astype("float32"), rs[0], r, h)
                    if store_mask and has_x1:
                        B["mask1"][r, h] = keep_mask(B["seeds1"], r, h)

    return row


def _fwd(d: NormDims, x_dtype, w_dtype, res_dtype, rout_dtype, V):
    """The forward loop nest: one task per row (_fwd_row), on the calling thread for decode-size calls.
    The row's buffers travel as one dict ``B`` (a T.meta_var)."""
    hidden, G = d.hidden, d.ngroups
    has_bias, has_res, store_res, rms = d.has_bias, d.has_residual, d.store_residual, d.is_rms_norm
    p, store_mask, has_x1, has_w1 = d.dropout_p, d.store_dropout_mask, d.has_x1, d.has_weight1
    row = _fwd_row(d, V, FwdMath(d, MATH, x_dtype), rout_dtype)

    def full_if(cond):
        return lambda rows: (rows, hidden) if cond else (1, 1)

    @T.prim_func
    def rmsnorm_gated_fwd(x_h: T.handle, w_h: T.handle, b_h: T.handle, z_h: T.handle, res_h: T.handle,
                          rsc_h: T.handle, sd_h: T.handle, x1_h: T.handle, w1_h: T.handle, b1_h: T.handle,
                          sd1_h: T.handle, o_h: T.handle, ro_h: T.handle, mk_h: T.handle, o1_h: T.handle,
                          mk1_h: T.handle, m_h: T.handle, r_h: T.handle):
        T.func_attr({"global_symbol": "rmsnorm_gated_fwd", "tirx.noalias": True})
        rows = T.int32()
        b_x = T.match_buffer(x_h, (rows, hidden), x_dtype)
        b_weight = T.match_buffer(w_h, (hidden,), w_dtype)
        b_bias = T.match_buffer(b_h, (hidden,) if has_bias else (1,), w_dtype)
        b_z = T.match_buffer(z_h, full_if(d.has_z)(rows), x_dtype)
        b_residual = T.match_buffer(res_h, full_if(has_res)(rows), res_dtype)
        b_rowscale = T.match_buffer(rsc_h, (rows,) if d.has_rowscale else (1,), "float32")
        b_seeds = T.match_buffer(sd_h, (rows,) if p > 0 else (1,), "int32")
        b_x1 = T.match_buffer(x1_h, full_if(has_x1)(rows), x_dtype)
        b_weight1 = T.match_buffer(w1_h, (hidden,) if has_w1 else (1,), w_dtype)
        b_bias1 = T.match_buffer(b1_h, (hidden,) if d.has_bias1 else (1,), w_dtype)
        b_seeds1 = T.match_buffer(sd1_h, (rows,) if p > 0 and has_x1 else (1,), "int32")
        b_out = T.match_buffer(o_h, (rows, hidden), x_dtype)
        b_residual_out = T.match_buffer(ro_h, full_if(store_res)(rows), rout_dtype)
        b_mask = T.match_buffer(mk_h, full_if(store_mask)(rows), "uint8")
        b_out1 = T.match_buffer(o1_h, full_if(has_w1)(rows), x_dtype)
        b_mask1 = T.match_buffer(mk1_h, full_if(store_mask and has_x1)(rows), "uint8")
        b_mean = T.match_buffer(m_h, (1, 1) if rms else (rows, G), "float32")
        b_rstd = T.match_buffer(r_h, (rows, G), "float32")
        B = T.meta_var(dict(x=b_x, weight=b_weight, bias=b_bias, z=b_z, residual=b_residual, rowscale=b_rowscale,
                            seeds=b_seeds, x1=b_x1, weight1=b_weight1, bias1=b_bias1, seeds1=b_seeds1, out=b_out,
                            residual_out=b_residual_out, mask=b_mask, out1=b_out1, mask1=b_mask1, mean=b_mean,
                            rstd=b_rstd))
        if rows * hidden <= rule.SERIAL_WORK:  # decode-size: on the calling thread, no thread-pool launch
            for r in T.serial(rows):
                row(B, r)
        else:
            for r in T.parallel(rows):
                row(B, r)

    return rmsnorm_gated_fwd


def _bwd_row(d: NormDims, V: int, m: BwdMath, x_dtype: str):
    """The backward's work on one row of part ``pi``: per group, the two sums, then the row's gradients,
    and the row's terms added to the part's weight/bias partial sums (in row order)."""
    gs, G, NV, inv_gs = d.group_size, d.ngroups, d.group_size // V, 1.0 / d.group_size
    has_z, rms, store_dres, has_w1 = d.has_z, d.is_rms_norm, d.store_dresidual, d.has_weight1
    store_dx1 = d.has_x1 and d.dropout_p > 0
    xhat, dy, dy1, dxhat, ds, dx, dz, dx1 = m.xhat, m.dy, m.dy1, m.dxhat, m.ds, m.dx, m.dz, m.dx1

    @T.macro
    def row(B, part, pi, acc, tot, r):
        for g in range(G):
            rs = T.meta_var(B["rstd"][r, g])
            mu = T.meta_var(T.float32(0) if rms else B["mean"][r, g])
            for i in T.vectorized(V):
                acc[0, i] = T.float32(0)
                acc[1, i] = T.float32(0)
            for j in range(NV):
                for i in T.vectorized(V):
                    h = T.meta_var(g * gs + j * V + i)
                    acc[0, i] = acc[0, i] + dxhat(B, r, h) * xhat(B, mu, rs, r, h)
                    if not rms:
                        acc[1, i] = acc[1, i] + dxhat(B, r, h)
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
                    B["dx"][r, h] = dx(B, mu, rs, tot[0], tot[1], r, h)
                    if has_z:
                        B["dz"][r, h] = dz(B, mu, rs, tot[0], tot[1], r, h)
                    if store_dres:
                        B["dresidual_in"][r, h] = ds(B, mu, rs, tot[0], tot[1], r, h).astype(x_dtype)
                    if store_dx1:
                        B["dx1"][r, h] = dx1(B, mu, rs, tot[0], tot[1], r, h)
                    part[pi, 0, h] = part[pi, 0, h] + dy(B, r, h) * xhat(B, mu, rs, r, h)
                    part[pi, 1, h] = part[pi, 1, h] + dy(B, r, h)
                    if has_w1:
                        part[pi, 2, h] = part[pi, 2, h] + dy1(B, r, h) * xhat(B, mu, rs, r, h)
                        part[pi, 3, h] = part[pi, 3, h] + dy1(B, r, h)

    return row


def _bwd(d: NormDims, x_dtype, w_dtype, dout_dtype, V):
    """The backward loop nests (row parts, each row by _bwd_row, then the in-order sum of the parts);
    buffers in one dict ``B``."""
    hidden, G, HV = d.hidden, d.ngroups, d.hidden // V
    has_bias, has_z, rms = d.has_bias, d.has_z, d.is_rms_norm
    has_dres, store_dres, p, has_w1 = d.has_dresidual, d.store_dresidual, d.dropout_p, d.has_weight1
    store_dx1 = d.has_x1 and p > 0
    NT = 4 if has_w1 else 2  # partial rows: dy*xhat, dy (, dy1*xhat, dy1)
    row = _bwd_row(d, V, BwdMath(d, MATH, dout_dtype), x_dtype)

    @T.prim_func
    def rmsnorm_gated_bwd(x_h: T.handle, w_h: T.handle, b_h: T.handle, z_h: T.handle, d_h: T.handle,
                          m_h: T.handle, r_h: T.handle, dr_h: T.handle, rsc_h: T.handle, sd_h: T.handle,
                          w1_h: T.handle, d1_h: T.handle, sd1_h: T.handle, dx_h: T.handle, dz_h: T.handle,
                          dw_h: T.handle, db_h: T.handle, dri_h: T.handle, dx1_h: T.handle, dw1_h: T.handle,
                          db1_h: T.handle, p_h: T.handle):
        T.func_attr({"global_symbol": "rmsnorm_gated_bwd", "tirx.noalias": True})
        rows = T.int32()
        nparts = T.int32()
        b_x = T.match_buffer(x_h, (rows, hidden), x_dtype)
        b_weight = T.match_buffer(w_h, (hidden,), w_dtype)
        b_bias = T.match_buffer(b_h, (hidden,) if has_bias else (1,), w_dtype)
        b_z = T.match_buffer(z_h, (rows, hidden) if has_z else (1, 1), dout_dtype)
        b_dout = T.match_buffer(d_h, (rows, hidden), dout_dtype)
        b_mean = T.match_buffer(m_h, (1, 1) if rms else (rows, G), "float32")
        b_rstd = T.match_buffer(r_h, (rows, G), "float32")
        b_dres = T.match_buffer(dr_h, (rows, hidden) if has_dres else (1, 1), x_dtype)
        b_rowscale = T.match_buffer(rsc_h, (rows,) if d.has_rowscale else (1,), "float32")
        b_seeds = T.match_buffer(sd_h, (rows,) if p > 0 else (1,), "int32")
        b_weight1 = T.match_buffer(w1_h, (hidden,) if has_w1 else (1,), w_dtype)
        b_dout1 = T.match_buffer(d1_h, (rows, hidden) if has_w1 else (1, 1), dout_dtype)
        b_seeds1 = T.match_buffer(sd1_h, (rows,) if store_dx1 else (1,), "int32")
        b_dx = T.match_buffer(dx_h, (rows, hidden), dout_dtype)
        b_dz = T.match_buffer(dz_h, (rows, hidden) if has_z else (1, 1), dout_dtype)
        dw = T.match_buffer(dw_h, (hidden,), w_dtype)
        db = T.match_buffer(db_h, (hidden,) if has_bias else (1,), w_dtype)
        b_dri = T.match_buffer(dri_h, (rows, hidden) if store_dres else (1, 1), x_dtype)
        b_dx1 = T.match_buffer(dx1_h, (rows, hidden) if store_dx1 else (1, 1), dout_dtype)
        dw1 = T.match_buffer(dw1_h, (hidden,) if has_w1 else (1,), w_dtype)
        db1 = T.match_buffer(db1_h, (hidden,) if has_w1 and d.has_bias1 else (1,), w_dtype)
        part = T.match_buffer(p_h, (nparts, NT, hidden), "float32")
        B = T.meta_var(dict(x=b_x, weight=b_weight, bias=b_bias, z=b_z, dout=b_dout, mean=b_mean, rstd=b_rstd,
                            dresidual=b_dres, rowscale=b_rowscale, seeds=b_seeds, weight1=b_weight1,
                            dout1=b_dout1, seeds1=b_seeds1, dx=b_dx, dz=b_dz, dresidual_in=b_dri, dx1=b_dx1))
        for pi in T.parallel(nparts):
            acc = T.alloc_buffer((2, V), "float32")
            tot = T.alloc_buffer((2,), "float32")
            for t in range(NT):
                for j in range(HV):
                    for i in T.vectorized(V):
                        part[pi, t, j * V + i] = T.float32(0)
            chunk = T.meta_var(PART_ROWS)
            for q in range(T.max(T.min(chunk, rows - pi * chunk), 0)):
                row(B, part, pi, acc, tot, pi * chunk + q)
        for j in T.parallel(HV):
            a2 = T.alloc_buffer((NT, V), "float32")
            for t in range(NT):
                for i in T.vectorized(V):
                    a2[t, i] = T.float32(0)
            for pj in range(nparts):
                for t in range(NT):
                    for i in T.vectorized(V):
                        a2[t, i] = a2[t, i] + part[pj, t, j * V + i]
            for i in T.vectorized(V):
                dw[j * V + i] = a2[0, i].astype(w_dtype)
                if has_bias:
                    db[j * V + i] = a2[1, i].astype(w_dtype)
                if has_w1:
                    dw1[j * V + i] = a2[2, i].astype(w_dtype)
                    if d.has_bias1:
                        db1[j * V + i] = a2[3, i].astype(w_dtype)

    return rmsnorm_gated_bwd


def lay_out(kernel: str, dims, target, decisions: rule.Decisions):
    """A gated norm kernel's CPU loop nest, or None for another kernel or target."""
    if kernel not in ("fwd", "bwd") or "cpu" not in target.keys:
        return None
    d, x_dtype = dims.norm(), dims.x_dtype
    widths = tuple(v for v in (16, 8, 4, 2, 1) if d.group_size % v == 0)
    V = decisions.pick("vector", widths, widths[0])
    if kernel == "fwd":
        tmpl = _fwd(d, x_dtype, dims.weight_dtype, dims.residual_dtype or x_dtype, dims.residual_out_dtype or x_dtype,
                    V)
    else:
        tmpl = _bwd(d, x_dtype, dims.weight_dtype, dims.dout_dtype or x_dtype, V)
    return rule.schedule_of(tmpl, f"rmsnorm_gated_{kernel}")
