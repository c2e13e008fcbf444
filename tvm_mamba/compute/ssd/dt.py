"""ssd_chunk_cumsum and its backward: dt' = clamp(softplus(dt + dt_bias)) and the chunk-local cumsum of the
decay steps dt' A. Templates (see strategy.py): a task per (batch, head, chunk) forward, per (batch, head)
backward (its dA / ddt_bias sums run over every chunk in order)."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from .._common import stamp
from .common import F32, dA_passes, dA_step, dt_stages
from .dims import DtDims, dims_of
from .strategy import SERIAL, ChunkStrategy, unravel


class _Slots:
    """tmp[i] -> the element of one-element buffer i: separate scalars, not one array of 4 (one local array
    kept nvcc from registerizing it: 12 B of spills in ssd_chunk_cumsum_bwd)."""

    def __init__(self, *bufs):
        self.bufs = bufs

    def __getitem__(self, i):
        return self.bufs[i][0]


def _flags(d: DtDims) -> dict:
    return dict(has_dt_bias=d.has_dt_bias, dt_softplus=d.dt_softplus, has_dt_limit=d.has_dt_limit)


def _dt_inputs(d: DtDims, handles):
    """The extents (batch, seqlen, nchunks) and the first five parameters of both directions, (dt, dt_bias, A,
    dt_limit, dt_out), declared from their handles (named as in the builders' docstrings); absent optional ones
    are one-element placeholders."""
    batch, seqlen, nchunks = (IRBuilder.name(n, T.int32()) for n in ("batch", "seqlen", "nchunks"))
    shapes = {"dt": (batch, seqlen, d.nheads), "dt_bias": (d.nheads,) if d.has_dt_bias else (1,), "A": (d.nheads,),
              "dt_limit": (2,) if d.has_dt_limit else (1,), "dt_out": (batch, d.nheads, nchunks, d.chunk_size)}
    return (batch, seqlen, nchunks) + tuple(IRBuilder.name(n, T.match_buffer(h, shape, F32))
                                            for h, (n, shape) in zip(handles, shapes.items()))


def cumsum_template(d: DtDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_chunk_cumsum loop nest laid out by ``S`` (same parameters as the builder's PrimFunc): a task per
    (batch, head, chunk)."""
    H, Q, m, fa = d.nheads, d.chunk_size, S.math, _flags(d)
    tasks = S.tasks()

    @T.macro
    def chunk(i, dt, dt_bias, A, dt_limit, dt_out, dA_cs, seqlen, nchunks):
        acc = T.alloc_buffer((1,), F32, scope=S.scope)
        t0 = T.alloc_buffer((1,), F32, scope=S.scope)
        t1 = T.alloc_buffer((1,), F32, scope=S.scope)
        t2 = T.alloc_buffer((1,), F32, scope=S.scope)
        b, h, c = T.meta_var(unravel(i, (None, H, nchunks)))
        acc[0] = T.float32(0)
        for l in range(Q):
            t2[0] = T.float32(0)
            if c * Q + l < seqlen:
                st = T.meta_var(dt_stages(m, _Slots(t0, t1, t2, t2), dt[b, c * Q + l, h], dt_bias, h, dt_limit, **fa))
                t0[0] = st[0][1]
                t1[0] = st[1][1]
                t2[0] = st[2][1]
            dt_out[b, h, c, l] = t2[0]
            acc[0] = acc[0] + dA_step(t2[0], A[h])  # clamped: A = -inf gives decay 0, not NaN
            dA_cs[b, h, c, l] = acc[0]

    @T.prim_func
    def func(dt_h: T.handle, bias_h: T.handle, a_h: T.handle, lim_h: T.handle, dto_h: T.handle,
             dac_h: T.handle):
        batch, seqlen, nchunks, dt, dt_bias, A, dt_limit, dt_out = T.meta_var(
            _dt_inputs(d, (dt_h, bias_h, a_h, lim_h, dto_h)))
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        tasks(batch * H * nchunks, lambda i: chunk(i, dt, dt_bias, A, dt_limit, dt_out, dA_cs, seqlen, nchunks))

    return func


def cumsum_bwd_template(d: DtDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_chunk_cumsum_bwd loop nest laid out by ``S``: a task per (batch, head), its chunks in order."""
    H, Q, m, fa = d.nheads, d.chunk_size, S.math, _flags(d)
    tasks = S.tasks()

    @T.macro
    def head(i, dt, dt_bias, A, dt_limit, dt_out, ddt_out, ddA_step, ddecay, ddt, dA_part, dbias_part, seqlen,
             nchunks):
        a0 = T.alloc_buffer((1,), F32, scope=S.scope)  # d dA_step of this position
        a1 = T.alloc_buffer((1,), F32, scope=S.scope)  # dA sum
        a2 = T.alloc_buffer((1,), F32, scope=S.scope)  # ddt_bias sum
        t0 = T.alloc_buffer((1,), F32, scope=S.scope)
        t1 = T.alloc_buffer((1,), F32, scope=S.scope)
        t3 = T.alloc_buffer((1,), F32, scope=S.scope)
        b, h = T.meta_var(unravel(i, (None, H)))
        a1[0] = T.float32(0)
        a2[0] = T.float32(0)
        for c in range(nchunks):
            for lr in range(Q):
                l = T.meta_var(Q - 1 - lr)
                a0[0] = ddecay[b, h, c] + ddA_step[b, h, c, l]
                a1[0] = a1[0] + T.Select(dA_passes(dt_out[b, h, c, l], A[h]), dt_out[b, h, c, l] * a0[0],
                                         T.float32(0))
                if c * Q + l < seqlen:
                    st = T.meta_var(dt_stages(m, _Slots(t0, t1, t1, t3), dt[b, c * Q + l, h], dt_bias, h, dt_limit,
                                              **fa))
                    t0[0] = st[0][1]
                    t1[0] = st[1][1]
                    t3[0] = st[3][1]
                    ddt[b, c * Q + l, h] = (ddt_out[b, h, c, l] + T.Select(
                        dA_passes(dt_out[b, h, c, l], A[h]), A[h] * a0[0], T.float32(0))) * t3[0]
                    a2[0] = a2[0] + ddt[b, c * Q + l, h]
        dA_part[b, h] = a1[0]
        dbias_part[b, h] = a2[0]

    @T.prim_func
    def func(dt_h: T.handle, bias_h: T.handle, a_h: T.handle, lim_h: T.handle, dto_h: T.handle,
             ddto_h: T.handle, ddac_h: T.handle, ddec_h: T.handle, ddt_h: T.handle, da_h: T.handle,
             dbias_h: T.handle):
        batch, seqlen, nchunks, dt, dt_bias, A, dt_limit, dt_out = T.meta_var(
            _dt_inputs(d, (dt_h, bias_h, a_h, lim_h, dto_h)))
        ddt_out = T.match_buffer(ddto_h, (batch, H, nchunks, Q), F32)
        ddA_step = T.match_buffer(ddac_h, (batch, H, nchunks, Q), F32)
        ddecay = T.match_buffer(ddec_h, (batch, H, nchunks), F32)
        ddt = T.match_buffer(ddt_h, (batch, seqlen, H), F32)
        dA_part = T.match_buffer(da_h, (batch, H), F32)
        dbias_part = T.match_buffer(dbias_h, (batch, H), F32)
        tasks(batch * H, lambda i: head(i, dt, dt_bias, A, dt_limit, dt_out, ddt_out, ddA_step, ddecay, ddt, dA_part,
                                        dbias_part, seqlen, nchunks))

    return func


def ssd_chunk_cumsum(dims: DtDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """dt: (batch, seqlen, nheads) f32; dt_bias: (nheads,); A: (nheads,); dt_limit: (2,) f32
    -> dt_out, dA_cumsum: (batch, nheads, nchunks, chunk_size) f32.

    dt_out = clamp(softplus(dt + dt_bias)) inside the sequence, 0 past seqlen; dA_cumsum = cumsum_l dt_out A
    (each step clamped below at DA_MIN: dA_step). ``dims``: a DtDims (or its fields as keywords).
    """
    d = dims_of(DtDims, dims, kw)
    return stamp(cumsum_template(d, strategy), "ssd_chunk_cumsum")


def ssd_chunk_cumsum_bwd(dims: DtDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """dt: (batch, seqlen, nheads) f32; dt_bias, A: (nheads,); dt_limit: (2,); dt_out, ddt_out, ddA_step:
    (batch, nheads, nchunks, chunk_size) f32; ddecay: (batch, nheads, nchunks) f32 (gradient of the chunk's
    last dA_cumsum from state passing) -> ddt: (batch, seqlen, nheads) f32, dA_part, ddt_bias_part:
    (batch, nheads) f32 (summed over batch by the caller, in order).

    ddA_step is already the gradient of each step dt' A within its chunk (ssd_chunk_scan_bwd sums crossing
    pairs, no reverse cumsum here: that would carry a non-finite d dA_cs to every earlier step). With
    ddA[l] = ddecay + ddA_step[l]: d dt_out = ddt_out + A ddA; dA = sum dt_out ddA; ddt = d dt_out dt'/ddt.
    """
    d = dims_of(DtDims, dims, kw)
    return stamp(cumsum_bwd_template(d, strategy), "ssd_chunk_cumsum_bwd")
