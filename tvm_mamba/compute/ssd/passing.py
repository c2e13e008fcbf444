"""ssd_state_passing and its backward (the sequential scans over chunks) and ssd_head_sum (dB / dC partials
summed over heads). Templates (strategy.py): a task per (batch, head, headdim) row of dstate lanes."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, I32, Z4, chunk_scale
from .dims import HeadSumDims, PassingBwdDims, PassingDims, dims_of
from .strategy import SERIAL, ChunkStrategy, unravel


def _row_scan(d, S: ChunkStrategy, reverse: bool):
    """A macro ``run(i, start, emit, step, finish, dA_cs, seq_idx, seqlen, nchunks)``: the scan over chunks of task
    i = (batch, head, p, lane block) of dstate lanes, chunks in order (``reverse``: last first): cur = start(b, h,
    p, n); per chunk c, with a = chunk_scale(c), emit(b, c, h, p, n, cur) then cur = step(b, c, h, p, n, a, cur);
    then finish(b, h, p, n, cur) (None: nothing). Both directions of state passing are this recurrence."""
    H, P, N, Q, m = d.nheads, d.headdim, d.dstate, d.chunk_size, S.math
    V = S.lanes(N)

    @T.macro
    def run(i, start, emit, step, finish, dA_cs, seq_idx, seqlen, nchunks):
        cur = T.alloc_buffer((V,), F32, scope=S.scope)
        a = T.alloc_buffer((1,), F32, scope=S.scope)
        b, h, p, nb = T.meta_var(unravel(i, (None, H, P, N // V)))
        for v in S.lane_loop(V):
            cur[v] = start(b, h, p, nb * V + v)
        for cr in range(nchunks):
            c = T.meta_var(nchunks - 1 - cr if reverse else cr)
            a[0] = chunk_scale(m, seq_idx, dA_cs, b, h, c, Q, seqlen, d.has_seq_idx)
            for v in S.lane_loop(V):
                emit(b, c, h, p, nb * V + v, cur[v])
                cur[v] = step(b, c, h, p, nb * V + v, a[0], cur[v])
        if finish is not None:
            for v in S.lane_loop(V):
                finish(b, h, p, nb * V + v, cur[v])

    return run


def passing_template(d: PassingDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_state_passing loop nest laid out by ``S``: a task per (batch, head, p) and lanes of n."""
    H, P, N, Q, sd = d.nheads, d.headdim, d.dstate, d.chunk_size, d.state_dtype
    scan, tasks = _row_scan(d, S, reverse=False), S.tasks()

    @T.prim_func
    def func(st_h: T.handle, dac_h: T.handle, i_h: T.handle, s_h: T.handle, sin_h: T.handle, f_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        states = T.match_buffer(st_h, (batch, nchunks, H, P, N), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        init = T.match_buffer(i_h, (batch, H, P, N) if d.has_init else Z4, F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        states_in = T.match_buffer(sin_h, (batch, nchunks, H, P, N), sd)
        final = T.match_buffer(f_h, (batch, H, P, N), F32)
        tasks(batch * H * P * (N // S.lanes(N)), lambda i: scan(
            i, lambda b, h, p, n: init[b, h, p, n] if d.has_init else T.float32(0),
            lambda b, c, h, p, n, v: T.buffer_store(states_in, v.astype(sd), [b, c, h, p, n]),
            lambda b, c, h, p, n, a, v: a * v + states[b, c, h, p, n],
            lambda b, h, p, n, v: T.buffer_store(final, v, [b, h, p, n]), dA_cs, seq_idx, seqlen, nchunks))

    return func


def passing_bwd_template(d: PassingBwdDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_state_passing_bwd loop nest laid out by ``S``, in two launches: the reverse scan (a task per
    (batch, head, p), lanes of n), then ddecay per (batch, head, chunk) from the dS_c the first one stored:
    sum over n of (sum over p) in that order, the same on every target."""
    H, P, N, Q, m = d.nheads, d.headdim, d.dstate, d.chunk_size, S.math
    V = S.lanes(N)
    NV = N // V
    scan, tasks = _row_scan(d, S, reverse=True), S.tasks()

    @T.macro
    def ddecay_of(i, dso, states_in, dA_cs, seq_idx, ddecay, seqlen, nchunks):  # a_c <dS_c, Sin_c>
        part = T.alloc_buffer((V,), F32, scope=S.scope)
        acc = T.alloc_buffer((1,), F32, scope=S.scope)
        b, h, c = T.meta_var(unravel(i, (None, H, nchunks)))
        acc[0] = T.float32(0)
        for nb in range(NV):
            for v in S.lane_loop(V):
                part[v] = T.float32(0)
            for p in range(P):
                for v in S.lane_loop(V):
                    part[v] = part[v] + dso[b, c, h, p, nb * V + v] * states_in[b, c, h, p, nb * V + v]
            for v in range(V):
                acc[0] = acc[0] + part[v]
        ddecay[b, h, c] = acc[0] * chunk_scale(m, seq_idx, dA_cs, b, h, c, Q, seqlen, d.has_seq_idx)

    @T.prim_func
    def func(sin_h: T.handle, dsl_h: T.handle, dac_h: T.handle, df_h: T.handle, s_h: T.handle,
             dso_h: T.handle, di_h: T.handle, ddec_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        states_in = T.match_buffer(sin_h, (batch, nchunks, H, P, N), F32)
        dsl = T.match_buffer(dsl_h, (batch, nchunks, H, P, N), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        dfinal = T.match_buffer(df_h, (batch, H, P, N) if d.has_dfinal else Z4, F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if d.has_seq_idx else (1, 1), I32)
        dso = T.match_buffer(dso_h, (batch, nchunks, H, P, N), F32)
        dinit = T.match_buffer(di_h, (batch, H, P, N) if d.has_init else Z4, F32)
        ddecay = T.match_buffer(ddec_h, (batch, H, nchunks), F32)
        tasks(batch * H * P * NV, lambda i: scan(
            i, lambda b, h, p, n: dfinal[b, h, p, n] if d.has_dfinal else T.float32(0),
            lambda b, c, h, p, n, v: T.buffer_store(dso, v, [b, c, h, p, n]),
            lambda b, c, h, p, n, a, v: dsl[b, c, h, p, n] + a * v,
            (lambda b, h, p, n, v: T.buffer_store(dinit, v, [b, h, p, n])) if d.has_init else None,
            dA_cs, seq_idx, seqlen, nchunks))
        # ddecay_c: one task per (batch, head, chunk), reading the dS_c stored above
        tasks(batch * H * nchunks, lambda i: ddecay_of(i, dso, states_in, dA_cs, seq_idx, ddecay, seqlen, nchunks))

    return func


def head_sum_template(d: HeadSumDims, S: ChunkStrategy) -> tirx.PrimFunc:
    """The ssd_head_sum loop nest laid out by ``S``: a task per (batch, position, group), lanes of n; each
    output sums its group's heads in head order, starting from the first."""
    H, G, N, od = d.nheads, d.ngroups, d.dstate, d.out_dtype
    R = H // G
    V = S.lanes(N)
    NV = N // V
    tasks = S.tasks()

    @T.macro
    def group(i, per_head, out, seqlen):
        acc = T.alloc_buffer((V,), F32, scope=S.scope)
        b, t, g, nb = T.meta_var(unravel(i, (None, seqlen, G, NV)))
        for v in S.lane_loop(V):
            acc[v] = per_head[b, t, g * R, nb * V + v]
        for r in range(1, R):
            for v in S.lane_loop(V):
                acc[v] = acc[v] + per_head[b, t, g * R + r, nb * V + v]
        for v in S.lane_loop(V):
            out[b, t, g, nb * V + v] = acc[v].astype(od)

    @T.prim_func
    def func(ph_h: T.handle, o_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        per_head = T.match_buffer(ph_h, (batch, seqlen, H, N), F32)
        out = T.match_buffer(o_h, (batch, seqlen, G, N), od)
        tasks(batch * seqlen * G * NV, lambda i: group(i, per_head, out, seqlen))

    return func


def ssd_state_passing(dims: PassingDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """states: (batch, nchunks, nheads, headdim, dstate) f32; dA_cumsum: (batch, nheads, nchunks, chunk_size);
    initial_states: (batch, nheads, headdim, dstate) f32; seq_idx: (batch, seqlen) int32
    -> states_in: (batch, nchunks, nheads, headdim, dstate) in state_dtype (state entering each chunk),
    final_states: (batch, nheads, headdim, dstate) f32.

    Sin_0 = initial_states (or 0); Sin_{c+1} = a_c Sin_c + states_c, a_c = exp(dA_cs[c, Q-1]) (seq-masked).
    The running state stays float32; only the stored states_in are rounded to state_dtype.
    """
    d = dims_of(PassingDims, dims, kw)
    return stamp(passing_template(d, strategy), "ssd_state_passing")


def ssd_state_passing_bwd(dims: PassingBwdDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """states_in, dstates_local: (batch, nchunks, nheads, headdim, dstate) f32; dA_cumsum: (batch, nheads,
    nchunks, chunk_size); dfinal: (batch, nheads, headdim, dstate); seq_idx: (batch, seqlen)
    -> dstates_out: (batch, nchunks, nheads, headdim, dstate) (gradient of the state leaving each chunk),
    dinit: (batch, nheads, headdim, dstate), ddecay: (batch, nheads, nchunks) (gradient of dA_cs[c, Q-1]).

    dH_nc = dfinal; dS_c = dH_{c+1}; ddecay_c = a_c <dH_{c+1}, Sin_c>; dH_c = dSloc_c + a_c dH_{c+1}.
    """
    d = dims_of(PassingBwdDims, dims, kw)
    return stamp(passing_bwd_template(d, strategy), "ssd_state_passing_bwd")


def ssd_head_sum(dims: HeadSumDims | None = None, strategy: ChunkStrategy = SERIAL, **kw) -> tirx.PrimFunc:
    """per_head: (batch, seqlen, nheads, dstate) f32 -> out: (batch, seqlen, ngroups, dstate) in out_dtype,
    the sum over the heads of each group in head order (dB / dC: the backward writes one partial per head;
    summing here, in a fixed order, keeps it deterministic without atomics)."""
    d = dims_of(HeadSumDims, dims, kw)
    return stamp(head_sum_template(d, strategy), "ssd_head_sum")
