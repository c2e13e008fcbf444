"""CUDA rules for the int8 dot family.

matmul on int8 tensor cores where N and K are multiples of 16 (``_tc_matmul``: wmma s8 through _tiled_tc.tc_matmul);
otherwise one row of a x ``tile`` columns of b per block (one output per thread), K staged through shared memory in
chunks of ``4 * kgroups`` bytes, and the inner 4-wide dot tensorized with TVM's ``dp4a_s8s8s32`` intrinsic
(registered by :func:`_dp4a_s8s8s32`), so the source contains ``__dp4a`` (the intrinsic needs its operands in
shared memory and the accumulator in a local register: field guide §8). Needs K % 4 == 0; otherwise (and for
foreign functions) None, and the dispatcher's dlight fallback schedules the plain int32 dot.
dgrad / wgrad (float32 straight-through backward): on bf16 tensor cores where N and K are multiples of 16, g
staged as three bf16 parts whose sum is g (float32-exact products against the codes); otherwise one thread per
output element, reductions serial per thread in registers; wgrad's two-stage sum over rows keeps the fixed part
order either way (deterministic). The tensor-core forms are written loop nests whose parameter lists are declared
once in tvm_mamba/compute/int8_dot/signature.py (``grad_kernel``, shared with the CPU templates); the per-thread
forms schedule the TE definitions.
pack / unpack: elementwise, one thread per output word / byte.
Capabilities (``GpuCaps``, from the target): tensor cores and ``__dp4a`` only where the target has them (CUDA);
elsewhere (WebGPU) the matmul is the same tiled kernel with the 4-byte dot unrolled in plain int32 arithmetic,
and the float backward the per-thread forms. Where the target has no 8-bit buffers (WGSL) every int8 tensor is
passed as the int32 words of its bytes (compute/int8_dot/codes.py: ``t.view(torch.int32)``), each byte
unpacked with shifts; the kernels take float32 g as everywhere (the bf16 parts exist only on tensor cores).
Threads per block and staged shared memory stay within the target's limits.
Knobs: ``tile`` (threads per block edge), ``kgroups`` (4-byte K groups staged per step), ``threads`` (dgrad/wgrad
and elementwise threads per block), ``tensor_cores`` / ``tc_rows`` (the tensor-core forms).
"""
from __future__ import annotations

import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from tvm_mamba.compute import int8_dot as int8_compute
from tvm_mamba.compute.int8_dot.codes import held
from tvm_mamba.compute.int8_dot.signature import grad_kernel
from tvm_mamba.schedules import rule
from tvm_mamba.schedules.cuda._common import bind_flat, threads_over
from tvm_mamba.schedules.cuda._strategy import GpuCaps
from tvm_mamba.schedules.cuda._tiled import K_SLICE, TILE_CAP
from tvm_mamba.schedules.cuda._tiled_tc import TcTiling, tc_matmul


def _dp4a_shaped(body):
    """A PrimFunc of the dp4a intrinsic's shape, ``body(A, B, C)`` inside: 4 int8 of A and of B in shared
    memory (4-byte aligned: one 32-bit load each) and one int32 accumulator C in a register."""

    @T.prim_func(s_tir=True)
    def intrin(A: T.Buffer((4,), "int8", offset_factor=1, align=4, scope="shared"),
               B: T.Buffer((4,), "int8", offset_factor=1, align=4, scope="shared"),
               C: T.Buffer((1,), "int32", offset_factor=1, align=4, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0], A[0:4], B[0:4])
            T.writes(C[0])
            body(A, B, C)

    return intrin


@T.macro
def _dot4(A, B, C):  # what the intrinsic computes: C += sum_i A[i] * B[i] in int32
    for i in range(0, 4):
        with T.sblock("update"):
            vi = T.axis.remap("R", [i])
            C[0] = C[0] + T.cast(A[vi], "int32") * T.cast(B[vi], "int32")


@T.macro
def _dp4a(A, B, C):  # how: one __dp4a on the two 4-byte words
    C[0] += T.call_pure_extern("__dp4a", A.vload([0], "int8x4"), B.vload([0], "int8x4"), T.int32(0), dtype="int32")


@functools.lru_cache(maxsize=None)
def _dp4a_s8s8s32() -> str:
    """Register TVM's ``dp4a_s8s8s32`` tensor intrinsic (the same desc / impl as
    tvm/s_tir/tensor_intrin/dot_product_common.py) under our own name and return the name. Importing
    ``tvm.s_tir.tensor_intrin`` for it would register every target's intrinsics first: 48 s on this
    machine (its cuda module alone, the MMA / ldmatrix variants, 34 s), paid by every process that schedules
    one int8 CUDA matmul."""
    name = "tvm_mamba.dp4a_s8s8s32"
    TensorIntrin.register(name, _dp4a_shaped(_dot4), _dp4a_shaped(_dp4a), override=True)
    return name


