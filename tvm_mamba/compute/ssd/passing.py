"""ssd_state_passing and its backward (the sequential scans over chunks) and ssd_head_sum (dB / dC partials
summed over heads). Templates (strategy.py): a task per (batch, head, headdim) row of dstate lanes."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .._common import stamp
from .common import F32, I32, Z4, chunk_scale
from .dims import HeadSumDims, PassingBwdDims, PassingDims, dims_of
from .strategy import SERIAL, Strategy


def passing_template(d: PassingDims, S: Strategy) -> tirx.PrimFunc:
    """The ssd_state_passing loop nest laid out by ``S``: a task per (batch, head, p) and lanes of n."""
    H, P, N, Q, sd, m = d.nheads, d.headdim, d.dstate, d.chunk_size, d.state_dtype, S.math
    V = S.lanes(N)
    NV = N // V

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
        for bx in S.outer(batch * H * P * NV):
            for tx in S.inner():
                cur = T.alloc_buffer((V,), F32, scope=S.scope)
                a = T.alloc_buffer((1,), F32, scope=S.scope)
                i = T.meta_var(S.index(bx, tx))
                b = T.meta_var(i // (H * P * NV))
                h = T.meta_var(i // (P * NV) % H)
                p = T.meta_var(i // NV % P)
                n0 = T.meta_var(i % NV * V)
                if i < batch * H * P * NV:
                    for v in S.lane_loop(V):
                        cur[v] = init[b, h, p, n0 + v] if d.has_init else T.float32(0)
                    for c in range(nchunks):
                        a[0] = chunk_scale(m, seq_idx, dA_cs, b, h, c, Q, seqlen, d.has_seq_idx)
                        for v in S.lane_loop(V):
                            states_in[b, c, h, p, n0 + v] = cur[v].astype(sd)
                            cur[v] = a[0] * cur[v] + states[b, c, h, p, n0 + v]
                    for v in S.lane_loop(V):
                        final[b, h, p, n0 + v] = cur[v]

    return func


def passing_bwd_template(d: PassingBwdDims, S: Strategy) -> tirx.PrimFunc:
    """The ssd_state_passing_bwd loop nest laid out by ``S``, in two launches: the reverse scan (a task per
    (batch, head, p), lanes of n), then ddecay per (batch, head, chunk) from the dS_c the first one stored:
    sum over n of (sum over p) in that order, the same on every target."""
    H, P, N, Q, m = d.nheads, d.headdim, d.dstate, d.chunk_size, S.math
    V = S.lanes(N)
    NV = N // V

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
        for bx in S.outer(batch * H * P * NV):
            for tx in S.inner():
                cur = T.alloc_buffer((V,), F32, scope=S.scope)
                a = T.alloc_buffer((1,), F32, scope=S.scope)
                i = T.meta_var(S.index(bx, tx))
                b = T.meta_var(i // (H * P * NV))
                h = T.meta_var(i // (P * NV) % H)
                p = T.meta_var(i // NV % P)
                n0 = T.meta_var(i % NV * V)
                if i < batch * H * P * NV:
                    for v in S.lane_loop(V):
                        cur[v] = dfinal[b, h, p, n0 + v] if d.has_dfinal else T.float32(0)
                    for cr in range(nchunks):
                        c = T.meta_var(nchunks - 1 - cr)
                        a[0] = chunk_scale(m, seq_idx, dA_cs, b, h, c, Q, seqlen, d.has_seq_idx)
                        for v in S.lane_loop(V):
                            dso[b, c, h, p, n0 + v] = cur[v]
                            cur[v] = dsl[b, c, h, p, n0 + v] + a[0] * cur[v]
                    if d.has_init:
                        for v in S.lane_loop(V):
                            dinit[b, h, p, n0 + v] = cur[v]
        # ddecay_c = a_c <dS_c, Sin_c>: one task per (batch, head, chunk), reading the dS_c stored above
        for bx in S.outer(batch * H * nchunks):
            for tx in S.inner():
                part = T.alloc_buffer((V,), F32, scope=S.scope)
                acc = T.alloc_buffer((1,), F32, scope=S.scope)
                i = T.meta_var(S.index(bx, tx))
                b = T.meta_var(i // (H * nchunks))
                h = T.meta_var(i // nchunks % H)
                c = T.meta_var(i % nchunks)
                if i < batch * H * nchunks:
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

    return func


def head_sum_template(d: HeadSumDims, S: Strategy) -> tirx.PrimFunc:
    """The ssd_head_sum loop nest laid out by ``S``: a task per (batch, position, group), lanes of n; each
    output sums its group's heads in head order, starting from the first."""
    H, G, N, od = d.nheads, d.ngroups, d.dstate, d.out_dtype
    R = H // G
    V = S.lanes(N)
    NV = N // V

    @T.prim_func
    def func(ph_h: T.handle, o_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        per_head = T.match_buffer(ph_h, (batch, seqlen, H, N), F32)
        out = T.match_buffer(o_h, (batch, seqlen, G, N), od)
        for bx in S.outer(batch * seqlen * G * NV):
            for tx in S.inner():
                acc = T.alloc_buffer((V,), F32, scope=S.scope)
                i = T.meta_var(S.index(bx, tx))
                b = T.meta_var(i // (seqlen * G * NV))
                t = T.meta_var(i // (G * NV) % seqlen)
                g = T.meta_var(i // NV % G)
                n0 = T.meta_var(i % NV * V)
                if i < batch * seqlen * G * NV:
                    for v in S.lane_loop(V):
                        acc[v] = per_head[b, t, g * R, n0 + v]
                    for r in range(1, R):
                        for v in S.lane_loop(V):
                            acc[v] = acc[v] + per_head[b, t, g * R + r, n0 + v]
                    for v in S.lane_loop(V):
                        out[b, t, g, n0 + v] = acc[v].astype(od)

    return func


def ssd_state_passing(dims: PassingDims | None = None, strategy: Strategy = SERIAL, **kw) -> tirx.PrimFunc:
    """states: (batch, nchunks, nheads, headdim, dstate) f32; dA_cumsum: (batch, nheads, nchunks, chunk_size);
    initial_states: (batch, nheads, headdim, dstate) f32; seq_idx: (batch, seqlen) int32
    -> states_in: (batch, nchunks, nheads, headdim, dstate) in state_dtype (state entering each chunk),
    final_states: (batch, nheads, headdim, dstate) f32.

    Sin_0 = initial_states (or 0); Sin_{c+1} = a_c Sin_c + states_c, a_c = exp(dA_cs[c, Q-1]) (seq-masked).
    The running state stays float32; only the stored states_in are rounded to state_dtype.
    """
    d = dims_of(PassingDims, dims, kw)
    return stamp(passing_template(d, strategy), "ssd_state_passing", d.stamp_static())


def ssd_state_passing_bwd(dims: PassingBwdDims | None = None, strategy: Strategy = SERIAL, **kw) -> tirx.PrimFunc:
    """states_in, dstates_local: (batch, nchunks, nheads, headdim, dstate) f32; dA_cumsum: (batch, nheads,
    nchunks, chunk_size); dfinal: (batch, nheads, headdim, dstate); seq_idx: (batch, seqlen)
    -> dstates_out: (batch, nchunks, nheads, headdim, dstate) (gradient of the state leaving each chunk),
    dinit: (batch, nheads, headdim, dstate), ddecay: (batch, nheads, nchunks) (gradient of dA_cs[c, Q-1]).

    dH_nc = dfinal; dS_c = dH_{c+1}; ddecay_c = a_c <dH_{c+1}, Sin_c>; dH_c = dSloc_c + a_c dH_{c+1}.
    """
    d = dims_of(PassingBwdDims, dims, kw)
    return stamp(passing_bwd_template(d, strategy), "ssd_state_passing_bwd", d.stamp_static())


def ssd_head_sum(dims: HeadSumDims | None = None, strategy: Strategy = SERIAL, **kw) -> tirx.PrimFunc:
    """per_head: (batch, seqlen, nheads, dstate) f32 -> out: (batch, seqlen, ngroups, dstate) in out_dtype,
    the sum over the heads of each group in head order (dB / dC: the backward writes one partial per head;
    summing here, in a fixed order, keeps it deterministic without atomics)."""
    d = dims_of(HeadSumDims, dims, kw)
    return stamp(head_sum_template(d, strategy), "ssd_head_sum", d.stamp_static())
