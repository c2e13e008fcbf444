"""Linear (projection GEMV / GEMM) with weight-only low-precision weights, as TE.

    fwd: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n])     (float32 accumulation)
    bwd: dx[m, k] = sum_n dy[m, n] * scale[n] * w[n, k]                 (input gradient only)

x: (rows, in_features) float32 / bfloat16 with rows symbolic (decode: 1..8 rows); w: (out_features,
in_features) float32, bfloat16 or int8; scale: (out_features,) float32, present exactly when w is int8
(per-output-channel scales: weight-only quantization, x stays in its float dtype); bias: (out_features,)
float32 (has_bias). y and dx have x's dtype. Every kernel takes the same arguments (fwd: x, weight, scale,
bias, y; bwd: dy, weight, scale, dx): an absent scale or bias is a (1,) placeholder that is never read. The int8 weight is widened to float32 and multiplied with the
float x, so the only error against the fp32 layer is the weight's rounding (no activation quantization).
There is no weight gradient: low-precision weights are frozen (inference), see torch_ops/linear.py.

These TE definitions are the semantic source of truth and what the CUDA rule schedules; the CPU rule emits an
AVX-512 loop nest with the same parameters (schedules/cpu/linear.py). ``storage`` says how an int8 weight is
held: bytes (the default), or the int32 words of its bytes for a target without 8-bit buffers (WebGPU;
compute/int8_dot/codes.py).
"""
from __future__ import annotations

from tvm import te, tirx

from .._common import f32, stamp
from ..int8_dot.codes import BYTES, Storage
from .dims import DIMS, LinearDims, WEIGHT_DTYPES, X_DTYPES  # noqa: F401  (the op's typed dims)


def _weight_inputs(d: LinearDims, storage: Storage):
    """weight, scale and bias placeholders ((1,) and unused for an absent scale or bias), and a function of
    (n, k) giving weight[n, k] as float32 (an int8 weight held as ``storage`` says)."""
    shape = (d.out_features, d.in_features)
    if d.weight_dtype == "int8":
        w = storage.placeholder(shape, "int8", "weight")
    else:
        w = te.placeholder(shape, d.weight_dtype, name="weight")
    scale = te.placeholder((d.out_features if d.has_scale else 1,), "float32", name="scale")
    bias = te.placeholder((d.out_features if d.has_bias else 1,), "float32", name="bias")

    def wf(n, k):
        return storage.read(w, shape, "int8", (n, k), "float32") if d.weight_dtype == "int8" else f32(w[n, k])

    return w, scale, bias, wf


def linear_fwd(d: LinearDims, storage: Storage = BYTES) -> tirx.PrimFunc:
    """x: (rows, in_features), weight: (out_features, in_features), scale: (out_features,) float32 (int8
    weight), bias: (out_features,) float32 (has_bias) -> y: (rows, out_features) in x's dtype;
    y[m, n] = scale[n] * sum_k x[m, k] * weight[n, k] + bias[n] (float32 accumulation)."""
    rows = te.var("rows")
    x = te.placeholder((rows, d.in_features), d.x_dtype, name="x")
    w, scale, bias, wf = _weight_inputs(d, storage)
    k = te.reduce_axis((0, d.in_features), name="in_features")
    acc = te.compute((rows, d.out_features), lambda m, n: te.sum(f32(x[m, k]) * wf(n, k), axis=k), name="acc")

    def epilogue(m, n):
        v = acc[m, n]
        if d.has_scale:
            v = v * scale[n]
        if d.has_bias:
            v = v + bias[n]
        return v.astype(d.x_dtype)

    y = te.compute((rows, d.out_features), epilogue, name="y")
    return stamp(te.create_prim_func([x, w, scale, bias, y]), "linear_fwd")


def linear_bwd(d: LinearDims, storage: Storage = BYTES) -> tirx.PrimFunc:
    """dy: (rows, out_features) in x's dtype, weight: (out_features, in_features), scale: (out_features,)
    float32 (int8 weight) -> dx: (rows, in_features) in x's dtype; dx[m, k] = sum_n dy[m, n] * scale[n] * weight[n, k]
    (float32 accumulation; the bias flag does not change the input gradient)."""
    rows = te.var("rows")
    dy = te.placeholder((rows, d.out_features), d.x_dtype, name="dy")
    w, scale, _, wf = _weight_inputs(d, storage)
    n = te.reduce_axis((0, d.out_features), name="out_features")

    def term(m, kk):
        g = f32(dy[m, n]) * scale[n] if d.has_scale else f32(dy[m, n])
        return te.sum(g * wf(n, kk), axis=n)

    acc = te.compute((rows, d.in_features), term, name="acc")
    dx = te.compute((rows, d.in_features), lambda m, kk: acc[m, kk].astype(d.x_dtype), name="dx")
    return stamp(te.create_prim_func([dy, w, scale, dx]), "linear_bwd")


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static_dims, dtypes) for the CUDA build-check: the 130M Mamba's projections (768 -> 3072
    in_proj, 1536 -> 768 out_proj, 768 -> 50280 LM head) for every weight dtype, a bf16 x, an odd in_features,
    and the input gradient."""
    dims = [LinearDims(768, 3072, weight_dtype=w) for w in WEIGHT_DTYPES]
    dims += [LinearDims(1536, 768, weight_dtype="int8"), LinearDims(768, 50280, weight_dtype="bfloat16"),
             LinearDims(768, 3072, True, x_dtype="bfloat16", weight_dtype="bfloat16"),
             LinearDims(131, 40, True, weight_dtype="int8")]
    out = [("fwd", *d.key_parts()) for d in dims]
    out += [("bwd", *d.key_parts()) for d in (LinearDims(768, 3072, weight_dtype="int8"),
                                              LinearDims(131, 40, x_dtype="bfloat16", weight_dtype="bfloat16"))]
    return out


VOCAB = 50280  # the released checkpoints' padded vocabulary (GPT-NeoX tokenizer): the LM head's out_features


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning workloads: the projections a decode step of each preset model streams, for every weight dtype
    (fp32 x): in_proj (Mamba: d_model -> 2 d_inner; Mamba-2: -> 2 d_inner + 2 ngroups d_state + nheads),
    out_proj (d_inner -> d_model), the LM head (d_model -> VOCAB), and Mamba's x_proj (d_inner -> dt_rank +
    2 d_state) and dt_proj (dt_rank -> d_inner)."""
    from .._presets import presets

    shapes = []
    for _, p in presets(preset, families=("mamba", "mamba2")):
        d, di = p["d_model"], p["d_inner"]
        if "nheads" in p:
            shapes.append((d, 2 * di + 2 * p["ngroups"] * p["d_state"] + p["nheads"]))
        else:
            shapes += [(d, 2 * di), (di, p["dt_rank"] + 2 * p["d_state"]), (p["dt_rank"], di)]
        shapes += [(di, d), (d, VOCAB)]
    seen = list(dict.fromkeys(shapes))
    return [("fwd", *LinearDims(k, n, weight_dtype=w).key_parts()) for k, n in seen for w in WEIGHT_DTYPES]


# direction -> builder(dims) -> PrimFunc: this op's kernels (runtime/registry.py reads this table)
KERNELS = {"fwd": linear_fwd, "bwd": linear_bwd}
