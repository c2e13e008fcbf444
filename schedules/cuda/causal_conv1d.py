"""CUDA schedule for the causal_conv1d kernels (TE compute from tvm_mamba/compute/causal_conv1d.py).

One thread per output element with time innermost: a warp covers 32 consecutive time steps of one
channel, so x / out accesses coalesce and the width-1 halo of each tap is served by L1 (the taps of
neighbouring threads overlap). The conv accumulator lives in registers, computed inside its consumer's
thread. The dweight/dbias reductions run in two stages (per row over time, then over batch in order):
deterministic, no atomics. The decode step (causal_conv1d_update) is the loop-nest template of
compute/_causal_conv1d_update.py laid out as one thread per (batch, channel) row, as upstream's kernel.

Knobs: ``threads`` per block (64, 128, 256, 512; default 256).
"""
from __future__ import annotations

from ..rule import Decisions, kernel_attrs, schedule_of
from ...compute._causal_conv1d_update import update_template
from ...compute.causal_conv1d import CausalConv1dUpdate
from ._common import schedule_acc_chain


def apply(func, target, decisions: Decisions):
    kernel, _ = kernel_attrs(func)
    if "gpu" not in target.keys or kernel is None or not kernel.startswith("causal_conv1d_"):
        return None
    threads = decisions.pick("threads", (64, 128, 256, 512), 256)
    if kernel == "causal_conv1d_update":  # a loop-nest template: one thread per (batch, channel) row
        _, static = kernel_attrs(func)
        loop = update_template(CausalConv1dUpdate(**static), mode="cuda", threads=threads)
        return schedule_of(loop.with_attrs(dict(func.attrs)), name=kernel)
    sch = schedule_of(func, name=kernel)
    schedule_acc_chain(sch, threads)
    return sch
