"""ssd_bmm_chunk: cb[c, g, l, s] = C_l . B_s (s <= l; 0 above the diagonal) within each chunk, once per (batch,
chunk, group) and shared by the group's heads (upstream's _bmm_chunk_fwd; every consumer reads the causal pairs
only: the chunk scan and its backward, Mamba-3's strict / grouped ones). A template laid out by the strategy's
``matmul_rows`` with ``lower`` (strategy.py: the CUDA tiles above the diagonal skip their product, the CPU's
staged register-blocked matmul computes the whole block)."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, ld
from .dims import BmmDims, dims_of
from .strategy import SERIAL, ChunkStrategy


def bmm_template(d: BmmDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_bmm_chunk kernel laid out by ``S``: task t = (batch, chunk, group), out[l, s] = sum_n C[l, n] B[s, n]
    for s <= l, 0 for s > l (positions past seqlen read as zero rows)."""
    G, N, Q = d.ngroups, d.dstate, d.chunk_size
    run = S.matmul_rows(Q, Q, N, lower=True)

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
            lambda t, l, s, v: T.buffer_store(cb, T.Select(s <= l, v, T.float32(0)),
                                              [t // (nchunks * G), t // G % nchunks, t % G, l, s]))

    return func


def ssd_bmm_chunk(dims: BmmDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """B, C: (batch, seqlen, ngroups, dstate) -> cb: (batch, nchunks, ngroups, chunk_size, chunk_size) f32.

    cb[c, g, l, s] = C_l . B_s within chunk c for s <= l, 0 above the diagonal (positions past seqlen count as
    zero rows): computed once per group and shared by its heads (the decay / sequence masks are applied by the
    consumers, which read the causal pairs only). The CPU strategy's knobs rows x cols x order: the matmul's
    register block (mm.py).
    """
    d = dims_of(BmmDims, dims, kw)
    return stamp(bmm_template(d, strategy), "ssd_bmm_chunk")
