"""CUDA rule for the norm kernels (gated RMSNorm / LayerNorm, fused residual-add norm); design and figures in
docs/rmsnorm_gated.md ("CUDA kernels"). Memory-bound kernels: each global element is requested once.

Forward: one kernel. A block walks ``rows_per_block`` rows; per row it stages the row's inputs in shared
memory (one cooperative copy each, up to 128 bits a thread), computes the per-group statistics as
cross-thread reductions over the staged row (a fixed shuffle tree: warp shuffles, then shared memory), and
writes out (and residual_out, the masks, out1) from the staged row in the same pass; the weights are
staged once per block. The statistics are outputs, which s_tir cannot compute_at into a consumer: the
reductions', statistics' and outputs' row loops are merged into one instead, rstd (and mean) go through a
shared copy.
Backward: one pass and stage 2. A block per part of PART_ROWS rows (the TE definition's parts of the
weight gradients) walks them in order with the same row staging; per row the per-group dot(dxhat, xhat)
(and LayerNorm's sum(dxhat)) are cross-thread reductions in registers, then dx (and dz, dresidual_in, dx1)
are written and each thread adds its features' weight / bias terms to the part's sums (shared memory, or
registers when they do not fit), written once per part. Stage 2: one thread per feature adds the parts in
order. Deterministic, no atomics.
Capabilities (``GpuCaps``, from the target): threads per block within the target's, and what a block stages
within its shared memory less the reductions' scratch (:func:`_budget`: on a target without warp shuffles,
WebGPU's thread_warp_size 1, TVM's cross-thread reduction is a tree in shared memory, a float per thread).
Without float64 (WGSL) the forward's reductions are float32; without 8-bit buffers its dropout masks are int32
words of the same bytes, each its own kernel (a thread per word); without 16-bit buffers the kernels take and
return float32 (``GpuCaps.storable``: the WebGPU launcher converts bf16 / fp16 tensors).
Knobs: ``threads`` (threads per row block), ``rows_per_block`` (forward), ``part_threads`` (stage 2).
"""
from __future__ import annotations

import math

import tvm

from tvm_mamba.compute.int8_dot.codes import held
from tvm_mamba.compute.rmsnorm_gated import PART_ROWS, rmsnorm_gated_bwd, rmsnorm_gated_fwd
from tvm_mamba.schedules import rule
from tvm_mamba.schedules.cuda._common import threads_over
from tvm_mamba.schedules.cuda._strategy import GpuCaps


def _cross_thread(sch, block, loop, threads):
    """Compute the reduction ``block`` under ``loop``, its reduction axis across ``threads`` threads (warp
    shuffles + shared memory), the result kept in a register."""
    sch.compute_at(block, loop)
    _, ki = sch.split(sch.get_loops(block)[-1], [None, threads])
    sch.bind(ki, "threadIdx.x")
    sch.set_scope(block, 0, "local")


ROWS_PER_BLOCK = (1, 2, 4, 8)
# shared memory a block keeps back from staging for the reductions and the statistics' copies: at least 2 KB
# (CUDA: 46 of its 48 KB of static shared memory are staged)
RESERVE = 2 * 1024
WEIGHTS = ("weight", "bias", "weight1", "bias1")  # (hidden,) inputs, staged once per block of rows


def _budget(caps: GpuCaps, threads, reductions: int, stats: int = 0) -> int:
    """Bytes of shared memory a block may stage: the target's per block less RESERVE, or less the scratch of
    ``reductions`` cross-thread reductions over ``threads`` threads plus ``stats`` bytes of statistics' copies
    where that is more (WebGPU: 16 KB, a 256-thread reduction's tree takes 1 KB). A MetaSchedule-sampled
    ``threads`` counts as the target's most."""
    t = threads if isinstance(threads, int) else caps.max_threads
    return caps.shared_bytes - max(RESERVE, reductions * caps.reduction_bytes(t) + stats)


def _global_inputs(sch, consumers: list) -> dict:
    """Every global input the ``consumers`` read, by name (absent inputs are placeholders nobody reads)."""
    bufs = {}
    for blk in consumers:
        bufs.update({rg.source.name: rg.source for rg in sch.get(blk).reads if rg.source.scope() == "global"})
    return bufs


def _per_row(buf) -> bool:
    """All but the weight vectors are per row (rows may be static: MetaSchedule's buckets)."""
    return buf.name not in WEIGHTS


