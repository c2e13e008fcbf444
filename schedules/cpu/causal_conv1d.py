"""CPU schedules for causal conv1d: hand-written loop nests (templates) with tunable knobs.

Why not s_tir primitives on the TE compute: with a symbolic seqlen, split(t, [None, V]) + vectorize adds a
``t < seqlen`` predicate and LLVM then emits no vector code at all (9.7 ms vs 0.42 ms here), and
``loop_partition`` rejects dynamic extents. So each row (batch, channel) runs a scalar head (t < V, where
the window reaches before t=0: initial states / zeros), a vectorized main loop over full vectors (no
conditions except the seq_idx mask, a vector select), and a scalar tail.

Only the loops are this file's: the math at a tap (the window it reads, the gradient flowing back to it, the
activation and its derivative) is the TE definitions' own (tvm_mamba/compute/causal_conv1d/taps.py, with the
CPU's polynomial exp), and the parameter lists are declared once (compute/causal_conv1d/signature.py).

Knobs (``decisions``): ``vector`` — lanes per main-loop step (8, 16, 32; default 16 = one zmm of fp32).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute._math import math_for
from ...compute.causal_conv1d import CausalConv1dBwd, CausalConv1dFwd, causal_conv1d_varlen_states
from ...compute.causal_conv1d.signature import conv_kernel
from ...compute.causal_conv1d.taps import ConvMath
from ...compute.causal_conv1d.update import update_template
from ..rule import Decisions, schedule_compute, schedule_of
from ._strategy import CpuStrategy

MATH = math_for()  # float32, the vectorizable polynomials (llvm.exp is one libm call per lane)
F32 = "float32"


def _pre_rows(d: CausalConv1dFwd | CausalConv1dBwd, V: int, cm: ConvMath, value, final_states: bool = False):
    """The pass both directions make over every (batch, channel) row: the pre-activation
    pre[t] = bias + sum_k weight[k] * xx[t - (W-1) + k] (the forward's output; the backward recomputes it,
    cheaper than saving it: one row pass) in a scalar head (t < V: the window reaches before t = 0), full
    vectors and a scalar tail. ``dst[b, c, t] = value(aux, seq_idx, b, c, t, pre)``; with ``final_states``
    the row's last width-1 window values go to ``final`` in the same pass (the forward's final_states)."""
    D, W, has_bias, x_dtype = d.dim, d.width, d.has_bias, d.x_dtype

    @T.macro
    def pre_rows(x, weight, bias, seq_idx, init, aux, dst, final, B, L):
        for row in T.parallel(B * D):
            b = T.meta_var(row // D)
            c = T.meta_var(row % D)
            wv = T.alloc_buffer((W + 1,), F32)
            acc = T.alloc_buffer((V,), F32)
            for k in T.unroll(W):
                wv[k] = weight[c, k].astype(F32)
            wv[W] = bias[c].astype(F32) if has_bias else T.float32(0)
            for t in range(T.min(L, V)):
                acc[0] = wv[W]
                for k in T.unroll(W):
                    acc[0] = acc[0] + wv[k] * cm.xx(x, init, seq_idx, b, c, t - (W - 1) + k, t)
                dst[b, c, t] = value(aux, seq_idx, b, c, t, acc[0])
            for t0 in range(1, L // V):  # every tap inside the row
                for i in T.vectorized(V):
                    acc[i] = wv[W]
                for k in T.unroll(W):
                    for i in T.vectorized(V):
                        acc[i] = acc[i] + wv[k] * cm.xx(x, init, seq_idx, b, c, t0 * V + i - (W - 1) + k, t0 * V + i,
                                                          inside=True)
                for i in T.vectorized(V):
                    dst[b, c, t0 * V + i] = value(aux, seq_idx, b, c, t0 * V + i, acc[i])
            for t in range(T.max(L // V * V, V), L):
                acc[0] = wv[W]
                for k in T.unroll(W):
                    acc[0] = acc[0] + wv[k] * cm.xx(x, init, seq_idx, b, c, t - (W - 1) + k, t, inside=True)
                dst[b, c, t] = value(aux, seq_idx, b, c, t, acc[0])
            if final_states:
                for j in range(W - 1):
                    final[b, c, j] = cm.final_state(x, init, b, c, L, j).astype(x_dtype)

    return pre_rows


def _fwd(d: CausalConv1dFwd, V: int):
    """The forward loop nest (its signature: conv_kernel): one _pre_rows pass, act applied, final states."""
    cm = ConvMath(d, MATH)

    def out_value(_, seq_idx, b, c, t, pre):
        return cm.out(seq_idx, b, t, pre).astype(d.x_dtype)

    pre_rows = _pre_rows(d, V, cm, out_value, final_states=d.return_final)

    @T.macro
    def body(x, weight, bias, seq_idx, init, out, final, B, L):
        pre_rows(x, weight, bias, seq_idx, init, x, out, final, B, L)  # out_value reads no aux: x stands in

    return conv_kernel(d, body)


def _bwd_grad_inputs(d: CausalConv1dBwd, V: int, cm: ConvMath):
    """Phase 2, per row: dx, dinit, and the row's partial sums for dweight / dbias (stage 1 of 2)."""
    D, W, x_dtype, has_init = d.dim, d.width, d.x_dtype, d.has_init

    @T.macro
    def dx_dinit(weight, seq_idx, dfinal, dx, dinit, g, wv, acc, b, c, L):
        for k in T.unroll(W):
            wv[k] = weight[c, k].astype(F32)
        nmain = T.meta_var(T.max(L - (W - 1), 0) // V)
        for s0 in range(nmain):  # dx main: every source s + (W-1) - k < L
            for i in T.vectorized(V):
                acc[i] = T.float32(0)
            for k in T.unroll(W):
                for i in T.vectorized(V):
                    acc[i] = acc[i] + wv[k] * cm.later_grad(g, seq_idx, L, b, c, s0 * V + i + (W - 1) - k, s0 * V + i,
                                                                  inside=True)
            for i in T.vectorized(V):
                dx[b, c, s0 * V + i] = acc[i].astype(x_dtype)
        for s in range(nmain * V, L):
            acc[0] = cm.final_grad(dfinal, L, b, c, s)
            for k in T.unroll(W):
                acc[0] = acc[0] + wv[k] * cm.later_grad(g, seq_idx, L, b, c, s + (W - 1) - k, s)
            dx[b, c, s] = acc[0].astype(x_dtype)
        if has_init:
            for j in range(W - 1):
                acc[0] = cm.final_grad(dfinal, L, b, c, j - (W - 1))
                for k in T.unroll(W):
                    acc[0] = acc[0] + wv[k] * cm.later_grad(g, seq_idx, L, b, c, j - k, 0)
                dinit[b, c, j] = acc[0].astype(x_dtype)

    @T.macro
    def row_partials(x, seq_idx, init, g, partial, acc, pacc, b, c, L):
        for k in range(W + 1):
            for i in T.vectorized(V):
                pacc[k, i] = T.float32(0)
        for t in range(T.min(L, V)):
            for k in T.unroll(W):
                pacc[k, 0] = pacc[k, 0] + g[b, c, t] * cm.xx(x, init, seq_idx, b, c, t - (W - 1) + k, t)
            pacc[W, 0] = pacc[W, 0] + g[b, c, t]
        for t0 in range(1, L // V):
            for k in T.unroll(W):
                for i in T.vectorized(V):
                    pacc[k, i] = pacc[k, i] + g[b, c, t0 * V + i] * cm.xx(
                        x, init, seq_idx, b, c, t0 * V + i - (W - 1) + k, t0 * V + i, inside=True)
            for i in T.vectorized(V):
                pacc[W, i] = pacc[W, i] + g[b, c, t0 * V + i]
        for t in range(T.max(L // V * V, V), L):
            for k in T.unroll(W):
                pacc[k, 0] = pacc[k, 0] + g[b, c, t] * cm.xx(x, init, seq_idx, b, c, t - (W - 1) + k, t, inside=True)
            pacc[W, 0] = pacc[W, 0] + g[b, c, t]
        for k in range(W + 1):
            acc[0] = T.float32(0)
            for i in range(V):  # fixed order: deterministic
                acc[0] = acc[0] + pacc[k, i]
            partial[b, c, k] = acc[0]

    @T.macro
    def grad_inputs(x, weight, seq_idx, init, dfinal, dx, dinit, g, partial, B, L):
        for row in T.parallel(B * D):
            b = T.meta_var(row // D)
            c = T.meta_var(row % D)
            wv = T.alloc_buffer((W,), F32)
            acc = T.alloc_buffer((V,), F32)
            pacc = T.alloc_buffer((W + 1, V), F32)
            dx_dinit(weight, seq_idx, dfinal, dx, dinit, g, wv, acc, b, c, L)
            row_partials(x, seq_idx, init, g, partial, acc, pacc, b, c, L)

    return grad_inputs


def _bwd(d: CausalConv1dBwd, V: int):
    """The backward loop nest (its signature: conv_kernel): phase 1, per row, g = dout * act'(pre)
    (_pre_rows), phase 2 (_bwd_grad_inputs), then stage 2 of the dweight / dbias reduction over batch, in
    batch order (deterministic)."""
    # plain names: TVMScript folds these Python values into the kernel's static branches
    D, W, has_bias, weight_dtype = d.dim, d.width, d.has_bias, d.weight_dtype
    cm = ConvMath(d, MATH)
    grad_pre, grad_inputs = _pre_rows(d, V, cm, cm.grad), _bwd_grad_inputs(d, V, cm)

    @T.macro
    def body(x, weight, bias, seq_idx, init, dout, dfinal, dx, dweight, dbias, dinit, g, partial, B, L):
        grad_pre(x, weight, bias, seq_idx, init, dout, g, g, B, L)  # no final states: g stands in
        grad_inputs(x, weight, seq_idx, init, dfinal, dx, dinit, g, partial, B, L)
        for c in T.parallel(D):  # stage 2: the per-row partials summed over batch, in batch order
            acc = T.alloc_buffer((W + 1,), F32)
            for k in range(W + 1):
                acc[k] = T.float32(0)
            for b in range(B):
                for k in range(W + 1):
                    acc[k] = acc[k] + partial[b, c, k]
            for k in range(W):
                dweight[c, k] = acc[k].astype(weight_dtype)
            if has_bias:
                dbias[c] = acc[W].astype(weight_dtype)

    return conv_kernel(d, body)


def _varlen_states(dims):
    """states (batch, state_len, dim): one parallel task per (batch, state row), dim innermost (a copy of
    one contiguous row of x, or zeros)."""
    sch = schedule_compute(causal_conv1d_varlen_states(dims), "causal_conv1d_varlen_states")
    blk = sch.get_sblock("states")
    b, j, _ = sch.get_loops(blk)
    sch.parallel(sch.fuse(b, j))
    return sch


def lay_out(kernel: str, dims, target, decisions: Decisions):
    """The CPU loop nests of the causal_conv1d kernels; None for another kernel or target."""
    if "cpu" not in target.keys:
        return None
    if kernel == "fwd":
        f = _fwd(dims, decisions.pick("vector", (8, 16, 32), 16))
    elif kernel == "bwd":
        f = _bwd(dims, decisions.pick("vector", (8, 16, 32), 16))
    elif kernel == "update":
        f = update_template(dims, CpuStrategy())
    elif kernel == "varlen_states":
        return _varlen_states(dims)
    else:
        return None
    return schedule_of(f, f"causal_conv1d_{kernel}")
