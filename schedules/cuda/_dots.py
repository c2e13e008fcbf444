"""The CUDA form of the SSD strategy's ``position_dots`` (compute/ssd/strategy.py: ssd_chunk_scan_bwd's
per-position <x_s, dSo B_s> and <g_s, C_s Sin>, scan_bwd_launch.py): a block per task (batch, chunk, head), a
thread per chunk position.

Thread s keeps its row u_s (headdim values) in registers; the task's headdim x dstate matrix is staged in shared
memory ``SLICE`` columns of dstate at a time (every thread reads the same element: a broadcast) and each thread
forms u_s . m[:, n] and adds v(s, n) times it, n ascending: every operand element is read from global memory
once per task (the per-position launch read the whole matrix once per position).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ._tiled import _buffers, largest_divisor

SLICE = 32  # dstate columns staged per round (headdim x 32 floats: 8 KB at headdim 64)


def position_dots(Q: int, P: int, N: int):
    """The strategy's ``position_dots`` run (strategy.py), a block of Q threads per task."""
    NS = largest_divisor(N, SLICE)
    copies = (P * NS + Q - 1) // Q

    @T.macro
    def run(extent, u, v, m, store):
        for bx in T.thread_binding(extent, thread="blockIdx.x"):
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)  # (_tiled.py: MIN_BLOCKS)
            sh = T.meta_var(_buffers("shared", m=(P * NS,)))
            for tx in T.thread_binding(Q, thread="threadIdx.x"):
                reg = T.meta_var(_buffers("local", ur=(P,), acc=(2,)))
                for p in T.unroll(P):
                    reg.ur[p] = u(bx, tx, p)
                reg.acc[0] = T.float32(0)
                for no in range(N // NS):
                    for e in T.unroll(copies):  # m[:, no NS : (no + 1) NS], consecutive threads on n
                        if e * Q + tx < P * NS:
                            sh.m[e * Q + tx] = m(bx, (e * Q + tx) // NS, no * NS + (e * Q + tx) % NS)
                    T.tvm_storage_sync("shared")
                    for n in range(NS):
                        reg.acc[1] = T.float32(0)
                        for p in T.unroll(P):
                            reg.acc[1] = reg.acc[1] + reg.ur[p] * sh.m[p * NS + n]
                        reg.acc[0] = reg.acc[0] + v(bx, tx, no * NS + n) * reg.acc[1]
                    T.tvm_storage_sync("shared")
                store(bx, tx, reg.acc[0])

    return run
