"""Gated RMSNorm (mamba_ssm 2.3.x ``rmsnorm_fn`` semantics) as TE: forward and backward.

Rows (all leading dims flattened) are symbolic; hidden, group_size, eps and the flags are static.
With u = x * silu(z) when gating before the norm (norm_before_gate=False), else u = x:

    rstd[r, g] = 1 / sqrt(mean_{h in group g} u[r, h]^2 + eps)
    y = u * rstd * weight (+ bias);   out = y * silu(z) when norm_before_gate (and z is given), else y.

The forward also writes rstd (float32, (rows, ngroups)), which the backward reads instead of recomputing
the reduction. Math is float32 except the sum of squares (float64, so |x| up to the float32 maximum
normalizes); out has x's dtype. Absent bias / z are (1,)*ndim placeholders.
These TE definitions are the semantic source of truth and what the CUDA rules schedule; the CPU rules
emit hand-written loop nests with the same parameters (schedules/cpu/rmsnorm_gated.py).
"""
from __future__ import annotations

from tvm import te, tirx

from ._common import check_dtype, f32, sigmoid, stamp


def _f64(expr) -> tirx.PrimExpr:
    """Widen to float64 (the sum of squares)."""
    return expr.astype("float64")


def _check(hidden: int, group_size: int) -> None:
    if hidden < 1:
        raise ValueError(f"hidden: must be >= 1, got {hidden}")
    if group_size < 1 or hidden % group_size:
        raise ValueError(f"group_size: must divide hidden={hidden}, got {group_size}")


def _inputs(hidden, has_bias, has_z, x_dtype, weight_dtype):
    rows = te.var("rows")
    x = te.placeholder((rows, hidden), x_dtype, name="x")
    weight = te.placeholder((hidden,), weight_dtype, name="weight")
    bias = te.placeholder((hidden,) if has_bias else (1,), weight_dtype, name="bias")
    z = te.placeholder((rows, hidden) if has_z else (1, 1), x_dtype, name="z")
    return rows, x, weight, bias, z


def _silu_grad(v):
    s = sigmoid(v)
    return s * (1.0 + v * (1.0 - s))


