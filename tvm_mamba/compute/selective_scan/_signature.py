"""The scan kernels' signatures, written once (shapes: ``selective_scan_fwd`` / ``selective_scan_bwd``).

Every forward kernel (fwd, fwd_chunked, fwd_complex) takes (u, delta, A, B, C, D, z, delta_bias,
initial_state) and writes (out, last_state, checkpoints); every backward (bwd, bwd_complex) takes the same
inputs plus (checkpoints, dout, dlast) and writes the gradients (each the shape of its input) and one
workspace ``ws`` in the accumulation dtype (``bwd_workspace``). Its four regions (wsA, wsB, wsC, wsS: the
partials stage 2 sums) are buffers declared over that one allocation, so a GPU kernel binds one buffer for
them: WebGPU caps the storage buffers of one shader (8 by default, 16 on llvmpipe) and the backward's
first kernel binds 16 (u, delta, A, B, C, D, z, delta_bias, checkpoints, dout, dlast, du, ddelta, dz,
dinit, ws; four workspaces made it 19). A complex A adds a trailing (re, im) axis of 2 (``pair``) to A,
B, C and every state, and keeps a time-invariant B / C in the accumulation dtype. A template supplies only
its body: a macro called with the matched buffers (the four regions each as a buffer), then batch, seqlen
and nchunk (the checkpoint count, ``L.nchunk``).
"""
from __future__ import annotations


import tvm
from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanDims, bwd_workspace
from ._layout import Layout


def _views_into_kernels(func: tirx.PrimFunc, names: tuple) -> tirx.PrimFunc:
    """``func`` with the views ``names`` (declared first thing in its body) declared again at the top of
    each GPU kernel (each outermost thread-bound loop) instead; unchanged where no loop is thread-bound
    (CPU, serial). Why: TVM's SplitHostDevice gives a kernel one parameter per outside *buffer* it reads,
    not one per allocation, so the four views declared outside bound four storage buffers (stage 1: 18 of
    WebGPU's 16); declared inside, the kernel's one parameter is their allocation ``ws``. ConvertSSA makes
    each kernel's declarations fresh buffers (one buffer declared twice is ill-formed)."""
    seq = list(func.body.seq)
    decls = [s for s in seq if isinstance(s, tirx.DeclBuffer) and s.buffer.name in names]
    assert len(decls) == len(names), "the views are declared first thing in the body"
    found = []

    def kernels(stmt):  # stmt with ``decls`` at the top of each outermost thread-bound loop in it
        if isinstance(stmt, tirx.For):
            if stmt.kind == tirx.ForKind.THREAD_BINDING:
                found.append(stmt)
                body = tirx.SeqStmt(decls + [stmt.body])
            else:
                body = kernels(stmt.body)
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
                            stmt.annotations, stmt.step)
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([kernels(s) for s in stmt.seq])
        if isinstance(stmt, tirx.IfThenElse):
            return tirx.IfThenElse(stmt.condition, kernels(stmt.then_case),
                                   kernels(stmt.else_case) if stmt.else_case is not None else None)
        return stmt

    body = tirx.SeqStmt([kernels(s) for s in seq if not any(s.same_as(d) for d in decls)])
    if not found:
        return func
    return tirx.transform.ConvertSSA()(tvm.IRModule({"main": func.with_body(body)}))["main"]


