"""CUDA rule for the SSD kernels: correctness-first templates, one thread per output element.

Same kernels and parameter lists as tvm_mamba/compute/ssd.py (the CPU loop nests); each CUDA template
launches one or more grids (several launches inside one PrimFunc run in order on the stream, so a later
launch may read what an earlier one wrote — used for the backward's cross-position sums instead of atomics).
C_l.B_s comes from ssd_bmm_chunk (once per group); g_l.x_s is recomputed per output element from global
memory: no shared-memory staging and no tensor cores yet, so these kernels compile cleanly (0 spills) but are far from
upstream's Triton speed — see docs/ssd.md. Knob: ``threads`` per block (64 / 128 / 256, default 128).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...compute._math import Math
from ...compute.ssd import dA_passes, dA_step
from ..rule import Decisions, kernel_attrs, schedule_of

F32, I32 = "float32", "int32"
NEG = -100.0
Z4 = (1, 1, 1, 1)


def _c(v):
    return tirx.const(v, F32)


# CUDA-native math (expf, log1pf), not the CPU polynomials: nested in softplus they made expression
# trees that spilled in ssd_chunk_cumsum_bwd.
_math = Math(F32, native=True)


def _dt_stages(tmp, raw, dt_bias, h, dt_limit, has_dt_bias, dt_softplus, has_dt_limit):
    """compute/ssd.py's _dt_stages with CUDA-native math (same slots, same semantics)."""
    v = raw + dt_bias[h] if has_dt_bias else raw
    gs = _math.softplus_grad(tmp[0]) if dt_softplus else _c(1.0)
    if has_dt_limit:
        gs = tirx.Select(tirx.all(tmp[1] >= dt_limit[0], tmp[1] <= dt_limit[1]), gs, _c(0.0))
    return [(0, v), (1, _math.softplus(tmp[0]) if dt_softplus else tmp[0]),
            (2, tirx.min(tirx.max(tmp[1], dt_limit[0]), dt_limit[1]) if has_dt_limit else tmp[1]), (3, gs)]


class _Ctx:
    """Index helpers shared by the templates (all loads are float32)."""

    def __init__(self, s):
        self.s = s
        self.G = s.get("ngroups", 1)
        self.H, self.Q = s.get("nheads", self.G), s.get("chunk_size", 1)  # head_sum: no chunk; bmm_chunk: no heads
        self.R = self.H // self.G
        self.seq = s.get("has_seq_idx", False)
        # serial=True: the same template with serial loops instead of thread bindings, so tests can run
        # the CUDA kernels' arithmetic on the CPU (tests/schedules/test_ssd.py)
        self.serial = s.get("_serial", False)
        self.scope = "global" if self.serial else "local"

    def loop(self, extent, thread):
        return T.serial(extent) if self.serial else T.thread_binding(extent, thread=thread)

    def ld(self, buf, idx, L, t):
        return tirx.if_then_else(t < L, buf[idx].astype(F32), _c(0.0))

    def seg(self, dA_cs, seq_idx, b, h, c, l, s, L):
        """exp(dA_cs[l] - dA_cs[s]) for s <= l (same sequence), else 0."""
        ok = s <= l
        if self.seq:
            Q = self.Q
            ok = tirx.all(ok, seq_idx[b, tirx.min(c * Q + l, L - 1)] == seq_idx[b, tirx.min(c * Q + s, L - 1)])
        return _math.exp(tirx.Select(ok, dA_cs[b, h, c, l] - dA_cs[b, h, c, s], _c(NEG)))

    def e(self, dA_cs, seq_idx, b, h, c, l, L):
        """exp(dA_cs[l]), zero where the carried state belongs to another sequence."""
        v = _math.exp(dA_cs[b, h, c, l])
        if not self.seq:
            return v
        Q = self.Q
        prev = tirx.if_then_else(c > 0, seq_idx[b, tirx.max(c * Q, 1) - 1], tirx.const(0, I32))
        return tirx.Select(seq_idx[b, tirx.min(c * Q + l, L - 1)] == prev, v, _c(0.0))

    def w(self, dA_cs, seq_idx, b, h, c, s, L):
        """exp(dA_cs[Q-1] - dA_cs[s]), zero where s is not in the chunk's last sequence."""
        Q = self.Q
        v = _math.exp(dA_cs[b, h, c, Q - 1] - dA_cs[b, h, c, s])
        if not self.seq:
            return v
        return tirx.Select(seq_idx[b, tirx.min(c * Q + s, L - 1)] == seq_idx[b, tirx.min(c * Q + Q, L) - 1], v,
                           _c(0.0))

    def scale(self, dA_cs, seq_idx, b, h, c, L):
        Q = self.Q
        a = _math.exp(dA_cs[b, h, c, Q - 1])
        if not self.seq:
            return a
        cur = seq_idx[b, tirx.min(c * Q + Q, L) - 1]
        prev = tirx.if_then_else(c > 0, seq_idx[b, tirx.max(c * Q, 1) - 1], tirx.const(0, I32))
        return tirx.Select(cur == prev, a, _c(0.0))

    def g(self, dy, z, b, t, h, p, L, has_z):
        v = self.ld(dy, (b, tirx.min(t, L - 1), h, p), L, t)
        if has_z:
            v = v * _math.silu(self.ld(z, (b, tirx.min(t, L - 1), h, p), L, t))
        return v


