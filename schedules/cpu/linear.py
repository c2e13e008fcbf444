"""CPU rule for linear (compute/linear/): vector loop nests for the weight-streaming GEMV and the GEMM.

fwd: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]). At decode (1..8 rows) the step is bound by
reading w once, so the loop nest streams each weight row exactly once per call and keeps x (rows x K floats,
<= 48 KiB at K = 1536, 8 rows) in L1/L2:
- parallel over tasks of (a block of ``row_block`` rows, ``task`` consecutive output features): each task
  reads task x K contiguous weights; a block's rows of x stay in L2 across its tasks (prefill-size calls; a
  decode call is one block);
- inside a task, tiles of ``rows`` rows of x (the block's rows % rows left over: one tile of that many rows)
  against ``features`` output features (fewer where rows x features x unroll would pass the accumulators,
  half the vector registers): one register accumulator per (row, feature, unrolled k vector), features x
  unroll weight vectors loaded and widened to float32 per k step (bf16: the 16 bits shifted into the top of
  a float32 lane; int8: sign-extend + convert), each used by every row of the tile. A row tile reads the
  task's weights (task x K) once; a further row tile rereads them from L2. Default one feature per tile: the
  weights are then read as one sequential stream (see ``lay_out``);
- lanes and unrolled accumulators summed at the end, K % vector columns in scalar code, then scale, bias and
  the cast to x's dtype.
Summation order: lane-strided partial sums (k = i mod vector*unroll), the unrolled ones folded, then the
lanes as a tree: a function of ``vector`` and ``unroll`` only (the same bits at any thread count, and for
a row whatever tile or block it falls in: at any number of rows). Calls of at most SERIAL_WORK multiply-adds
run on the calling thread.

bwd: dx[m, k] = sum_n dy[m, n] * scale[n] * w[n, k]: parallel over blocks of ``vector`` x ``k_vectors``
columns of k; per row, the n loop streams the weight block (contiguous along k) with register accumulators.
It serves autograd of the frozen-weight inference op (correctness first; training keeps fp32 nn.Linear).

Knobs: fwd ``task``, ``row_block``, ``features``, ``rows``, ``vector`` (default: the target's float lanes),
``unroll``; bwd ``vector``, ``k_vectors``.
"""
from __future__ import annotations

from tvm.script import tirx as T

from tvm_mamba.compute.linear import LinearDims
from tvm_mamba.schedules import rule



def _accumulators(lanes: int) -> int:
    """Register accumulators a tile may use: half the vector registers (the rest hold the weight and x
    vectors), 16 of AVX-512's 32 zmm, 8 of AVX2's 16 ymm; a tile of R rows holds at most that // (R * unroll)
    features."""
    return 16 if lanes == 16 else 8


def _widen(buf, bits, row, k0, V: int, dtype: str):
    """V consecutive elements of buf[row, k0:k0+V] as float32xV. bf16: the raw 16 bits (``bits``, a uint16
    view of the same buffer) shifted left by 16 are the float32 pattern (exact: bf16 is truncated fp32)."""
    if dtype == "bfloat16":
        u = T.Cast(f"uint32x{V}", bits[row, T.ramp(k0, 1, V)])
        return T.reinterpret(f"float32x{V}", T.shift_left(u, T.broadcast(T.uint32(16), V)))
    if dtype == "float32":
        return buf[row, T.ramp(k0, 1, V)]
    return T.Cast(f"float32x{V}", buf[row, T.ramp(k0, 1, V)])


