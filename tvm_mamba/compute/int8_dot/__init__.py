"""Int8 packed dot family as TE: exact int8 x int8 -> int32 matmul and the i8x4 pack / unpack.

    matmul: c[m, n] = sum_k a[m, k] * b[n, k]  (int32 accumulation; a: (M, K), b: (N, K), both int8)
    pack:   packed[r, j] = sum_i (codes[r, 4j+i] & 0xff) << 8i   (zero padded past K; little-endian lanes)
    unpack: codes[r, k] = sign-extended byte (k % 4) of packed[r, k // 4]
    dgrad:  out[h, m, n] = scale * sum_k g[h, m, k] * codes[h, k, n]         (float32; straight-through)
    wgrad:  out[h, n, k] = scale * sum_m codes[h|0, m, n] * g[h, m, k]       (float32; two-stage over m)

M / rows are symbolic; N and K are static. These TE definitions are the semantic source of truth and what
the CUDA rules schedule (dp4a tensorize); the CPU rule emits a VNNI loop nest with the same parameters
(schedules/cpu/int8_dot.py). The hand-written dgrad / wgrad loop nests (the CPU templates, the CUDA
tensor-core forms) take their parameter lists, declared once to match the TE definitions here, from
signature.py (``grad_kernel``; TVMScript, so imported by those rules, not by this module).
Every builder takes ``storage``: how its int8 tensors are held, as bytes (the default) or, for a target without
8-bit buffers (WebGPU), as the 32-bit words of the same bytes (codes.py); the math is the same.
"""
from __future__ import annotations

from tvm import te, tirx

from .._common import stamp
from .codes import BYTES, WORDS, Storage  # noqa: F401  (how the 8-bit tensors are held: bytes or words)
from .dims import DIMS, Int8DotDgrad, Int8DotMatmul, Int8DotPacking, Int8DotWgrad  # noqa: F401  (the op's typed dims)


def int8_dot_matmul(*dims, storage: Storage = BYTES, **fields) -> tirx.PrimFunc:
    """a: (M, K) int8, b: (N, K) int8 -> c: (M, N) int32; c[m, n] = sum_k a[m, k] * b[n, k] (exact).
    ``dims``: an :class:`Int8DotMatmul`, or its fields ``N, K``; a and b held as ``storage`` says."""
    d = Int8DotMatmul.of(*dims, **fields)
    N, K = d.N, d.K
    M = te.var("M")
    a = storage.placeholder((M, K), "int8", "a")
    b = storage.placeholder((N, K), "int8", "b")
    k = te.reduce_axis((0, K), name="K")

    def at(buf, rows, r):
        return storage.read(buf, (rows, K), "int8", (r, k), "int32")

    c = te.compute((M, N), lambda m, n: te.sum(at(a, M, m) * at(b, N, n), axis=k), name="c")
    return stamp(te.create_prim_func([a, b, c]), "int8_dot_matmul")


def _packing(dims, fields) -> tuple[int, int, tirx.Var]:
    """(K, words per packed row ceil(K/4), the symbolic row count) of a pack / unpack builder's dims."""
    K = Int8DotPacking.of(*dims, **fields).K
    return K, (K + 3) // 4, te.var("rows")


def int8_dot_pack(*dims, storage: Storage = BYTES, **fields) -> tirx.PrimFunc:
    """codes: (rows, K) int8 -> packed: (rows, ceil(K/4)) int32, byte i of word j = codes[:, 4j+i] (0 past K).
    ``dims``: an :class:`Int8DotPacking`, or ``K``; codes held as ``storage`` says."""
    K, W, rows = _packing(dims, fields)
    codes = storage.placeholder((rows, K), "int8", "codes")

    def word(r, j):
        acc = tirx.const(0, "int32")
        for i in range(4):
            kk = 4 * j + i
            code = storage.read(codes, (rows, K), "int8", (r, tirx.min(kk, K - 1)), "int32")
            byte = tirx.if_then_else(kk < K, code & 0xFF, 0)
            acc = acc | (byte << (8 * i))
        return acc

    packed = te.compute((rows, W), word, name="packed")
    return stamp(te.create_prim_func([codes, packed]), "int8_dot_pack")


