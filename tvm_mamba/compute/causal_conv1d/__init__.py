"""Depthwise causal conv1d (causal-conv1d 1.7.0 semantics) as TE: forward, backward, decode update.

    out[b, c, t] = act(bias[c] + sum_k weight[c, k] * xx[b, c, t - (width-1) + k])

where ``xx`` is x extended to the left by ``initial_states`` (or zeros), and, with ``seq_idx``, a tap
contributes only when its position has the same sequence id as ``t`` (packed variable-length batches;
initial states carry the id of position 0) and out is 0 where seq_idx < 0 (padding).
``act`` is identity or SiLU. Accumulation is float32; out has x's dtype.

Every kernel has a fixed parameter list; an optional input that is absent is a (1,)*ndim placeholder
that the kernel never reads (its ``has_*`` flag is False). Batch and seqlen are symbolic.
These TE definitions are the semantic source of truth and what the CUDA rules schedule; the CPU rules
emit hand-written loop nests with the same parameters (schedules/cpu/causal_conv1d.py). The decode step
(``causal_conv1d_update``, in place on a state pool) is one loop-nest template for every target
(causal_conv1d/update.py); ``causal_conv1d_varlen_states`` gathers each packed sequence's last inputs.
"""
from __future__ import annotations

from tvm import te, tirx

from .dims import (ACTIVATIONS, DIMS, WIDTHS, CausalConv1dBwd, CausalConv1dFwd,  # noqa: F401
                                  CausalConv1dUpdate, CausalConv1dVarlenStates)
from .._common import f32, stamp
from .._math import math_for
from .taps import ConvMath


def _inputs(d: CausalConv1dFwd | CausalConv1dBwd):
    batch, seqlen = te.var("batch"), te.var("seqlen")
    x = te.placeholder((batch, d.dim, seqlen), d.x_dtype, name="x")
    weight = te.placeholder((d.dim, d.width), d.weight_dtype, name="weight")
    bias = te.placeholder((d.dim,) if d.has_bias else (1,), d.weight_dtype, name="bias")
    seq_idx = te.placeholder((batch, seqlen) if d.has_seq_idx else (1, 1), "int32", name="seq_idx")
    init = te.placeholder((batch, d.dim, d.width - 1) if d.has_init else (1, 1, 1), d.x_dtype,
                          name="initial_states")
    return batch, seqlen, x, weight, bias, seq_idx, init


def causal_conv1d_fwd(*dims, **fields) -> tirx.PrimFunc:
    """x: (batch, dim, seqlen); weight: (dim, width); bias: (dim,); seq_idx: (batch, seqlen) int32;
    initial_states: (batch, dim, width-1) -> out: (batch, dim, seqlen), final_states: (batch, dim, width-1).

    out = act(bias + sum_k weight[:, k] * xx[..., t-(width-1)+k]); final_states = xx[..., seqlen-(width-1):].
    ``dims``: a :class:`CausalConv1dFwd`, or its fields (``dim, width, activation="none", ...``).
    """
    d = CausalConv1dFwd.of(*dims, **fields)
    cm = ConvMath(d, math_for(native=True))  # the target's own exp (CUDA expf): these TE computes are the GPU's
    width, x_dtype = d.width, d.x_dtype
    batch, seqlen, x, weight, bias, seq_idx, init = _inputs(d)
    k = te.reduce_axis((0, width), name="width")
    acc = te.compute(
        (batch, d.dim, seqlen),
        lambda b, c, t: te.sum(f32(weight[c, k]) * cm.xx(x, init, seq_idx, b, c, t - (width - 1) + k, t), axis=k),
        name="conv_acc")

    def finish(b, c, t):
        return cm.out(seq_idx, b, t, acc[b, c, t] + (f32(bias[c]) if d.has_bias else 0.0)).astype(x_dtype)

    out = te.compute((batch, d.dim, seqlen), finish, name="out")
    fshape = (batch, d.dim, width - 1) if d.return_final else (1, 1, 1)
    final = te.compute(
        fshape,
        lambda b, c, j: cm.final_state(x, init, b, c, seqlen, j).astype(x_dtype)
        if d.return_final else tirx.const(0, x_dtype),
        name="final_states")
    func = te.create_prim_func([x, weight, bias, seq_idx, init, out, final])
    return stamp(func, "causal_conv1d_fwd")


