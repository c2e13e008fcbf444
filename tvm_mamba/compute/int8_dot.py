"""Int8 packed dot family as TE: exact int8 x int8 -> int32 matmul and the i8x4 pack / unpack.

    matmul: c[m, n] = sum_k a[m, k] * b[n, k]  (int32 accumulation; a: (M, K), b: (N, K), both int8)
    pack:   packed[r, j] = sum_i (codes[r, 4j+i] & 0xff) << 8i   (zero padded past K; little-endian lanes)
    unpack: codes[r, k] = sign-extended byte (k % 4) of packed[r, k // 4]

M / rows are symbolic; N and K are static. These TE definitions are the semantic source of truth and what
the CUDA rules schedule (dp4a tensorize); the CPU rule emits a VNNI loop nest with the same parameters
(schedules/cpu/int8_dot.py).
"""
from __future__ import annotations

from tvm import te, tirx

from ._common import stamp


def _check_pos(name: str, v: int) -> None:
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: must be a positive int, got {v!r}")


def int8_dot_matmul(N: int, K: int) -> tirx.PrimFunc:
    """a: (M, K) int8, b: (N, K) int8 -> c: (M, N) int32; c[m, n] = sum_k a[m, k] * b[n, k] (exact)."""
    _check_pos("N", N)
    _check_pos("K", K)
    M = te.var("M")
    a = te.placeholder((M, K), "int8", name="a")
    b = te.placeholder((N, K), "int8", name="b")
    k = te.reduce_axis((0, K), name="K")
    c = te.compute((M, N), lambda m, n: te.sum(a[m, k].astype("int32") * b[n, k].astype("int32"), axis=k),
                   name="c")
    return stamp(te.create_prim_func([a, b, c]), "int8_dot_matmul", dict(N=N, K=K))


def int8_dot_pack(K: int) -> tirx.PrimFunc:
    """codes: (rows, K) int8 -> packed: (rows, ceil(K/4)) int32, byte i of word j = codes[:, 4j+i] (0 past K)."""
    _check_pos("K", K)
    W = (K + 3) // 4
    rows = te.var("rows")
    codes = te.placeholder((rows, K), "int8", name="codes")

    def word(r, j):
        acc = tirx.const(0, "int32")
        for i in range(4):
            kk = 4 * j + i
            byte = tirx.if_then_else(kk < K, codes[r, tirx.min(kk, K - 1)].astype("int32") & 0xFF, 0)
            acc = acc | (byte << (8 * i))
        return acc

    packed = te.compute((rows, W), word, name="packed")
    return stamp(te.create_prim_func([codes, packed]), "int8_dot_pack", dict(K=K))


def int8_dot_unpack(K: int) -> tirx.PrimFunc:
    """packed: (rows, ceil(K/4)) int32 -> codes: (rows, K) int8; inverse of :func:`int8_dot_pack`."""
    _check_pos("K", K)
    W = (K + 3) // 4
    rows = te.var("rows")
    packed = te.placeholder((rows, W), "int32", name="packed")
    # shift the wanted byte to the top, then arithmetic-shift it down: sign extension in one step
    codes = te.compute(
        (rows, K),
        lambda r, k: ((packed[r, k // 4] << (24 - 8 * (k % 4))) >> 24).astype("int8"), name="codes")
    return stamp(te.create_prim_func([packed, codes]), "int8_dot_unpack", dict(K=K))


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static_dims, dtypes) for the CUDA build-check: the issue's K = N = 4096 matmul, a
    low-rank projection shape (E=1024 -> Lc=128) and the packing kernels."""
    return [("matmul", dict(N=4096, K=4096), {}), ("matmul", dict(N=128, K=1024), {}),
            ("pack", dict(K=4096), {}), ("unpack", dict(K=4096), {})]