def _stage_bytes(buf) -> int:
    """Bytes a block stages of ``buf``: a row of a per-row input, a whole weight vector."""
    dims = buf.shape[1:] if _per_row(buf) else buf.shape
    return math.prod(int(n) for n in dims) * buf.dtype.bits // 8


def _plan(sch, consumers: list, budget: int, reserve: int = 0) -> list:
    """The global inputs of ``consumers`` that _stage copies, in order: the per-row inputs, most-read first
    (a row the reductions and every output read saves the most requests), then the weight vectors, each while
    the block's shared memory plus ``reserve`` bytes stays within ``budget`` (:func:`_budget`); the rest are
    read from global memory where used (Mamba-2 2.7B's float32 backward: x, z and dout rows are 60 KB)."""
    bufs = list(_global_inputs(sch, consumers).values())

    def readers(buf):
        return sum(any(rg.source.same_as(buf) for rg in sch.get(b).reads) for b in consumers)

    order = sorted((b for b in bufs if _per_row(b)), key=lambda b: -readers(b)) + [b for b in bufs if not _per_row(b)]
    out, total = [], reserve
    for buf in order:
        if total + _stage_bytes(buf) <= budget:
            out.append(buf)
            total += _stage_bytes(buf)
    return out


def _stage(sch, consumers: list, row_loop, outer_loop, threads: int, budget: int, reserve: int = 0) -> None:
    """cache_read into shared memory the global inputs the ``consumers`` read (:func:`_plan`): (rows, hidden)
    inputs (x, z, residual, x1, dout, ...) and per-row scalars (rstd, rowscale, seeds) at ``row_loop`` (each
    element requested once per row, then read from shared memory by both passes over the row), the (hidden,)
    parameters (weight, bias, ...) at ``outer_loop`` (once per block of rows). A copy is cooperative: its loops
    fused and split over ``threads`` (consecutive threads on consecutive features: whole 128-byte lines per
    warp)."""
    for blk in consumers:  # MetaSchedule's trace simplifier drops a block RV used only as a cache's consumer
        sch.annotate(blk, "tvm_mamba.staged_row", 1)  # (dxdz_v1, out_v1): an annotation keeps it (no effect)
    for buf in _plan(sch, consumers, budget, reserve):
        readers = [b for b in consumers if any(rg.source.same_as(buf) for rg in sch.get(b).reads)]
        idx = next(i for i, rg in enumerate(sch.get(readers[0]).reads) if rg.source.same_as(buf))
        cache = sch.cache_read(readers[0], idx, "shared", consumer_blocks=readers)
        at = row_loop if _per_row(buf) else outer_loop
        sch.compute_at(cache, at, preserve_unit_loops=True)
        loops = sch.get_loops(cache)
        depth = next(j for j, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(at)))
        loops = loops[depth + 1:]
        _threads_over(sch, loops, threads, _stage_bytes(buf) * 8 // buf.dtype.bits, buf.dtype.bits)


def _threads_over(sch, loops: list, threads, elems: int = 1, bits: int = 32) -> None:
    """Fuse ``loops`` (the block's loops under its compute_at point, ``elems`` iterations of ``bits``-bit
    elements) and split them over ``threads`` on threadIdx.x, each thread moving up to 128 bits at a time
    (a vectorized inner loop) where threads x lanes divides ``elems`` (a ragged vector would need a predicate,
    which TVM's vectorizer refuses). A unit loop (one per-row scalar; kept by preserve_unit_loops) is
    thread 0 alone."""
    lp = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    lanes = max(128 // bits, 1) if isinstance(threads, int) else 1  # (a MetaSchedule sample: scalar)
    while lanes > 1 and elems % (threads * lanes):
        lanes //= 2
    if lanes > 1:
        _, tx, vec = sch.split(lp, [None, threads, lanes])
        sch.vectorize(vec)
    else:
        _, tx = sch.split(lp, [None, threads])
    sch.bind(tx, "threadIdx.x")


def _row_blocks(sch, loop, per_block: int):
    """Split the row ``loop``: blocks of ``per_block`` rows on blockIdx.x, the rows of a block serial.
    Returns (block loop, row loop)."""
    bx, r = sch.split(loop, [None, per_block])
    sch.bind(bx, "blockIdx.x")
    return bx, r


def _fwd(d, decisions, caps: GpuCaps):
    d, gs = caps.storable(d), d.group_size
    cands = caps.threads(tuple(t for t in (32, 64, 128, 256, 512) if gs % t == 0) or (1,))
    threads = decisions.pick("threads", cands, 256 if 256 in cands else cands[-1])
    per_block = decisions.pick("rows_per_block", ROWS_PER_BLOCK, 4)
    func = rmsnorm_gated_fwd(d, wide="float64" if caps.float64 else "float32", storage=held(caps.bytes))
    sch = rule.schedule_compute(func, "rmsnorm_gated_fwd")
    rms = d.is_rms_norm
    # one kernel: a block walks its rows; per row the statistics (the group reductions as cross-thread
    # reductions, warp shuffles + shared memory; LayerNorm's mean first, then the centred squares), then out
    # (and residual_out, the masks, out1: one loop nest) in the same pass, all reading the row from shared
    # memory. rstd (and mean) are outputs: s_tir refuses compute_at of an output block into its consumer, so
    # the row loops are merged instead, and out reads the statistics from a shared copy.
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    stats = [sch.get_sblock(n) for n in (["rstd"] if rms else ["stats_v0", "stats_v1"])]
    outs = [sch.get_sblock(n) for n in names if n == "out" or n.startswith("out_v")]
    reds = [sch.get_sblock(n) for n in (("sum", "sumsq") if not rms else ("sumsq",))]
    # the reductions', statistics' and outputs' row loops merged into one (merge, not reverse_compute_at:
    # residual_out and the masks do not read the statistics, so a reverse_compute_at would keep all rows)
    r = sch.merge(*[sch.get_loops(blk)[0] for blk in reds + stats[:1] + outs[:1]])
    bx, r = _row_blocks(sch, r, per_block)
    g = sch.get_loops(stats[0])[-1]
    for blk in reversed(reds):  # consumers first: sum feeds sumsq and the mean
        _cross_thread(sch, blk, g, threads)
    copies = [sch.cache_write(blk, 0, "shared", consumer_blocks=outs) for blk in stats]
    for blk in copies:  # one thread per group writes the statistic
        sch.reverse_compute_at(blk, r, preserve_unit_loops=True)
        _threads_over(sch, sch.get_loops(blk)[-1:], threads)
    _, hi = sch.split(sch.get_loops(outs[0])[-1], [None, threads])
    sch.bind(hi, "threadIdx.x")
    stat_bytes = len(stats) * 4 * (d.hidden // gs)  # the statistics' shared copies
    _stage(sch, reds + outs, r, bx, threads, _budget(caps, threads, len(reds), stat_bytes))
    for name in names:  # masks held as words (no 8-bit buffers): a kernel of their own, a thread per word
        if name.startswith("dropout_mask"):
            loops = sch.get_loops(sch.get_sblock(name))
            threads_over(sch, sch.fuse(*loops) if len(loops) > 1 else loops[0], threads)
    return sch


def _bwd(d, decisions, caps: GpuCaps):
    """One pass: a block per part of PART_ROWS rows (compute.rmsnorm_gated) walks its rows in order, each row
    staged once in shared memory (x, z, dout, ...; the weights once per block). Per row, the per-group
    dot(dxhat, xhat) (and LayerNorm's sum(dxhat)) are cross-thread reductions kept in registers; each thread
    then writes its dx (and dz, dresidual_in, dx1) elements and adds the row's weight/bias terms (dy*xhat, dy,
    ...) of its features to the part's sums (stage 1 of the weight gradients, in shared memory or registers:
    _sums_scope; written once per part).
    The dx loop nest and the partial sums' are merged part by part and row by row. Stage 2: one thread per
    feature adds the parts in order. Deterministic, no atomics."""
    d, hidden, gs = caps.storable(d), d.hidden, d.group_size
    cands = caps.threads(tuple(t for t in (32, 64, 128, 256, 512) if gs % t == 0) or (1,))
    threads = decisions.pick("threads", cands, 256 if 256 in cands else cands[-1])
    pthreads = decisions.pick("part_threads", caps.threads((64, 128, 256)), 128)
    sch = rule.schedule_compute(rmsnorm_gated_bwd(d), "rmsnorm_gated_bwd")
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    outs = [sch.get_sblock(n) for n in names if n == "dx" or n.startswith("dxdz_v")]
    sums, part, r = _part_rows(sch, outs[0], threads)
    # threads divides group_size: each group is gs/threads consecutive chunks, so the group's reductions are
    # computed under the group loop and held in registers (a per-row array of G dots indexed by a runtime
    # loop variable went to local memory: 4 spill stores on sm_90)
    grp, _, hi = sch.split(sch.get_loops(outs[0])[-1], [hidden // gs, None, threads])
    sch.bind(hi, "threadIdx.x")
    reds = [sch.get_sblock(n) for n in (("dot",) if d.is_rms_norm else ("dot", "dysum"))]
    for blk in reds:
        _cross_thread(sch, blk, grp, threads)
    budget = _budget(caps, threads, len(reds))
    reserve = _sums_scope(sch, sums, reds + outs + [sums], threads, grp, budget)
    _stage(sch, reds + outs + [sums], r, part, threads, budget, reserve)
    for name in ("dweight", "dbias", "dweight1", "dbias1"):  # stage 2: a thread per feature, parts in order
        if name + "_acc" in names:
            acc = sch.get_sblock(name + "_acc")
            tx = threads_over(sch, sch.get_loops(acc)[0], pthreads)
            sch.reverse_compute_at(sch.get_sblock(name), tx)
            sch.set_scope(acc, 0, "local")
    return sch


def _part_rows(sch, out, threads: int):
    """The row loop of ``out`` (the dx loop nest) split into (part, row of the part), merged with the partial
    sums' (part, row) loops; the part on blockIdx.x. The sums' features split over ``threads`` (each thread
    its features' terms, unrolled; where they live: _sums_scope), written back after the part's rows. Returns
    (the sums' block, part, row)."""
    blk = sch.get_sblock("partial")
    acc = sch.cache_write(blk, 0, "local")
    p, sel, h, j = sch.get_loops(blk)
    sch.reorder(j, sel, h)
    po, r = sch.split(sch.get_loops(out)[0], [None, PART_ROWS])
    part = sch.merge(po, p)
    r = sch.merge(r, sch.get_loops(blk)[1])
    sch.bind(part, "blockIdx.x")
    sel, h = sch.get_loops(blk)[2:]
    ho, hi = sch.split(h, [None, threads])
    sch.reorder(ho, hi, sel)
    sch.bind(hi, "threadIdx.x")
    sch.unroll(ho)
    sch.unroll(sel)
    sch.reverse_compute_at(acc, part)
    sel, h = sch.get_loops(acc)[-2:]
    ho, t = sch.split(h, [None, threads])
    sch.bind(t, "threadIdx.x")
    sch.unroll(sel)  # constant slot indices: the slots stay in registers
    sch.unroll(ho)
    sch.decompose_reduction(blk, r)
    return blk, part, r


def _sums_scope(sch, sums, readers: list, threads, grp, budget: int) -> int:
    """Where a block keeps its partial sums (each thread its features' terms): shared memory when they fit
    beside everything the block stages (``budget``), else registers. Registers are the fallback:
    live across the whole row walk, across the calls of the IEEE division's slow path (SiLU, dropout's
    1 / (1 - p)), they made ptxas spill a few bytes (8 groups of 256 features: 8-24 bytes at 48 registers on
    sm_80 / sm_90) where shared memory does not. With registers, the group loop ``grp`` is unrolled by nvcc
    (#pragma unroll; TVM's own unroll duplicates the cross-thread reductions' buffers and fails in codegen):
    rolled, it made those configurations spill. Returns the shared bytes the sums take."""
    acc = sch.get(sums).writes[0].source
    need = math.prod(int(n) for n in acc.shape[1:]) * 4
    staged = sum(_stage_bytes(buf) for buf in _global_inputs(sch, readers).values())
    if staged + need <= budget:
        sch.set_scope(sums, 0, "shared")
        return need
    if isinstance(threads, int):  # a thread's own (term, feature / threads) slots, not a row-sized array
        sch.transform_layout(sums, ("write", 0), lambda p, s, h: (s, h // threads), assume_injective_transform=True)
    sch.annotate(grp, "pragma_auto_unroll_max_step", 4096)
    sch.annotate(grp, "pragma_unroll_explicit", 0)
    return 0


def lay_out(kernel: str, dims, target, decisions: rule.Decisions):
    """A gated norm kernel's compute scheduled for a GPU by its capabilities (GpuCaps); None for another
    kernel or target."""
    schedule = {"fwd": _fwd, "bwd": _bwd}.get(kernel)
    if schedule is None or "gpu" not in target.keys:
        return None
    return schedule(dims, decisions, GpuCaps.of(target))
