"""SSD chunk-scan kernel (forward); see the package docstring for the algorithm.

ssd_chunk_scan is one template for every target (``chunk_scan_template``: its math written once, laid out by
the strategy's ``causal_matmul``). Positions past seqlen read as zeros (their dt_out is 0 too), so the ragged
last chunk needs no special case inside the matmuls.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, I32, Z4, batch_sids, carried_decay, d_per_row, d_shape, ld, seg_exp_of, skip_at
from .dims import ScanDims, dims_of
from .strategy import SERIAL, ChunkStrategy


def _task(t, nchunks, H):
    """Task t of the chunk scan -> (batch, chunk, head)."""
    return t // (nchunks * H), t // H % nchunks, t % H


def _pos(c, l, Q, seqlen):
    """Chunk position l as a sequence index clamped into range (the loads past seqlen are masked)."""
    return tirx.min(c * Q + l, seqlen - 1)


def _row(buf, task, l, head, j, Q, seqlen):
    """buf[b, c Q + l, head, j] of task (b, c, h) as float32, 0 past seqlen."""
    b, c, _ = task
    return ld(buf, (b, _pos(c, l, Q, seqlen), head, j), seqlen, c * Q + l)


def _positions(d: ScanDims, dA_cs, dt_out, seq_idx, Dm, nchunks, H, seqlen):
    """The per-position values the weights and the carry read, as (reader(t, q), dtype) pairs of task t's chunk
    position q: dA_cs, dt_out, with seq_idx the sequence id, and D where ``d_per_row`` (last: D[h] is the same
    at every position, but staged with the row's values a block reads it once per row instead of once per
    output). A strategy may stage them per tile."""
    Q = d.chunk_size
    pos = [(lambda t, q: dA_cs[t // (nchunks * H), t % H, t // H % nchunks, q], F32),
           (lambda t, q: dt_out[t // (nchunks * H), t % H, t // H % nchunks, q], F32)]
    if d.has_seq_idx:
        pos.append((lambda t, q: seq_idx[t // (nchunks * H), _pos(t // H % nchunks, q, Q, seqlen)], I32))
    if d_per_row(d) and d.diag_skip:
        pos.append((lambda t, q: Dm[t // (nchunks * H), t % H, t // H % nchunks, q], F32))
    elif d_per_row(d):
        pos.append((lambda t, q: Dm[t % H], F32))
    return tuple(pos)


def _carry(m, d: ScanDims, seq_idx, Dm, task, l, p, seqlen, v, xv, vl, fold: bool):
    """e[l] (C_l Sin)[p] + D x[l, p] (v = (C_l Sin)[p], xv = x[l, p], vl: ``_positions`` at l, D its last value
    where ``d_per_row``; ``fold``: D x is the weights' diagonal term instead), e[l] = exp(dA_cs[l]) masked by
    common.carried_decay (0 where the carried state belongs to another sequence than position l)."""
    b, c, h = task
    Q = d.chunk_size
    sid = vl[2] if d.has_seq_idx else seq_idx[b, _pos(c, l, Q, seqlen)]
    e = carried_decay(m, vl[0], sid, batch_sids(seq_idx, b), c, Q, d.has_seq_idx)
    if d_per_row(d):
        return e * v if fold else e * v + vl[-1] * xv
    return e * v + skip_at(d, Dm, b, h, c, l, p, xv) if d.has_D else e * v


def _weight(m, d: ScanDims, cb, task, l, s, vl, vs, fold: bool):
    """(C_l.B_s) exp(dA_cs[l] - dA_cs[s]) dt'[s] for s <= l in the same sequence, else 0 (the decay masked
    before the exp; vl / vs: ``_positions`` at l / s); ``fold``: plus D (vl's last value) on the diagonal."""
    b, c, h = task
    sids = (vl[2], vs[2]) if d.has_seq_idx else None
    w = cb[b, c, h // d.heads_per_group, l, s] * seg_exp_of(m, vl[0], vs[0], sids, l, s) * vs[1]
    return w + T.Select(l == s, vl[-1], T.float32(0)) if fold else w  # (w once: a Select of two sums held two exps)


def _put(m, d: ScanDims, y, y_pre, z, task, l, p, v):
    """y = v silu(z) and y_pre = v with z, else y = v (in x's dtype), at position l of the task's chunk."""
    b, c, h = task
    idx = [b, c * d.chunk_size + l, h, p]
    if d.has_z:
        T.buffer_store(y_pre, v.astype(d.x_dtype), idx)
        T.buffer_store(y, (v * m.silu(z[idx].astype(F32))).astype(d.x_dtype), idx)
    else:
        T.buffer_store(y, v.astype(d.x_dtype), idx)


def chunk_scan_template(d: ScanDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_chunk_scan kernel laid out by ``S``: task t = (batch, chunk, head), its chunk_size x headdim
    output by the strategy's ``causal_matmul`` (strategy.py): y0[l, p] = e[l] (C_l Sin)[p] + D x[l, p]
    + sum_{s<=l} w[l, s] x[s, p], w = (C.B^T) exp(segsum) dt' (D per row: D x as w's diagonal term where the
    strategy ``folds_diagonal``); then the z gate. Positions past seqlen read as 0
    and are not stored."""
    H, G, P, N, Q, R, m = d.nheads, d.ngroups, d.headdim, d.dstate, d.chunk_size, d.heads_per_group, S.math
    run = S.causal_matmul(Q, P, N, strict=d.diag_skip, group=d.step_group)
    fold = d_per_row(d) and S.folds_diagonal(Q, P, N, strict=d.diag_skip, group=d.step_group)

    @T.prim_func
    def func(x_h: T.handle, z_h: T.handle, cb_h: T.handle, c_h: T.handle, dto_h: T.handle, dac_h: T.handle,
             sin_h: T.handle, d_h: T.handle, s_h: T.handle, y_h: T.handle, yp_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        x = T.match_buffer(x_h, (batch, seqlen, H, P), d.x_dtype)
        z = T.match_buffer(z_h, (batch, seqlen, H, P) if d.has_z else Z4, d.x_dtype)
        cb = T.match_buffer(cb_h, (batch, nchunks, G, Q, Q), F32)  # C_l . B_s (ssd_bmm_chunk)
        Cm = T.match_buffer(c_h, (batch, seqlen, G, N), d.bc_dtype)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        sin = T.match_buffer(sin_h, (batch, nchunks, H, P, N), d.state_dtype)
        Dm = T.match_buffer(d_h, d_shape(d, batch, nchunks), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        y = T.match_buffer(y_h, (batch, seqlen, H, P), d.x_dtype)
        y_pre = T.match_buffer(yp_h, (batch, seqlen, H, P) if d.has_z else Z4, d.x_dtype)
        run(batch * nchunks * H,
            lambda t: T.min(Q, seqlen - t // H % nchunks * Q),
            lambda t: t // H % nchunks > 0 if not d.has_init else True,  # without initial states Sin[c=0] = 0
            lambda t, l, n: _row(Cm, _task(t, nchunks, H), l, t % H // R, n, Q, seqlen),
            lambda t, n, p: sin[t // (nchunks * H), t // H % nchunks, t % H, p, n].astype(F32),
            lambda t, l, p, v, xv, vl: _carry(m, d, seq_idx, Dm, _task(t, nchunks, H), l, p, seqlen, v, xv, vl,
                                              fold),
            lambda t, l, s, vl, vs: _weight(m, d, cb, _task(t, nchunks, H), l, s, vl, vs, fold),
            lambda t, s, p: _row(x, _task(t, nchunks, H), s, t % H, p, Q, seqlen),
            lambda t, l, p, v: _put(m, d, y, y_pre, z, _task(t, nchunks, H), l, p, v),
            _positions(d, dA_cs, dt_out, seq_idx, Dm, nchunks, H, seqlen))

    return func


def ssd_chunk_scan(dims: ScanDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """x, z: (batch, seqlen, nheads, headdim); cb: (batch, nchunks, ngroups, chunk_size, chunk_size) f32 (C.B^T,
    ssd_bmm_chunk); C: (batch, seqlen, ngroups, dstate); dt_out, dA_cumsum: (batch, nheads, nchunks, chunk_size)
    f32; states_in: (batch, nchunks, nheads, headdim, dstate) in state_dtype; D: (nheads,) or (nheads, headdim) f32;
    seq_idx: (batch, seqlen) int32
    -> y: (batch, seqlen, nheads, headdim), y_pre: same (the pre-gate output, written only with z).

    y0[l] = sum_{s<=l} (C_l.B_s) exp(dA_cs[l]-dA_cs[s]) dt_out[s] x[s] + exp(dA_cs[l]) Sin C_l + D x[l];
    y = y0 * silu(z). With ``diag_skip`` (Mamba-3): the sum runs over s < l and D is (batch, nheads, nchunks,
    chunk_size), a per-position skip: y0[l] gets D[l] x[l] in place of the diagonal term; with ``step_group`` G > 1
    as well the sum runs over s // G < l // G (Mamba-3 MIMO: the same-step block is the caller's). Chunk 0's Sin is read
    only with ``has_init`` (initial states given): without them it is
    zero and its C . Sin product is skipped. One template (``chunk_scan_template``) laid out by ``strategy``;
    the CPU strategy's knobs rows x cols x order: the register block of its chunk matmuls (mm.py).
    """
    d = dims_of(ScanDims, dims, kw)
    return stamp(chunk_scan_template(d, strategy), "ssd_chunk_scan")
