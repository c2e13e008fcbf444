"""CPU schedules for causal conv1d: hand-written loop nests (templates) with tunable knobs.

Why not s_tir primitives on the TE compute: with a symbolic seqlen, split(t, [None, V]) + vectorize adds a
``t < seqlen`` predicate and LLVM then emits no vector code at all (9.7 ms vs 0.42 ms here), and
``loop_partition`` rejects dynamic extents. So each row (batch, channel) runs a scalar head (t < V, where
the window reaches before t=0: initial states / zeros), a vectorized main loop over full vectors (no
conditions except the seq_idx mask, a vector select), and a scalar tail.

Knobs (``decisions``): ``vector`` — lanes per main-loop step (8, 16, 32; default 16 = one zmm of fp32).
The parameter lists match tvm_mamba/compute/causal_conv1d.py exactly.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...compute import _math
from ...compute._causal_conv1d_update import update_template
from ...compute.causal_conv1d import window_value, zero_padding
from ..rule import Decisions, kernel_attrs, schedule_of

F32 = "float32"


def _act(v, activation):
    return _math.silu(v) if activation == "silu" else v


def _act_grad(v, activation):
    return _math.silu_grad(v) if activation == "silu" else tirx.const(1.0, F32)


def _fwd(dim, width, activation, has_bias, has_seq_idx, has_init, return_final, x_dtype, weight_dtype, V):
    D, W = dim, width

    def xx(x, init, seq_idx, b, c, s, t):
        return window_value(x, init, seq_idx, W, has_seq_idx, has_init, b, c, s, t)

    def pad0(seq_idx, b, t, v):  # padding positions (seq_idx < 0) output 0
        return zero_padding(v, seq_idx, has_seq_idx, b, t)

    def tap(x, seq_idx, b, c, s, t):  # main loop: s >= 0 always
        v = x[b, c, s].astype(F32)
        return tirx.Select(seq_idx[b, s] == seq_idx[b, t], v, tirx.const(0.0, F32)) if has_seq_idx else v

    @T.prim_func
    def causal_conv1d_fwd(x_h: T.handle, w_h: T.handle, b_h: T.handle, s_h: T.handle, i_h: T.handle,
                          o_h: T.handle, f_h: T.handle):
        T.func_attr({"global_symbol": "causal_conv1d_fwd", "tirx.noalias": True})
        B = T.int32()
        L = T.int32()
        x = T.match_buffer(x_h, (B, D, L), x_dtype)
        weight = T.match_buffer(w_h, (D, W), weight_dtype)
        bias = T.match_buffer(b_h, (D,) if has_bias else (1,), weight_dtype)
        seq_idx = T.match_buffer(s_h, (B, L) if has_seq_idx else (1, 1), "int32")
        init = T.match_buffer(i_h, (B, D, W - 1) if has_init else (1, 1, 1), x_dtype)
        out = T.match_buffer(o_h, (B, D, L), x_dtype)
        final = T.match_buffer(f_h, (B, D, W - 1) if return_final else (1, 1, 1), x_dtype)
        for row in T.parallel(B * D):
            b = T.meta_var(row // D)
            c = T.meta_var(row % D)
            wv = T.alloc_buffer((W + 1,), F32)
            acc = T.alloc_buffer((V,), F32)
            for k in T.unroll(W):
                wv[k] = weight[c, k].astype(F32)
            wv[W] = bias[c].astype(F32) if has_bias else T.float32(0)
            for t in range(T.min(L, V)):  # head: the window may reach before t = 0
                acc[0] = wv[W]
                for k in T.unroll(W):
                    acc[0] = acc[0] + wv[k] * xx(x, init, seq_idx, b, c, t - (W - 1) + k, t)
                out[b, c, t] = pad0(seq_idx, b, t, _act(acc[0], activation)).astype(x_dtype)
            for t0 in range(1, L // V):  # main: full vectors, every tap inside the row
                for i in T.vectorized(V):
                    acc[i] = wv[W]
                for k in T.unroll(W):
                    for i in T.vectorized(V):
                        acc[i] = acc[i] + wv[k] * tap(x, seq_idx, b, c, t0 * V + i - (W - 1) + k, t0 * V + i)
                for i in T.vectorized(V):
                    out[b, c, t0 * V + i] = pad0(seq_idx, b, t0 * V + i, _act(acc[i], activation)).astype(x_dtype)
            for t in range(T.max(L // V * V, V), L):  # tail
                acc[0] = wv[W]
                for k in T.unroll(W):
                    acc[0] = acc[0] + wv[k] * tap(x, seq_idx, b, c, t - (W - 1) + k, t)
                out[b, c, t] = pad0(seq_idx, b, t, _act(acc[0], activation)).astype(x_dtype)
            if return_final:
                for j in range(W - 1):
                    final[b, c, j] = window_value(x, init, seq_idx, W, False, has_init, b, c,
                                                  L - (W - 1) + j, 0).astype(x_dtype)

    return causal_conv1d_fwd


def _bwd(dim, width, activation, has_bias, has_seq_idx, has_init, has_dfinal, x_dtype, weight_dtype, V):
    D, W = dim, width
    zero = tirx.const(0.0, F32)

    def xx(x, init, seq_idx, b, c, s, t):
        return window_value(x, init, seq_idx, W, has_seq_idx, has_init, b, c, s, t)

    def same(seq_idx, b, s, t):  # both positions inside [0, L)
        return seq_idx[b, s] == seq_idx[b, t]

    def g_at(g, seq_idx, L, b, c, src, s):  # g[src] if src is a later position of s's sequence, else 0
        val = g[b, c, tirx.min(tirx.max(src, 0), L - 1)]
        if has_seq_idx:
            val = tirx.Select(same(seq_idx, b, tirx.min(tirx.max(src, 0), L - 1), tirx.max(s, 0)), val, zero)
        return tirx.if_then_else(tirx.all(src >= 0, src < L), val, zero)

    def g_main(g, seq_idx, b, c, src, s):  # main loop: 0 <= s <= src < L
        val = g[b, c, src]
        return tirx.Select(same(seq_idx, b, src, s), val, zero) if has_seq_idx else val

    def final_grad(dfinal, L, b, c, s):
        if not has_dfinal:
            return zero
        j = s - (L - (W - 1))
        return tirx.if_then_else(tirx.all(j >= 0, j < W - 1),
                                 dfinal[b, c, tirx.min(tirx.max(j, 0), W - 2)].astype(F32), zero)

    def dout_at(dout, seq_idx, b, c, t):  # a padding output is a constant 0: no gradient flows from it
        return zero_padding(dout[b, c, t].astype(F32), seq_idx, has_seq_idx, b, t)

    def xtap(x, seq_idx, b, c, s, t):  # main loop: s >= 0
        v = x[b, c, s].astype(F32)
        return tirx.Select(same(seq_idx, b, s, t), v, zero) if has_seq_idx else v

    @T.prim_func
    def causal_conv1d_bwd(x_h: T.handle, w_h: T.handle, b_h: T.handle, s_h: T.handle, i_h: T.handle,
                          do_h: T.handle, df_h: T.handle, dx_h: T.handle, dw_h: T.handle, db_h: T.handle,
                          di_h: T.handle, g_h: T.handle, p_h: T.handle):
        T.func_attr({"global_symbol": "causal_conv1d_bwd", "tirx.noalias": True})
        B = T.int32()
        L = T.int32()
        x = T.match_buffer(x_h, (B, D, L), x_dtype)
        weight = T.match_buffer(w_h, (D, W), weight_dtype)
        bias = T.match_buffer(b_h, (D,) if has_bias else (1,), weight_dtype)
        seq_idx = T.match_buffer(s_h, (B, L) if has_seq_idx else (1, 1), "int32")
        init = T.match_buffer(i_h, (B, D, W - 1) if has_init else (1, 1, 1), x_dtype)
        dout = T.match_buffer(do_h, (B, D, L), x_dtype)
        dfinal = T.match_buffer(df_h, (B, D, W - 1) if has_dfinal else (1, 1, 1), x_dtype)
        dx = T.match_buffer(dx_h, (B, D, L), x_dtype)
        dweight = T.match_buffer(dw_h, (D, W), weight_dtype)
        dbias = T.match_buffer(db_h, (D,) if has_bias else (1,), weight_dtype)
        dinit = T.match_buffer(di_h, (B, D, W - 1) if has_init else (1, 1, 1), x_dtype)
        g = T.match_buffer(g_h, (B, D, L), F32)
        partial = T.match_buffer(p_h, (B, D, W + 1), F32)
        # phase 1: g = dout * act'(pre), pre recomputed (cheaper than saving it: one row pass)
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
                    acc[0] = acc[0] + wv[k] * xx(x, init, seq_idx, b, c, t - (W - 1) + k, t)
                g[b, c, t] = dout_at(dout, seq_idx, b, c, t) * _act_grad(acc[0], activation)
            for t0 in range(1, L // V):
                for i in T.vectorized(V):
                    acc[i] = wv[W]
                for k in T.unroll(W):
                    for i in T.vectorized(V):
                        acc[i] = acc[i] + wv[k] * xtap(x, seq_idx, b, c, t0 * V + i - (W - 1) + k, t0 * V + i)
                for i in T.vectorized(V):
                    g[b, c, t0 * V + i] = dout_at(dout, seq_idx, b, c, t0 * V + i) * _act_grad(acc[i], activation)
            for t in range(T.max(L // V * V, V), L):
                acc[0] = wv[W]
                for k in T.unroll(W):
                    acc[0] = acc[0] + wv[k] * xtap(x, seq_idx, b, c, t - (W - 1) + k, t)
                g[b, c, t] = dout_at(dout, seq_idx, b, c, t) * _act_grad(acc[0], activation)
        # phase 2: dx, dinit, and per-row partial sums for dweight / dbias (stage 1 of 2)
        for row in T.parallel(B * D):
            b = T.meta_var(row // D)
            c = T.meta_var(row % D)
            wv = T.alloc_buffer((W,), F32)
            acc = T.alloc_buffer((V,), F32)
            pacc = T.alloc_buffer((W + 1, V), F32)
            for k in T.unroll(W):
                wv[k] = weight[c, k].astype(F32)
            nmain = T.meta_var(T.max(L - (W - 1), 0) // V)
            for s0 in range(nmain):  # dx main: every source s + (W-1) - k < L
                for i in T.vectorized(V):
                    acc[i] = T.float32(0)
                for k in T.unroll(W):
                    for i in T.vectorized(V):
                        acc[i] = acc[i] + wv[k] * g_main(g, seq_idx, b, c, s0 * V + i + (W - 1) - k, s0 * V + i)
                for i in T.vectorized(V):
                    dx[b, c, s0 * V + i] = acc[i].astype(x_dtype)
            for s in range(nmain * V, L):
                acc[0] = final_grad(dfinal, L, b, c, s)
                for k in T.unroll(W):
                    acc[0] = acc[0] + wv[k] * g_at(g, seq_idx, L, b, c, s + (W - 1) - k, s)
                dx[b, c, s] = acc[0].astype(x_dtype)
            if has_init:
                for j in range(W - 1):
                    acc[0] = final_grad(dfinal, L, b, c, j - (W - 1))
                    for k in T.unroll(W):
                        acc[0] = acc[0] + wv[k] * g_at(g, seq_idx, L, b, c, j - k, 0)
                    dinit[b, c, j] = acc[0].astype(x_dtype)
            for k in range(W + 1):
                for i in T.vectorized(V):
                    pacc[k, i] = T.float32(0)
            for t in range(T.min(L, V)):
                for k in T.unroll(W):
                    pacc[k, 0] = pacc[k, 0] + g[b, c, t] * xx(x, init, seq_idx, b, c, t - (W - 1) + k, t)
                pacc[W, 0] = pacc[W, 0] + g[b, c, t]
            for t0 in range(1, L // V):
                for k in T.unroll(W):
                    for i in T.vectorized(V):
                        pacc[k, i] = pacc[k, i] + g[b, c, t0 * V + i] * xtap(
                            x, seq_idx, b, c, t0 * V + i - (W - 1) + k, t0 * V + i)
                for i in T.vectorized(V):
                    pacc[W, i] = pacc[W, i] + g[b, c, t0 * V + i]
            for t in range(T.max(L // V * V, V), L):
                for k in T.unroll(W):
                    pacc[k, 0] = pacc[k, 0] + g[b, c, t] * xtap(x, seq_idx, b, c, t - (W - 1) + k, t)
                pacc[W, 0] = pacc[W, 0] + g[b, c, t]
            for k in range(W + 1):
                acc[0] = T.float32(0)
                for i in range(V):  # fixed order: deterministic
                    acc[0] = acc[0] + pacc[k, i]
                partial[b, c, k] = acc[0]
        # phase 3 (stage 2): sum the per-row partials over batch, in batch order
        for c in T.parallel(D):
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

    return causal_conv1d_bwd


def _varlen_states(func):
    """states (batch, state_len, dim): one parallel task per (batch, state row), dim innermost (a copy of
    one contiguous row of x, or zeros)."""
    sch = schedule_of(func, name="causal_conv1d_varlen_states")
    blk = sch.get_sblock("states")
    b, j, _ = sch.get_loops(blk)
    sch.parallel(sch.fuse(b, j))
    return sch


def apply(func, target, decisions: Decisions):
    """Loop-nest template for the causal_conv1d kernels on llvm targets; None for anything else."""
    kernel, st = kernel_attrs(func)
    if target.kind.name != "llvm" or kernel is None or not kernel.startswith("causal_conv1d_"):
        return None
    if kernel == "causal_conv1d_fwd":
        V = decisions.pick("vector", (8, 16, 32), 16)
        f = _fwd(st["dim"], st["width"], st["activation"], st["has_bias"], st["has_seq_idx"], st["has_init"],
                 st["return_final"], st["x_dtype"], st["weight_dtype"], V)
    elif kernel == "causal_conv1d_bwd":
        V = decisions.pick("vector", (8, 16, 32), 16)
        f = _bwd(st["dim"], st["width"], st["activation"], st["has_bias"], st["has_seq_idx"], st["has_init"],
                 st["has_dfinal"], st["x_dtype"], st["weight_dtype"], V)
    elif kernel == "causal_conv1d_update":
        f = update_template(**st, mode="cpu")
    elif kernel == "causal_conv1d_varlen_states":
        return _varlen_states(func)
    else:
        return None
    return schedule_of(f.with_attrs(dict(func.attrs)), name=kernel)
