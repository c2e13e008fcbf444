"""Chunked (parallel-in-time) forward, for long sequences with little batch x dim parallelism.

Same parameters and outputs as the forward (out, last_state, and the checkpoints = the state before every
``chunk`` steps, which the backward recomputes from), in three passes:

1. local scans, parallel over (lane, chunk): from a zero state, S_c = the chunk's end state, and
   L_c = sum_t dt_t A (the log of the chunk's decay; exp(L_c) may underflow to 0, which is exact enough:
   no division by a running decay anywhere, so it is stable at any length);
2. carry, parallel over lanes, serial over chunks: H_0 = initial state, checkpoint_c = H_c,
   H_{c+1} = exp(L_c) * H_c + S_c (the recurrence is linear in h), last_state = H_nchunk;
3. fix-up, parallel over (lane, chunk): rerun each chunk from its checkpoint and write the outputs (the
   forward template's step and time-batched chunk halves).

The recurrence runs twice, spread over lanes x chunks instead of lanes (1.5x the core time of the
dstate-layout sequential scan, 2.5x that of the channels layout): it pays when batch x dim lanes cannot
keep the cores busy (the torch op dispatches on that, torch_ops/selective_scan.py). Layouts with one
thread per lane only (serial, CPU); CUDA uses the sequential scan.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanDims
from ._layout import Layout
from ._signature import scan_kernel
from ._step import ScanMath
from .fwd import _chunk_macros, step_macro


def _passes(dims: ScanDims, L: Layout, sm: ScanMath):
    N, chunk, ACC, m = dims.dstate, dims.chunk, dims.acc, sm.m
    chunk_dt, chunk_out = _chunk_macros(dims, L, sm)
    step = step_macro(dims, L, sm)

    @T.macro
    def local_scan(u, delta, db, A, Bm, ck, logdec, seqlen, b, d, c):
        """Pass 1: S_c into ck[c], L_c into logdec[c]."""
        h = T.alloc_buffer((N,), ACC)
        lg = T.alloc_buffer((N,), ACC)
        s = T.alloc_buffer((2,), ACC)
        dtb = T.alloc_buffer((chunk,), ACC)
        NT = T.min(seqlen - c * chunk, chunk)  # a let: bound analysis of the meta_var form overflows
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                h[L.reg(ko, ki)] = m.zero
                lg[L.reg(ko, ki)] = m.zero
        chunk_dt(delta, db, dtb, b, d, c, NT)
        for i in range(NT):
            s[0] = dtb[i]
            s[1] = s[0] * m.cast(u[b, d, c * chunk + i])
            for ko in L.st_outer(N):
                for ki in L.st_inner():
                    h[L.reg(ko, ki)] = sm.h_next(m.exp(s[0] * A[d, L.state(ko, ki, 0)]), h[L.reg(ko, ki)], s[1],
                                                 sm.B(Bm, b, d, c * chunk + i, L.state(ko, ki, 0)))
                    lg[L.reg(ko, ki)] = lg[L.reg(ko, ki)] + s[0] * A[d, L.state(ko, ki, 0)]
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                ck[b, d, c, L.state(ko, ki, 0)] = h[L.reg(ko, ki)]
                logdec[b, d, c, L.state(ko, ki, 0)] = lg[L.reg(ko, ki)]

    @T.macro
    def carry(init, ck, logdec, last, nchunk, b, d):
        """Pass 2: ck[c] <- H_c (the checkpoints), H_{c+1} = exp(L_c) H_c + S_c."""
        hc = T.alloc_buffer((N,), ACC)
        loc = T.alloc_buffer((N,), ACC)
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                hc[L.reg(ko, ki)] = init[b, d, L.state(ko, ki, 0)] if dims.has_init else m.zero
        for c in range(nchunk):
            for ko in L.st_outer(N):
                for ki in L.st_inner():
                    loc[L.reg(ko, ki)] = ck[b, d, c, L.state(ko, ki, 0)]
                    ck[b, d, c, L.state(ko, ki, 0)] = hc[L.reg(ko, ki)]
                    # the recurrence over a whole chunk: exp(L_c) H_c + S_c
                    r = T.meta_var(L.reg(ko, ki))
                    hc[r] = m.exp(logdec[b, d, c, L.state(ko, ki, 0)]) * hc[r] + loc[r]
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                last[b, d, L.state(ko, ki, 0)] = hc[L.reg(ko, ki)]

    @T.macro
    def fixup(u, delta, db, A, Bm, Cm, Dv, z, ck, out, seqlen, b, d, c):
        """Pass 3: chunk c again from its checkpoint, writing the outputs."""
        h = T.alloc_buffer((N, 1), ACC)
        yv = T.alloc_buffer((1, L.V), ACC)
        s = T.alloc_buffer((3,), ACC)
        dtb = T.alloc_buffer((chunk,), ACC)
        yb = T.alloc_buffer((chunk,), ACC)
        NT = T.min(seqlen - c * chunk, chunk)  # a let: bound analysis of the meta_var form overflows
        for ko in L.st_outer(N):
            for ki in L.st_inner():
                h[L.reg(ko, ki), 0] = ck[b, d, c, L.state(ko, ki, 0)]
        chunk_dt(delta, db, dtb, b, d, c, NT)
        for i in range(NT):
            s[0] = dtb[i]
            step(u, A, Bm, Cm, Dv, A, Bm, Cm, h, yv, s, b, d, c * chunk + i, 0)
            yb[i] = s[2]
        chunk_out(u, Dv, z, out, yb, b, d, c, NT)

    return local_scan, carry, fixup


def fwd_chunked_template(dims: ScanDims, L: Layout) -> tirx.PrimFunc:
    """The three-pass loop nest of ``dims`` (one-thread-per-lane layout ``L``)."""
    N, ACC, dim = dims.dstate, dims.acc, dims.dim
    local_scan, carry, fixup = _passes(dims, L, ScanMath(dims, L.math))

    @T.macro
    def body(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, batch, seqlen, nchunk):
        # pass 1 writes S_c into ck[c] and L_c into logdec[c]; pass 2 turns ck into the checkpoints in place
        logdec = T.alloc_buffer((batch, dim, nchunk, N), ACC)
        for lc in L.block_loop(batch * dim * nchunk):
            local_scan(u, delta, db, A, Bm, ck, logdec, seqlen, lc // (dim * nchunk), lc // nchunk % dim,
                       lc % nchunk)
        for lane in L.block_loop(batch * dim):
            carry(init, ck, logdec, last, nchunk, lane // dim, lane % dim)
        for lc in L.block_loop(batch * dim * nchunk):
            fixup(u, delta, db, A, Bm, Cm, Dv, z, ck, out, seqlen, lc // (dim * nchunk), lc // nchunk % dim,
                  lc % nchunk)

    return scan_kernel(dims, L, body)
