"""CPU rules for the int8 dot family.

matmul: a hand-written loop nest on AVX-512 VNNI (``vpdpbusd``: 16 int32 lanes, each += the dot product of
4 unsigned bytes with 4 signed bytes), called directly through ``T.call_llvm_pure_intrin`` (the body of
TVM's ``dot_16x4_vnni`` tensor intrinsic). Layout: both operands are read along K, 64 bytes per vector, so
neither a nor b needs repacking; each of the MB x NB accumulators holds 16 partial sums of one output,
added horizontally once at the end. Signedness: vpdpbusd wants one unsigned operand, so a is offset by
+128 (xor 0x80) and 128 * sum_k b[n, k] (one more vpdpbusd against ones, once per n) is subtracted:
exact for every int8 input. K % 64 leftover columns are done in scalar code.
Loop order: blocks of MO rows (sequential) x N/NB column tiles (parallel) x MB-row tiles x K; the NB rows
of b of a tile stay in L1 while the MO rows of a stream from L2.
Knobs: ``mb`` (rows per tile), ``nb`` (b rows per tile), ``mo`` (rows per L2 block).

pack / unpack: parallel over rows; elementwise, default (unscheduled TE, serial per row) inner loops.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from tvm_mamba.schedules import rule

VEC = 64  # bytes per zmm


def _vnni(acc, u8, s8):
    """acc (int32x16) += per-lane dot of 4 bytes; u8, s8: int8x64 (the LLVM bundled with TVM 0.27 declares
    the operands <64 x i8>; TVM's own dot_16x4_vnni body passes <16 x i32> and fails to verify)."""
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                                   acc, u8, s8, dtype="int32x16")


def _matmul(N: int, K: int, MB: int, NB: int, MO: int):
    KV, KT = K // VEC, K % VEC
    KM = KV * VEC  # columns done by vpdpbusd

    def a_u8(a, m, k0):
        return T.bitwise_xor(a[m, T.ramp(k0, 1, VEC)], T.broadcast(T.int8(-128), VEC))

    @T.prim_func
    def int8_dot_matmul(a_h: T.handle, b_h: T.handle, c_h: T.handle):
        T.func_attr({"global_symbol": "int8_dot_matmul", "tirx.noalias": True})
        M = T.int32()
        a = T.match_buffer(a_h, (M, K), "int8")
        b = T.match_buffer(b_h, (N, K), "int8")
        c = T.match_buffer(c_h, (M, N), "int32")
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

    return int8_dot_matmul


def _has_vnni(target) -> bool:
    mcpu = str(target.attrs.get("mcpu", ""))
    # LLVM CPUs with AVX512-VNNI (Cascade Lake and later Intel server/client parts, Zen 4/5)
    return mcpu in ("cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                    "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5", "alderlake",
                    "raptorlake", "meteorlake", "arrowlake", "lunarlake", "pantherlake", "graniterapids-d")


def apply(func, target, decisions: rule.Decisions):
    """Loop-nest schedule for int8_dot kernels, or None for a foreign PrimFunc."""
    name, st = rule.kernel_attrs(func)
    if name == "int8_dot_matmul":
        N, K = st["N"], st["K"]
        if not _has_vnni(target):
            return None  # no VNNI: the unscheduled TE (LLVM auto-vectorizes the int32 dot)
        nbs = tuple(v for v in (4, 2, 1) if N % v == 0)
        NB = decisions.pick("nb", nbs, nbs[0])
        MB = decisions.pick("mb", (1, 2, 4, 6, 8), 4)
        MO = decisions.pick("mo", (32, 64, 128, 256), 64)
        return rule.schedule_of(_matmul(N, K, MB, NB, MO), name=name)
    if name in ("int8_dot_pack", "int8_dot_unpack"):
        sch = rule.schedule_of(func, name=name)
        blk = sch.get_sblock("packed" if name == "int8_dot_pack" else "codes")
        sch.parallel(sch.get_loops(blk)[0])
        return sch
    return None
