"""SSD per-chunk backward kernel (every gradient of one chunk; see the package docstring): one template whose
math is written once (scan_bwd_spec.py: the gradients, and each piece's summand, range and order as a spec),
laid out by the strategy (strategy.py) in one of two forms that execute those specs.

The two forms (``S.vector``): a task per (batch, chunk, group, part) that runs the part's heads in order on
staged operands (scan_bwd_task.py: the CPU, knobs rows / cols / order), each product spec an mm.py
register-blocked matmul and the per-step sums its row pass; or a task per output element, one launch per
piece, a later launch reading what an earlier one finished (scan_bwd_launch.py: CUDA's threads, serial for
tests), each spec a loop per output element. Both read the operands through a reader (the spec's interface:
staged rows, or global memory), share the masks and decays of common.py, and take every sum in the spec's
order; they differ in the last bits only: exp / silu are the target's (``S.math``) and the compilers contract
multiply-adds differently.

``diag_skip`` (Mamba-3, the forward's ScanDims.diag_skip) and ``step_group``: the strict / grouped causal sums
(scan_bwd_spec.py); D and dD per position, D[b, h, c, s] (dt_out's layout).
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, I32, Z4, d_shape
from .dims import ScanBwdDims, dims_of
from .strategy import SERIAL, ChunkStrategy


def chunk_scan_bwd_template(d: ScanBwdDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_chunk_scan_bwd kernel laid out by ``S`` (parameters: ``ssd_chunk_scan_bwd``): the pieces run on
    staged operands per (batch, chunk, group, part) task where the strategy owns whole lane axes (a CPU), else
    a launch per piece, a task per output element."""
    from .scan_bwd_launch import launches
    from .scan_bwd_task import task_body

    H, G, P, N, Q = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size
    xd, bcd = d.x_dtype, d.bc_dtype
    body = task_body(d, S) if S.vector else launches(d, S)

    @T.prim_func
    def func(x_h: T.handle, z_h: T.handle, dy_h: T.handle, b_h: T.handle, c_h: T.handle, cb_h: T.handle,
             dto_h: T.handle, dac_h: T.handle, sin_h: T.handle, dso_h: T.handle, d_h: T.handle, s_h: T.handle,
             dx_h: T.handle, db_h: T.handle, dc_h: T.handle, ddto_h: T.handle, ddac_h: T.handle, dd_h: T.handle,
             ws_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        gparts = T.int32()  # groups x parts of their heads (compute.ssd.head_parts)
        x = T.match_buffer(x_h, (batch, seqlen, H, P), xd)
        z = T.match_buffer(z_h, (batch, seqlen, H, P) if d.has_z else Z4, xd)
        dy = T.match_buffer(dy_h, (batch, seqlen, H, P), xd)
        Bm = T.match_buffer(b_h, (batch, seqlen, G, N), bcd)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), bcd)
        cbg = T.match_buffer(cb_h, (batch, nchunks, G, Q, Q), F32)  # C_l . B_s (ssd_bmm_chunk)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        sin = T.match_buffer(sin_h, (batch, nchunks, H, P, N), F32)
        dso = T.match_buffer(dso_h, (batch, nchunks, H, P, N), F32)
        Dm = T.match_buffer(d_h, d_shape(d, batch, nchunks), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        dx = T.match_buffer(dx_h, (batch, seqlen, H, P), xd)
        dBp = T.match_buffer(db_h, (batch, seqlen, gparts, N), F32)
        dCp = T.match_buffer(dc_h, (batch, seqlen, gparts, N), F32)
        ddt_out = T.match_buffer(ddto_h, (batch, H, nchunks, Q), F32)
        ddA_step = T.match_buffer(ddac_h, (batch, H, nchunks, Q), F32)
        dD_part = T.match_buffer(dd_h, _dd_shape(d, batch, nchunks), F32)
        gsum = T.match_buffer(ws_h, (batch, nchunks, gparts, Q, Q), F32)  # workspace: sum over a part of gx K dt
        o = T.meta_var(SimpleNamespace(
            batch=batch, seqlen=seqlen, nchunks=nchunks, gparts=gparts, x=x, z=z, dy=dy, Bm=Bm, Cm=Cm, cbg=cbg,
            dt_out=dt_out, dA_cs=dA_cs, sin=sin, dso=dso, Dm=Dm, seq_idx=seq_idx, dx=dx, dBp=dBp, dCp=dCp,
            ddt_out=ddt_out, ddA_step=ddA_step, dD_part=dD_part, gsum=gsum))
        body(o)

    return func


def _dd_shape(d: ScanBwdDims, batch, nchunks):
    """dD_part's shape: per (batch, chunk) partials of D's gradient per (head, headdim) (summed by the torch op),
    per position with diag_skip (D's own layout), or a placeholder without D."""
    if d.diag_skip:
        return (batch, d.nheads, nchunks, d.chunk_size)
    return (batch, nchunks, d.nheads, d.headdim) if d.has_D else Z4


def ssd_chunk_scan_bwd(dims: ScanBwdDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """x, z, dy: (batch, seqlen, nheads, headdim); B, C: (batch, seqlen, ngroups, dstate); cb: (batch, nchunks,
    ngroups, chunk_size, chunk_size) f32 (C.B^T, ssd_bmm_chunk); dt_out, dA_cumsum:
    (batch, nheads, nchunks, chunk_size) f32; states_in, dstates_out: (batch, nchunks, nheads, headdim,
    dstate) f32; D: (nheads,) / (nheads, headdim), with diag_skip (batch, nheads, nchunks, chunk_size) f32;
    seq_idx: (batch, seqlen)
    -> dx: (batch, seqlen, nheads, headdim); dB_parts, dC_parts: (batch, seqlen, gparts, dstate) f32;
    ddt_out, ddA_step: (batch, nheads, nchunks, chunk_size) f32; dD_part: (batch, nchunks, nheads, headdim)
    (summed over batch and chunks, and over headdim for D per head, by the caller), with diag_skip
    (batch, nheads, nchunks, chunk_size): dD_part[b, h, c, l] = sum_p g[l, p] x[l, p] (0 past seqlen), D's own
    gradient; gsum (workspace, written then read): (batch, nchunks, gparts, chunk_size, chunk_size) f32.

    diag_skip (Mamba-3; dims.ScanBwdDims): every intra-chunk causal term runs over s < l (module docstring).

    gparts = ngroups * hparts (module docstring): hparts = 1 gives the group's dB / dC themselves. The CPU
    strategy's knobs rows x cols x order: the register block of the chunk matmuls (mm.py).
    """
    d = dims_of(ScanBwdDims, dims, kw)
    return stamp(chunk_scan_bwd_template(d, strategy), "ssd_chunk_scan_bwd")
