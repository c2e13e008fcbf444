"""CUDA rule for the norm kernels (gated RMSNorm / LayerNorm, fused residual-add norm); design and figures in
docs/rmsnorm_gated.md ("CUDA kernels"). Memory-bound kernels: each global element is requested once.

Forward: one kernel. A block walks ``rows_per_block`` rows; per row it stages the row's inputs in shared
memory (one cooperative copy each, up to 128 bits a thread), computes the per-group statistics as
cross-thread reductions over the staged row (a fixed shuffle tree: warp shuffles, then shared memory), and
writes out (and residual_out, the masks, out1) from the staged row in the same pass; the weights are
staged once per block. The statistics are outputs, which s_tir cannot compute_at into a consumer: the
reductions', statistics' and outputs' row loops are merged into one instead, rstd (and mean) go through a
shared copy.
Backward: three launches. (1) The same row walk for dx (and dz, dresidual_in, dx1): the per-group
dot(dxhat, xhat) (and LayerNorm's sum(dxhat)) as cross-thread reductions in registers. (2) Stage 1 of
dweight/dbias: one block per (row part, ``part_threads`` features), each thread walking the part's rows in
order, loading its element of each input once per row into a register and adding every term to its own
register accumulator. (3) Stage 2: one thread per feature adds the parts in order. Deterministic, no atomics.
Knobs: ``threads`` (threads per row block), ``rows_per_block``, ``part_threads`` (stage 1 / 2).
"""
from __future__ import annotations

import math

import tvm

from tvm_mamba.schedules import rule
from tvm_mamba.schedules.cuda._common import threads_over


def _cross_thread(sch, block, loop, threads):
    """Compute the reduction ``block`` under ``loop``, its reduction axis across ``threads`` threads (warp
    shuffles + shared memory), the result kept in a register."""
    sch.compute_at(block, loop)
    _, ki = sch.split(sch.get_loops(block)[-1], [None, threads])
    sch.bind(ki, "threadIdx.x")
    sch.set_scope(block, 0, "local")


ROWS_PER_BLOCK = (1, 2, 4, 8)
# static shared memory a block may stage (48 KB is the static limit; a little left for the reductions)
SHARED_BUDGET = 46 * 1024
WEIGHTS = ("weight", "bias", "weight1", "bias1")  # (hidden,) inputs, staged once per block of rows


