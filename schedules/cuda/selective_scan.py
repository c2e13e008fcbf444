"""CUDA schedules for the selective scan: the compute templates laid out by ``CudaTimeLayout`` / ``CudaLayout``.

Forward and backward, parallel in time (``CudaTimeLayout``; compute/selective_scan/timescan.py, timescan_bwd.py):
a warp per (batch, channel), thread p holding ``items`` consecutive steps of each time block of 32 x items, the
blocks joined by warp scans of (decay, increment) pairs (``__shfl_up_sync``; the backward's adjoint
``__shfl_down_sync``), B / C staged in shared memory for the block's channels, per-state lane values held one
state per lane (register slots picked by constant indices). A forward block is ``threads`` / 32 channels; a
backward block the torch op's channel block. Knobs ``items`` and ``threads``; a backward whose checkpoint chunk
no 32 x items <= 16 divides (e.g. 45) takes the sequential warp-lane kernel below. docs/selective_scan.md.

Sequential warp-lane scan kernels (``warp=True``; the fallback backward): a lane (one (batch, channel) pair; backward: one (batch, block of channels))
is W = the largest power of two <= 32 dividing dstate consecutive threads of a warp; thread j holds the
S = dstate/W states n = k*W + j (k < S, unrolled: registers; coalesced loads of A/B/C/checkpoints). Time
runs serially with the per-step math inline (no chunk buffers: registers are scarce); each step's dstate
sums (y = C.h; in the backward sum g*B and sum g*h*A*e^{dt A}) are butterfly warp shuffles
(``__shfl_xor_sync``) over the W threads, so every thread holds the total. Lanes are clamped rather than
skipped (every thread of a warp joins the shuffles) and their writes guarded. The backward keeps the
recomputed states of one chunk per thread ((chunk+1) x S, local memory); its stage-2 sums (one lane per
output row, W threads over its dstate) follow in a fixed order: deterministic, no atomics.
Decode step (``warp=True`` too): a lane is W threads over one row's dstate, so a warp's state loads and
stores are whole 128-byte lines (a thread per row read its row's dstate contiguous run alone: each load
instruction touched 32 lines), y = C.h a butterfly, a row's scalars loaded by the lane's first thread and
shuffled to the others (``uniform``), out written by that thread. A lane runs ``head_rows`` rows of one head
(knob: 1, 2, 4, 8, 16; default 4), its B / C states loaded once into registers for all of them
(``stage_bc``; tied, Mamba-2, the head's softplus / exp once too): the step requests state + B / C /
head_rows bytes instead of B / C again per row (tied at Mamba-2's dstate 128: 2.2x -> 1.25x the minimum).
Complex A (``warp=False``): one thread per lane, the dstate loop serial; its rotation through
``sincospif`` (``Math(sincospi=True)``): cosf / sinf's slow path made ptxas spill.

``nchunk`` is a free var of the warp kernels (the serial/CPU layouts use the expression ceil(seqlen/chunk)):
with the expression, ptxas spilled 4 bytes in the fp32 dstate-16 backward; ptxas's spilling at 40-56
registers is fragile, so re-run ``build-check`` after any change to the templates.

Knobs: ``threads`` per block (64, 128, 256 up to the target's ``max_num_threads``; default 128, the
time-parallel forward 256); ``items`` (steps per thread of the time-parallel kernels); ``head_rows`` (tied
decode step). The rule serves any target with the "gpu" key and chooses by its capabilities
(``_strategy.GpuCaps``, read from ``target.attrs``), not its kind:

- ``thread_warp_size`` >= 32 (CUDA): the warp kernels above. Below (WebGPU without subgroups: 1) there are no
  shuffles, so a lane is one thread (``warp=False``): the sequential forward / backward and the decode step
  with a lane's dstate serial in the thread (the serial layout's loops on blockIdx x threadIdx, its sums a
  loop), as the complex-A kernels always were; no shared memory at all;
- ``max_shared_memory_per_block``: the time-parallel forward stages ``STAGE_ELEMS`` (step, state) values per
  48 KB, the backward stages what fits beside its reduction rows in the limit less ``SMEM_SPARE``; a
  backward ``items`` whose rows leave no room is not a candidate (none left: the sequential kernel);
- ``max_num_threads``: the ``threads`` candidates a block may have;
- ``libm`` (CUDA's log1pf / sincospif; not WGSL's): else ``Math`` forms log1p from exp / log and the complex
  rotation uses cos / sin (``target_math``).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...compute import selective_scan as compute
from ...compute._math import Math
from ..rule import Decisions, schedule_of
from ._strategy import CUDA_SHARED_BYTES, GpuCaps, GpuLoops

MASK = tirx.const(0xFFFFFFFF, "uint32")
HEAD_ROWS = (1, 2, 4, 8, 16)  # decode steps: rows of one head per warp lane
ITEMS = (4, 8, 16)  # forward: consecutive steps per thread (a time block is 32 x items steps)
THREADS = (64, 128, 256)  # threads per block (the target's max_num_threads caps them)
REGS = 80  # forward: the register budget a thread at dstate <= 32 (launch bounds' minimum blocks per SM)
SMEM_SPARE = 4 * 1024  # backward: shared memory not staged (CUDA's 48 KB static limit -> a 44 KB budget)
STAGE_ELEMS = 4096  # forward: staged (step, state) values of B and of C per slice at CUDA's 48 KB (2 x 16.5 KB)
WARP = 32  # the warp kernels' shuffles span 32 threads (mask 0xFFFFFFFF, width 32)


def warp_width(dstate: int) -> int:
    w = 1
    while w * 2 <= 32 and dstate % (w * 2) == 0:
        w *= 2
    return w


class CudaLayout(GpuLoops, compute.Layout):
    """Blocks x threads. ``warp``: W threads per lane (S = dstate / W unrolled states each, shuffle sums,
    clamped lanes, inline per-step math, free ``nchunk``); else one thread per lane (the serial layout's
    loops bound to blockIdx x threadIdx, ``threads`` lanes per block)."""

    head_rows = 1  # tied decode step: the rule's knob (rows of a head per warp lane)

    def __init__(self, math: Math, threads: int, dstate: int = 1, warp: bool = False):
        self.warp = warp
        W = warp_width(dstate) if warp else 1
        super().__init__(math, vec=1, scope="local", lanes_per_block=max(1, threads // W) if warp else threads)
        self.W, self.LOG = W, W.bit_length() - 1
        self.time_batched = not warp
        if warp:
            self._warp_reductions()

    def inner(self):  # W threads per lane
        return self.thread_loop(self.threads * self.W)

    # warp lanes: every thread runs (clamped lane index), writes are guarded by lane_ok
    def lane_guard(self, lo, li, total):
        return True if self.warp else super().lane_guard(lo, li, total)

    def lane_of(self, lo, li, total):
        return T.min(lo * self.threads + li // self.W, total - 1) if self.warp else super().lane_of(lo, li, total)

    def lane_ok(self, lo, li, total):
        return lo * self.threads + li // self.W < total if self.warp else True

    def thread(self, li):
        return li % self.W if self.warp else 0

    def leader(self, ok, j):
        return tirx.And(ok, j == 0) if self.warp else True

    def st_outer(self, N):
        return T.unroll(N // self.W) if self.warp else super().st_outer(N)

    def st_inner(self):
        return T.unroll(1) if self.warp else super().st_inner()

    def state(self, ko, ki, j):
        return ko * self.W + j if self.warp else super().state(ko, ki, j)

    def reg(self, ko, ki):
        return ko if self.warp else super().reg(ko, ki)

    def regs(self, N):
        return N // self.W if self.warp else N

    def nchunk(self, seqlen, chunk):
        return tirx.Var("nchunk", "int32") if self.warp else super().nchunk(seqlen, chunk)

    def _warp_reductions(self):
        W, LOG = self.W, self.LOG

        @T.macro
        def reduce(dst, i, parts, row):
            dst[i] = parts[row, 0]
            for r in T.unroll(LOG):
                dst[i] = dst[i] + T.tvm_warp_shuffle_xor(MASK, dst[i], 1 << r, W, 32)

        @T.macro
        def reduce_plus(dst, i, parts, row, init):
            reduce(dst, i, parts, row)
            dst[i] = dst[i] + init

        @T.macro
        def reduce2(dst, i0, i1, parts):
            dst[i0] = parts[0, 0]
            dst[i1] = parts[1, 0]
            for r in T.unroll(LOG):
                dst[i0] = dst[i0] + T.tvm_warp_shuffle_xor(MASK, dst[i0], 1 << r, W, 32)
                dst[i1] = dst[i1] + T.tvm_warp_shuffle_xor(MASK, dst[i1], 1 << r, W, 32)

        @T.macro
        def uniform(dst, i, value, j):
            if j == 0:
                dst[i] = value
            dst[i] = T.tvm_warp_shuffle(MASK, dst[i], 0, W, 32)

        @T.macro
        def reduce_plus_lead(dst, i, parts, row, init, lead):
            reduce(dst, i, parts, row)
            if lead:
                dst[i] = dst[i] + init

        self.reduce, self.reduce_plus, self.reduce2 = reduce, reduce_plus, reduce2
        self.uniform, self.reduce_plus_lead = uniform, reduce_plus_lead


class CudaTimeLayout(GpuLoops, compute.Layout):
    """The parallel-in-time forward (compute/selective_scan/timescan.py): a lane (one (batch, channel)) is a
    warp, thread p holding ``items`` consecutive steps of each time block of 32 x items; a block is
    ``chans`` lanes (warps) of one batch row; the pair scan is a Hillis-Steele scan over the warp by
    ``__shfl_up_sync`` (5 rounds of two shuffles), the total a broadcast from lane 31."""

    time_threads = 32
    stage_scope = "shared"
    vector_bytes = 16  # 128-bit loads of a thread's u / delta / z steps and of staged B / C states

    def __init__(self, math: Math, items: int, chans: int, stage_states: int, dstate: int, io: str = "float32"):
        super().__init__(math, vec=1, scope="local")
        self.items, self.block_chans, self.stage_states = items, chans, stage_states
        # the register budget of a thread: 80 at dstate <= 32 with float32 inputs (ptxas took 104 at 256 threads,
        # 2 blocks per SM; capped at 80: 3 blocks, no spills); more lane-held slots above, or 16-bit inputs
        # (capped at 80 they spilled 8-20 bytes)
        regs = REGS if dstate <= 32 and math.acc == "float32" and io == "float32" else 2 * REGS
        self.min_blocks = max(1, 65536 // (regs * 32 * chans))
        self._warp_pair_scan()

    # per-state values of a lane spread over its warp: state n in lane n % 32, register slot n // 32 (slots
    # picked by constant indices: a dynamic index would put the slots in local memory)
    def held_regs(self, N):
        return (N + 31) // 32

    def held_state(self, k, p):
        return k * 32 + p

    def held_get(self, buf, n):
        v = buf[0]
        for k in range(1, int(buf.shape[0])):
            v = tirx.Select(n // 32 == k, buf[k], v)
        return T.tvm_warp_shuffle(MASK, v, n % 32, 32, 32)

    @staticmethod
    @T.macro
    def held_set(buf, n, value, p):
        for k in T.unroll(buf.shape[0]):
            if tirx.And(p == n % 32, n // 32 == k):
                buf[k] = value

    @staticmethod
    @T.macro
    def held_add(buf, n, value, p):
        for k in T.unroll(buf.shape[0]):
            if tirx.And(p == n % 32, n // 32 == k):
                buf[k] = buf[k] + value

    @staticmethod
    @T.macro
    def time_sum(buf, i):  # butterfly over the warp: every thread gets the lane's sum (a fixed order)
        for r in T.unroll(5):
            buf[i] = buf[i] + T.tvm_warp_shuffle_xor(MASK, buf[i], 1 << r, 32, 32)

    def item_loop(self, n):
        return T.unroll(n)

    def leader(self, ok, j):
        return tirx.And(ok, j == 0)

    def _warp_pair_scan(self):
        one, zero = self.math.one, self.math.zero

        def scan(shift, first, last):
            """Over the warp in the direction ``shift`` (shfl_up: threads < p come first; shfl_down: > p)."""

            def inside(p, r):  # the partner 2^r away exists
                return p >= (1 << r) if first == 0 else p + (1 << r) < 32

            @T.macro
            def pair_scan(pr, p):
                for r in T.unroll(5):  # inclusive: the pairs of this thread and those before it
                    pr[2] = shift(MASK, pr[0], 1 << r, 32, 32)
                    pr[3] = shift(MASK, pr[1], 1 << r, 32, 32)
                    if inside(p, r):
                        pr[1] = pr[0] * pr[3] + pr[1]
                        pr[0] = pr[0] * pr[2]
                pr[4] = shift(MASK, pr[0], 1, 32, 32)
                pr[5] = shift(MASK, pr[1], 1, 32, 32)
                pr[2] = T.tvm_warp_shuffle(MASK, pr[0], last, 32, 32)
                pr[3] = T.tvm_warp_shuffle(MASK, pr[1], last, 32, 32)
                pr[0] = T.Select(p == first, one, pr[4])
                pr[1] = T.Select(p == first, zero, pr[5])

            return pair_scan

        self.pair_scan = scan(T.tvm_warp_shuffle_up, 0, 31)
        self.pair_scan_rev = scan(T.tvm_warp_shuffle_down, 31, 0)


def _bwd_smem(dims, tc: int) -> tuple[int, int]:
    """Shared memory bytes of the time-parallel backward at time blocks of ``tc`` steps: its dB / dC
    reduction rows (block x tc each) and one staged state of B / C."""
    width = 8 if dims.acc == "float64" else 4
    return (dims.varying_B + dims.varying_C) * dims.block * tc * width, 2 * (tc + tc // 32) * width


def _bwd_stage_states(dims, tc: int, budget: int) -> int:
    """States of B / C the backward stages per slice: what fits beside its reduction rows in ``budget``
    bytes of shared memory."""
    rows, per_state = _bwd_smem(dims, tc)
    return _divisor_at_most(dims.dstate, (budget - rows) // per_state)


def _divisor_at_most(n: int, most: int) -> int:
    """The largest divisor of n that is <= most (at least 1): staged slices tile dstate exactly."""
    return max(k for k in range(1, max(1, min(n, most)) + 1) if n % k == 0)


def _fwd(dims, caps: GpuCaps, decisions: Decisions, threads: int):
    """The forward: parallel in time on warps (a warp per lane, threads / 32 lanes a block sharing staged
    B / C: wider blocks re-read less); without shuffles the sequential scan, a thread per lane."""
    if caps.warp < WARP:
        return compute.build("fwd", dims, CudaLayout(target_math(dims, caps), threads))
    items = decisions.pick("items", ITEMS, 8)
    chans = threads // 32
    # B / C staged for the block's lanes when they share one group (else each lane reads its own)
    shared = all(not g or (dims.dim // g) % chans == 0 for g in (dims.b_groups, dims.c_groups))
    elems = STAGE_ELEMS * caps.shared_bytes // CUDA_SHARED_BYTES  # the staging at 48 KB, scaled to the limit
    stage = _divisor_at_most(dims.dstate, elems // (32 * items)) if shared else 0
    layout = CudaTimeLayout(target_math(dims, caps), items, chans, stage, dims.dstate, dims.u_dtype)
    return compute.build("fwd", dims, layout, variant="timescan")


def _bwd(dims, caps: GpuCaps, decisions: Decisions, threads: int):
    """The backward: parallel in time where 32 x items is a multiple of the checkpoint chunk and its
    reduction rows leave shared memory for a staged state (a block per channel block, a warp per channel,
    time blocks from checkpoints); else the sequential warp-lane kernel; without shuffles a thread per lane."""
    math = target_math(dims, caps)
    if caps.warp < WARP:
        return compute.build("bwd", dims, CudaLayout(math, threads))
    budget = caps.shared_bytes - SMEM_SPARE
    items = [k for k in range(2, 17) if (32 * k) % dims.chunk == 0 and sum(_bwd_smem(dims, 32 * k)) <= budget]
    if items:
        k = decisions.pick("items", items, min(items, key=lambda k: abs(k - 4)))
        layout = CudaTimeLayout(math, k, dims.block, _bwd_stage_states(dims, 32 * k, budget), dims.dstate)
        layout.reduce_layout = CudaLayout(math, threads, dims.dstate, warp=True)
        return compute.build("bwd", dims, layout, variant="timescan")
    return compute.build("bwd", dims, CudaLayout(math, threads, dims.dstate, warp=True))


def _update(dims, caps: GpuCaps, decisions: Decisions, threads: int):
    """The decode step (CUDA's own exp / log1p, as the scans; the polynomials are the CPU's): warp lanes of
    ``head_rows`` rows sharing staged B / C; without shuffles a thread per row, its dstate serial."""
    if caps.warp < WARP:
        return compute.build("update", dims, CudaLayout(target_math(dims, caps), threads))
    layout = CudaLayout(target_math(dims, caps), threads, dims.dstate, warp=True)
    rows = [r for r in HEAD_ROWS if dims.headdim % r == 0]
    layout.head_rows = decisions.pick("head_rows", rows, 4 if 4 in rows else rows[-1])
    layout.stage_bc = layout.head_rows > 1
    return compute.build("update", dims, layout)


def target_math(dims, caps: GpuCaps, sincospi: bool = False) -> Math:
    """The target's own float math in the accumulation dtype (not the CPU's polynomials): CUDA's expf / log1pf
    (and ``sincospi``'s sincospif where asked); where the target has no libm beyond exp / log / sin / cos
    (WGSL) log1p and expm1 formed from them, a rotation through cos / sin."""
    return Math(dims.acc, native=True, sincospi=sincospi and caps.libm, libm=caps.libm)


def pick_threads(caps: GpuCaps, decisions: Decisions, default: int) -> int:
    """The ``threads`` knob: THREADS up to the target's max_num_threads (``default`` if it may, else the most)."""
    fit = caps.threads(THREADS)
    return decisions.pick("threads", fit, default if default in fit else fit[-1])


def lay_out(direction: str, dims, target, decisions: Decisions):
    """A selective-scan kernel's template under a GPU layout chosen by the target's capabilities (module
    docstring); None for another kernel (the chunked forward: the CPU's) or target."""
    if "gpu" not in target.keys or direction not in ("fwd", "bwd", "update", "fwd_complex", "bwd_complex"):
        return None
    caps = GpuCaps.of(target)
    dims = caps.storable(dims)  # 32-bit buffers where the target has no others (WebGPU)
    threads = pick_threads(caps, decisions, 256 if direction == "fwd" else 128)
    if direction in ("fwd", "bwd", "update"):
        func = {"fwd": _fwd, "bwd": _bwd, "update": _update}[direction](dims, caps, decisions, threads)
    else:  # complex A: CUDA's own exp and sincospi (cosf / sinf's slow path spilled); a thread per lane
        func = compute.build(direction, dims, CudaLayout(target_math(dims, caps, sincospi=True), threads))
    return schedule_of(func, f"selective_scan_{direction}")
