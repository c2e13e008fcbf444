"""Mamba-2 SSD chunked scan (mamba_ssm 2.3.x ``mamba_chunk_scan_combined`` semantics): kernel builders.

Per head h of group g, with dt' = clamp(softplus(dt + dt_bias)), dA_cs = chunk-local cumsum(dt' A):

    h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T,   y_t = h_t C_t + D x_t,   y <- y * silu(z)

computed chunk by chunk (chunk length Q = chunk_size), as upstream's five Triton kernels do:

=====================  ============================================================================
ssd_chunk_cumsum       dt' and dA_cs per chunk; positions past seqlen get dt' = 0 (no decay, no input),
                       which makes a ragged last chunk exact without padding any tensor
ssd_bmm_chunk          CB_c[l, s] = C_l . B_s per (chunk, group): computed once, shared by the group's heads
ssd_chunk_state        S_c[p, n] = sum_l x[l, p] dt'[l] exp(dA_cs[Q-1] - dA_cs[l]) B[l, n]   (P x Q x N)
ssd_state_passing      Sin_{c+1} = exp(dA_cs_c[Q-1]) Sin_c + S_c (sequential over chunks)
ssd_chunk_scan         y[l] = sum_{s<=l} (C_l.B_s) exp(dA_cs[l] - dA_cs[s]) dt'[s] x[s]
                              + exp(dA_cs[l]) C_l Sin_c + D x_l ; optional silu(z) gate
ssd_chunk_scan_bwd_dstates   dSloc_c = sum_l exp(dA_cs[l]) g[l] C_l^T (g = dy * silu(z)), and dz
ssd_state_passing_bwd  reverse scan: dS_c = dH_{c+1}, dH_c = dSloc_c + a_c dH_{c+1}, dinit = dH_0
ssd_chunk_scan_bwd     every per-chunk gradient: dx, dB, dC (per head), d dt', d dA_step (per step), dD
ssd_chunk_cumsum_bwd   d dA_step + the state-passing term -> d dt', d A, through softplus/clamp -> d dt, d dt_bias
ssd_head_sum           dB, dC: the per-head partials summed over the heads of each group (fixed order)
=====================  ============================================================================

Segment decays are always exp of a *difference* of cumulative sums, masked (s <= l, same seq_idx) before
the exponential, so nothing overflows in any dtype (never exp(cumsum) / exp(cumsum)). With seq_idx the
masks are upstream's: a position's state contribution counts only toward its own sequence, the carried
state only where the sequence id matches the previous chunk's last id (id 0 before position 0).

All reductions are owned by one thread (no atomics): per-head dB/dC and per-(batch, chunk) dD partials are
summed over heads/chunks in a fixed order by the torch op. Accumulation and states are float32.
Batch, seqlen and nchunks are symbolic; nheads, ngroups, headdim, dstate, chunk_size are static.

These kernels are TVMScript loop nests (the chunk-local matmuls vectorized over their contiguous static
axis), not TE: a symbolic seqlen with vectorized TE schedules loses all vector code on CPU (see the CPU
rule). schedules/cpu/ssd.py serves them as they are; schedules/cuda/ssd.py replaces each by a CUDA template
with the same parameter list (one thread per output element; see docs/ssd.md).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from . import _math
from ._common import check_dtype, stamp
from ._ssd_dims import head_parts
from ._ssd_mm import DEFAULT_COLS, DEFAULT_ORDER, DEFAULT_ROWS, matmul, zero

F32 = "float32"
I32 = "int32"
NEG = -100.0  # exp(-100) == 0 in _math.exp (inputs below -87 give 0): the masked-out exponent


def _c(v):
    return tirx.const(v, F32)


DA_MIN = -110.0  # the lowest dt'*A step: exp(-110) = 1.7e-48 is 0 in float32 (exp(-104) ~ the last denormal)


def with_state_dtype(static: dict, state_dtype: str) -> dict:
    """static plus state_dtype when it is not the default float32 (default stamps stay as before)."""
    return dict(static, state_dtype=state_dtype) if state_dtype != F32 else static


def dA_step(dt, A):
    """dt' * A clamped below at DA_MIN (issue #16): A = -inf (or a huge negative A) gives decay exp(DA_MIN) = 0,
    exactly as exp(dt' A) = 0, while every cumsum and segment difference stays finite (-inf - -inf was NaN for
    the whole head). dt' = 0 (past seqlen; no step) gives 0 even for A = -inf (0 * -inf); NaN stays NaN."""
    u = dt * A
    lo = tirx.const(DA_MIN, F32)
    return tirx.Select(u >= lo, u, tirx.Select(u < lo, lo, tirx.Select(dt == _c(0.0), _c(0.0), u)))


