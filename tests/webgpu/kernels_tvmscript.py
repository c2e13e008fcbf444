"""Two hand-written GPU kernels for the WebGPU launcher's tests (tests/webgpu/test_launcher.py,
tests/runtime/test_webgpu_host.py): a block-parallel map over a dynamic length, and an in-place update of the
rows of a strided pool named by an index tensor."""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

THREADS = 64


@T.prim_func
def scaled(x_h: T.handle, y_h: T.handle):
    """y[i] = 2 x[i] + i // 64 (the block index): a block of 64 threads per 64 elements."""
    T.func_attr({"global_symbol": "scaled", "tirx.noalias": True})
    n = T.int32()
    x = T.match_buffer(x_h, (n,), "float32")
    y = T.match_buffer(y_h, (n,), "float32")
    for b in T.thread_binding((n + THREADS - 1) // THREADS, thread="blockIdx.x"):
        for t in T.thread_binding(THREADS, thread="threadIdx.x"):
            if b * THREADS + t < n:
                y[b * THREADS + t] = x[b * THREADS + t] * T.float32(2) + T.Cast("float32", b)


@T.prim_func
def bump_rows(s_h: T.handle, i_h: T.handle):
    """pool[idx[b], d] += 1 for every row b of idx and d < dim (dim <= 32); the pool's rows ``slot_stride``
    apart (a strided view)."""
    T.func_attr({"global_symbol": "bump_rows", "tirx.noalias": True})
    pool = T.int32()
    dim = T.int32()
    slot_stride = T.int32()
    rows = T.int32()
    s = T.match_buffer(s_h, (pool, dim), "float32", strides=(slot_stride, 1))
    idx = T.match_buffer(i_h, (rows,), "int32")
    for b in T.thread_binding(rows, thread="blockIdx.x"):
        for d in T.thread_binding(32, thread="threadIdx.x"):
            if d < dim:
                s[idx[b], d] = s[idx[b], d] + T.float32(1)


def module(func) -> tvm.IRModule:
    return tvm.IRModule({func.attrs["global_symbol"]: func})