def _matmul(d, decisions, caps: GpuCaps):
    """The tiled matmul (comment below); its 4-byte dot a dp4a where the target has it (CUDA), else unrolled
    int32 multiply-adds (WebGPU: a and b held as words, a byte per shift). K % 4 != 0: None (the dispatcher's
    dlight fallback schedules the byte definition), or a thread per output where the target has no 8-bit
    buffers, so the fallback's bytes could not be its buffers (_matmul_plain)."""
    N, K = d.N, d.K
    if K % 4:  # no whole 4-byte groups to tensorize or stage
        return None if caps.bytes else _matmul_plain(d, decisions, caps)
    # One row of a per block (blockIdx.y = m: M is symbolic, and an inexact split of it would put a
    # predicate on the compute block, which the dp4a tensorize cannot match), `tile` columns of b per block
    # (one output per thread), K staged through shared memory `kgroups` 4-byte groups at a time (the knob is
    # the group count, not bytes, so MetaSchedule's trace has no arithmetic on the sampled value). Staged per
    # step: (tile + 1) * kgroups * 4 bytes, within the target's shared memory at the largest tile.
    tiles = caps.threads(tuple(t for t in (32, 64, 128, 256) if N % t == 0) or (1,))
    tile = decisions.pick("tile", tiles, 128 if 128 in tiles else tiles[-1])
    fit = [c for c in (4, 8, 16, 32) if (max(tiles) + 1) * 4 * c <= caps.shared_bytes]
    kgroups = tuple(c for c in fit if K % (4 * c) == 0) or (1,)
    kgroup = decisions.pick("kgroups", kgroups, 16 if 16 in kgroups else kgroups[-1])
    sch = rule.schedule_compute(int8_compute.int8_dot_matmul(d, storage=held(caps.bytes)), "int8_dot_matmul")
    blk = sch.get_sblock("c")
    m, n, k = sch.get_loops(blk)
    no, ni = sch.split(n, [None, tile])
    k2, k1, ki = sch.split(k, [None, kgroup, 4])
    sch.reorder(m, no, ni, k2, k1, ki)
    sch.bind(m, "blockIdx.y")
    sch.bind(no, "blockIdx.x")
    sch.bind(ni, "threadIdx.x")
    cl = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(cl, ni)
    for idx in (0, 1):
        s = sch.cache_read(blk, idx, "shared")
        sch.compute_at(s, k2)
        inner = sch.get_loops(s)[4:]  # under m, no, ni, k2
        fused = sch.fuse(*inner) if len(inner) > 1 else inner[0]
        _, tx = sch.split(fused, [None, tile])
        sch.bind(tx, "threadIdx.x")
    sch.decompose_reduction(blk, k2)
    if caps.dp4a:
        sch.tensorize(ki, _dp4a_s8s8s32())
    else:
        sch.unroll(ki)
    return sch


def _matmul_plain(d, decisions, caps: GpuCaps):
    """c[m, n]: a thread per output, the K reduction serial in a register (K % 4 != 0 on a target without
    8-bit buffers: no whole 4-byte groups to stage, and a and b are flat words, rows not word-aligned)."""
    threads = decisions.pick("threads", caps.threads((64, 128, 256)), 128)
    sch = rule.schedule_compute(int8_compute.int8_dot_matmul(d, storage=held(caps.bytes)), "int8_dot_matmul")
    blk = sch.get_sblock("c")
    cl = sch.cache_write(blk, 0, "local")
    sch.compute_at(blk, bind_flat(sch, cl, threads))
    return sch


# tensor cores: the output tile's rows (M is symbolic: a block per TM rows x TW columns) and the tile cap
TC_ROWS = (32, 64, 128)