def dA_passes(dt, A):
    """Whether dA_step passes its gradient (dt' * A >= DA_MIN): a clamped step has zero gradient w.r.t. dt'
    and A (torch.clamp's rule; the true d exp(dt A) = A exp(dt A) or dt exp(dt A) is 0 in float32 there)."""
    return dt * A >= tirx.const(DA_MIN, F32)


def check_dims(nheads, ngroups, headdim, dstate, chunk_size):
    """ValueError naming the dim that is out of range."""
    for name, v, hi in (("nheads", nheads, 1 << 16), ("ngroups", ngroups, 1 << 16), ("headdim", headdim, 256),
                        ("dstate", dstate, 256), ("chunk_size", chunk_size, 256)):
        if not (isinstance(v, int) and 1 <= v <= hi):
            raise ValueError(f"{name}: must be an int in 1..{hi}, got {v!r}")
    if nheads % ngroups:
        raise ValueError(f"ngroups: must divide nheads={nheads}, got {ngroups}")


def _dt_stages(tmp, raw, dt_bias, h, dt_limit, has_dt_bias, dt_softplus, has_dt_limit):
    """Statements-as-values helper: the stages of dt' = clamp(softplus(dt + dt_bias)) as (slot, expr) pairs,
    each stage stored in a scalar slot of ``tmp`` (so no exp polynomial is nested inside another: inlined,
    the expression trees blow up and LLVM took 5 s to compile one kernel)."""
    v = raw + dt_bias[h] if has_dt_bias else raw
    stages = [(0, v)]  # tmp[0]: pre-activation
    stages.append((1, _math.softplus(tmp[0]) if dt_softplus else tmp[0]))  # tmp[1]: before the clamp
    stages.append((2, tirx.min(tirx.max(tmp[1], dt_limit[0]), dt_limit[1]) if has_dt_limit else tmp[1]))
    # tmp[3]: d dt' / d dt (torch semantics: the clamp passes the gradient on [lo, hi])
    gs = _math.softplus_grad(tmp[0]) if dt_softplus else _c(1.0)
    if has_dt_limit:
        gs = tirx.Select(tirx.all(tmp[1] >= dt_limit[0], tmp[1] <= dt_limit[1]), gs, _c(0.0))
    stages.append((3, gs))
    return stages