def rmsnorm_gated_fwd(hidden: int, group_size: int, eps: float = 1e-6, has_bias: bool = False,
                      has_z: bool = False, norm_before_gate: bool = True, x_dtype: str = "float32",
                      weight_dtype: str = "float32") -> tirx.PrimFunc:
    """x, z: (rows, hidden); weight, bias: (hidden,) -> out: (rows, hidden), rstd: (rows, hidden/group_size) f32.

    out = u * rstd * weight (+ bias) (* silu(z) if norm_before_gate), u = x (* silu(z) if not norm_before_gate).
    """
    _check(hidden, group_size)
    check_dtype("x", x_dtype)
    check_dtype("weight", weight_dtype)
    gs, G = group_size, hidden // group_size
    rows, x, weight, bias, z = _inputs(hidden, has_bias, has_z, x_dtype, weight_dtype)
    gate_in = has_z and not norm_before_gate
    gate_out = has_z and norm_before_gate

    def u(r, h):
        v = f32(x[r, h])
        return v * (f32(z[r, h]) * sigmoid(f32(z[r, h]))) if gate_in else v

    # The sum of squares is accumulated in float64: u^2 overflows float32 for |u| > 1.8e19 (rstd became 0 and
    # out garbage), while the square of any float32 fits float64 (<= 1.2e77) with room for the sum, and tiny
    # |u| (1e-30: u^2 = 1e-60) does not underflow either. rstd = 1/rms itself is representable in float32
    # for every finite u (subnormal once rms > 8.5e37). One widening and one float64 FMA per element.
    k = te.reduce_axis((0, gs), name="group_size")
    ss = te.compute((rows, G), lambda r, g: te.sum(_f64(u(r, g * gs + k)) * _f64(u(r, g * gs + k)), axis=k),
                    name="sumsq")
    rstd = te.compute((rows, G), lambda r, g: f32(tirx.rsqrt(ss[r, g] * (1.0 / gs) + eps)), name="rstd")

    def finish(r, h):
        y = u(r, h) * rstd[r, h // gs] * f32(weight[h])
        if has_bias:
            y = y + f32(bias[h])
        if gate_out:
            y = y * (f32(z[r, h]) * sigmoid(f32(z[r, h])))
        return y.astype(x_dtype)

    out = te.compute((rows, hidden), finish, name="out")
    func = te.create_prim_func([x, weight, bias, z, out, rstd])
    static = dict(hidden=hidden, group_size=group_size, eps=eps, has_bias=has_bias, has_z=has_z,
                  norm_before_gate=norm_before_gate, x_dtype=x_dtype, weight_dtype=weight_dtype)
    return stamp(func, "rmsnorm_gated_fwd", static)


def rmsnorm_gated_bwd(hidden: int, group_size: int, eps: float = 1e-6, has_bias: bool = False,
                      has_z: bool = False, norm_before_gate: bool = True, x_dtype: str = "float32",
                      weight_dtype: str = "float32") -> tirx.PrimFunc:
    """Backward of :func:`rmsnorm_gated_fwd`.

    Inputs as the forward plus dout: (rows, hidden) and the saved rstd: (rows, ngroups) f32. Outputs dx, dz:
    (rows, hidden), dweight, dbias: (hidden,), and partial: (nparts, 2, hidden) f32, the first stage of the
    deterministic two-stage weight/bias reduction (part p sums rows [p*chunk, (p+1)*chunk), chunk =
    ceil(rows/nparts); the second stage sums the parts in order).

    With xhat = u*rstd, dy = dout (* silu(z) if norm_before_gate), dxhat = dy*weight,
    c = mean_group(dxhat*xhat): du = rstd*(dxhat - xhat*c); dx = du (* silu(z) if gating before the norm);
    dz = dout*y*silu'(z) (norm_before_gate) or du*x*silu'(z); dweight = sum_rows dy*xhat; dbias = sum_rows dy.
    """
    _check(hidden, group_size)
    check_dtype("x", x_dtype)
    check_dtype("weight", weight_dtype)
    gs, G = group_size, hidden // group_size
    rows, x, weight, bias, z = _inputs(hidden, has_bias, has_z, x_dtype, weight_dtype)
    dout = te.placeholder((rows, hidden), x_dtype, name="dout")
    rstd = te.placeholder((rows, G), "float32", name="rstd")
    nparts = te.var("nparts")
    gate_in = has_z and not norm_before_gate
    gate_out = has_z and norm_before_gate

    def zf(r, h):
        return f32(z[r, h])

    def u(r, h):
        v = f32(x[r, h])
        return v * (zf(r, h) * sigmoid(zf(r, h))) if gate_in else v

    def xhat(r, h):
        return u(r, h) * rstd[r, h // gs]

    def dy(r, h):
        d = f32(dout[r, h])
        return d * (zf(r, h) * sigmoid(zf(r, h))) if gate_out else d

    def dxhat(r, h):
        return dy(r, h) * f32(weight[h])

    k = te.reduce_axis((0, gs), name="group_size")
    c = te.compute((rows, G), lambda r, g: te.sum(dxhat(r, g * gs + k) * xhat(r, g * gs + k), axis=k),
                   name="dot")

    def du(r, h):
        return rstd[r, h // gs] * (dxhat(r, h) - xhat(r, h) * c[r, h // gs] * (1.0 / gs))

    def dx_val(r, h):
        v = du(r, h)
        return (v * (zf(r, h) * sigmoid(zf(r, h))) if gate_in else v).astype(x_dtype)

    if has_z:
        def dz_val(r, h):
            if norm_before_gate:
                y = xhat(r, h) * f32(weight[h]) + (f32(bias[h]) if has_bias else 0.0)
                v = f32(dout[r, h]) * y * _silu_grad(zf(r, h))
            else:
                v = du(r, h) * f32(x[r, h]) * _silu_grad(zf(r, h))
            return v.astype(x_dtype)

        # one two-output compute: blocks "dxdz_v0" (dx) and "dxdz_v1" (dz) share the (rows, hidden) loop
        # nest, so a schedule can compute the row's reduction once under the row loop for both
        dx, dz = te.compute((rows, hidden), lambda r, h: (dx_val(r, h), dz_val(r, h)), name="dxdz")
    else:
        dx = te.compute((rows, hidden), dx_val, name="dx")
        dz = te.compute((1, 1), lambda i, j: tirx.const(0, x_dtype), name="dz")
    chunk = tirx.indexdiv(rows + nparts - 1, nparts)
    j = te.reduce_axis((0, chunk), name="chunk")

    def part(p, s, h):
        r = tirx.min(p * chunk + j, rows - 1)
        val = tirx.if_then_else(s == 0, dy(r, h) * xhat(r, h), dy(r, h))
        # te.sum(where=...) is silently dropped by create_prim_func in TVM 0.27: mask the value instead.
        return te.sum(tirx.if_then_else(p * chunk + j < rows, val, tirx.const(0.0, "float32")), axis=j)

    partial = te.compute((nparts, 2, hidden), part, name="partial")
    pa = te.reduce_axis((0, nparts), name="nparts")
    dw_acc = te.compute((hidden,), lambda h: te.sum(partial[pa, 0, h], axis=pa), name="dweight_acc")
    dweight = te.compute((hidden,), lambda h: dw_acc[h].astype(weight_dtype), name="dweight")
    if has_bias:
        pb = te.reduce_axis((0, nparts), name="nparts")
        db_acc = te.compute((hidden,), lambda h: te.sum(partial[pb, 1, h], axis=pb), name="dbias_acc")
        dbias = te.compute((hidden,), lambda h: db_acc[h].astype(weight_dtype), name="dbias")
    else:
        dbias = te.compute((1,), lambda h: tirx.const(0, weight_dtype), name="dbias")
    func = te.create_prim_func([x, weight, bias, z, dout, rstd, dx, dz, dweight, dbias, partial])
    static = dict(hidden=hidden, group_size=group_size, eps=eps, has_bias=has_bias, has_z=has_z,
                  norm_before_gate=norm_before_gate, x_dtype=x_dtype, weight_dtype=weight_dtype)
    return stamp(func, "rmsnorm_gated_bwd", static)


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static_dims, dtypes) compiled by the CUDA build-check: Mamba-2 2.7B's gated norm
    (hidden 5120, groups of 5120/8), both gate orders, bf16 activations with fp32 weights."""
    out = []
    for direction in ("fwd", "bwd"):
        for nbg in (True, False):
            static = dict(hidden=2048, group_size=256, eps=1e-5, has_bias=False, has_z=True, norm_before_gate=nbg)
            out.append((direction, static, dict(x="bfloat16", weight="float32")))
        out.append((direction, dict(hidden=2048, group_size=2048, eps=1e-5, has_bias=True, has_z=False,
                                    norm_before_gate=True), dict(x="float32", weight="float32")))
    return out


def derived_dims(direction: str, dims: dict, static: dict) -> dict:
    """Dynamic dims that follow from the others (for tuning-time inputs): the backward's stage-1 part
    count, min(rows, 64) as torch_ops/rmsnorm_gated.py allocates it."""
    return {"nparts": min(dims["rows"], 64)} if direction == "bwd" and "rows" in dims else {}
