"""ssd_bmm_chunk: cb[c, g, l, s] = C_l . B_s within each chunk, once per (batch, chunk, group) and shared by the
group's heads (upstream's _bmm_chunk_fwd). A template laid out by the strategy's ``matmul_rows`` (strategy.py: a
task per output on CUDA, the staged register-blocked matmul on a CPU)."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, ld
from .dims import BmmDims, dims_of
from .strategy import SERIAL, Strategy


def bmm_template(d: BmmDims, S: Strategy) -> tirx.PrimFunc:
    """The ssd_bmm_chunk kernel laid out by ``S``: task t = (batch, chunk, group), out[l, s] = sum_n C[l, n] B[s, n]
    (positions past seqlen read as zero rows)."""
    G, N, Q = d.ngroups, d.dstate, d.chunk_size
    run = S.matmul_rows(Q, Q, N)

    def row(buf, nchunks, seqlen):  # buf's row l of task t's chunk, as float32 (0 past seqlen)
        return lambda t, l, n: ld(buf, (t // (nchunks * G), T.min(t // G % nchunks * Q + l, seqlen - 1), t % G, n),
                                  seqlen, t // G % nchunks * Q + l)

    @T.prim_func
    def func(b_h: T.handle, c_h: T.handle, cb_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        Bm = T.match_buffer(b_h, (batch, seqlen, G, N), d.bc_dtype)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), d.bc_dtype)
        cb = T.match_buffer(cb_h, (batch, nchunks, G, Q, Q), F32)
        run(batch * nchunks * G, row(Cm, nchunks, seqlen), row(Bm, nchunks, seqlen),
            lambda t, l, s, v: T.buffer_store(cb, v, [t // (nchunks * G), t // G % nchunks, t % G, l, s]))

    return func


def ssd_bmm_chunk(dims: BmmDims | None = None, strategy: Strategy = SERIAL, **kw) -> tirx.PrimFunc:
    """B, C: (batch, seqlen, ngroups, dstate) -> cb: (batch, nchunks, ngroups, chunk_size, chunk_size) f32.

    cb[c, g, l, s] = C_l . B_s within chunk c (positions past seqlen count as zero rows): computed once per
    group and shared by its heads (the causal / sequence masks are applied by the consumers); the full Q x Q
    block is computed. The CPU strategy's knobs rows x cols x order: the matmul's register block (mm.py).
    """
    d = dims_of(BmmDims, dims, kw)
    return stamp(bmm_template(d, strategy), "ssd_bmm_chunk", d.stamp_static())
