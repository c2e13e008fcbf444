"""CUDA rule for the norm kernels (gated RMSNorm / LayerNorm, fused residual-add norm).

Forward: two launches, both one block per row with ``threads`` threads across hidden: the statistics (rstd,
and LayerNorm's mean: the per-group sums as cross-thread reductions, warp shuffles + shared memory, kept in
registers), then out and residual_out (read the statistics back; they are outputs, and s_tir refuses
compute_at of an output block into a consumer).
Backward: three launches. (1) one block per row: the per-group dot(dxhat, xhat) as a cross-thread reduction
kept in registers, computed once under the row loop for both dx and dz (the TE computes dx and dz as one
two-output op so they share that loop), then dx, dz per thread; (2) stage 1 of dweight/dbias: one block per
(row part, ``part_threads`` features), each thread sums its feature over the part's rows in order; (3)
stage 2: one thread per feature adds the parts in order. Deterministic, no atomics.
Knobs: ``threads`` (threads per row block, forward and backward), ``part_threads`` (stage 1 / 2).
"""
from __future__ import annotations

from tvm_mamba.schedules import rule
from tvm_mamba.schedules.cuda._common import threads_over


def _cross_thread(sch, block, loop, threads):
    """Compute the reduction ``block`` under ``loop``, its reduction axis across ``threads`` threads (warp
    shuffles + shared memory), the result kept in a register."""
    sch.compute_at(block, loop)
    _, ki = sch.split(sch.get_loops(block)[-1], [None, threads])
    sch.bind(ki, "threadIdx.x")
    sch.set_scope(block, 0, "local")


def _fwd(func, st: dict, decisions):
    gs = st["group_size"]
    cands = tuple(t for t in (32, 64, 128, 256, 512) if gs % t == 0) or (1,)
    threads = decisions.pick("threads", cands, 256 if 256 in cands else cands[-1])
    sch = rule.schedule_of(func, name="rmsnorm_gated_fwd")
    rms = st["is_rms_norm"]
    # rstd (and mean) are outputs (no compute_at into the out loop): kernel 1 = the statistics (one block per
    # row, the group reductions as cross-thread reductions; LayerNorm's mean first, then the centred squares),
    # kernel 2 = out (and residual_out, the dropout mask: same loop nest), one block per row, reading the statistics back.
    r1, g = sch.get_loops(sch.get_sblock("rstd" if rms else "stats_v0"))
    sch.bind(r1, "blockIdx.x")
    for name in ("sumsq",) if rms else ("sumsq", "sum"):  # consumers first: sum feeds sumsq and the mean
        _cross_thread(sch, sch.get_sblock(name), g, threads)
    multi = st["store_residual"] or st["store_dropout_mask"] or st["has_weight1"]
    r, h = sch.get_loops(sch.get_sblock("out_v0" if multi else "out"))
    sch.bind(r, "blockIdx.x")
    _, hi = sch.split(h, [None, threads])
    sch.bind(hi, "threadIdx.x")
    return sch


def _bwd(func, st: dict, decisions):
    hidden, gs = st["hidden"], st["group_size"]
    cands = tuple(t for t in (32, 64, 128, 256, 512) if gs % t == 0) or (1,)
    threads = decisions.pick("threads", cands, 256 if 256 in cands else cands[-1])
    pthreads = decisions.pick("part_threads", (64, 128, 256), 128)
    sch = rule.schedule_of(func, name="rmsnorm_gated_bwd")
    # kernel 1: one block per row; the row's per-group dot(dxhat, xhat) (and LayerNorm's sum(dxhat)) are
    # cross-thread reductions (warp shuffles + shared memory) kept in registers, then each thread writes its
    # dx (and dz, dresidual_in) elements.
    multi = st["has_z"] or st["store_dresidual"] or (st["has_x1"] and st["dropout_p"] > 0)
    r, h = sch.get_loops(sch.get_sblock("dxdz_v0" if multi else "dx"))
    sch.bind(r, "blockIdx.x")
    # threads divides group_size: each group is gs/threads consecutive chunks, so the group's reductions are
    # computed under the group loop and held in registers (a per-row array of G dots indexed by a runtime
    # loop variable went to local memory: 4 spill stores on sm_90)
    grp, _, hi = sch.split(h, [hidden // gs, None, threads])
    sch.bind(hi, "threadIdx.x")
    for name in ("dot",) if st["is_rms_norm"] else ("dot", "dysum"):
        _cross_thread(sch, sch.get_sblock(name), grp, threads)
    # kernel 2 (stage 1 of dweight/dbias): one block per (row part, `pthreads` features); each thread sums
    # dy*xhat and dy over the part's rows in order (coalesced across the features of a row).
    part = sch.get_sblock("partial")
    p, s, hh, _ = sch.get_loops(part)
    sch.reorder(p, hh, s)
    ho, hi2 = sch.split(hh, [None, pthreads])
    sch.bind(p, "blockIdx.y")
    sch.bind(ho, "blockIdx.x")
    sch.bind(hi2, "threadIdx.x")
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