class _Slots:
    """tmp[i] -> slot buffer i's element: separate one-element local buffers instead of one local array
    (one array of 4 kept nvcc from registerizing it: 12 B of spills in ssd_chunk_cumsum_bwd)."""

    def __init__(self, *bufs):
        self.bufs = bufs

    def __getitem__(self, i):
        return self.bufs[i][0]


def _cumsum(s, TH):
    k = _Ctx(s)
    H, Q = s["nheads"], s["chunk_size"]
    fa = dict(has_dt_bias=s["has_dt_bias"], dt_softplus=s["dt_softplus"], has_dt_limit=s["has_dt_limit"])
    has_bias, has_lim = fa["has_dt_bias"], fa["has_dt_limit"]

    @T.prim_func
    def func(dt_h: T.handle, bias_h: T.handle, a_h: T.handle, lim_h: T.handle, dto_h: T.handle, dac_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        dt = T.match_buffer(dt_h, (Bt, L, H), F32)
        dt_bias = T.match_buffer(bias_h, (H,) if has_bias else (1,), F32)
        A = T.match_buffer(a_h, (H,), F32)
        dt_limit = T.match_buffer(lim_h, (2,) if has_lim else (1,), F32)
        dt_out = T.match_buffer(dto_h, (Bt, H, NC, Q), F32)
        dA_cs = T.match_buffer(dac_h, (Bt, H, NC, Q), F32)
        for bx in k.loop(T.ceildiv(Bt * H * NC, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                t0 = T.alloc_buffer((1,), F32, scope=k.scope)
                t1 = T.alloc_buffer((1,), F32, scope=k.scope)
                t2 = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (H * NC))
                h = T.meta_var(i // NC % H)
                c = T.meta_var(i % NC)
                if i < Bt * H * NC:
                    acc[0] = T.float32(0)
                    for l in range(Q):
                        t2[0] = T.float32(0)
                        if c * Q + l < L:
                            st = T.meta_var(_dt_stages(_Slots(t0, t1, t2, t2), dt[b, c * Q + l, h], dt_bias, h,
                                                       dt_limit, **fa))
                            t0[0] = st[0][1]
                            t1[0] = st[1][1]
                            t2[0] = st[2][1]
                        dt_out[b, h, c, l] = t2[0]
                        acc[0] = acc[0] + dA_step(t2[0], A[h])  # clamped: A = -inf gives decay 0, not NaN
                        dA_cs[b, h, c, l] = acc[0]

    return func


def _cumsum_bwd(s, TH):
    k = _Ctx(s)
    H, Q = s["nheads"], s["chunk_size"]
    fa = dict(has_dt_bias=s["has_dt_bias"], dt_softplus=s["dt_softplus"], has_dt_limit=s["has_dt_limit"])
    has_bias, has_lim = fa["has_dt_bias"], fa["has_dt_limit"]

    @T.prim_func
    def func(dt_h: T.handle, bias_h: T.handle, a_h: T.handle, lim_h: T.handle, dto_h: T.handle,
             ddto_h: T.handle, ddac_h: T.handle, ddec_h: T.handle, ddt_h: T.handle, da_h: T.handle,
             dbias_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        dt = T.match_buffer(dt_h, (Bt, L, H), F32)
        dt_bias = T.match_buffer(bias_h, (H,) if has_bias else (1,), F32)
        A = T.match_buffer(a_h, (H,), F32)
        dt_limit = T.match_buffer(lim_h, (2,) if has_lim else (1,), F32)
        dt_out = T.match_buffer(dto_h, (Bt, H, NC, Q), F32)
        ddt_out = T.match_buffer(ddto_h, (Bt, H, NC, Q), F32)
        ddA_step = T.match_buffer(ddac_h, (Bt, H, NC, Q), F32)  # per step (compute/ssd.py)
        ddecay = T.match_buffer(ddec_h, (Bt, H, NC), F32)
        ddt = T.match_buffer(ddt_h, (Bt, L, H), F32)
        dA_part = T.match_buffer(da_h, (Bt, H), F32)
        dbias_part = T.match_buffer(dbias_h, (Bt, H), F32)
        for bx in k.loop(T.ceildiv(Bt * H, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                a0 = T.alloc_buffer((1,), F32, scope=k.scope)
                a1 = T.alloc_buffer((1,), F32, scope=k.scope)
                a2 = T.alloc_buffer((1,), F32, scope=k.scope)
                t0 = T.alloc_buffer((1,), F32, scope=k.scope)
                t1 = T.alloc_buffer((1,), F32, scope=k.scope)
                t3 = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // H)
                h = T.meta_var(i % H)
                if i < Bt * H:
                    a1[0] = T.float32(0)
                    a2[0] = T.float32(0)
                    for c in range(NC):
                        for lr in range(Q):
                            l = T.meta_var(Q - 1 - lr)
                            a0[0] = ddecay[b, h, c] + ddA_step[b, h, c, l]
                            a1[0] = a1[0] + T.Select(dA_passes(dt_out[b, h, c, l], A[h]), dt_out[b, h, c, l] * a0[0],
                                                     T.float32(0))
                            if c * Q + l < L:
                                st = T.meta_var(_dt_stages(_Slots(t0, t1, t1, t3), dt[b, c * Q + l, h], dt_bias, h,
                                                           dt_limit, **fa))
                                t0[0] = st[0][1]
                                t1[0] = st[1][1]
                                t3[0] = st[3][1]
                                ddt[b, c * Q + l, h] = (ddt_out[b, h, c, l] + T.Select(
                                    dA_passes(dt_out[b, h, c, l], A[h]), A[h] * a0[0], T.float32(0))) * t3[0]
                                a2[0] = a2[0] + ddt[b, c * Q + l, h]
                    dA_part[b, h] = a1[0]
                    dbias_part[b, h] = a2[0]

    return func


def _bmm_chunk(s, TH):
    k = _Ctx(s)
    G, N, Q, bcd = s["ngroups"], s["dstate"], s["chunk_size"], s["bc_dtype"]

    @T.prim_func
    def func(b_h: T.handle, c_h: T.handle, cb_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        Bm = T.match_buffer(b_h, (Bt, L, G, N), bcd)
        Cm = T.match_buffer(c_h, (Bt, L, G, N), bcd)
        cb = T.match_buffer(cb_h, (Bt, NC, G, Q, Q), F32)
        for bx in k.loop(T.ceildiv(Bt * NC * G * Q * Q, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (NC * G * Q * Q))
                c = T.meta_var(i // (G * Q * Q) % NC)
                g = T.meta_var(i // (Q * Q) % G)
                l = T.meta_var(i // Q % Q)
                sp = T.meta_var(i % Q)
                if i < Bt * NC * G * Q * Q:
                    acc[0] = T.float32(0)
                    for n in range(N):
                        acc[0] = acc[0] + k.ld(Cm, (b, T.min(c * Q + l, L - 1), g, n), L, c * Q + l) * k.ld(
                            Bm, (b, T.min(c * Q + sp, L - 1), g, n), L, c * Q + sp)
                    cb[b, c, g, l, sp] = acc[0]

    return func


def _chunk_state(s, TH):
    k = _Ctx(s)
    H, G, P, N, Q, R = s["nheads"], s["ngroups"], s["headdim"], s["dstate"], s["chunk_size"], k.R
    xd, bcd, seq = s["x_dtype"], s["bc_dtype"], s["has_seq_idx"]

    @T.prim_func
    def func(x_h: T.handle, b_h: T.handle, dto_h: T.handle, dac_h: T.handle, s_h: T.handle, st_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        x = T.match_buffer(x_h, (Bt, L, H, P), xd)
        Bm = T.match_buffer(b_h, (Bt, L, G, N), bcd)
        dt_out = T.match_buffer(dto_h, (Bt, H, NC, Q), F32)
        dA_cs = T.match_buffer(dac_h, (Bt, H, NC, Q), F32)
        seq_idx = T.match_buffer(s_h, (Bt, L) if seq else (1, 1), I32)
        states = T.match_buffer(st_h, (Bt, NC, H, P, N), F32)
        for bx in k.loop(T.ceildiv(Bt * NC * H * P * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (NC * H * P * N))
                c = T.meta_var(i // (H * P * N) % NC)
                h = T.meta_var(i // (P * N) % H)
                p = T.meta_var(i // N % P)
                n = T.meta_var(i % N)
                if i < Bt * NC * H * P * N:
                    acc[0] = T.float32(0)
                    for l in range(T.min(Q, L - c * Q)):
                        acc[0] = acc[0] + x[b, c * Q + l, h, p].astype(F32) * dt_out[b, h, c, l] * k.w(
                            dA_cs, seq_idx, b, h, c, l, L) * Bm[b, c * Q + l, h // R, n].astype(F32)
                    states[b, c, h, p, n] = acc[0]

    return func


def _state_passing(s, TH):
    k = _Ctx(s)
    H, P, N, Q = s["nheads"], s["headdim"], s["dstate"], s["chunk_size"]
    has_init, seq = s["has_init"], s["has_seq_idx"]
    sd = s.get("state_dtype", F32)

    @T.prim_func
    def func(st_h: T.handle, dac_h: T.handle, i_h: T.handle, s_h: T.handle, sin_h: T.handle, f_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        states = T.match_buffer(st_h, (Bt, NC, H, P, N), F32)
        dA_cs = T.match_buffer(dac_h, (Bt, H, NC, Q), F32)
        init = T.match_buffer(i_h, (Bt, H, P, N) if has_init else Z4, F32)
        seq_idx = T.match_buffer(s_h, (Bt, L) if seq else (1, 1), I32)
        states_in = T.match_buffer(sin_h, (Bt, NC, H, P, N), sd)
        final = T.match_buffer(f_h, (Bt, H, P, N), F32)
        for bx in k.loop(T.ceildiv(Bt * H * P * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                cur = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (H * P * N))
                h = T.meta_var(i // (P * N) % H)
                p = T.meta_var(i // N % P)
                n = T.meta_var(i % N)
                if i < Bt * H * P * N:
                    cur[0] = init[b, h, p, n] if has_init else T.float32(0)
                    for c in range(NC):
                        states_in[b, c, h, p, n] = cur[0].astype(sd)
                        cur[0] = k.scale(dA_cs, seq_idx, b, h, c, L) * cur[0] + states[b, c, h, p, n]
                    final[b, h, p, n] = cur[0]

    return func


def _state_passing_bwd(s, TH):
    k = _Ctx(s)
    H, P, N, Q = s["nheads"], s["headdim"], s["dstate"], s["chunk_size"]
    has_init, has_df, seq = s["has_init"], s["has_dfinal"], s["has_seq_idx"]

    @T.prim_func
    def func(sin_h: T.handle, dsl_h: T.handle, dac_h: T.handle, df_h: T.handle, s_h: T.handle,
             dso_h: T.handle, di_h: T.handle, ddec_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        states_in = T.match_buffer(sin_h, (Bt, NC, H, P, N), F32)
        dsl = T.match_buffer(dsl_h, (Bt, NC, H, P, N), F32)
        dA_cs = T.match_buffer(dac_h, (Bt, H, NC, Q), F32)
        dfinal = T.match_buffer(df_h, (Bt, H, P, N) if has_df else Z4, F32)
        seq_idx = T.match_buffer(s_h, (Bt, L) if seq else (1, 1), I32)
        dso = T.match_buffer(dso_h, (Bt, NC, H, P, N), F32)
        dinit = T.match_buffer(di_h, (Bt, H, P, N) if has_init else Z4, F32)
        ddecay = T.match_buffer(ddec_h, (Bt, H, NC), F32)
        for bx in k.loop(T.ceildiv(Bt * H * P * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                cur = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (H * P * N))
                h = T.meta_var(i // (P * N) % H)
                p = T.meta_var(i // N % P)
                n = T.meta_var(i % N)
                if i < Bt * H * P * N:
                    cur[0] = dfinal[b, h, p, n] if has_df else T.float32(0)
                    for cr in range(NC):
                        c = T.meta_var(NC - 1 - cr)
                        dso[b, c, h, p, n] = cur[0]
                        cur[0] = dsl[b, c, h, p, n] + k.scale(dA_cs, seq_idx, b, h, c, L) * cur[0]
                    if has_init:
                        dinit[b, h, p, n] = cur[0]
        # second launch: ddecay_c = a_c <dS_c, Sin_c>, one thread per (batch, head, chunk), fixed order
        for bx in k.loop(T.ceildiv(Bt * H * NC, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (H * NC))
                h = T.meta_var(i // NC % H)
                c = T.meta_var(i % NC)
                if i < Bt * H * NC:
                    acc[0] = T.float32(0)
                    for pn in range(P * N):
                        acc[0] = acc[0] + dso[b, c, h, pn // N, pn % N] * states_in[b, c, h, pn // N, pn % N]
                    ddecay[b, h, c] = acc[0] * k.scale(dA_cs, seq_idx, b, h, c, L)

    return func


def _head_sum(s, TH):
    k = _Ctx(s)
    H, N, out_dtype = s["nheads"], s["dstate"], s["out_dtype"]
    G, R = k.G, k.R

    @T.prim_func
    def func(ph_h: T.handle, o_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        per_head = T.match_buffer(ph_h, (Bt, L, H, N), F32)
        out = T.match_buffer(o_h, (Bt, L, G, N), out_dtype)
        for bx in k.loop(T.ceildiv(Bt * L * G * N, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                bt = T.meta_var(i // (G * N))
                g = T.meta_var(i // N % G)
                n = T.meta_var(i % N)
                if i < Bt * L * G * N:
                    acc[0] = T.float32(0)
                    for r in range(R):
                        acc[0] = acc[0] + per_head[bt // L, bt % L, g * R + r, n]
                    out[bt // L, bt % L, g, n] = acc[0].astype(out_dtype)

    return func


# the chunk-scan templates (forward, dstates, backward) are in _ssd_scan.py, varlen states in _ssd_varlen.py
from ._ssd_scan import _chunk_scan, _chunk_scan_bwd, _chunk_scan_bwd_dstates  # noqa: E402
from ._ssd_varlen import _chunk_state_varlen  # noqa: E402

TEMPLATES = {"ssd_chunk_cumsum": _cumsum, "ssd_chunk_cumsum_bwd": _cumsum_bwd, "ssd_chunk_state": _chunk_state,
             "ssd_state_passing": _state_passing, "ssd_state_passing_bwd": _state_passing_bwd,
             "ssd_bmm_chunk": _bmm_chunk, "ssd_chunk_scan": _chunk_scan,
             "ssd_chunk_scan_bwd_dstates": _chunk_scan_bwd_dstates, "ssd_chunk_scan_bwd": _chunk_scan_bwd,
             "ssd_head_sum": _head_sum, "ssd_chunk_state_varlen": _chunk_state_varlen}


def template(name: str, static: dict, threads: int = 128, serial: bool = False):
    """The CUDA template PrimFunc of kernel ``name`` (serial=True: thread loops made serial, for CPU tests)."""
    return TEMPLATES[name](dict(static, _serial=serial), threads)


def apply(func, target, decisions: Decisions):
    """The CUDA template for an SSD kernel (same parameters as the compute builder), or None."""
    name, static = kernel_attrs(func)
    if name not in TEMPLATES:
        return None
    threads = decisions.pick("threads", (64, 128, 256), 128)
    prim = template(name, static, threads).with_attrs({"global_symbol": name, "tirx.noalias": True,
                                                        "tvm_mamba.kernel": name})
    return schedule_of(prim, name=name)
