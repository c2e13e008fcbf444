"""The causal conv1d loop-nest kernels' signatures, written once (the forward and backward CPU templates in
schedules/cpu/causal_conv1d.py, the decode step in update.py).

Every kernel takes x: (batch, dim, seqlen) (the decode step's ``x_2d``: x and out (batch, dim)) and weight: (dim, width), bias: (dim,) in weight's dtype. The
forward and the backward add seq_idx: (batch, seqlen) int32 and initial_states: (batch, dim, width-1) in x's
dtype, then their own buffers: the forward writes (out, final_states); the backward takes (dout, dfinal) and
writes the gradients (each the shape and dtype of its input) and its fp32 workspaces g: (batch, dim, seqlen)
and partial: (batch, dim, width+1). The decode step instead takes conv_state: (pool, dim, state_len),
conv_state_indices and cache_seqlens: (batch,) int32 and writes out. An absent optional input is a
placeholder of ones (the parameter lists stay fixed, so one PrimFunc per static flag set). A template
supplies only its body: a macro called with the matched buffers, then batch and seqlen.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import CausalConv1dBwd, CausalConv1dFwd, CausalConv1dUpdate


def _opt(cond: bool, shape: tuple) -> tuple:
    """``shape`` when the input is present, else its all-ones placeholder."""
    return shape if cond else (1,) * len(shape)


def conv_kernel(d: CausalConv1dFwd | CausalConv1dBwd | CausalConv1dUpdate, body) -> tirx.PrimFunc:
    """The PrimFunc ``causal_conv1d_fwd`` / ``_bwd`` / ``_update`` (by the type of ``d``) whose loop nest is
    ``body``; the parameter lists match tvm_mamba/compute/causal_conv1d/__init__.py."""
    D, W, XT, WT = d.dim, d.width, d.x_dtype, d.weight_dtype
    update, backward = isinstance(d, CausalConv1dUpdate), isinstance(d, CausalConv1dBwd)
    iw = 2 if update else 1  # weight's handle: the decode step takes conv_state second
    has_seq_idx, has_init = (False, False) if update else (d.has_seq_idx, d.has_init)
    x_2d = update and d.x_2d

    @T.macro
    def declare(h, B, L, P, PS):  # h: the kernel's handles, in signature order; P: the state pool (update),
        # PS its strides (slots a page apart in a server's pool; vLLM's (state_len, dim) pages transposed)
        weight = T.match_buffer(h[iw], (D, W), WT)
        bias = T.match_buffer(h[iw + 1], _opt(d.has_bias, (D,)), WT)
        if update:
            state = T.match_buffer(h[1], (P, D, d.state_len), d.state_dtype, strides=PS)
            idx = T.match_buffer(h[4], _opt(d.has_indices, (B,)), "int32")
            cseq = T.match_buffer(h[5], _opt(d.has_cache_seqlens, (B,)), "int32")
            if x_2d:  # (batch, dim) in and out: the body reads them as (batch, dim, 1), the same memory
                x2 = T.match_buffer(h[0], (B, D), XT)
                out2 = T.match_buffer(h[6], (1, 1) if d.in_place else (B, D), XT)  # in place: a placeholder
                x = T.decl_buffer((B, D, 1), XT, data=x2.data)
                if d.in_place:  # out is x itself: one buffer (two views of one pointer would be two kernel
                    body(x, state, weight, bias, idx, cseq, x, B, 1)  # parameters, each __restrict__)
                else:
                    out = T.decl_buffer((B, D, 1), XT, data=out2.data)
                    body(x, state, weight, bias, idx, cseq, out, B, 1)
            else:
                x = T.match_buffer(h[0], (B, D, L), XT)
                out = T.match_buffer(h[6], (B, D, L), XT)
                body(x, state, weight, bias, idx, cseq, out, B, L)
        else:
            x = T.match_buffer(h[0], (B, D, L), XT)
            seq_idx = T.match_buffer(h[3], _opt(has_seq_idx, (B, L)), "int32")
            init = T.match_buffer(h[4], _opt(has_init, (B, D, W - 1)), XT)
            if backward:
                dout = T.match_buffer(h[5], (B, D, L), XT)
                dfinal = T.match_buffer(h[6], _opt(d.has_dfinal, (B, D, W - 1)), XT)
                dx = T.match_buffer(h[7], x.shape, XT)
                dweight = T.match_buffer(h[8], weight.shape, WT)
                dbias = T.match_buffer(h[9], bias.shape, WT)
                dinit = T.match_buffer(h[10], init.shape, XT)
                g = T.match_buffer(h[11], (B, D, L), "float32")
                partial = T.match_buffer(h[12], (B, D, W + 1), "float32")
                body(x, weight, bias, seq_idx, init, dout, dfinal, dx, dweight, dbias, dinit, g, partial, B, L)
            else:
                out = T.match_buffer(h[5], (B, D, L), XT)
                final = T.match_buffer(h[6], _opt(d.return_final, (B, D, W - 1)), XT)
                body(x, weight, bias, seq_idx, init, out, final, B, L)

    name = "causal_conv1d_" + ("update" if update else "bwd" if backward else "fwd")
    if backward:
        @T.prim_func
        def bwd(x_h: T.handle, w_h: T.handle, b_h: T.handle, s_h: T.handle, i_h: T.handle, do_h: T.handle,
                df_h: T.handle, dx_h: T.handle, dw_h: T.handle, db_h: T.handle, di_h: T.handle, g_h: T.handle,
                p_h: T.handle):
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            B = T.int32()
            L = T.int32()
            declare((x_h, w_h, b_h, s_h, i_h, do_h, df_h, dx_h, dw_h, db_h, di_h, g_h, p_h), B, L, 0, None)

        return bwd

    # the forward and the decode step both take 7 buffers: (x, weight, bias, seq_idx, init, out, final) and
    # (x, conv_state, weight, bias, conv_state_indices, cache_seqlens, out)
    @T.prim_func
    def fwd_or_update(h0: T.handle, h1: T.handle, h2: T.handle, h3: T.handle, h4: T.handle, h5: T.handle,
                      h6: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        B = T.int32()
        L = T.int32()
        P = T.int32()  # the decode step's state pool; the forward has none (unused)
        slot_stride = T.int32()
        dim_stride = T.int32()
        pos_stride = T.int32()
        declare((h0, h1, h2, h3, h4, h5, h6), B, L, P, (slot_stride, dim_stride, pos_stride))

    return fwd_or_update