def int8_dot_unpack(*dims, storage: Storage = BYTES, **fields) -> tirx.PrimFunc:
    """packed: (rows, ceil(K/4)) int32 -> codes: (rows, K) int8; inverse of :func:`int8_dot_pack`.
    ``dims``: an :class:`Int8DotPacking`, or ``K``; codes held as ``storage`` says."""
    K, W, rows = _packing(dims, fields)
    packed = te.placeholder((rows, W), "int32", name="packed")
    # shift the wanted byte to the top, then arithmetic-shift it down: sign extension in one step
    codes = storage.output((rows, K), "int8", lambda r, k: (packed[r, k // 4] << (24 - 8 * (k % 4))) >> 24,
                           "codes")
    return stamp(te.create_prim_func([packed, codes]), "int8_dot_unpack")


def int8_dot_dgrad(*dims, storage: Storage = BYTES, **fields) -> tirx.PrimFunc:
    """Straight-through input gradient, a float x codes matmul (the scale is a device tensor, no host sync).

    g: (heads, M, K) float32, codes: (heads, K, N) int8, scale: (1,) float32 -> out: (heads, M, N) float32;
    out[h, m, n] = scale * sum_k g[h, m, k] * codes[h, k, n]. (Projection: k = latent (h, l), n = E;
    decoder tail: k = D, n = (h, l).) M is symbolic. ``dims``: an :class:`Int8DotDgrad`, or its fields; codes
    held as ``storage`` says.
    """
    d = Int8DotDgrad.of(*dims, **fields)
    heads, N, K = d.heads, d.N, d.K
    M = te.var("M")
    g = te.placeholder((heads, M, K), "float32", name="g")
    codes = storage.placeholder((heads, K, N), "int8", "codes")
    scale = te.placeholder((1,), "float32", name="scale")
    k = te.reduce_axis((0, K), name="K")

    def code(h, n):
        return storage.read(codes, (heads, K, N), "int8", (h, k, n), "float32")

    acc = te.compute((heads, M, N), lambda h, m, n: te.sum(g[h, m, k] * code(h, n), axis=k), name="acc")
    out = te.compute((heads, M, N), lambda h, m, n: acc[h, m, n] * scale[0], name="out")
    return stamp(te.create_prim_func([g, codes, scale, out]), "int8_dot_dgrad")


def int8_dot_wgrad(*dims, storage: Storage = BYTES, **fields) -> tirx.PrimFunc:
    """Straight-through weight gradient, codes^T x float summed over the rows M = batch*T in two stages.

    codes: (code_heads, M, N) int8 (code_heads 1 = shared by every head), g: (heads, M, K) float32,
    scale: (1,) float32 -> out: (heads, N, K) float32 and partial: (nparts, heads, N, K) float32 (stage 1:
    part p sums rows [p*chunk, (p+1)*chunk) in order, chunk = ceil(M/nparts); stage 2 adds the parts in
    order: deterministic, no atomics). out[h, n, k] = scale * sum_m codes[h|0, m, n] * g[h, m, k].
    ``dims``: an :class:`Int8DotWgrad`, or its fields; codes held as ``storage`` says.
    """
    d = Int8DotWgrad.of(*dims, **fields)
    heads, code_heads, N, K = d.heads, d.code_heads, d.N, d.K
    M = te.var("M")
    nparts = te.var("nparts")
    codes = storage.placeholder((code_heads, M, N), "int8", "codes")
    g = te.placeholder((heads, M, K), "float32", name="g")
    scale = te.placeholder((1,), "float32", name="scale")
    chunk = tirx.indexdiv(M + nparts - 1, nparts)
    j = te.reduce_axis((0, chunk), name="chunk")

    def part(p, h, n, kk):
        m = tirx.min(p * chunk + j, M - 1)
        code = storage.read(codes, (code_heads, M, N), "int8", (h if code_heads > 1 else 0, m, n), "float32")
        v = code * g[h, m, kk]
        # te.sum(where=...) is dropped by create_prim_func in TVM 0.27: mask the summand instead
        return te.sum(tirx.if_then_else(p * chunk + j < M, v, tirx.const(0.0, "float32")), axis=j)

    partial = te.compute((nparts, heads, N, K), part, name="partial")
    pa = te.reduce_axis((0, nparts), name="nparts")
    acc = te.compute((heads, N, K), lambda h, n, kk: te.sum(partial[pa, h, n, kk], axis=pa), name="acc")
    out = te.compute((heads, N, K), lambda h, n, kk: acc[h, n, kk] * scale[0], name="out")
    return stamp(te.create_prim_func([codes, g, scale, out, partial]), "int8_dot_wgrad")


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static_dims, dtypes) for the CUDA build-check: the issue's K = N = 4096 matmul, a
    low-rank projection shape (E=1024 -> Lc=128) and the packing kernels."""
    dims = [("matmul", Int8DotMatmul(N=4096, K=4096)), ("matmul", Int8DotMatmul(N=128, K=1024)),
            ("pack", Int8DotPacking(K=4096)), ("unpack", Int8DotPacking(K=4096)),
            # straight-through backward: projection H=8, E=1024, latent 128 (per head, and heads summed
            # for input_heads=1), decoder tail H*L=1024 -> D=2048
            ("dgrad", Int8DotDgrad(heads=8, N=1024, K=128)), ("dgrad", Int8DotDgrad(heads=1, N=1024, K=1024)),
            ("wgrad", Int8DotWgrad(heads=8, code_heads=1, N=1024, K=128)),
            ("wgrad", Int8DotWgrad(heads=1, code_heads=1, N=1024, K=2048))]
    return [(direction, *d.key_parts()) for direction, d in dims]


def wgrad_parts(M: int, heads: int, K: int) -> int:
    """Stage-1 parts of the weight-gradient sum over rows, a function of the shapes only (the same bits on
    every machine and thread count): one part per 512 rows, at most 8, and no more than it takes to give
    64 parallel (part, head, 64-column block) tasks. More parts only cost their partial buffer
    (parts x heads x N x K floats): at M = 4096, N = 1024, K = 2048 the op takes 130 ms with 8 parts, 114 ms
    with 2 (the 32 column blocks already keep 2 cores busy)."""
    blocks = heads * -(-K // 64)
    return max(1, min(8, M // 512, -(-64 // blocks)))


def derived_dims(direction: str, dims: dict, static: dict) -> dict:
    """Dynamic dims that follow from the others (for tuning-time inputs): wgrad's stage-1 part count,
    as torch_ops/int8_dot.py allocates it."""
    if direction == "wgrad" and "M" in dims:
        return {"nparts": wgrad_parts(dims["M"], static["heads"], static["K"])}
    return {}


# direction -> builder(dims) -> PrimFunc: this op's kernels (runtime/registry.py reads this table)
KERNELS = {"matmul": int8_dot_matmul, "pack": int8_dot_pack, "unpack": int8_dot_unpack, "dgrad": int8_dot_dgrad,
           "wgrad": int8_dot_wgrad}