def _stage(sch, consumers: list, row_loop, outer_loop, threads: int, hidden: int) -> None:
    """cache_read into shared memory every global input the ``consumers`` read: (rows, hidden) inputs (x, z,
    residual, x1, dout, ...) and per-row scalars (rstd, rowscale, seeds) at ``row_loop`` (each element
    requested once per row, then read from shared memory by both passes over the row), the (hidden,)
    parameters (weight, bias, ...) at ``outer_loop`` (once per block of rows) while the block's stages fit
    :data:`SHARED_BUDGET`, else read per row from global memory. A copy is cooperative: its loops fused and
    split over ``threads`` (consecutive threads on consecutive features: whole 128-byte lines per warp)."""
    for blk in consumers:  # MetaSchedule's trace simplifier drops a block RV used only as a cache's consumer
        sch.annotate(blk, "tvm_mamba.staged_row", 1)  # (dxdz_v1, out_v1): an annotation keeps it (no effect)
    bufs = {}  # every global input the consumers read (absent inputs are placeholders nobody reads)
    for blk in consumers:
        bufs.update({rg.source.name: rg.source for rg in sch.get(blk).reads if rg.source.scope() == "global"})

    def per_row(buf):  # all but the weight vectors are per row (rows may be static: MetaSchedule's buckets)
        return buf.name not in WEIGHTS

    def size(buf):  # bytes a block stages: a row of a per-row input, a whole weight vector
        dims = buf.shape[1:] if per_row(buf) else buf.shape
        return math.prod(int(n) for n in dims) * buf.dtype.bits // 8

    staged = sum(size(buf) for buf in bufs.values() if per_row(buf))
    for buf in bufs.values():
        if not per_row(buf):
            if staged + size(buf) > SHARED_BUDGET:
                continue
            staged += size(buf)
        readers = [b for b in consumers if any(rg.source.same_as(buf) for rg in sch.get(b).reads)]
        idx = next(i for i, rg in enumerate(sch.get(readers[0]).reads) if rg.source.same_as(buf))
        cache = sch.cache_read(readers[0], idx, "shared", consumer_blocks=readers)
        at = row_loop if per_row(buf) else outer_loop
        sch.compute_at(cache, at, preserve_unit_loops=True)
        loops = sch.get_loops(cache)
        depth = next(j for j, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(at)))
        loops = loops[depth + 1:]
        _threads_over(sch, loops, threads, size(buf) * 8 // buf.dtype.bits, buf.dtype.bits)


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


def _fwd(func, st: dict, decisions):
    gs = st["group_size"]
    cands = tuple(t for t in (32, 64, 128, 256, 512) if gs % t == 0) or (1,)
    threads = decisions.pick("threads", cands, 256 if 256 in cands else cands[-1])
    per_block = decisions.pick("rows_per_block", ROWS_PER_BLOCK, 4)
    sch = rule.schedule_of(func, name="rmsnorm_gated_fwd")
    rms = st["is_rms_norm"]
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
    _stage(sch, reds + outs, r, bx, threads, st["hidden"])
    return sch


def _bwd(func, st: dict, decisions):
    hidden, gs = st["hidden"], st["group_size"]
    cands = tuple(t for t in (32, 64, 128, 256, 512) if gs % t == 0) or (1,)
    threads = decisions.pick("threads", cands, 256 if 256 in cands else cands[-1])
    pthreads = decisions.pick("part_threads", (64, 128, 256), 128)
    per_block = decisions.pick("rows_per_block", ROWS_PER_BLOCK, 4)
    sch = rule.schedule_of(func, name="rmsnorm_gated_bwd")
    # kernel 1: a block walks rows_per_block rows, each staged once in shared memory (x, z, dout, ...; the
    # weights once per block); per row the per-group dot(dxhat, xhat) (and LayerNorm's sum(dxhat)) are
    # cross-thread reductions (warp shuffles + shared memory) kept in registers, then each thread writes its
    # dx (and dz, dresidual_in) elements from the staged row.
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    outs = [sch.get_sblock(n) for n in names if n == "dx" or n.startswith("dxdz_v")]
    r, h = sch.get_loops(outs[0])
    bx, r = _row_blocks(sch, r, per_block)
    # threads divides group_size: each group is gs/threads consecutive chunks, so the group's reductions are
    # computed under the group loop and held in registers (a per-row array of G dots indexed by a runtime
    # loop variable went to local memory: 4 spill stores on sm_90)
    grp, _, hi = sch.split(h, [hidden // gs, None, threads])
    sch.bind(hi, "threadIdx.x")
    reds = [sch.get_sblock(n) for n in (("dot",) if st["is_rms_norm"] else ("dot", "dysum"))]
    for blk in reds:
        _cross_thread(sch, blk, grp, threads)
    _stage(sch, reds + outs, r, bx, threads, hidden)
    # kernel 2 (stage 1 of dweight/dbias): one block per (row part, `pthreads` features); each thread walks
    # the part's rows in order (coalesced across the features of a row), loads its element of each input
    # once per row into registers and adds every term (dy*xhat, dy, ...) to its own register accumulator
    # (the term loop unrolled innermost), written to the partial buffer once at the end.
    part = sch.get_sblock("partial")
    p, s, hh, j = sch.get_loops(part)
    ho, hi2 = sch.split(hh, [None, pthreads])
    sch.reorder(p, ho, hi2, j, s)
    sch.bind(p, "blockIdx.y")
    sch.bind(ho, "blockIdx.x")
    sch.bind(hi2, "threadIdx.x")
    acc = sch.cache_write(part, 0, "local")
    sch.reverse_compute_at(acc, hi2)
    sch.decompose_reduction(part, j)
    i = 0
    while i < len(sch.get(part).reads):
        if sch.get(part).reads[i].source.scope() == "global":
            cache = sch.cache_read(part, i, "local", consumer_blocks=[part])
            sch.compute_at(cache, j)
            # one element a row; its row index is clamped (min(p*chunk + j, rows-1)), which TVM cannot bound
            # (the register array was sized 2^31 - 1): a one-element layout
            sch.transform_layout(cache, ("write", 0), lambda *idx: (tvm.tirx.const(0, "int32"),),
                                 assume_injective_transform=True)
        i += 1
    sch.unroll(s)
    # kernel 3 (stage 2): one thread per feature, parts added in order in a register, then cast.
    w1 = st["has_weight1"]
    for name, present in (("dweight", True), ("dbias", st["has_bias"]), ("dweight1", w1),
                          ("dbias1", w1 and st["has_bias1"])):
        if present:
            acc = sch.get_sblock(name + "_acc")
            tx = threads_over(sch, sch.get_loops(acc)[0], pthreads)
            sch.reverse_compute_at(sch.get_sblock(name), tx)
            sch.set_scope(acc, 0, "local")
    return sch


def apply(func, target, decisions: rule.Decisions):
    """Schedule a gated RMSNorm kernel for CUDA; None for foreign functions."""
    return rule.apply_by_kernel({"rmsnorm_gated_fwd": _fwd, "rmsnorm_gated_bwd": _bwd}, func, target, decisions,
                                "gpu")