def _tc_matmul(d, decisions):
    """int8 x int8 -> int32 on tensor cores (wmma m16n16k16 s8, _tiled_tc.tc_matmul): a block per TM rows of a
    (M symbolic: ceil(M / TM) row tiles, rows past M read as row M - 1 and not stored) x TW columns of b, both
    staged along K in fragment-blocked shared slices (128-bit copies). Needs N % 16 == K % 16 == 0 (else None:
    the dp4a kernel).
    Exact: integer products and int32 sums, as the dp4a kernel and the compute definition."""
    N, K = d.N, d.K
    if not TcTiling.fits(16, N, K):
        return None
    rows = decisions.pick("tc_rows", TC_ROWS, 64)
    threads = decisions.pick("threads", (64, 128, 256), 128)
    tl = TcTiling.of(rows, N, K, threads, decisions.pick("tile", TILE_CAP, 64), "int8", acc="int32")
    run = tc_matmul(tl, True, True, scaled=False)
    TM = tl.M

    @T.macro
    def store(c, M, t, i, j, v):
        if t * TM + i < M:
            c[t * TM + i, j] = v

    @T.prim_func
    def matmul(a_h: T.handle, b_h: T.handle, c_h: T.handle):
        M = T.int32()
        a = T.match_buffer(a_h, (M, K), "int8")
        b = T.match_buffer(b_h, (N, K), "int8")
        c = T.match_buffer(c_h, (M, N), "int32")
        # rows past M read row M - 1 (whole 16-byte runs, no per-element select); their outputs are not stored
        run((M + TM - 1) // TM, lambda t, i, k: a[T.min(t * TM + i, M - 1), k], lambda t, j, k: b[j, k],
            lambda t, i, j, v: store(c, M, t, i, j, v))

    return _handwritten(matmul, "int8_dot_matmul")


def _matmul_any(d, decisions, caps: GpuCaps):
    """Tensor cores where the target has them and the sides allow (knob ``tensor_cores``, default 1), else the
    tiled kernel."""
    if _on_tc(d, decisions, caps):
        return _tc_matmul(d, decisions)
    return _matmul(d, decisions, caps)


def _elementwise(kernel: str, block: str):
    """pack / unpack: one thread per output element of ``block``."""

    def schedule(d, decisions, caps: GpuCaps):
        threads = decisions.pick("threads", caps.threads((128, 256, 512)), 256)
        sch = rule.schedule_compute(int8_compute.KERNELS[kernel](d, storage=held(caps.bytes)), f"int8_dot_{kernel}")
        loops = sch.get_loops(sch.get_sblock(block))  # one loop: codes as flat words (K % 4 != 0)
        threads_over(sch, sch.fuse(*loops) if len(loops) > 1 else loops[0], threads)
        return sch

    return schedule


