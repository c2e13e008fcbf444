"""CPU rules for the int8 dot family.

matmul: a hand-written loop nest on AVX-512 VNNI (``vpdpbusd``: 16 int32 lanes, each += the dot product of
4 unsigned bytes with 4 signed bytes), called directly through ``T.call_llvm_pure_intrin`` (the body of
TVM's ``dot_16x4_vnni`` tensor intrinsic). Two paths in one kernel, chosen at run time on M:
- direct (M < pack_min_rows = 128; decode-like): both operands read along K, 64 bytes per vector, no
  repacking; each of the MB x NB accumulators holds 16 partial sums of one output, added horizontally at the
  end. a is offset by +128 (xor 0x80, unsigned operand) and 128 * sum_k b[n, k] is subtracted. Blocks of MO
  rows (sequential) x N/NB column tiles (parallel) x MB-row tiles x K: a b tile stays in L1 while a streams
  from L2, and b is read from memory once per MO rows. K % 64 leftovers in scalar code.
- packed (M >= 128, N % 64 == 0, K % 256 == 0): per 64-column tile and K block the b tile is repacked into
  the VNNI layout in a stack buffer (b becomes the unsigned operand), and broadcast 4-byte groups of a rows
  give 16 outputs per vpdpbusd: 6 x 4 accumulators, no horizontal sums (:func:`_packed_body`). Measured
  crossover between M = 64 (direct faster) and M = 128 (packed faster), K = N = 4096.
Both exact for every int8 input, -128 included.
Knobs: ``mb``, ``nb``, ``mo`` (direct); ``pack_mr``, ``pack_kc``, ``pack_mo``, ``pack_min_rows`` (packed).

dgrad / wgrad (the float32 straight-through backward): loop nests vectorized over the contiguous output
axis with register tiles; wgrad's sum over rows is two-stage (fixed parts, fixed order). Knobs ``vector``,
``rows``, ``k_tile``, ``row_chunk`` (dgrad register tile, float staging of the codes per k tile and row
chunk), ``k_vectors`` and ``row_tile`` (wgrad register tile and loop order). Their parameter lists are declared
once in tvm_mamba/compute/int8_dot/signature.py (``grad_kernel``, shared with the CUDA tensor-core forms): these
templates supply only the loop nests.
pack / unpack: block-scheduled (so also a MetaSchedule design space on CPU): parallel over rows, knob
``vector`` splits the contiguous axis and vectorizes the inner part (default 1: the serial loop).
"""
from __future__ import annotations

from tvm.script import tirx as T

from tvm_mamba.compute import int8_dot as int8_compute
from tvm_mamba.compute.int8_dot.dims import Int8DotDgrad, Int8DotWgrad
from tvm_mamba.compute.int8_dot.signature import grad_kernel
from tvm_mamba.schedules import rule

VEC = 64  # bytes per zmm


def _vnni(acc, u8, s8):
    """acc (int32x16) += per-lane dot of 4 bytes; u8, s8: int8x64 (the LLVM bundled with TVM 0.27 declares
    the operands <64 x i8>; TVM's own dot_16x4_vnni body passes <16 x i32> and fails to verify)."""
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                                   acc, u8, s8, dtype="int32x16")


