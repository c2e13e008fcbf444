"""Gated group norm (mamba_ssm 2.3.x ``layernorm_gated.py``: ``rmsnorm_fn`` / ``layernorm_fn``) and the fused
residual-add norm (``layer_norm.py``: ``rms_norm_fn`` / ``layer_norm_fn``) as TE: forward and backward.

One definition for both upstream files: rows (all leading dims flattened) are symbolic; hidden, group_size,
eps and the flags are static. With s = x (+ residual), u = s * silu(z) when gating before the norm
(norm_before_gate=False), else u = s:

    mean[r, g] = mean_{h in group g} u[r, h]          (LayerNorm; 0 for RMSNorm, is_rms_norm)
    rstd[r, g] = 1 / sqrt(mean_{h in group g} (u[r, h] - mean[r, g])^2 + eps)
    y = (u - mean) * rstd * weight (+ bias);   out = y * silu(z) when norm_before_gate (and z is given), else y.

The forward writes rstd (and mean for LayerNorm; float32, (rows, ngroups)), which the backward reads instead
of recomputing the reductions, and with ``store_residual`` residual_out = s in its own dtype (the ``prenorm``
residual of layer_norm.py; the backward's x is then that stored residual_out, as upstream's). Math is
float32 except the reductions over x (float64, so |x| up to the float32 maximum normalizes); out has x's
dtype. Absent inputs and outputs are unused (1,)*ndim placeholders.
These TE definitions are the semantic source of truth and what the CUDA rules schedule; the CPU rules emit
hand-written loop nests with the same parameters (schedules/cpu/rmsnorm_gated.py). The per-element math (s, u,
xhat, the outputs, the backward's dxhat / du / ds / dx / dz, dropout) is written once in values.py and shared
by both; each side keeps only its own reductions and loops.
What a target lacks is a builder argument its GPU rule passes (schedules/cuda/rmsnorm_gated.py, from the
target's capabilities): ``wide``, the reductions' type (float32 where there is no float64: WGSL; then |u| above
~1.8e19 overflows u^2), and ``storage``, how the uint8 dropout masks are held (int32 words of the same bytes
where there are no 8-bit buffers: compute/int8_dot/codes.py).
"""
from __future__ import annotations

from tvm import te, tirx

from .._common import f32, stamp
from .._math import math_for
from ..int8_dot.codes import BYTES, Storage
from .dims import DIMS, NormDims, RMSNormGatedBwd, RMSNormGatedFwd  # noqa: F401  (the op's typed dims)
from .values import BwdMath, FwdMath


def _maybe(cond: bool, shape: tuple, dtype: str, name: str, full: tuple):
    return te.placeholder(full if cond else shape, dtype, name=name)


def _multi(shape, vals: list, name: str) -> list:
    """One compute per value function, or one multi-output compute (blocks ``<name>_v0``, ``_v1``, ... in one
    loop nest, so a schedule computes a row's reductions once for all of them)."""
    if len(vals) == 1:
        return [te.compute(shape, vals[0], name=name)]
    return list(te.compute(shape, lambda *i: tuple(f(*i) for f in vals), name=name))


def _group_red(rows, G: int, gs: int, fn, name: str):
    """(rows, ngroups) sum over each group of gs features of fn(r, h)."""
    k = te.reduce_axis((0, gs), name="group_size")
    return te.compute((rows, G), lambda r, g: te.sum(fn(r, g * gs + k), axis=k), name=name)