def _fwd(d: LinearDims, TN: int, NB: int, MB: int, V: int, U: int, MR: int, ACC: int):
    K, N = d.in_features, d.out_features
    KU = K // (V * U)  # k steps of U vectors
    K1 = (K - KU * V * U) // V  # leftover whole vectors
    KS = KU * V * U + K1 * V  # columns done in vector code; [KS, K) scalar
    NT = (N + TN - 1) // TN
    xd, wd = d.x_dtype, d.weight_dtype
    def fb(R: int) -> int:  # features per tile of R rows: R x features x unroll accumulators, at most ACC
        return max(1, min(NB, ACC // (R * U)))

    A = max(R * fb(R) for R in range(1, MB + 1)) * U  # accumulators of the largest tile

    @T.macro
    def tile(x, xb, w, wb, scale, bias, y, acc, tot, R, F, m0, n0):
        for a in T.unroll(R * F * U):
            acc[T.ramp(a * V, 1, V)] = T.broadcast(T.float32(0), V)
        for ks in range(KU):
            for u in T.unroll(U):
                for j in T.unroll(F):
                    for r in T.unroll(R):
                        acc[T.ramp(((r * F + j) * U + u) * V, 1, V)] = acc[T.ramp(((r * F + j) * U + u) * V, 1, V)] + \
                            _widen(x, xb, m0 + r, (ks * U + u) * V, V, xd) * _widen(w, wb, n0 + j, (ks * U + u) * V, V, wd)
        for k1 in range(K1):
            for j in T.unroll(F):
                for r in T.unroll(R):
                    acc[T.ramp((r * F + j) * U * V, 1, V)] = acc[T.ramp((r * F + j) * U * V, 1, V)] + \
                        _widen(x, xb, m0 + r, KU * U * V + k1 * V, V, xd) * _widen(w, wb, n0 + j, KU * U * V + k1 * V, V, wd)
        for r in T.unroll(R):
            for j in T.unroll(F):
                for u in T.unroll(1, U):  # fold the unrolled accumulators into the first, lane-wise
                    acc[T.ramp((r * F + j) * U * V, 1, V)] = acc[T.ramp((r * F + j) * U * V, 1, V)] + \
                        acc[T.ramp(((r * F + j) * U + u) * V, 1, V)]
                # lanes summed as a tree (halves added lane-wise): 4 dependent adds, not V
                if V == 16:
                    acc[T.ramp((r * F + j) * U * V, 1, 8)] = acc[T.ramp((r * F + j) * U * V, 1, 8)] + \
                        acc[T.ramp((r * F + j) * U * V + 8, 1, 8)]
                acc[T.ramp((r * F + j) * U * V, 1, 4)] = acc[T.ramp((r * F + j) * U * V, 1, 4)] + \
                    acc[T.ramp((r * F + j) * U * V + 4, 1, 4)]
                acc[T.ramp((r * F + j) * U * V, 1, 2)] = acc[T.ramp((r * F + j) * U * V, 1, 2)] + \
                    acc[T.ramp((r * F + j) * U * V + 2, 1, 2)]
                tot[0] = acc[(r * F + j) * U * V] + acc[(r * F + j) * U * V + 1]
                for kt in range(KS, K):
                    tot[0] = tot[0] + T.Cast("float32", x[m0 + r, kt]) * T.Cast("float32", w[n0 + j, kt])
                if d.has_scale:
                    tot[0] = tot[0] * scale[n0 + j]
                if d.has_bias:
                    tot[0] = tot[0] + bias[n0 + j]
                y[m0 + r, n0 + j] = T.Cast(xd, tot[0])

    @T.macro
    def row_tile(x, xb, w, wb, scale, bias, y, acc, tot, R, m0, n0, count):
        # R rows from m0 against the task's `count` features from n0, fb(R) features per tile
        for jb in range(count // fb(R)):
            tile(x, xb, w, wb, scale, bias, y, acc, tot, R, fb(R), m0, n0 + jb * fb(R))
        for jr in range(count % fb(R)):
            tile(x, xb, w, wb, scale, bias, y, acc, tot, R, 1, m0, n0 + count - count % fb(R) + jr)

    @T.macro
    def task(x, xb, w, wb, scale, bias, y, m0, rows, t):
        # rows m0 .. m0 + rows of x against the task's features t * TN ..
        acc = T.alloc_buffer((A * V,), "float32")
        tot = T.alloc_buffer((1,), "float32")
        n0 = T.meta_var(t * TN)
        count = T.meta_var(T.min(TN, N - t * TN))
        for mt in range(rows // MB):
            row_tile(x, xb, w, wb, scale, bias, y, acc, tot, MB, m0 + mt * MB, n0, count)
        # the last rows % MB rows as one tile of that many rows, never a loop of 1-row tiles: LLVM unrolls the
        # whole k loop and hoists the weight row out of such a loop (at 1 row: spilled to the stack, reloaded)
        if MB > 1:
            if rows % MB == 1:
                row_tile(x, xb, w, wb, scale, bias, y, acc, tot, 1, m0 + rows - 1, n0, count)
        if MB > 2:
            if rows % MB == 2:
                row_tile(x, xb, w, wb, scale, bias, y, acc, tot, 2, m0 + rows - 2, n0, count)
        if MB > 3:
            if rows % MB == 3:
                row_tile(x, xb, w, wb, scale, bias, y, acc, tot, 3, m0 + rows - 3, n0, count)

    serial_rows = rule.SERIAL_WORK // (N * K)  # (rows * N * K overflows int32 for the LM head)

    @T.macro
    def body(x, xb, w, wb, scale, bias, y, M):
        if M <= serial_rows:  # decode-size: on the calling thread, no thread-pool launch
            for t in T.serial(NT):
                task(x, xb, w, wb, scale, bias, y, 0, M, t)
        else:  # a task per (block of MR rows, TN features): the block's rows of x stay in L2 across its tasks
            for i in T.parallel((M + MR - 1) // MR * NT):
                task(x, xb, w, wb, scale, bias, y, i // NT * MR, T.min(MR, M - i // NT * MR), i % NT)

    NS, NBIAS = (N if d.has_scale else 1), (N if d.has_bias else 1)  # absent: (1,), never read

    @T.prim_func
    def linear_fwd(x_h: T.handle, w_h: T.handle, s_h: T.handle, b_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "linear_fwd", "tirx.noalias": True})
        M = T.int32()
        x, w = T.match_buffer(x_h, (M, K), xd), T.match_buffer(w_h, (N, K), wd)
        scale, bias = T.match_buffer(s_h, (NS,), "float32"), T.match_buffer(b_h, (NBIAS,), "float32")
        y = T.match_buffer(y_h, (M, N), xd)
        xb, wb = T.decl_buffer((M, K), "uint16", data=x.data), T.decl_buffer((N, K), "uint16", data=w.data)
        body(x, xb, w, wb, scale, bias, y, M)

    return linear_fwd


def _bwd(d: LinearDims, V: int, KB: int):
    K, N = d.in_features, d.out_features
    W = V * KB  # columns of k per task
    NKB, KR = K // W, K % W
    tasks = NKB + (1 if KR else 0)
    xd, wd = d.x_dtype, d.weight_dtype

    @T.macro
    def body(dy, w, wb, scale, dx, M):
        for t in T.parallel(tasks):
            acc = T.alloc_buffer((W,), "float32")
            g = T.alloc_buffer((1,), "float32")
            if t < NKB:
                for m in range(M):
                    for b in T.unroll(KB):
                        acc[T.ramp(b * V, 1, V)] = T.broadcast(T.float32(0), V)
                    for n in range(N):
                        g[0] = T.Cast("float32", dy[m, n])
                        if d.has_scale:
                            g[0] = g[0] * scale[n]
                        for b in T.unroll(KB):
                            acc[T.ramp(b * V, 1, V)] = acc[T.ramp(b * V, 1, V)] + T.broadcast(g[0], V) * _widen(
                                w, wb, n, t * W + b * V, V, wd)
                    for i in T.vectorized(W):
                        dx[m, t * W + i] = T.Cast(xd, acc[i])
            else:  # the last K % W columns: scalar
                for m in range(M):
                    for kt in range(KR):
                        acc[0] = T.float32(0)
                        for n in range(N):
                            g[0] = T.Cast("float32", dy[m, n])
                            if d.has_scale:
                                g[0] = g[0] * scale[n]
                            acc[0] = acc[0] + g[0] * T.Cast("float32", w[n, NKB * W + kt])
                        dx[m, NKB * W + kt] = T.Cast(xd, acc[0])

    NS = N if d.has_scale else 1  # absent: (1,), never read

    @T.prim_func
    def linear_bwd(dy_h: T.handle, w_h: T.handle, s_h: T.handle, dx_h: T.handle):
        T.func_attr({"global_symbol": "linear_bwd", "tirx.noalias": True})
        M = T.int32()
        dy, w = T.match_buffer(dy_h, (M, N), xd), T.match_buffer(w_h, (N, K), wd)
        scale = T.match_buffer(s_h, (NS,), "float32")
        dx = T.match_buffer(dx_h, (M, K), xd)
        wb = T.decl_buffer((N, K), "uint16", data=w.data)
        body(dy, w, wb, scale, dx, M)

    return linear_bwd


def lay_out(kernel: str, d: LinearDims, target, decisions: rule.Decisions):
    """The linear kernels' CPU loop nests, or None for another kernel or target."""
    if kernel not in ("fwd", "bwd") or "cpu" not in target.keys:
        return None
    name = f"linear_{kernel}"
    if kernel == "fwd":
        lanes = rule.vector_floats(target)
        # the target's vector width: 16-float vectors on AVX2 (two ymm each) ran 10-30% slower at 4-256 rows
        V = decisions.pick("vector", (8, 16), lanes)
        U = decisions.pick("unroll", (1, 2, 4), 2)
        # one feature per tile: its weight row is one sequential stream, which the hardware prefetcher
        # follows (fp32 at 1 row: ~15-19 GB/s on one thread, the core's streaming read); 2 or 4 weight rows
        # read side by side (short interleaved streams of in_features elements) measured 1.4-1.5x (fp32) to
        # 3.6x (int8) slower on one thread at 768 -> 3072 / 50280, 1 row (2-vCPU EPYC)
        NB = decisions.pick("features", (1, 2, 4, 8), 1)
        # 4 x rows per weight vector: at 8 rows 10-20% faster than 2 (fewer passes over the row)
        MB = decisions.pick("rows", (1, 2, 4), 4)
        # 16 features per task: 48 tasks at N = 768 (2 cores stay balanced), 16 x 3 KiB weight rows each
        TN = decisions.pick("task", (8, 16, 32, 64), 16)
        # rows per block (prefill-size calls): a block's rows of x (MR x in_features) stay in L2 while the
        # block's tasks stream their weights; at decode (<= MR rows) one block, the plain GEMV
        MR = decisions.pick("row_block", (32, 64, 128, 256), 64)
        return rule.schedule_of(_fwd(d, TN, NB, MB, V, U, MR, _accumulators(lanes)), name)
    V = decisions.pick("vector", (8, 16), 16)
    KB = decisions.pick("k_vectors", (1, 2, 4), 2)
    return rule.schedule_of(_bwd(d, V, KB), name)