def causal_conv1d_bwd(*dims, **fields) -> tirx.PrimFunc:
    """Backward of :func:`causal_conv1d_fwd`; ``dims``: a :class:`CausalConv1dBwd`, or its fields.

    Inputs as the forward plus dout: (batch, dim, seqlen) and dfinal: (batch, dim, width-1).
    Outputs: dx: (batch, dim, seqlen), dweight: (dim, width), dbias: (dim,), dinit: (batch, dim, width-1),
    and two float32 workspaces written by the kernel: g: (batch, dim, seqlen) = dout * act'(pre) and
    partial: (batch, dim, width+1), the first stage of the deterministic two-stage dweight/dbias reduction
    (per row over time; the second stage sums rows over batch in a fixed order).

    dx[s] = sum_k weight[k] * g[s + (width-1) - k] (same seq id) + dfinal[s - (seqlen-(width-1))];
    dweight[c, k] = sum_{b,t} g[b,c,t] * xx[b, c, t-(width-1)+k]; dbias[c] = sum_{b,t} g[b,c,t].
    """
    d = CausalConv1dBwd.of(*dims, **fields)
    cm = ConvMath(d, math_for(native=True))  # the target's own exp (CUDA expf): these TE computes are the GPU's
    dim, W, has_bias, has_init, has_dfinal = d.dim, d.width, d.has_bias, d.has_init, d.has_dfinal
    x_dtype, weight_dtype = d.x_dtype, d.weight_dtype
    batch, seqlen, x, weight, bias, seq_idx, init = _inputs(d)
    dout = te.placeholder((batch, dim, seqlen), x_dtype, name="dout")
    dfinal = te.placeholder((batch, dim, W - 1) if has_dfinal else (1, 1, 1), x_dtype, name="dfinal")

    def xx(b, c, s, t):
        return cm.xx(x, init, seq_idx, b, c, s, t)

    k = te.reduce_axis((0, W), name="width")
    pre = te.compute((batch, dim, seqlen),
                     lambda b, c, t: te.sum(f32(weight[c, k]) * xx(b, c, t - (W - 1) + k, t), axis=k),
                     name="pre_acc")

    def grad_pre(b, c, t):
        return cm.grad(dout, seq_idx, b, c, t, pre[b, c, t] + (f32(bias[c]) if has_bias else 0.0))

    # g: the workspace output (written once; dinit reads it), grad: the same values as an intermediate that
    # dx and the dweight / dbias sums read, so a schedule may compute it per tile in fast memory
    grad = te.compute((batch, dim, seqlen), grad_pre, name="grad")
    g = te.compute((batch, dim, seqlen), lambda b, c, t: grad[b, c, t], name="g")

    def g_at(b, c, src, s, g=grad):
        return cm.later_grad(g, seq_idx, seqlen, b, c, src, s)

    def final_grad(b, c, s):
        return cm.final_grad(dfinal, seqlen, b, c, s)

    k2 = te.reduce_axis((0, W), name="width")
    dx_acc = te.compute((batch, dim, seqlen),
                        lambda b, c, s: te.sum(f32(weight[c, k2]) * g_at(b, c, s + (W - 1) - k2, s), axis=k2),
                        name="dx_acc")
    dx = te.compute((batch, dim, seqlen),
                    lambda b, c, s: (dx_acc[b, c, s] + final_grad(b, c, s)).astype(x_dtype), name="dx")
    k3 = te.reduce_axis((0, W), name="width")
    if has_init:
        dinit_acc = te.compute(
            (batch, dim, W - 1),
            lambda b, c, j: te.sum(f32(weight[c, k3]) * g_at(b, c, j - k3, 0, g), axis=k3), name="dinit_acc")
        dinit = te.compute((batch, dim, W - 1),
                           lambda b, c, j: (dinit_acc[b, c, j] + final_grad(b, c, j - (W - 1))).astype(x_dtype),
                           name="dinit")
    else:
        dinit = te.compute((1, 1, 1), lambda b, c, j: tirx.const(0, x_dtype), name="dinit")
    t_ax = te.reduce_axis((0, seqlen), name="seqlen")
    partial = te.compute(
        (batch, dim, W + 1),
        lambda b, c, kk: te.sum(grad[b, c, t_ax] * tirx.if_then_else(
            kk < W, xx(b, c, t_ax - (W - 1) + tirx.min(kk, W - 1), t_ax), tirx.const(1.0, "float32")),
            axis=t_ax),
        name="partial")
    b_ax = te.reduce_axis((0, batch), name="batch")
    dweight_acc = te.compute((dim, W), lambda c, kk: te.sum(partial[b_ax, c, kk], axis=b_ax), name="dweight_acc")
    dweight = te.compute((dim, W), lambda c, kk: dweight_acc[c, kk].astype(weight_dtype), name="dweight")
    if has_bias:
        b_ax2 = te.reduce_axis((0, batch), name="batch")
        dbias_acc = te.compute((dim,), lambda c: te.sum(partial[b_ax2, c, W], axis=b_ax2), name="dbias_acc")
        dbias = te.compute((dim,), lambda c: dbias_acc[c].astype(weight_dtype), name="dbias")
    else:
        dbias = te.compute((1,), lambda c: tirx.const(0, weight_dtype), name="dbias")
    func = te.create_prim_func([x, weight, bias, seq_idx, init, dout, dfinal, dx, dweight, dbias, dinit, g, partial])
    return stamp(func, "causal_conv1d_bwd")