def _stats(rows, d: NormDims, u64):
    """mean (LayerNorm; a (1, 1) placeholder for RMSNorm) and rstd, (rows, ngroups) float32, of u, given
    u64(r, h, mu=None): u in float64 (FwdMath.wide), less the group mean mu when given (FwdMath.u64).

    Reductions in float64: u^2 overflows float32 for |u| > 1.8e19 (rstd became 0 and out garbage), while the
    square of any float32 fits float64 (<= 1.2e77) with room for the sum, and tiny |u| (1e-30: u^2 = 1e-60)
    does not underflow either. LayerNorm centres with the float64 mean before squaring (two passes over the
    group, no E[u^2] - mean^2 cancellation)."""
    gs, G, eps = d.group_size, d.ngroups, d.eps
    if d.is_rms_norm:
        ss = _group_red(rows, G, gs, lambda r, h: u64(r, h) * u64(r, h), "sumsq")
        rstd = te.compute((rows, G), lambda r, g: f32(tirx.rsqrt(ss[r, g] * (1.0 / gs) + eps)), name="rstd")
        return te.placeholder((1, 1), "float32", name="mean"), rstd
    s1 = _group_red(rows, G, gs, u64, "sum")

    def centred(r, h):
        return u64(r, h, s1[r, h // gs] * (1.0 / gs))

    ss = _group_red(rows, G, gs, lambda r, h: centred(r, h) * centred(r, h), "sumsq")
    # one two-output compute ("stats_v0" = mean, "stats_v1" = rstd): both read the group's reductions in one
    # loop nest, so a schedule computes them once under the (row, group) loop
    mean, rstd = te.compute((rows, G), lambda r, g: (f32(s1[r, g] * (1.0 / gs)),
                                                     f32(tirx.rsqrt(ss[r, g] * (1.0 / gs) + eps))), name="stats")
    return mean, rstd


def _mask_words(fm: FwdMath, seeds):
    """The keep mask of the rows' ``seeds`` as an int32 value of (r, h), for a mask held as words."""
    return lambda r, h: fm.keep_mask(seeds, r, h, "int32")


def rmsnorm_gated_fwd(*dims, wide: str = "float64", storage: Storage = BYTES, **fields) -> tirx.PrimFunc:
    """x, z, x1: (rows, hidden); residual: (rows, hidden); weight, bias, weight1, bias1: (hidden,); rowscale:
    (rows,) f32; seeds, seeds1: (rows,) int32 -> out, out1: (rows, hidden) in x's dtype, residual_out: (rows,
    hidden), dropout_mask, dropout_mask1: (rows, hidden) uint8, mean, rstd: (rows, hidden/group_size) f32.

    s = dropout(x (* rowscale)) (+ dropout1(x1)) (+ residual); u = s (* silu(z) if not norm_before_gate);
    xhat = (u - mean_g(u)) * rstd_g(u); out = xhat * weight (+ bias) (* silu(z) if norm_before_gate);
    out1 = xhat * weight1 (+ bias1) (upstream's parallel norm); residual_out = s.
    ``wide``: the reductions' float type; ``storage``: how the masks are held (module docstring).
    """
    m = math_for(native=True)  # the target's own exp (CUDA expf): these TE computes are the GPU rules'
    dd = RMSNormGatedFwd.of(*dims, **fields)
    d, x_dtype, weight_dtype = dd.norm(), dd.x_dtype, dd.weight_dtype
    res_dt, rout_dt = dd.residual_dtype or x_dtype, dd.residual_out_dtype or x_dtype
    gs, p = d.group_size, d.dropout_p
    rows = te.var("rows")
    full = (rows, d.hidden)
    x = te.placeholder(full, x_dtype, name="x")
    weight = te.placeholder((d.hidden,), weight_dtype, name="weight")
    bias = _maybe(d.has_bias, (1,), weight_dtype, "bias", (d.hidden,))
    z = _maybe(d.has_z, (1, 1), x_dtype, "z", full)
    residual = _maybe(d.has_residual, (1, 1), res_dt, "residual", full)
    rowscale = _maybe(d.has_rowscale, (1,), "float32", "rowscale", (rows,))
    seeds = _maybe(p > 0, (1,), "int32", "seeds", (rows,))
    x1 = _maybe(d.has_x1, (1, 1), x_dtype, "x1", full)
    weight1 = _maybe(d.has_weight1, (1,), weight_dtype, "weight1", (d.hidden,))
    bias1 = _maybe(d.has_bias1, (1,), weight_dtype, "bias1", (d.hidden,))
    seeds1 = _maybe(p > 0 and d.has_x1, (1,), "int32", "seeds1", (rows,))

    fm = FwdMath(d, m, x_dtype, wide)  # the per-element math (values.py), shared with the CPU loop nests
    B = dict(x=x, weight=weight, bias=bias, z=z, residual=residual, rowscale=rowscale, seeds=seeds, x1=x1,
             weight1=weight1, bias1=bias1, seeds1=seeds1)
    mean, rstd = _stats(rows, d, lambda r, h, mu=None: fm.u64(B, r, h, mu))

    def stat(r, h):  # the group's (mean, rstd) at column h
        return (None if d.is_rms_norm else mean[r, h // gs]), rstd[r, h // gs]

    # residual_out, the masks and out1 share out's loop nest (blocks "out_v0" = out, then the others in this
    # order): one pass over s
    wanted = [("out", True, lambda r, h: fm.y(B, *stat(r, h), r, h)),
              ("residual_out", d.store_residual, lambda r, h: fm.s(B, r, h).astype(rout_dt)),
              ("dropout_mask", d.store_dropout_mask, lambda r, h: fm.keep_mask(seeds, r, h)),
              ("out1", d.has_weight1, lambda r, h: fm.y1(B, *stat(r, h), r, h)),
              ("dropout_mask1", d.store_dropout_mask and d.has_x1, lambda r, h: fm.keep_mask(seeds1, r, h))]
    dtypes = {"residual_out": rout_dt, "dropout_mask": "uint8", "dropout_mask1": "uint8", "out1": x_dtype}
    # masks held as words are computes of their own (blocks "dropout_mask", "dropout_mask1": a word is four
    # columns), not values of out's loop nest; absent, the (1, 1) placeholder's one word
    apart = {"dropout_mask": seeds, "dropout_mask1": seeds1} if storage.words else {}
    outs = _multi(full, [f for n, on, f in wanted if on and n not in apart], "out")
    got = {}
    for n, on, _ in wanted:
        if n in apart:
            got[n] = (storage.output(full, "uint8", _mask_words(fm, apart[n]), n) if on
                      else storage.placeholder((1, 1), "uint8", n))
        else:
            got[n] = outs.pop(0) if on else te.placeholder((1, 1), dtypes.get(n, x_dtype), name=n)
    func = te.create_prim_func([x, weight, bias, z, residual, rowscale, seeds, x1, weight1, bias1, seeds1,
                                got["out"], got["residual_out"], got["dropout_mask"], got["out1"],
                                got["dropout_mask1"], mean, rstd])
    return stamp(func, "rmsnorm_gated_fwd")


# rows per part of the weight / bias gradients' first stage: part p sums rows [p*PART_ROWS, (p+1)*PART_ROWS).
# A constant, so the parts (and the bits of dweight) depend on the row count only, never on the machine; and
# the row walk of a part is the same loop for dx and for the sums (the CUDA rule runs both in one pass). 32
# rows keep the workspace at 1/16 of a row's inputs at 2 terms and give a GPU rows / 32 blocks.
PART_ROWS = 32


def _weight_grads(rows, hidden: int, terms: list, weight_dtype: str):
    """Sums over rows of the given terms (name, present, fn(r, h)), e.g. dweight = sum_rows dy*xhat, as a
    deterministic two-stage reduction: partial: (ceil(rows / PART_ROWS), len(terms), hidden) f32 (part p sums
    its PART_ROWS rows in order), then the parts added in order. Returns (partial, [each term's (hidden,) sum
    in weight_dtype, or a (1,) placeholder when absent])."""
    nparts = tirx.indexdiv(rows + PART_ROWS - 1, PART_ROWS)
    j = te.reduce_axis((0, PART_ROWS), name="chunk")

    def part(p, sel, h):
        r = p * PART_ROWS + j  # past the last row only in the last part, where the mask below reads nothing
        val = terms[-1][2](r, h)
        for i in range(len(terms) - 2, -1, -1):
            val = tirx.if_then_else(sel == i, terms[i][2](r, h), val)
        # te.sum(where=...) is silently dropped by create_prim_func in TVM 0.27: mask the value instead (an
        # if_then_else: the load is made only where the row exists)
        return te.sum(tirx.if_then_else(r < rows, val, tirx.const(0.0, "float32")), axis=j)

    partial = te.compute((nparts, len(terms), hidden), part, name="partial")

    def total(sel, name):
        pa = te.reduce_axis((0, nparts), name="nparts")
        acc = te.compute((hidden,), lambda h: te.sum(partial[pa, sel, h], axis=pa), name=f"{name}_acc")
        return te.compute((hidden,), lambda h: acc[h].astype(weight_dtype), name=name)

    sums = [total(i, name) if on else te.placeholder((1,), weight_dtype, name=name)
            for i, (name, on, _) in enumerate(terms)]
    return partial, sums


def rmsnorm_gated_bwd(*dims, **fields) -> tirx.PrimFunc:
    """Backward of :func:`rmsnorm_gated_fwd`.

    Inputs: x: (rows, hidden), the forward's s (its x, or the stored residual_out) in x_dtype; weight, bias, z;
    dout: (rows, hidden) in dout_dtype (the forward's x dtype); the saved mean (LayerNorm) and rstd: (rows,
    ngroups) f32; dresidual: (rows, hidden) x_dtype, the gradient of residual_out; rowscale: (rows,) f32;
    seeds, seeds1: (rows,) int32, the forward's dropout seeds; weight1: (hidden,), dout1: (rows, hidden) the
    gradient of out1. Outputs: dx, dz, dx1: (rows, hidden) dout_dtype; dweight, dbias, dweight1, dbias1:
    (hidden,); dresidual_in: (rows, hidden) x_dtype (d s, in residual's dtype); partial: (ceil(rows / PART_ROWS),
    2 or 4, hidden) f32, stage 1 of the deterministic weight/bias reductions (:func:`_weight_grads`).

    With xhat = (u - mean)*rstd, dy = dout (* silu(z) if norm_before_gate), dxhat = dy*weight (+ dout1*weight1),
    c1 = mean_group(dxhat*xhat), c2 = mean_group(dxhat) (LayerNorm; 0 for RMSNorm):
    du = rstd*(dxhat - xhat*c1 - c2); ds = du (* silu(z) if gating before the norm) (+ dresidual);
    dz = dout*y*silu'(z) (norm_before_gate) or du*s*silu'(z); dx = dropout(ds) (* rowscale);
    dx1 = dropout1(ds); dweight = sum_rows dy*xhat; dbias = sum_rows dy; dweight1, dbias1 likewise from dout1.
    """
    m = math_for(native=True)  # the target's own exp (CUDA expf): these TE computes are the GPU rules'
    dd = RMSNormGatedBwd.of(*dims, **fields)
    d, x_dtype, weight_dtype, dout_dtype = dd.norm(), dd.x_dtype, dd.weight_dtype, dd.dout_dtype or dd.x_dtype
    gs, G, p = d.group_size, d.ngroups, d.dropout_p
    rows = te.var("rows")
    full = (rows, d.hidden)
    x = te.placeholder(full, x_dtype, name="x")
    weight = te.placeholder((d.hidden,), weight_dtype, name="weight")
    bias = _maybe(d.has_bias, (1,), weight_dtype, "bias", (d.hidden,))
    z = _maybe(d.has_z, (1, 1), dout_dtype, "z", full)
    dout = te.placeholder(full, dout_dtype, name="dout")
    mean = _maybe(not d.is_rms_norm, (1, 1), "float32", "mean", (rows, G))
    rstd = te.placeholder((rows, G), "float32", name="rstd")
    dres = _maybe(d.has_dresidual, (1, 1), x_dtype, "dresidual", full)
    rowscale = _maybe(d.has_rowscale, (1,), "float32", "rowscale", (rows,))
    seeds = _maybe(p > 0, (1,), "int32", "seeds", (rows,))
    weight1 = _maybe(d.has_weight1, (1,), weight_dtype, "weight1", (d.hidden,))
    dout1 = _maybe(d.has_weight1, (1, 1), dout_dtype, "dout1", full)
    seeds1 = _maybe(p > 0 and d.has_x1, (1,), "int32", "seeds1", (rows,))

    bm = BwdMath(d, m, dout_dtype)  # the per-element math (values.py), shared with the CPU loop nests
    B = dict(x=x, weight=weight, bias=bias, z=z, dout=dout, dresidual=dres, rowscale=rowscale, seeds=seeds,
             weight1=weight1, dout1=dout1, seeds1=seeds1)

    def stat(r, h):  # the group's (mean, rstd) at column h
        return (None if d.is_rms_norm else mean[r, h // gs]), rstd[r, h // gs]

    def xhat(r, h):
        return bm.xhat(B, *stat(r, h), r, h)

    def dxhat(r, h):
        return bm.dxhat(B, r, h)

    c1 = _group_red(rows, G, gs, lambda r, h: dxhat(r, h) * xhat(r, h), "dot")
    c2 = None if d.is_rms_norm else _group_red(rows, G, gs, dxhat, "dysum")

    def at(r, h):  # BwdMath's arguments after B: mean, rstd, the group means c1, c2, then r, h
        g = h // gs
        return (*stat(r, h), c1[r, g] * (1.0 / gs), None if c2 is None else c2[r, g] * (1.0 / gs), r, h)

    # dx, dz, dresidual_in and dx1 as one multi-output compute ("dxdz": blocks dxdz_v0 = dx, then the others
    # in this order) sharing the (rows, d.hidden) loop nest, so a schedule computes the row's reductions once
    # under the row loop for all of them; a lone dx is the block "dx".
    wanted = [("dx", True, lambda r, h: bm.dx(B, *at(r, h))), ("dz", d.has_z, lambda r, h: bm.dz(B, *at(r, h))),
              ("dresidual_in", d.store_dresidual, lambda r, h: bm.ds(B, *at(r, h)).astype(x_dtype)),
              ("dx1", d.has_x1 and p > 0, lambda r, h: bm.dx1(B, *at(r, h)))]
    present = [f for _, on, f in wanted if on]
    outs = _multi(full, present, "dx" if len(present) == 1 else "dxdz")
    got = {n: outs.pop(0) if on else te.placeholder((1, 1), x_dtype if n == "dresidual_in" else dout_dtype, name=n)
           for n, on, _ in wanted}
    terms = [("dweight", True, lambda r, h: bm.dy(B, r, h) * xhat(r, h)),
             ("dbias", d.has_bias, lambda r, h: bm.dy(B, r, h))]
    if d.has_weight1:
        terms += [("dweight1", True, lambda r, h: bm.dy1(B, r, h) * xhat(r, h)),
                  ("dbias1", d.has_bias1, lambda r, h: bm.dy1(B, r, h))]
    partial, sums = _weight_grads(rows, d.hidden, terms, weight_dtype)
    if not d.has_weight1:
        sums += [te.placeholder((1,), weight_dtype, name=n) for n in ("dweight1", "dbias1")]
    func = te.create_prim_func([x, weight, bias, z, dout, mean, rstd, dres, rowscale, seeds, weight1, dout1, seeds1,
                                got["dx"], got["dz"], sums[0], sums[1], got["dresidual_in"], got["dx1"], sums[2],
                                sums[3], partial])
    return stamp(func, "rmsnorm_gated_bwd")


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static_dims, dtypes) compiled by the CUDA build-check: a gated norm of 8 groups (hidden
    2048, groups of 256), both gate orders, bf16 activations with fp32 weights; a plain one in fp32; the gated
    LayerNorm; Mamba-2 2.7B's float32 backward (hidden 5120); and the fused residual-add norm of
    mixer_seq_simple's Block (prenorm, residual in fp32, RMSNorm
    and LayerNorm with bias)."""
    Fwd, Bwd = RMSNormGatedFwd, RMSNormGatedBwd
    bf16 = dict(x_dtype="bfloat16")
    dims = []
    for cls in (Fwd, Bwd):
        dims += [cls(2048, 256, 1e-5, has_z=True, norm_before_gate=nbg, **bf16) for nbg in (True, False)]
        dims += [cls(2048, 2048, 1e-5, has_bias=True),
                 cls(2048, 256, 1e-5, True, True, False, is_rms_norm=False, **bf16)]
    # Mamba-2 2.7B's gated norm in float32 (hidden 5120, one group): its rows pass the CUDA backward's shared
    # memory budget, so some are read from global memory instead (schedules/cuda/rmsnorm_gated.py, _plan)
    dims += [Bwd(5120, 5120, 1e-5, has_z=True, norm_before_gate=False)]
    for rms in (True, False):  # the fused residual-add norm: prenorm, residual in fp32
        dims += [Fwd(2048, 2048, 1e-5, has_bias=not rms, is_rms_norm=rms, has_residual=True, store_residual=True,
                     residual_dtype="float32", residual_out_dtype="float32", **bf16),
                 Bwd(2048, 2048, 1e-5, has_bias=not rms, is_rms_norm=rms, has_dresidual=True, store_dresidual=True,
                     dout_dtype="bfloat16")]
    # the dropout path (RMSNorm module in training): uint32 hash, the uint8 keep mask, rowscale
    drop = dict(dropout_p=0.1, has_rowscale=True)
    dims += [Fwd(2048, 2048, 1e-5, has_residual=True, store_residual=True, store_dropout_mask=True, **drop,
                 residual_dtype="float32", residual_out_dtype="float32", **bf16),
             Bwd(2048, 2048, 1e-5, has_dresidual=True, store_dresidual=True, **drop, dout_dtype="bfloat16")]
    # upstream's parallel norm (x1, weight1, bias1) with dropout on both inputs, LayerNorm
    par = dict(is_rms_norm=False, has_bias=True, dropout_p=0.1, has_x1=True, has_weight1=True, has_bias1=True)
    dims += [Fwd(2048, 2048, 1e-5, has_residual=True, store_residual=True, store_dropout_mask=True, **par),
             Bwd(2048, 2048, 1e-5, has_dresidual=True, store_dresidual=True, **par)]
    return [("fwd" if isinstance(d, Fwd) else "bwd", *d.key_parts()) for d in dims]


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning / roofline workloads: the gated norm of each preset's Mamba-2 mixer (RMSNormGated over d_ssm =
    d_inner features in groups of d_inner / ngroups, eps 1e-5, gated by z before the norm,
    norm_before_gate=False, no bias), forward and backward, fp32; rows = batch * seqlen. Mamba-1 presets
    have no gated norm; Mamba-3's (B / C norms, the out_proj norm) are not covered yet."""
    from .._presets import presets

    out = []
    for _, dims in presets(preset, families=("mamba2",)):
        base = dict(hidden=dims["d_inner"], group_size=dims["d_inner"] // dims["ngroups"], eps=1e-5, has_z=True,
                    norm_before_gate=False)
        out += [(direction, *cls(**base).key_parts()) for direction, cls in DIMS.items()]
    return out


# direction -> builder(dims) -> PrimFunc: this op's kernels (runtime/registry.py reads this table)
KERNELS = {"fwd": rmsnorm_gated_fwd, "bwd": rmsnorm_gated_bwd}
