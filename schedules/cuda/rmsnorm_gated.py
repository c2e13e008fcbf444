"""CUDA rule for gated RMSNorm.

Forward: two launches, both one block per row with ``threads`` threads across hidden: rstd (the per-group
sum of squares as a cross-thread reduction, warp shuffles + shared memory, kept in registers), then out
(reads rstd back; rstd is an output, and s_tir refuses compute_at of an output block into a consumer).
Backward: not hand-scheduled yet; apply returns None and the dispatcher's dlight Fallback binds the
spatial loops (reductions serial per thread). It compiles clean (tests/schedules), untuned.
Knobs: ``threads`` (forward threads per block).
"""
from __future__ import annotations

from tvm_mamba.schedules import rule


def _fwd(func, hidden: int, gs: int, decisions):
    cands = tuple(t for t in (32, 64, 128, 256, 512) if gs % t == 0) or (1,)
    threads = decisions.pick("threads", cands, 256 if 256 in cands else cands[-1])
    sch = rule.schedule_of(func, name="rmsnorm_gated_fwd")
    out = sch.get_sblock("out")
    ss = sch.get_sblock("sumsq")
    rstd = sch.get_sblock("rstd")
    # rstd is an output (no compute_at into the out loop): kernel 1 = rstd (one block per row, the group
    # sums as cross-thread reductions), kernel 2 = out (one block per row), reading rstd back.
    r1, g = sch.get_loops(rstd)
    sch.bind(r1, "blockIdx.x")
    sch.compute_at(ss, g)
    _, ki = sch.split(sch.get_loops(ss)[-1], [None, threads])
    sch.bind(ki, "threadIdx.x")
    sch.set_scope(ss, 0, "local")
    r, h = sch.get_loops(out)
    sch.bind(r, "blockIdx.x")
    _, hi = sch.split(h, [None, threads])
    sch.bind(hi, "threadIdx.x")
    return sch


def apply(func, target, decisions: rule.Decisions):
    """Schedule a gated RMSNorm kernel for CUDA; None for foreign functions and for the backward."""
    name, st = rule.kernel_attrs(func)
    if name == "rmsnorm_gated_fwd":
        return _fwd(func, st["hidden"], st["group_size"], decisions)
    return None