def ssd_chunk_cumsum(nheads: int, chunk_size: int, has_dt_bias: bool = False, dt_softplus: bool = False,
                     has_dt_limit: bool = False) -> tirx.PrimFunc:
    """dt: (batch, seqlen, nheads) f32; dt_bias: (nheads,); A: (nheads,); dt_limit: (2,) f32
    -> dt_out, dA_cumsum: (batch, nheads, nchunks, chunk_size) f32.

    dt_out = clamp(softplus(dt + dt_bias)) inside the sequence, 0 past seqlen; dA_cumsum = cumsum_l dt_out A
    (each step clamped below at DA_MIN: dA_step).
    """
    H, Q = nheads, chunk_size
    fa = dict(has_dt_bias=has_dt_bias, dt_softplus=dt_softplus, has_dt_limit=has_dt_limit)

    @T.prim_func
    def func(dt_h: T.handle, bias_h: T.handle, a_h: T.handle, lim_h: T.handle, dto_h: T.handle,
             dac_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        dt = T.match_buffer(dt_h, (batch, seqlen, H), F32)
        dt_bias = T.match_buffer(bias_h, (H,) if has_dt_bias else (1,), F32)
        A = T.match_buffer(a_h, (H,), F32)
        dt_limit = T.match_buffer(lim_h, (2,) if has_dt_limit else (1,), F32)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        for bh in T.parallel(batch * H):
            b = T.meta_var(bh // H)
            h = T.meta_var(bh % H)
            acc = T.alloc_buffer((1,), F32)
            tmp = T.alloc_buffer((4,), F32)
            for c in range(nchunks):
                acc[0] = T.float32(0)
                for l in range(Q):
                    tmp[2] = T.float32(0)
                    if c * Q + l < seqlen:
                        st = T.meta_var(_dt_stages(tmp, dt[b, c * Q + l, h], dt_bias, h, dt_limit, **fa))
                        tmp[st[0][0]] = st[0][1]
                        tmp[st[1][0]] = st[1][1]
                        tmp[st[2][0]] = st[2][1]
                    dt_out[b, h, c, l] = tmp[2]
                    acc[0] = acc[0] + dA_step(tmp[2], A[h])
                    dA_cs[b, h, c, l] = acc[0]

    return stamp(func, "ssd_chunk_cumsum", dict(nheads=H, chunk_size=Q, **fa))


def ssd_chunk_cumsum_bwd(nheads: int, chunk_size: int, has_dt_bias: bool = False, dt_softplus: bool = False,
                         has_dt_limit: bool = False) -> tirx.PrimFunc:
    """dt: (batch, seqlen, nheads) f32; dt_bias, A: (nheads,); dt_limit: (2,); ddt_out, ddA_step:
    (batch, nheads, nchunks, chunk_size) f32; ddecay: (batch, nheads, nchunks) f32 (gradient of the chunk's
    last dA_cumsum from state passing) -> ddt: (batch, seqlen, nheads) f32, dA_part, ddt_bias_part:
    (batch, nheads) f32 (summed over batch by the caller, in order).

    ddA_step is already the gradient of each step dt' A within its chunk (ssd_chunk_scan_bwd sums crossing
    pairs, no reverse cumsum here: that would carry a non-finite d dA_cs to every earlier step). With
    ddA[l] = ddecay + ddA_step[l]: d dt_out = ddt_out + A ddA; dA = sum dt_out ddA; ddt = d dt_out dt'/ddt.
    """
    H, Q = nheads, chunk_size
    fa = dict(has_dt_bias=has_dt_bias, dt_softplus=dt_softplus, has_dt_limit=has_dt_limit)

    @T.prim_func
    def func(dt_h: T.handle, bias_h: T.handle, a_h: T.handle, lim_h: T.handle, dto_h: T.handle,
             ddto_h: T.handle, ddac_h: T.handle, ddec_h: T.handle, ddt_h: T.handle, da_h: T.handle,
             dbias_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        dt = T.match_buffer(dt_h, (batch, seqlen, H), F32)
        dt_bias = T.match_buffer(bias_h, (H,) if has_dt_bias else (1,), F32)
        A = T.match_buffer(a_h, (H,), F32)
        dt_limit = T.match_buffer(lim_h, (2,) if has_dt_limit else (1,), F32)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        ddt_out = T.match_buffer(ddto_h, (batch, H, nchunks, Q), F32)
        ddA_step = T.match_buffer(ddac_h, (batch, H, nchunks, Q), F32)
        ddecay = T.match_buffer(ddec_h, (batch, H, nchunks), F32)
        ddt = T.match_buffer(ddt_h, (batch, seqlen, H), F32)
        dA_part = T.match_buffer(da_h, (batch, H), F32)
        dbias_part = T.match_buffer(dbias_h, (batch, H), F32)
        for bh in T.parallel(batch * H):
            b = T.meta_var(bh // H)
            h = T.meta_var(bh % H)
            acc = T.alloc_buffer((3,), F32)  # d dA_step, dA sum, ddt_bias sum
            tmp = T.alloc_buffer((4,), F32)
            acc[1] = T.float32(0)
            acc[2] = T.float32(0)
            for c in range(nchunks):
                for lr in range(Q):
                    l = T.meta_var(Q - 1 - lr)
                    acc[0] = ddecay[b, h, c] + ddA_step[b, h, c, l]
                    acc[1] = acc[1] + T.Select(dA_passes(dt_out[b, h, c, l], A[h]), dt_out[b, h, c, l] * acc[0],
                                               T.float32(0))
                    if c * Q + l < seqlen:
                        st = T.meta_var(_dt_stages(tmp, dt[b, c * Q + l, h], dt_bias, h, dt_limit, **fa))
                        tmp[st[0][0]] = st[0][1]
                        tmp[st[1][0]] = st[1][1]
                        tmp[st[3][0]] = st[3][1]
                        ddt[b, c * Q + l, h] = (ddt_out[b, h, c, l] + T.Select(
                            dA_passes(dt_out[b, h, c, l], A[h]), A[h] * acc[0], T.float32(0))) * tmp[3]
                        acc[2] = acc[2] + ddt[b, c * Q + l, h]
            dA_part[b, h] = acc[1]
            dbias_part[b, h] = acc[2]

    return stamp(func, "ssd_chunk_cumsum_bwd", dict(nheads=H, chunk_size=Q, **fa))


def ssd_chunk_state(nheads: int, ngroups: int, headdim: int, dstate: int, chunk_size: int,
                    has_seq_idx: bool = False, x_dtype: str = F32, bc_dtype: str = F32,
                    rows: int = DEFAULT_ROWS, cols: int = DEFAULT_COLS, order: int = DEFAULT_ORDER) -> tirx.PrimFunc:
    """x: (batch, seqlen, nheads, headdim); B: (batch, seqlen, ngroups, dstate); dt_out, dA_cumsum:
    (batch, nheads, nchunks, chunk_size) f32; seq_idx: (batch, seqlen) int32
    -> states: (batch, nchunks, nheads, headdim, dstate) f32.

    states[c, p, n] = sum_l x[l, p] dt_out[l] exp(dA_cs[Q-1] - dA_cs[l]) B[l, n] over the chunk's positions
    of the sequence its last position belongs to. ``rows`` x ``cols``: the matmul's register block.
    """
    check_dtype("x", x_dtype)
    check_dtype("B", bc_dtype)
    H, G, P, N, Q = nheads, ngroups, headdim, dstate, chunk_size
    R = H // G
    mm = matmul(P, N, rows, cols, order=order)

    @T.prim_func
    def func(x_h: T.handle, b_h: T.handle, dto_h: T.handle, dac_h: T.handle, s_h: T.handle, st_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        x = T.match_buffer(x_h, (batch, seqlen, H, P), x_dtype)
        Bm = T.match_buffer(b_h, (batch, seqlen, G, N), bc_dtype)
        dt_out = T.match_buffer(dto_h, (batch, H, nchunks, Q), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if has_seq_idx else (1, 1), I32)
        states = T.match_buffer(st_h, (batch, nchunks, H, P, N), F32)
        for bch in T.parallel(batch * nchunks * H):
            b = T.meta_var(bch // (nchunks * H))
            c = T.meta_var(bch // H % nchunks)
            h = T.meta_var(bch % H)
            bw = T.alloc_buffer((Q, N), F32)  # B rows scaled by the decay weight w[l]
            xt = T.alloc_buffer((P, Q), F32)  # x transposed: the l loop reads it contiguously
            w = T.alloc_buffer((1,), F32)
            for l in range(Q):
                w[0] = T.float32(0)
                if c * Q + l < seqlen:
                    w[0] = dt_out[b, h, c, l] * _math.exp(dA_cs[b, h, c, Q - 1] - dA_cs[b, h, c, l])
                    if has_seq_idx:
                        w[0] = T.Select(seq_idx[b, c * Q + l] == seq_idx[b, T.min(c * Q + Q, seqlen) - 1], w[0],
                                        T.float32(0))
                for n in T.vectorized(N):
                    bw[l, n] = w[0] * Bm[b, T.min(c * Q + l, seqlen - 1), h // R, n].astype(F32)
                for p in range(P):
                    xt[p, l] = x[b, T.min(c * Q + l, seqlen - 1), h, p].astype(F32)
            mm(lambda lo, hi: 0, lambda lo, hi: Q, lambda p, l: xt[p, l], lambda l, n: bw[l, n], zero,
               lambda p, n, v: T.buffer_store(states, v, [b, c, h, p, n]))

    return stamp(func, "ssd_chunk_state", dict(nheads=H, ngroups=G, headdim=P, dstate=N, chunk_size=Q,
                                                has_seq_idx=has_seq_idx, x_dtype=x_dtype, bc_dtype=bc_dtype))


def _chunk_scale(seq_idx, dA_cs, b, h, c, Q, seqlen, has_seq_idx):
    """exp(dA_cs[c, Q-1]), zeroed when chunk c's last sequence id differs from chunk c-1's (0 for c = 0)."""
    a = _math.exp(dA_cs[b, h, c, Q - 1])
    if not has_seq_idx:
        return a
    cur = seq_idx[b, tirx.min(c * Q + Q, seqlen) - 1]
    prev = tirx.if_then_else(c > 0, seq_idx[b, tirx.max(c * Q, 1) - 1], tirx.const(0, I32))
    return tirx.Select(cur == prev, a, _c(0.0))


def ssd_state_passing(nheads: int, headdim: int, dstate: int, chunk_size: int, has_init: bool = False,
                      has_seq_idx: bool = False, state_dtype: str = F32) -> tirx.PrimFunc:
    """states: (batch, nchunks, nheads, headdim, dstate) f32; dA_cumsum: (batch, nheads, nchunks, chunk_size);
    initial_states: (batch, nheads, headdim, dstate) f32; seq_idx: (batch, seqlen) int32
    -> states_in: (batch, nchunks, nheads, headdim, dstate) in state_dtype (state entering each chunk),
    final_states: (batch, nheads, headdim, dstate) f32.

    Sin_0 = initial_states (or 0); Sin_{c+1} = a_c Sin_c + states_c, a_c = exp(dA_cs[c, Q-1]) (seq-masked).
    The running state stays float32; only the stored states_in are rounded to state_dtype (``state_dtype``).
    """
    check_dtype("states", state_dtype)
    H, P, N, Q = nheads, headdim, dstate, chunk_size

    @T.prim_func
    def func(st_h: T.handle, dac_h: T.handle, i_h: T.handle, s_h: T.handle, sin_h: T.handle, f_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        states = T.match_buffer(st_h, (batch, nchunks, H, P, N), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        init = T.match_buffer(i_h, (batch, H, P, N) if has_init else (1, 1, 1, 1), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if has_seq_idx else (1, 1), I32)
        states_in = T.match_buffer(sin_h, (batch, nchunks, H, P, N), state_dtype)
        final = T.match_buffer(f_h, (batch, H, P, N), F32)
        for bhp in T.parallel(batch * H * P):
            b = T.meta_var(bhp // (H * P))
            h = T.meta_var(bhp // P % H)
            p = T.meta_var(bhp % P)
            cur = T.alloc_buffer((N,), F32)
            a = T.alloc_buffer((1,), F32)
            for n in T.vectorized(N):
                cur[n] = init[b, h, p, n] if has_init else T.float32(0)
            for c in range(nchunks):
                a[0] = _chunk_scale(seq_idx, dA_cs, b, h, c, Q, seqlen, has_seq_idx)
                for n in T.vectorized(N):
                    states_in[b, c, h, p, n] = cur[n].astype(state_dtype)
                    cur[n] = a[0] * cur[n] + states[b, c, h, p, n]
            for n in T.vectorized(N):
                final[b, h, p, n] = cur[n]

    return stamp(func, "ssd_state_passing", with_state_dtype(dict(
        nheads=H, headdim=P, dstate=N, chunk_size=Q, has_init=has_init, has_seq_idx=has_seq_idx), state_dtype))


def ssd_state_passing_bwd(nheads: int, headdim: int, dstate: int, chunk_size: int, has_init: bool = False,
                          has_dfinal: bool = False, has_seq_idx: bool = False) -> tirx.PrimFunc:
    """states_in, dstates_local: (batch, nchunks, nheads, headdim, dstate) f32; dA_cumsum: (batch, nheads,
    nchunks, chunk_size); dfinal: (batch, nheads, headdim, dstate); seq_idx: (batch, seqlen)
    -> dstates_out: (batch, nchunks, nheads, headdim, dstate) (gradient of the state leaving each chunk),
    dinit: (batch, nheads, headdim, dstate), ddecay: (batch, nheads, nchunks) (gradient of dA_cs[c, Q-1]).

    dH_nc = dfinal; dS_c = dH_{c+1}; ddecay_c = a_c <dH_{c+1}, Sin_c>; dH_c = dSloc_c + a_c dH_{c+1}.
    """
    H, P, N, Q = nheads, headdim, dstate, chunk_size

    @T.prim_func
    def func(sin_h: T.handle, dsl_h: T.handle, dac_h: T.handle, df_h: T.handle, s_h: T.handle,
             dso_h: T.handle, di_h: T.handle, ddec_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        nchunks = T.int32()
        states_in = T.match_buffer(sin_h, (batch, nchunks, H, P, N), F32)
        dsl = T.match_buffer(dsl_h, (batch, nchunks, H, P, N), F32)
        dA_cs = T.match_buffer(dac_h, (batch, H, nchunks, Q), F32)
        dfinal = T.match_buffer(df_h, (batch, H, P, N) if has_dfinal else (1, 1, 1, 1), F32)
        seq_idx = T.match_buffer(s_h, (batch, seqlen) if has_seq_idx else (1, 1), I32)
        dso = T.match_buffer(dso_h, (batch, nchunks, H, P, N), F32)
        dinit = T.match_buffer(di_h, (batch, H, P, N) if has_init else (1, 1, 1, 1), F32)
        ddecay = T.match_buffer(ddec_h, (batch, H, nchunks), F32)
        for bh in T.parallel(batch * H):
            b = T.meta_var(bh // H)
            h = T.meta_var(bh % H)
            cur = T.alloc_buffer((P, N), F32)
            part = T.alloc_buffer((N,), F32)
            a = T.alloc_buffer((1,), F32)
            for p in range(P):
                for n in T.vectorized(N):
                    cur[p, n] = dfinal[b, h, p, n] if has_dfinal else T.float32(0)
            for cr in range(nchunks):
                c = T.meta_var(nchunks - 1 - cr)
                a[0] = _chunk_scale(seq_idx, dA_cs, b, h, c, Q, seqlen, has_seq_idx)
                for n in T.vectorized(N):
                    part[n] = T.float32(0)
                for p in range(P):
                    for n in T.vectorized(N):
                        dso[b, c, h, p, n] = cur[p, n]
                        part[n] = part[n] + cur[p, n] * states_in[b, c, h, p, n]
                        cur[p, n] = dsl[b, c, h, p, n] + a[0] * cur[p, n]
                ddecay[b, h, c] = T.float32(0)
                for n in range(N):
                    ddecay[b, h, c] = ddecay[b, h, c] + part[n]
                ddecay[b, h, c] = ddecay[b, h, c] * a[0]
            if has_init:
                for p in range(P):
                    for n in T.vectorized(N):
                        dinit[b, h, p, n] = cur[p, n]

    return stamp(func, "ssd_state_passing_bwd", dict(nheads=H, headdim=P, dstate=N, chunk_size=Q,
                                                      has_init=has_init, has_dfinal=has_dfinal,
                                                      has_seq_idx=has_seq_idx))


def ssd_head_sum(nheads: int, ngroups: int, dstate: int, out_dtype: str = F32) -> tirx.PrimFunc:
    """per_head: (batch, seqlen, nheads, dstate) f32 -> out: (batch, seqlen, ngroups, dstate) in out_dtype,
    the sum over the heads of each group in head order (dB / dC: the backward writes one partial per head;
    summing here, in a fixed order, keeps it deterministic without atomics)."""
    check_dtype("out", out_dtype)
    H, G, N = nheads, ngroups, dstate
    R = H // G

    @T.prim_func
    def func(ph_h: T.handle, o_h: T.handle):
        batch = T.int32()
        seqlen = T.int32()
        per_head = T.match_buffer(ph_h, (batch, seqlen, H, N), F32)
        out = T.match_buffer(o_h, (batch, seqlen, G, N), out_dtype)
        for bt in T.parallel(batch * seqlen):
            acc = T.alloc_buffer((N,), F32)
            for g in range(G):
                for n in T.vectorized(N):
                    acc[n] = per_head[bt // seqlen, bt % seqlen, g * R, n]
                for r in range(1, R):
                    for n in T.vectorized(N):
                        acc[n] = acc[n] + per_head[bt // seqlen, bt % seqlen, g * R + r, n]
                for n in T.vectorized(N):
                    out[bt // seqlen, bt % seqlen, g, n] = acc[n].astype(out_dtype)

    return stamp(func, "ssd_head_sum", dict(nheads=H, ngroups=G, dstate=N, out_dtype=out_dtype))


# The two chunk-scan kernels (forward and the per-chunk backward) live in _ssd_scan.py (file size).
from ._ssd_scan import ssd_bmm_chunk, ssd_chunk_scan, ssd_chunk_scan_bwd_dstates  # noqa: E402,F401
from ._ssd_scan_bwd import ssd_chunk_scan_bwd  # noqa: E402,F401
from ._ssd_varlen import ssd_chunk_state_varlen  # noqa: E402,F401

DIRECTIONS = ("chunk_cumsum", "bmm_chunk", "chunk_state", "state_passing", "chunk_scan", "chunk_scan_bwd_dstates",
              "state_passing_bwd", "chunk_scan_bwd", "chunk_cumsum_bwd", "head_sum", "chunk_state_varlen")


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning workloads: the five kernels with chunk matmuls (the others have no knobs) of each Mamba-2
    preset (nheads, ngroups, headdim 64, dstate 128, chunk 256) as its block calls them: fp32, D per
    head, z, no seq_idx."""
    from ._presets import presets

    out = []
    f32 = {"x": "float32", "bc": "float32"}
    for _, d in presets(preset):
        if "headdim" not in d:
            continue
        dims = dict(nheads=d["nheads"], ngroups=d["ngroups"], headdim=d["headdim"], dstate=d["d_state"],
                    chunk_size=d["chunk_size"])
        out += [("bmm_chunk", dict(ngroups=d["ngroups"], dstate=d["d_state"], chunk_size=d["chunk_size"]),
                 {"bc": "float32"}),
                ("chunk_state", dict(dims, has_seq_idx=False), f32),
                ("chunk_scan", dict(dims, has_D=True, D_has_hdim=False, has_z=True, has_seq_idx=False), f32),
                ("chunk_scan_bwd_dstates", dict(dims, has_z=True, has_seq_idx=False), f32),
                ("chunk_scan_bwd", dict(dims, has_D=True, D_has_hdim=False, has_z=True, has_seq_idx=False), f32)]
    return out


def derived_dims(direction: str, dims: dict, static: dict) -> dict:
    """Dynamic dims that follow from the others (for tuning-time inputs): nchunks = ceil(seqlen / chunk);
    chunk_scan_bwd's gparts = ngroups * head_parts(...), as torch_ops/ssd.py allocates its partials."""
    if "seqlen" not in dims or "chunk_size" not in static:
        return {}
    out = {"nchunks": -(-dims["seqlen"] // static["chunk_size"])}
    if direction == "chunk_scan_bwd":
        G = static["ngroups"]
        out["gparts"] = G * head_parts(dims.get("batch", 1), out["nchunks"], static["nheads"], G)
    return out


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static dims, dtypes) built by ``python -m tvm_mamba build-check`` for CUDA: the Mamba-2
    2.7B shape (nheads 80, ngroups 1, headdim 64, dstate 128, chunk 256) and the same with dstate 256, bf16
    activations, with every optional input on (D per head, z, dt_bias, softplus, dt_limit, initial and
    final states, seq_idx) and, for the 2.7B shape, the plain variant too; then the varlen-states kernel
    (with seq_idx; without, from bf16 chunk states) and the kernels that store / read bf16 chunk states."""
    out = []
    dts = {"x": "bfloat16", "bc": "bfloat16"}
    for dstate, flag_sets in ((128, (False, True)), (256, (True,))):
        dims = dict(nheads=80, ngroups=1, headdim=64, dstate=dstate, chunk_size=256)
        sdims = dict(nheads=80, headdim=64, dstate=dstate, chunk_size=256)
        for on in flag_sets:
            dtf = dict(nheads=80, chunk_size=256, has_dt_bias=on, dt_softplus=on, has_dt_limit=on)
            out += [("chunk_cumsum", dtf, {}), ("chunk_cumsum_bwd", dtf, {}),
                    ("chunk_state", dict(dims, has_seq_idx=on), dts),
                    ("state_passing", dict(sdims, has_init=on, has_seq_idx=on), {}),
                    ("state_passing_bwd", dict(sdims, has_init=on, has_dfinal=on, has_seq_idx=on), {}),
                    ("chunk_scan", dict(dims, has_D=True, D_has_hdim=False, has_z=on, has_seq_idx=on), dts),
                    ("chunk_scan_bwd_dstates", dict(dims, has_z=on, has_seq_idx=on), dts),
                    ("chunk_scan_bwd", dict(dims, has_D=True, D_has_hdim=False, has_z=on, has_seq_idx=on), dts)]
        out.append(("head_sum", dict(nheads=80, ngroups=1, dstate=dstate), {"out": "bfloat16"}))
        out.append(("bmm_chunk", dict(ngroups=1, dstate=dstate, chunk_size=256), {"bc": "bfloat16"}))
    # varlen states (batch 1, cu_seqlens) and chunk states stored in bf16 (state_dtype), at the 2.7B shape
    dims = dict(nheads=80, ngroups=1, headdim=64, dstate=128, chunk_size=256)
    sdims = dict(nheads=80, headdim=64, dstate=128, chunk_size=256)
    out += [("chunk_state_varlen", dict(dims, has_seq_idx=True), dict(dts, out="bfloat16")),
            ("chunk_state_varlen", dict(dims, has_seq_idx=False), dict(dts, state="bfloat16", out="bfloat16")),
            ("state_passing", dict(sdims, has_init=True, has_seq_idx=True), {"state": "bfloat16"}),
            ("chunk_scan", dict(dims, has_D=True, D_has_hdim=False, has_z=True, has_seq_idx=True),
             dict(dts, state="bfloat16"))]
    return out