def causal_conv1d_varlen_states(*dims, **fields) -> tirx.PrimFunc:
    """x: (total_tokens, dim) packed sequences; cu_seqlens: (batch + 1,) int32, 0 = cu[0] <= ... <= total_tokens
    (tokens after cu[-1] are padding and never read)
    -> states: (batch, state_len, dim) (the torch op returns its (batch, dim, state_len) transpose, as
    causal-conv1d 1.7.0's causal_conv1d_varlen_states does).

    states[b, j] = x[end - state_len + j] if that row is inside sequence b (>= cu[b]) else 0, end = cu[b+1]:
    the last state_len tokens of each sequence, right-aligned, zeros on the left of a shorter one.
    ``dims``: a :class:`CausalConv1dVarlenStates`, or its fields (``dim, state_len, x_dtype="float32"``).
    """
    d = CausalConv1dVarlenStates.of(*dims, **fields)
    dim, state_len, x_dtype = d.dim, d.state_len, d.x_dtype
    batch, total, ncu = te.var("batch"), te.var("total_tokens"), te.var("ncu")
    x = te.placeholder((total, dim), x_dtype, name="x")
    cu = te.placeholder((ncu,), "int32", name="cu_seqlens")

    def state(b, j, c):
        end = cu[tirx.min(b + 1, ncu - 1)]
        row = end - state_len + j
        inside = tirx.all(row >= cu[b], row >= 0)
        return tirx.if_then_else(inside, x[tirx.min(tirx.max(row, 0), total - 1), c], tirx.const(0, x_dtype))

    states = te.compute((batch, state_len, dim), state, name="states")
    func = te.create_prim_func([x, cu, states])
    return stamp(func, "causal_conv1d_varlen_states")


def causal_conv1d_update(*dims, **fields) -> tirx.PrimFunc:
    """Decode step, conv_state (pool, dim, state_len) updated in place -> out (batch, dim, seqlen): the
    builder of direction "update", defined in update.py. Imported on first use: that module
    needs TVMScript, which a runtime-only TVM (a kernel pack on a GPU machine) lacks, and this module must
    stay importable there (build_check_configs). ``dims``: a :class:`CausalConv1dUpdate`, or its fields."""
    from .update import causal_conv1d_update as build

    return build(CausalConv1dUpdate.of(*dims, **fields))


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static dims, dtypes) built by ``python -m tvm_mamba build-check`` for CUDA.
    d_inner 1536 is Mamba-130M's; width 4 is every released Mamba's, 8 the widest supported. The decode
    step as a model's step and a server's call it (one token, (batch, dim) x; vLLM's, written over x) and
    with a circular state and several tokens."""
    dims = []
    for x_dtype in ("float32", "bfloat16"):
        base = dict(dim=1536, activation="silu", has_bias=True, x_dtype=x_dtype)
        for width in (4, 8):
            dims += [CausalConv1dFwd(**base, width=width), CausalConv1dBwd(**base, width=width)]
        dims += [CausalConv1dFwd(**base, width=4, has_seq_idx=True, has_init=True, return_final=True),
                 CausalConv1dBwd(**base, width=4, has_seq_idx=True, has_init=True, has_dfinal=True),
                 CausalConv1dUpdate(**base, width=4, state_len=3, state_dtype=x_dtype, x_2d=True),
                 CausalConv1dUpdate(**base, width=4, state_len=3, has_indices=True, state_dtype=x_dtype, x_2d=True),
                 CausalConv1dUpdate(**base, width=4, state_len=3, has_indices=True, state_dtype=x_dtype, x_2d=True,
                                    in_place=True),
                 CausalConv1dUpdate(**base, width=4, state_len=6, has_indices=True, has_cache_seqlens=True,
                                    state_dtype=x_dtype),
                 CausalConv1dVarlenStates(dim=1536, state_len=3, x_dtype=x_dtype)]
    return [(_direction(d), *d.key_parts()) for d in dims]


def _direction(dims) -> str:
    return next(name for name, cls in DIMS.items() if type(dims) is cls)


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning workloads: the conv of each preset model (Mamba: d_inner channels; Mamba-2: conv_dim),
    width 4, SiLU, bias; forward and backward, fp32."""
    from .._presets import presets

    out = []
    for _, dims in presets(preset, families=("mamba", "mamba2")):
        base = dict(dim=dims.get("conv_dim", dims["d_inner"]), width=dims["d_conv"], activation="silu",
                    has_bias=True)
        out += [("fwd", *CausalConv1dFwd(**base).key_parts()), ("bwd", *CausalConv1dBwd(**base).key_parts())]
    return out


# direction -> builder(dims) -> PrimFunc: this op's kernels (runtime/registry.py reads this table)
KERNELS = {"fwd": causal_conv1d_fwd, "bwd": causal_conv1d_bwd, "varlen_states": causal_conv1d_varlen_states,
           "update": causal_conv1d_update}