def _matmul(N: int, K: int, MB: int, NB: int, MO: int, packed: tuple | None):
    """The VNNI matmul. ``packed`` = (MR, KC, MO2, PM): rows >= PM take the packed path (:func:`_packed_body`),
    fewer rows the direct one below; None = direct only (N % 64 or K % KC != 0)."""
    KV, KT = K // VEC, K % VEC
    KM = KV * VEC  # columns done by vpdpbusd

    def a_u8(a, m, k0):
        return T.bitwise_xor(a[m, T.ramp(k0, 1, VEC)], T.broadcast(T.int8(-128), VEC))

    @T.macro
    def direct(a, b, c, M):
        # small M (decode-like): b is streamed once from memory, each b tile (NB rows) stays in L1
        bsum = T.alloc_buffer((N,), "int32")
        for mo in range((M + MO - 1) // MO):
            for nt in T.parallel(N // NB):
                acc = T.alloc_buffer((MB * NB * 16,), "int32")
                tot = T.alloc_buffer((1,), "int32")
                if mo == 0:  # 128 * row sums of b, for the +128 offset of a (b tile then sits in L1)
                    for j in T.unroll(NB):
                        acc[T.ramp(j * 16, 1, 16)] = T.broadcast(T.int32(0), 16)
                        for kk in range(KV):
                            acc[T.ramp(j * 16, 1, 16)] = _vnni(acc[T.ramp(j * 16, 1, 16)],
                                                               T.broadcast(T.int8(1), VEC),
                                                               b[nt * NB + j, T.ramp(kk * VEC, 1, VEC)])
                        tot[0] = T.int32(0)
                        for l in range(16):
                            tot[0] = tot[0] + acc[j * 16 + l]
                        bsum[nt * NB + j] = tot[0] * 128
                rows = T.meta_var(T.min(MO, M - mo * MO))
                for mt in range(rows // MB):
                    for t in T.unroll(MB * NB):
                        acc[T.ramp(t * 16, 1, 16)] = T.broadcast(T.int32(0), 16)
                    for kk in range(KV):
                        for i in T.unroll(MB):
                            for j in T.unroll(NB):
                                acc[T.ramp((i * NB + j) * 16, 1, 16)] = _vnni(
                                    acc[T.ramp((i * NB + j) * 16, 1, 16)],
                                    a_u8(a, mo * MO + mt * MB + i, kk * VEC),
                                    b[nt * NB + j, T.ramp(kk * VEC, 1, VEC)])
                    for i in T.unroll(MB):
                        for j in T.unroll(NB):
                            tot[0] = T.int32(0) - bsum[nt * NB + j]
                            for l in range(16):
                                tot[0] = tot[0] + acc[(i * NB + j) * 16 + l]
                            for kt in range(KT):
                                tot[0] = tot[0] + T.Cast("int32", a[mo * MO + mt * MB + i, KM + kt]) * T.Cast(
                                    "int32", b[nt * NB + j, KM + kt])
                            c[mo * MO + mt * MB + i, nt * NB + j] = tot[0]
                for mr in range(rows % MB):
                    for j in T.unroll(NB):
                        acc[T.ramp(j * 16, 1, 16)] = T.broadcast(T.int32(0), 16)
                    for kk in range(KV):
                        for j in T.unroll(NB):
                            acc[T.ramp(j * 16, 1, 16)] = _vnni(
                                acc[T.ramp(j * 16, 1, 16)],
                                a_u8(a, mo * MO + rows - rows % MB + mr, kk * VEC),
                                b[nt * NB + j, T.ramp(kk * VEC, 1, VEC)])
                    for j in T.unroll(NB):
                        tot[0] = T.int32(0) - bsum[nt * NB + j]
                        for l in range(16):
                            tot[0] = tot[0] + acc[j * 16 + l]
                        for kt in range(KT):
                            tot[0] = tot[0] + T.Cast("int32", a[mo * MO + rows - rows % MB + mr, KM + kt]) * T.Cast(
                                "int32", b[nt * NB + j, KM + kt])
                        c[mo * MO + rows - rows % MB + mr, nt * NB + j] = tot[0]

    if packed is not None:
        packed_body = _packed_body(N, K, *packed[:3])
        PM = packed[3]

    @T.prim_func
    def int8_dot_matmul(a_h: T.handle, b_h: T.handle, c_h: T.handle):
        T.func_attr({"global_symbol": "int8_dot_matmul", "tirx.noalias": True})
        M = T.int32()
        a = T.match_buffer(a_h, (M, K), "int8")
        b = T.match_buffer(b_h, (N, K), "int8")
        c = T.match_buffer(c_h, (M, N), "int32")
        if packed is None:
            direct(a, b, c, M)
        else:
            if M >= PM:
                packed_body(a, b, c, M)
            else:
                direct(a, b, c, M)

    return int8_dot_matmul


XOR80 = -2139062144  # 0x80808080 as int32


def _packed_body(N: int, K: int, MR: int, KC: int, MO: int):
    """Large M: blocks of MO rows x 64 columns x KC of K. Per (64-column tile, K block) the b tile is packed
    once into a KC * 64-byte stack buffer in the VNNI layout [KC/4][64 n][4 k] (xor 0x80: b becomes the unsigned
    operand), so one vpdpbusd of a broadcast 4-byte group of a row against one packed vector gives 16
    different outputs: MR x 4 accumulators (24 zmm at MR=6), 10 loads per 24 vpdpbusd, no horizontal sums.
    The partial sums live in c between K blocks. Correction: 128 * sum_k a[m, k] (computed per row block)."""
    K4, KC4, NT = K // 4, KC // 4, N // 64

    @T.macro
    def body(a, b, c, M):
        a32 = T.decl_buffer((M, K4), "int32", data=a.data)
        b32 = T.decl_buffer((N, K4), "int32", data=b.data)
        asum = T.alloc_buffer((MO,), "int32")
        for mo in range((M + MO - 1) // MO):
            rows = T.meta_var(T.min(MO, M - mo * MO))
            for i in T.parallel(rows):
                s16 = T.alloc_buffer((16,), "int32")
                tot = T.alloc_buffer((1,), "int32")
                s16[T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
                for kk in range(K // 64):
                    s16[T.ramp(0, 1, 16)] = _vnni(s16[T.ramp(0, 1, 16)], T.broadcast(T.int8(1), 64),
                                                  a[mo * MO + i, T.ramp(kk * 64, 1, 64)])
                tot[0] = T.int32(0)
                for l in range(16):
                    tot[0] = tot[0] + s16[l]
                asum[i] = tot[0] * 128
            for nt in T.parallel(NT):
                bp = T.alloc_buffer((KC4 * 64,), "int32")
                acc = T.alloc_buffer((MR * 4 * 16,), "int32")
                for kb in range(K // KC):
                    for j in range(64):
                        for k4 in range(KC4):
                            bp[k4 * 64 + j] = T.bitwise_xor(b32[nt * 64 + j, kb * KC4 + k4], T.int32(XOR80))
                    for mt in range(rows // MR + rows % MR):
                        if mt < rows // MR:
                            _packed_tile(a32, c, bp, asum, acc, MR, KC4, mo * MO + mt * MR, mt * MR, nt, kb)
                        else:
                            _packed_tile(a32, c, bp, asum, acc, 1, KC4, mo * MO + rows - rows % MR + mt - rows // MR,
                                         rows - rows % MR + mt - rows // MR, nt, kb)

    return body


@T.macro
def _packed_tile(a32, c, bp, asum, acc, R, KC4, m0, i0, nt, kb):
    for i in T.unroll(R):
        for v in T.unroll(4):
            if kb == 0:
                acc[T.ramp((i * 4 + v) * 16, 1, 16)] = T.broadcast(T.int32(0) - asum[i0 + i], 16)
            else:
                acc[T.ramp((i * 4 + v) * 16, 1, 16)] = c[m0 + i, T.ramp(nt * 64 + v * 16, 1, 16)]
    for k4 in range(KC4):
        for i in T.unroll(R):
            for v in T.unroll(4):
                acc[T.ramp((i * 4 + v) * 16, 1, 16)] = _vnni(
                    acc[T.ramp((i * 4 + v) * 16, 1, 16)],
                    T.reinterpret("int8x64", bp[T.ramp(k4 * 64 + v * 16, 1, 16)]),
                    T.reinterpret("int8x64", T.broadcast(a32[m0 + i, kb * KC4 + k4], 16)))
    for i in T.unroll(R):
        for v in T.unroll(4):
            c[m0 + i, T.ramp(nt * 64 + v * 16, 1, 16)] = acc[T.ramp((i * 4 + v) * 16, 1, 16)]


def _largest_div(n: int, cands=(4, 2, 1)) -> int:
    return next(c for c in cands if n % c == 0) if n else 1


def _dgrad(d: Int8DotDgrad, V: int, MB: int, KT: int, MC: int):
    """out[h, m, n] = scale * sum_k g[h, m, k] * codes[h, k, n]. Parallel over (h, chunk of MC rows); per block
    of NB vectors of V columns of n and tile of KT k, the KT x NB*V codes are converted to float32 once into a
    stack tile (L1) and every MB-row register tile of the chunk (MB rows x NB vectors, <= 16 zmm) runs over it:
    each k, MB broadcasts of g and MB*NB FMAs with the tile as memory operand. Accumulators are carried through
    ``out`` between k tiles (unscaled; the scale is applied on the last tile), so every tiling sums k in order:
    bitwise equal results. The conversion is amortized over MC rows, and codes are read once per chunk. (The
    earlier schedule converted NB codes vectors per k inside the register tile: 1.2-1.4x slower at K = 1024.)
    Rows past the last full MB tile: one-row tiles; N % V columns: a scalar loop. Its parameter list: grad_kernel."""
    H, N, K = d.heads, d.N, d.K
    NV, NT = N // V, N % V
    NB = _largest_div(NV, tuple(c for c in (4, 2, 1) if c * MB <= 16))
    NKT = (K + KT - 1) // KT

    @T.macro
    def tile(g, cf, scale, out, acc, R, h, m0, jb, k0, kn, kt):
        for r in T.unroll(R):
            for t in T.unroll(NB):
                for i in T.vectorized(V):
                    acc[(r * NB + t) * V + i] = T.if_then_else(kt > 0, out[h, m0 + r, (jb * NB + t) * V + i],
                                                               T.float32(0))
        for kk in range(kn):
            for r in T.unroll(R):
                for t in T.unroll(NB):
                    for i in T.vectorized(V):
                        acc[(r * NB + t) * V + i] = acc[(r * NB + t) * V + i] + g[h, m0 + r, k0 + kk] * cf[
                            (kk * NB + t) * V + i]
        for r in T.unroll(R):
            for t in T.unroll(NB):
                for i in T.vectorized(V):
                    out[h, m0 + r, (jb * NB + t) * V + i] = acc[(r * NB + t) * V + i] * T.if_then_else(
                        kt == NKT - 1, scale[0], T.float32(1))

    @T.macro
    def body(g, codes, scale, out, M):
        for hc in T.parallel(H * ((M + MC - 1) // MC)):
            cf = T.alloc_buffer((KT * NB * V,), "float32")
            acc = T.alloc_buffer((MB * NB * V,), "float32")
            tac = T.alloc_buffer((1,), "float32")
            h = T.meta_var(hc // ((M + MC - 1) // MC))
            m_lo = T.meta_var(hc % ((M + MC - 1) // MC) * MC)
            rows = T.meta_var(T.min(MC, M - m_lo))
            for jb in range(NV // NB):
                for kt in range(NKT):
                    for kk in range(T.min(KT, K - kt * KT)):
                        for t in T.unroll(NB):
                            for i in T.vectorized(V):
                                cf[(kk * NB + t) * V + i] = T.Cast("float32", codes[h, kt * KT + kk, (jb * NB + t) * V + i])
                    for rb in range(rows // MB):
                        tile(g, cf, scale, out, acc, MB, h, m_lo + rb * MB, jb, kt * KT, T.min(KT, K - kt * KT), kt)
                    for r in range(rows % MB):
                        tile(g, cf, scale, out, acc, 1, h, m_lo + rows - rows % MB + r, jb, kt * KT,
                             T.min(KT, K - kt * KT), kt)
            for r in range(rows):
                for nt in range(NT):
                    tac[0] = T.float32(0)
                    for k in range(K):
                        tac[0] = tac[0] + g[h, m_lo + r, k] * T.Cast("float32", codes[h, k, NV * V + nt])
                    out[h, m_lo + r, NV * V + nt] = tac[0] * scale[0]

    return grad_kernel(d, body)


def _wgrad(d: Int8DotWgrad, V: int, KBM: int = 4, RT: int = 0):
    """Stage 1: part p, head h, KB vectors of k: partial[p, h, n, k] = sum over the part's rows m (in order)
    of codes[h|0, m, n] * g[h, m, k]; register tile NB x KB vectors (each m: NB int8 broadcasts, KB loads of
    g, NB*KB FMAs). Parallel over (part, head, k block). Loop order, knob ``row_tile`` (RT):
    - 0: for one (p, h, k block) the NB-column blocks of n run over all the part's rows, so the part's rows
      x KB*V floats of g (128 KiB at 512 rows x 64) are streamed from L2 by every column block;
    - RT > 0: the part's rows are taken RT at a time, and every column block runs over those rows before the
      next tile (its accumulators carried through ``partial``), so the RT x KB*V floats of g stay in L1.
      Same per-element summation order as 0: bitwise equal results.
    K % V columns: scalar loop. Stage 2: out[h, n, k] = scale * sum_p partial[p, h, n, k], parts in order.
    Parallel over (h, n). Its parameter list: grad_kernel."""
    H, CH, N, K = d.heads, d.code_heads, d.N, d.K
    KV, KT = K // V, K % V
    KB = _largest_div(KV, tuple(c for c in (8, 4, 2, 1) if c <= KBM))
    NB = _largest_div(N, tuple(c for c in (4, 2, 1) if c * KB <= 16))  # <= 16 accumulators
    NNB, NKB = N // NB, KV // KB
    NKB1 = max(NKB, 1)  # divisor in the index math of a loop that runs 0 times when K < V

    def hc(h):
        return h if CH > 1 else 0

    @T.macro
    def column_block(codes, g, partial, acc, p, h, k0, nb, m0, rows, carry):
        for t in T.unroll(NB):
            for u in T.unroll(KB):
                for i in T.vectorized(V):
                    acc[(t * KB + u) * V + i] = T.if_then_else(carry, partial[p, h, nb * NB + t, k0 + u * V + i],
                                                               T.float32(0))
        for q in range(rows):
            for t in T.unroll(NB):
                for u in T.unroll(KB):
                    for i in T.vectorized(V):
                        acc[(t * KB + u) * V + i] = acc[(t * KB + u) * V + i] + T.Cast(
                            "float32", codes[hc(h), m0 + q, nb * NB + t]) * g[h, m0 + q, k0 + u * V + i]
        for t in T.unroll(NB):
            for u in T.unroll(KB):
                for i in T.vectorized(V):
                    partial[p, h, nb * NB + t, k0 + u * V + i] = acc[(t * KB + u) * V + i]

    @T.macro
    def part_rows(codes, g, partial, acc, p, h, k0, m0, rows):
        if RT == 0:
            for nb in range(NNB):
                column_block(codes, g, partial, acc, p, h, k0, nb, m0, rows, False)
        else:
            for qo in range((rows + RT - 1) // RT):
                for nb in range(NNB):
                    column_block(codes, g, partial, acc, p, h, k0, nb, m0 + qo * RT, T.min(RT, rows - qo * RT), qo > 0)

    @T.macro
    def body(codes, g, scale, out, partial, M, nparts):
        chunk = T.meta_var((M + nparts - 1) // nparts)
        for phk in T.parallel(nparts * H * NKB):
            acc = T.alloc_buffer((NB * KB * V,), "float32")
            p = T.meta_var(phk // (H * NKB1))
            part_rows(codes, g, partial, acc, p, phk // NKB1 % H, phk % NKB1 * KB * V, p * chunk,
                      T.max(T.min(chunk, M - p * chunk), 0))
        for phn in T.parallel(nparts * H * NNB * T.min(KT, 1)):
            tac = T.alloc_buffer((NB,), "float32")
            p = T.meta_var(phn // (H * NNB))
            h = T.meta_var(phn // NNB % H)
            n0 = T.meta_var(phn % NNB * NB)
            for kt in range(KT):
                for t in T.unroll(NB):
                    tac[t] = T.float32(0)
                for q in range(T.max(T.min(chunk, M - p * chunk), 0)):
                    for t in T.unroll(NB):
                        tac[t] = tac[t] + T.Cast("float32", codes[hc(h), p * chunk + q, n0 + t]) * g[
                            h, p * chunk + q, KV * V + kt]
                for t in T.unroll(NB):
                    partial[p, h, n0 + t, KV * V + kt] = tac[t]
        for hn in T.parallel(H * N):
            a2 = T.alloc_buffer((V,), "float32")
            t2 = T.alloc_buffer((1,), "float32")
            for kv in range(KV):
                for i in T.vectorized(V):
                    a2[i] = T.float32(0)
                for p in range(nparts):
                    for i in T.vectorized(V):
                        a2[i] = a2[i] + partial[p, hn // N, hn % N, kv * V + i]
                for i in T.vectorized(V):
                    out[hn // N, hn % N, kv * V + i] = a2[i] * scale[0]
            for kt in range(KT):
                t2[0] = T.float32(0)
                for p in range(nparts):
                    t2[0] = t2[0] + partial[p, hn // N, hn % N, KV * V + kt]
                out[hn // N, hn % N, KV * V + kt] = t2[0] * scale[0]

    return grad_kernel(d, body)


def _has_vnni(target) -> bool:
    mcpu = str(target.attrs.get("mcpu", ""))
    # LLVM CPUs with AVX512-VNNI (Cascade Lake and later Intel server/client parts, Zen 4/5)
    return mcpu in ("cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                    "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5", "alderlake",
                    "raptorlake", "meteorlake", "arrowlake", "lunarlake", "pantherlake", "graniterapids-d")


def lay_out(kernel: str, d, target, decisions: rule.Decisions):
    """The int8_dot kernels' CPU loop nests (pack / unpack: their compute scheduled), or None for another
    kernel or target, and for the matmul without VNNI (the dispatcher's unscheduled TE: LLVM vectorizes it)."""
    if "cpu" not in target.keys:
        return None
    name = f"int8_dot_{kernel}"
    if kernel == "matmul":
        N, K = d.N, d.K
        if not _has_vnni(target):
            return None  # no VNNI: the unscheduled TE (LLVM auto-vectorizes the int32 dot)
        nbs = tuple(v for v in (4, 2, 1) if N % v == 0)
        NB = decisions.pick("nb", nbs, nbs[0])
        MB = decisions.pick("mb", (1, 2, 4, 6, 8), 4)
        MO = decisions.pick("mo", (32, 64, 128, 256), 64)
        packed = None
        kcs = tuple(v for v in (256, 512, 1024, 2048, 4096) if K % v == 0)
        if N % 64 == 0 and kcs:
            MR = decisions.pick("pack_mr", (4, 6), 6)
            # defaults measured at M = 512 / 2048, K = N = 4096: the longest K block (fewest partial-sum passes
            # over c) and 2048-row blocks (b packed once per 2048 rows): 15.6 / 52.7 ms vs 16.7 / 66.4 ms at
            # (pack_mo 256, pack_kc 512); the packed b tile is KC * 64 bytes of stack (256 KiB at 4096)
            KC = decisions.pick("pack_kc", kcs, kcs[-1])
            MO2 = decisions.pick("pack_mo", (128, 256, 512, 1024, 2048), 2048)
            PM = decisions.pick("pack_min_rows", (64, 128, 256, 1 << 30), 128)
            packed = (MR, KC, MO2, PM)
        return rule.schedule_of(_matmul(N, K, MB, NB, MO, packed), name)
    if kernel == "dgrad":
        V = decisions.pick("vector", (16, 8), 16)
        MB = decisions.pick("rows", (1, 2, 4, 8), 4)
        # k_tile 64: a 64 x 64-float staged codes tile (16 KiB) fits any L1d of 32 KiB or more
        KT = decisions.pick("k_tile", (64, 128, 256), 64)
        MC = decisions.pick("row_chunk", (32, 64, 128, 256), 64)
        return rule.schedule_of(_dgrad(d, V, MB, KT, MC), name)
    if kernel == "wgrad":
        V = decisions.pick("vector", (16, 8), 16)
        KBM = decisions.pick("k_vectors", (2, 4, 8), 4)
        # row_tile 64: the g tile (64 rows x KB*V floats = 16 KiB) fits any L1d of 32 KiB or more; 0 was the
        # hand schedule before the knob (1.6-1.9x slower at K = 2048 here), 128 / 256 are for larger L1s
        RT = decisions.pick("row_tile", (0, 64, 128, 256), 64)
        return rule.schedule_of(_wgrad(d, V, KBM, RT), name)
    if kernel in ("pack", "unpack"):
        # block-scheduled (a MetaSchedule design space on CPU too): rows in parallel; the contiguous axis
        # (K/4 words or K bytes) split by ``vector`` and the inner part vectorized (1: the plain serial loop,
        # today's hand schedule, left to LLVM's loop vectorizer)
        sch = rule.schedule_compute(int8_compute.KERNELS[kernel](d), name)
        blk = sch.get_sblock("packed" if kernel == "pack" else "codes")
        r, j = sch.get_loops(blk)
        extent = (d.K + 3) // 4 if kernel == "pack" else d.K
        lanes = (4, 8, 16, 32) if kernel == "pack" else (16, 32, 64)
        vec = decisions.pick("vector", (1,) + tuple(v for v in lanes if extent % v == 0), 1)
        _, ji = sch.split(j, [None, vec])
        sch.vectorize(ji)
        sch.parallel(r)
        return sch
    return None
