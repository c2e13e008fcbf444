"""linear (projection GEMV) at the 130M Mamba's shapes: GB/s of weight read, torch F.linear with fp32 weights
against tvm_mamba's linear with fp32 / bf16 / int8 weight-only weights, 1 and 8 rows (decode), and fp32 at
PREFILL_ROWS rows (a prompt's projections: GFLOP/s in the note).

A decode step is bound by reading the weights once, so the figure of merit is weight bytes / time. A decode
step's weights (~0.5 GB at fp32 for 130M) do not stay in cache, so each side cycles through enough copies of its
weight (at least ``COLD_BYTES`` in all, past a 32 MiB L3) that every call reads its weight from memory. The two
sides are timed alternately (``ROUNDS`` rounds of medians each), so a neighbour's load on a shared machine
hits both; each row keeps the median of the round medians and its note the range over the rounds.
Shapes: in_proj 768 -> 3072 (d_inner 1536, x and z), out_proj 1536 -> 768, LM head 768 -> 50280.

    python scripts/bench_linear.py            # or: python scripts/bench.py --ops linear
    python scripts/bench_linear.py --cpu-time # one thread each side, CPU seconds of the calling thread

``--cpu-time`` runs both sides on one thread (torch.set_num_threads(1), TVM_NUM_THREADS=1) and times the
thread's CPU time instead of the wall clock: on a machine shared with other jobs, time spent waiting for a
core is left out (memory stalls are not), so the kernels can be compared while neighbours run.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchlib import Row, median_ms

SHAPES = ((768, 3072, "in_proj"), (1536, 768, "out_proj"), (768, 50280, "lm_head"))
ROUNDS = 3
PREFILL_ROWS = 256
COLD_BYTES = 128 << 20  # weight bytes cycled through per side
TIMER = [median_ms]  # median_ms, or _cpu_ms with --cpu-time


def _cpu_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median CPU time of fn() on the calling thread, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def _copies(w: torch.Tensor):
    """An endless cycle over enough copies of w to fill COLD_BYTES (one copy if w alone is that large)."""
    import itertools

    n = max(1, -(-COLD_BYTES // (w.numel() * w.element_size())))
    return itertools.cycle([w.clone() for _ in range(n)])


def _case(K: int, N: int, M: int, wdt: str, rounds: int) -> Row:
    from tvm_mamba.torch_ops.linear import linear, quantize_weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    x = torch.randn(M, K, generator=g)
    qw, s = quantize_weight(w, wdt)
    nbytes = qw.numel() * qw.element_size()
    ws, qws = _copies(w), _copies(qw)  # distinct weight copies: each call reads its weight from memory
    with torch.no_grad():
        err = (linear(x, qw, None, s) - F.linear(x, w)).abs().max().item()
        iters = 5 if N * K > 10**7 else 20
        ours, ref = [], []
        for _ in range(rounds):  # alternate: a neighbour's load hits both sides
            ref.append(TIMER[0](lambda: F.linear(x, next(ws)), iters=iters))
            ours.append(TIMER[0](lambda: linear(x, next(qws), None, s), iters=iters))
        copy = TIMER[0](lambda: next(qws).clone(), iters=iters)
    t, r = statistics.median(ours), statistics.median(ref)

    def gbs(ms):
        return f"{nbytes / ms / 1e6:.1f}"

    def ref_gbs(ms):
        return f"{N * K * 4 / ms / 1e6:.1f}"

    note = (f"weights {gbs(t)} GB/s (rounds {gbs(max(ours))}-{gbs(min(ours))}); torch fp32 {ref_gbs(r)} GB/s "
            f"({ref_gbs(max(ref))}-{ref_gbs(min(ref))}); max|y - fp32| {err:.1e}")
    if M > 8:
        note += f"; {2 * M * K * N / t / 1e6:.0f} vs torch {2 * M * K * N / r / 1e6:.0f} GFLOP/s"
    return Row("linear", f"fwd {wdt} weights", f"rows={M}, {K}->{N}", t, r, copy, "F.linear fp32", note)


def run(quick: bool) -> list[Row]:
    shapes = SHAPES[:1] if quick else SHAPES
    rows = []
    for K, N, _ in shapes:
        for M in ((1,) if quick else (1, 8)):
            for wdt in ("float32", "bfloat16", "int8"):
                rows.append(_case(K, N, M, wdt, 1 if quick else ROUNDS))
    if not quick:  # prefill: the fp32 layers' route on AVX-512 hosts (torch_ops/linear.fp32_on_kernel)
        rows += [_case(K, N, PREFILL_ROWS, "float32", ROUNDS) for K, N, _ in SHAPES[:2]]
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    if "--cpu-time" in sys.argv[1:]:
        os.environ["TVM_NUM_THREADS"] = "1"  # before tvm_mamba (and TVM's pool) is first imported
        torch.set_num_threads(1)
        TIMER[0] = _cpu_ms
    print(format_table(run(quick=False)))