def _tc_dgrad(d, decisions):
    """out[h, m, n] = scale * sum_k g[h, m, k] * codes[h, k, n] on bf16 tensor cores: a block per (head, TM rows
    of M) x TW columns (M symbolic, rows past M read row M - 1 and are not stored); g staged as three bfloat16
    parts (``_tiled_tc._copy_split``: their sum is g exactly) against the codes (exact in bfloat16), so every
    product is float32's, summed in float32 by the mma. Needs N % 16 == K % 16 == 0. Its parameter list: grad_kernel."""
    heads, N, K = d.heads, d.N, d.K
    rows = decisions.pick("tc_rows", TC_ROWS, 64)
    threads = decisions.pick("threads", (64, 128, 256), 128)
    tl = TcTiling.of(rows, N, K, threads, decisions.pick("tile", TILE_CAP, 64), "bfloat16")
    run = tc_matmul(tl, True, False, scaled=False, split="a")
    TM = tl.M

    @T.macro
    def store(out, scale, M, RT, t, i, j, v):
        if t % RT * TM + i < M:
            out[t // RT, t % RT * TM + i, j] = v * scale[0]

    @T.macro
    def body(g, codes, scale, out, M):
        RT = T.meta_var((M + TM - 1) // TM)
        run(heads * RT, lambda t, i, k: g[t // RT, T.min(t % RT * TM + i, M - 1), k],
            lambda t, j, k: codes[t // RT, k, j].astype("float32"),
            lambda t, i, j, v: store(out, scale, M, RT, t, i, j, v))

    return _handwritten(grad_kernel(d, body), "int8_dot_dgrad")


def _tc_wgrad(d, decisions):
    """Stage 1 on bf16 tensor cores: partial[p, h, n, k] = sum over part p's rows m of codes[h|0, m, n] *
    g[h, m, k], a block per (part, head) x TM of N x TW of K, the part's rows (chunk = ceil(M / nparts),
    symbolic) in k slices, rows past the part or M zero in g; g split in three bfloat16 parts as in
    ``_tc_dgrad`` (float32 products). Stage 2 as ``_wgrad``'s: a thread per out[h, n, k], the parts in order.
    Needs N % 16 == K % 16 == 0. Its parameter list: grad_kernel."""
    heads, code_heads, N, K = d.heads, d.code_heads, d.N, d.K
    threads = decisions.pick("threads", (64, 128, 256), 128)
    tl = TcTiling.of(N, K, K_SLICE, threads, decisions.pick("tile", TILE_CAP, 64), "bfloat16")
    KT = tl.KT

    @T.macro
    def store(partial, t, i, j, v):
        partial[t // heads, t % heads, i, j] = v

    @T.macro
    def body(codes, g, scale, out, partial, M, nparts):
        chunk = T.meta_var((M + nparts - 1) // nparts)
        run = T.meta_var(tc_matmul(tl, False, False, scaled=False, split="b",
                                   slices=lambda t: (chunk + KT - 1) // KT))
        run(nparts * heads,
            lambda t, i, m: codes[t % heads if code_heads > 1 else 0, T.min(t // heads * chunk + m, M - 1), i],
            lambda t, j, m: T.if_then_else(T.And(m < chunk, t // heads * chunk + m < M),
                                           g[t % heads, T.min(t // heads * chunk + m, M - 1), j], T.float32(0)),
            lambda t, i, j, v: store(partial, t, i, j, v))
        for bx in T.thread_binding((heads * N * K + 255) // 256, thread="blockIdx.x"):
            for tx in T.thread_binding(256, thread="threadIdx.x"):
                acc = T.alloc_buffer((1,), "float32", scope="local")
                e = T.meta_var(bx * 256 + tx)
                if e < heads * N * K:
                    acc[0] = T.float32(0)
                    for p in range(nparts):
                        acc[0] = acc[0] + partial[p, e // (N * K), e // K % N, e % K]
                    out[e // (N * K), e // K % N, e % K] = acc[0] * scale[0]

    return _handwritten(grad_kernel(d, body), "int8_dot_wgrad")


def _handwritten(func, name: str):
    """A template's own PrimFunc as kernel ``name`` (the tensor-core forms are written, not scheduled)."""
    return rule.schedule_of(func, name)


def _on_tc(d, decisions, caps: GpuCaps) -> bool:
    """On tensor cores (knob ``tensor_cores``, default 1) where the target has them and N and K are multiples
    of 16."""
    return caps.tensor_cores and TcTiling.fits(16, d.N, d.K) and decisions.pick("tensor_cores", (0, 1), 1)


def _dgrad(d, decisions, caps: GpuCaps):
    if _on_tc(d, decisions, caps):
        return _tc_dgrad(d, decisions)
    # out[h, m, n]: one block per (h, m) row x `threads` columns of n (threads read consecutive bytes of a
    # codes row: coalesced; g[h, m, k] is a broadcast), the K reduction serial per thread in a register.
    threads = decisions.pick("threads", caps.threads((64, 128, 256)), 128)
    sch = rule.schedule_compute(int8_compute.int8_dot_dgrad(d, storage=held(caps.bytes)), "int8_dot_dgrad")
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    h, m, n, _ = sch.get_loops(acc)
    no, ni = sch.split(n, [None, threads])
    sch.bind(sch.fuse(h, m), "blockIdx.x")
    sch.bind(no, "blockIdx.y")
    sch.bind(ni, "threadIdx.x")
    sch.reverse_compute_at(out, ni)
    sch.set_scope(acc, 0, "local")
    return sch


def _wgrad(d, decisions, caps: GpuCaps):
    if _on_tc(d, decisions, caps):
        return _tc_wgrad(d, decisions)
    # Stage 1: one thread per partial[p, h, n, k] (consecutive k across a warp: coalesced g reads and
    # partial writes), the part's rows summed serially in order. Stage 2: one thread per out[h, n, k],
    # parts summed in order in a register, then scaled. Deterministic (no atomics).
    threads = decisions.pick("threads", caps.threads((64, 128, 256)), 256)
    sch = rule.schedule_compute(int8_compute.int8_dot_wgrad(d, storage=held(caps.bytes)), "int8_dot_wgrad")
    part, acc, out = sch.get_sblock("partial"), sch.get_sblock("acc"), sch.get_sblock("out")
    threads_over(sch, sch.fuse(*sch.get_loops(part)[:4]), threads)
    sch.reverse_compute_at(out, threads_over(sch, sch.fuse(*sch.get_loops(acc)[:3]), threads))
    sch.set_scope(acc, 0, "local")
    return sch


_KERNELS = {"matmul": _matmul_any, "dgrad": _dgrad, "wgrad": _wgrad, "pack": _elementwise("pack", "packed"),
            "unpack": _elementwise("unpack", "codes")}


def lay_out(kernel: str, dims, target, decisions: rule.Decisions):
    """An int8_dot kernel laid out for a GPU by its capabilities (GpuCaps), or None for another kernel or
    target."""
    schedule = _KERNELS.get(kernel)
    if schedule is None or "gpu" not in target.keys:
        return None
    return schedule(dims, decisions, GpuCaps.of(target))
