"""Where a decode step's time goes, by kernel: bench_lm.py's model and decode path (``inference_params``,
greedy steps after an 8-token prompt), then the step's recorded program (modules/_decode.py ``LMStep``: the
replayed kernel launches and in-place copies of one whole-model step) run action by action with a timer
around each, medians over steps.

    python scripts/profile_decode.py [--model mamba2-130m] [--batch 1] [--steps 60] [--weights int8]

Rows: ``<op>.<direction>`` sums one kernel's launches over the layers (``linear.fwd``: the projections and the
LM head on tvm_mamba's GEMV; ``rmsnorm_gated.fwd`` also the blocks' fused add + RMSNorm), ``copy`` the program's
in-place copies; ``step`` is a whole step timed without the per-action timers (the embedding lookup
included), so step minus the rows' sum is about the timers' own cost. Wall time: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import bench_lm


def _label(action) -> str:
    """A program action's row: the kernel key a replayed launch closes over, or ``copy``."""
    if isinstance(action, functools.partial):
        return "copy"
    cells = dict(zip(action.__code__.co_freevars, (c.cell_contents for c in action.__closure__ or ())))
    key = cells.get("key")
    return f"{key.op}.{key.direction}" if key is not None else action.__qualname__


def profile(model_name: str, batch: int, steps: int, weights: str = "fp32") -> tuple[float, dict[str, float],
                                                                                  collections.Counter]:
    """-> (median step seconds, {row: median seconds per step}, {row: actions per step})."""
    import torch

    from tvm_mamba.modules import _decode

    model, _ = bench_lm.build_models(model_name, hf=False, weights=weights)
    runner = bench_lm.Runner(model, "ours")
    vocab = model.backbone.embedding.weight.shape[0]
    with torch.inference_mode():
        logits, state = runner.prefill(bench_lm._ids(batch, 8, vocab, seed=0))
        logits = runner.decode(logits, state, 4)  # the plan is built, then recorded as one program
        plan = _decode.plan_of(model)
        if plan is None or plan.program is None:
            raise SystemExit("no recorded decode program (an action of the step was not replayable)")
        labels = [_label(a) for a in plan.program]
        rows, whole = collections.defaultdict(list), []
        for _ in range(steps):
            ids = logits.argmax(dim=-1).reshape(-1)
            t0 = time.perf_counter()
            torch.index_select(plan.embedding, 0, ids, out=plan.h0)
            for action in plan.program:
                action()
            whole.append(time.perf_counter() - t0)
            per = collections.defaultdict(float)
            torch.index_select(plan.embedding, 0, ids, out=plan.h0)
            for action, label in zip(plan.program, labels):
                t = time.perf_counter()
                action()
                per[label] += time.perf_counter() - t
            for label, v in per.items():
                rows[label].append(v)
            logits = plan.logits
    return statistics.median(whole), {k: statistics.median(v) for k, v in rows.items()}, collections.Counter(labels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mamba2-130m", choices=sorted(bench_lm.MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--weights", default="fp32", choices=sorted(bench_lm.WEIGHTS),
                    help="the projections' weights, as bench_lm.py --weights (default: fp32)")
    args = ap.parse_args(argv)
    step, rows, counts = profile(args.model, args.batch, args.steps, args.weights)
    print(f"{args.model} b={args.batch}: step {step * 1e3:.2f} ms (median of {args.steps}), "
          f"{sum(counts.values())} actions")
    for label, sec in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {label:28s} {sec * 1e3:8.3f} ms  {100 * sec / step:5.1f} %  ({counts[label]} per step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