def scan_kernel(dims: ScanDims, L: Layout, body, backward: bool = False, pair: tuple = ()) -> tirx.PrimFunc:
    """The PrimFunc of a forward (or, ``backward``, a backward) scan kernel whose loop nest is ``body``."""
    N, dim, chunk, ACC, UT, P = dims.dstate, dims.dim, dims.chunk, dims.acc, dims.u_dtype, tuple(pair)
    VARB, VARC = dims.varying_B, dims.varying_C
    BT = dims.B_dtype if VARB or not P else ACC  # a complex time-invariant B / C is complex in acc
    CT = dims.C_dtype if VARC or not P else ACC
    opt = lambda cond, shape: shape if cond else (1,) * len(shape)  # noqa: E731  (absent input placeholder)

    def bc(groups, batch, seqlen):
        """B / C: (batch, groups, seqlen, dstate) time-varying, else (dim, dstate) (+ pair)."""
        return (batch, groups, seqlen, N, *P) if groups else (dim, N, *P)

    @T.macro
    def declare(h, batch, seqlen):  # h: the kernel's handles, in signature order
        nchunk = T.meta_var(L.nchunk(seqlen, chunk))  # checkpoints: the state before each chunk
        u = T.match_buffer(h[0], (batch, dim, seqlen), UT)
        delta = T.match_buffer(h[1], (batch, dim, seqlen), UT)
        A = T.match_buffer(h[2], (dim, N, *P), ACC)
        Bm = T.match_buffer(h[3], bc(dims.b_groups, batch, seqlen), BT)
        Cm = T.match_buffer(h[4], bc(dims.c_groups, batch, seqlen), CT)
        Dv = T.match_buffer(h[5], opt(dims.has_D, (dim,)), ACC)
        z = T.match_buffer(h[6], opt(dims.has_z, (batch, dim, seqlen)), UT)
        db = T.match_buffer(h[7], opt(dims.has_delta_bias, (dim,)), ACC)
        init = T.match_buffer(h[8], opt(dims.has_init, (batch, dim, N, *P)), ACC)
        if backward:
            ck = T.match_buffer(h[9], (batch, dim, nchunk, N, *P), ACC)
            dout = T.match_buffer(h[10], (batch, dim, seqlen), UT)
            dlast = T.match_buffer(h[11], (batch, dim, N, *P), ACC)
            # the gradients: each the shape and dtype of its input
            du = T.match_buffer(h[12], u.shape, UT)
            ddelta = T.match_buffer(h[13], delta.shape, UT)
            dA = T.match_buffer(h[14], A.shape, ACC)
            dB = T.match_buffer(h[15], Bm.shape, BT)
            dC = T.match_buffer(h[16], Cm.shape, CT)
            dD = T.match_buffer(h[17], Dv.shape, ACC)
            ddb = T.match_buffer(h[18], db.shape, ACC)
            dz = T.match_buffer(h[19], z.shape, UT)
            dinit = T.match_buffer(h[20], init.shape, ACC)
            regions, size = T.meta_var(bwd_workspace(dims, batch, seqlen, P))  # (dims: a ScanBwdDims here)
            ws = T.match_buffer(h[21], (size,), ACC)
            wsA = T.decl_buffer(regions[0][0], ACC, data=ws.data, elem_offset=regions[0][1])
            wsB = T.decl_buffer(regions[1][0], ACC, data=ws.data, elem_offset=regions[1][1])
            wsC = T.decl_buffer(regions[2][0], ACC, data=ws.data, elem_offset=regions[2][1])
            wsS = T.decl_buffer(regions[3][0], ACC, data=ws.data, elem_offset=regions[3][1])
            body(u, delta, A, Bm, Cm, Dv, z, db, init, ck, dout, dlast, du, ddelta, dA, dB, dC, dD, ddb, dz, dinit,
                 wsA, wsB, wsC, wsS, batch, seqlen, nchunk)
        else:
            out = T.match_buffer(h[9], (batch, dim, seqlen), UT)
            last = T.match_buffer(h[10], (batch, dim, N, *P), ACC)
            ck = T.match_buffer(h[11], (batch, dim, nchunk, N, *P), ACC)
            body(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, batch, seqlen, nchunk)

    if backward:
        @T.prim_func
        def bwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
                z_h: T.handle, db_h: T.handle, init_h: T.handle, ck_h: T.handle, dout_h: T.handle, dlast_h: T.handle,
                du_h: T.handle, ddelta_h: T.handle, dA_h: T.handle, dB_h: T.handle, dC_h: T.handle, dD_h: T.handle,
                ddb_h: T.handle, dz_h: T.handle, dinit_h: T.handle, ws_h: T.handle):
            batch = T.int32()
            seqlen = T.int32()
            declare((u_h, delta_h, A_h, B_h, C_h, D_h, z_h, db_h, init_h, ck_h, dout_h, dlast_h, du_h, ddelta_h, dA_h,
                     dB_h, dC_h, dD_h, ddb_h, dz_h, dinit_h, ws_h), batch, seqlen)

        return _views_into_kernels(bwd, ("wsA", "wsB", "wsC", "wsS"))

    @T.prim_func
    def fwd(u_h: T.handle, delta_h: T.handle, A_h: T.handle, B_h: T.handle, C_h: T.handle, D_h: T.handle,
            z_h: T.handle, db_h: T.handle, init_h: T.handle, out_h: T.handle, last_h: T.handle, ck_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        declare((u_h, delta_h, A_h, B_h, C_h, D_h, z_h, db_h, init_h, out_h, last_h, ck_h), batch, seqlen)

    return fwd
