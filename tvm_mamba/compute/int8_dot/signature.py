"""The int8 straight-through backward kernels' signatures, written once (the CPU loop nests in
schedules/cpu/int8_dot.py, the tensor-core forms in schedules/cuda/int8_dot.py).

dgrad takes g: (heads, M, K) float32, codes: (heads, K, N) int8, scale: (1,) float32 and writes out:
(heads, M, N) float32; wgrad takes codes: (code_heads, M, N) int8, g: (heads, M, K) float32, scale: (1,)
float32 and writes out: (heads, N, K) float32 and its stage-1 workspace partial: (nparts, heads, N, K)
float32. M and nparts are symbolic int32; the rest static (from the dims). The parameter lists match
``int8_dot_dgrad`` / ``int8_dot_wgrad`` in tvm_mamba/compute/int8_dot/__init__.py. A template supplies only
its body: a macro called with the matched buffers, then M (and nparts).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import Int8DotDgrad, Int8DotWgrad


def grad_kernel(d: Int8DotDgrad | Int8DotWgrad, body) -> tirx.PrimFunc:
    """The PrimFunc ``int8_dot_dgrad`` / ``int8_dot_wgrad`` (by the type of ``d``) whose loop nest is ``body``:
    ``body(g, codes, scale, out, M)`` / ``body(codes, g, scale, out, partial, M, nparts)``."""
    heads, N, K = d.heads, d.N, d.K
    if isinstance(d, Int8DotDgrad):
        @T.prim_func
        def int8_dot_dgrad(g_h: T.handle, codes_h: T.handle, scale_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "int8_dot_dgrad", "tirx.noalias": True})
            M = T.int32()
            g = T.match_buffer(g_h, (heads, M, K), "float32")
            codes = T.match_buffer(codes_h, (heads, K, N), "int8")
            scale = T.match_buffer(scale_h, (1,), "float32")
            out = T.match_buffer(out_h, (heads, M, N), "float32")
            body(g, codes, scale, out, M)

        return int8_dot_dgrad

    if not isinstance(d, Int8DotWgrad):
        raise TypeError(f"grad_kernel: an Int8DotDgrad or Int8DotWgrad, got {type(d).__name__}")
    code_heads = d.code_heads

    @T.prim_func
    def int8_dot_wgrad(codes_h: T.handle, g_h: T.handle, scale_h: T.handle, out_h: T.handle,
                       partial_h: T.handle):
        T.func_attr({"global_symbol": "int8_dot_wgrad", "tirx.noalias": True})
        M = T.int32()
        nparts = T.int32()
        codes = T.match_buffer(codes_h, (code_heads, M, N), "int8")
        g = T.match_buffer(g_h, (heads, M, K), "float32")
        scale = T.match_buffer(scale_h, (1,), "float32")
        out = T.match_buffer(out_h, (heads, N, K), "float32")
        partial = T.match_buffer(partial_h, (nparts, heads, N, K), "float32")
        body(codes, g, scale, out, partial, M, nparts)

    return int8_dot_wgrad
