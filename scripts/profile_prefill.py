"""Where a whole-model prefill's time goes, by part: bench_lm.py's model and prefill call (``inference_params``,
last-token logits), with every tvm_mamba kernel launch and the projections timed, medians over runs.

    python scripts/profile_prefill.py [--model mamba2-130m] [--tokens 256,1024] [--batch 1] [--runs 5] [--cpu]

Parts: ``k:<op>.<direction>`` sums one kernel's launches over the layers (each SSD kernel on its own:
chunk_cumsum, bmm_chunk, chunk_state, state_passing, chunk_scan; the blocks' add + RMSNorm and the gated
RMSNorm are ``k:rmsnorm_gated.fwd``), ``m:<module>`` a module's forward over the layers (in_proj, out_proj,
lm_head; ``m:mixer`` a whole Mamba / Mamba2 mixer), and ``glue``: the mixers' time outside their projections and
kernels (Python, checks, allocations, splits and copies). --cpu times with ``time.thread_time`` (this thread's
CPU time: what a shared machine's other jobs do not inflate, but work on other threads does not count: run it with
OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 for a complete account); default: wall time.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import bench_lm

ACC: dict = collections.defaultdict(float)
IN_MIXER = [False]  # set between a mixer's pre- and post-hook: its kernels' time also goes to ACC["mixer kernels"]
KERNEL_MODULES = ("ssd", "causal_conv1d", "rmsnorm_gated", "selective_scan")
MODULES = ("in_proj", "out_proj", "x_proj", "dt_proj", "lm_head", "mixer")


class _Timed:
    """A kernel whose launches add their time to ACC[name]."""

    def __init__(self, kernel, name: str, clock):
        self.kernel, self.name, self.clock = kernel, name, clock

    def __call__(self, *args):
        t0 = self.clock()
        out = self.kernel(*args)
        dt = self.clock() - t0
        ACC[self.name] += dt
        if IN_MIXER[0]:
            ACC["mixer kernels"] += dt
        return out


def _time_lm_head(model, clock) -> None:
    """Time the LM head as ``m:lm_head``: the LM calls it through ``_decode.project`` (the decode plan's
    projection, so no module hook sees it), which is wrapped here for this model's head."""
    from tvm_mamba.modules import _decode

    orig = getattr(_decode.project, "untimed", _decode.project)
    heads = getattr(_decode.project, "heads", set()) | {id(model.lm_head)}

    def project(layer, x):
        if id(layer) not in heads:
            return orig(layer, x)
        t0 = clock()
        out = orig(layer, x)
        ACC["m:lm_head"] += clock() - t0
        return out
    project.untimed, project.heads = orig, heads
    _decode.project = project


def instrument(model, clock) -> None:
    """Time every kernel the torch_ops modules load (their ``kernel_for``) and the MODULES' forwards."""
    import importlib

    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"tvm_mamba.torch_ops.{name}")
        orig = mod.kernel_for
        if getattr(orig, "timed", False):  # a model profiled before in this process: already wrapped
            continue
        mod.kernel_for = (lambda orig: lambda op, direction, *a, **k: _Timed(
            orig(op, direction, *a, **k), f"k:{op}.{direction}", clock))(orig)
        mod.kernel_for.timed = True
    _time_lm_head(model, clock)
    for path, mod in model.named_modules():
        kind = path.rsplit(".", 1)[-1]
        if kind in MODULES and kind != "lm_head":
            def pre(m, _inp, mixer=kind == "mixer"):
                m._prof_t0 = clock()
                IN_MIXER[0] |= mixer

            def post(m, _inp, _out, name=f"m:{kind}", mixer=kind == "mixer"):
                ACC[name] += clock() - m._prof_t0
                if mixer:
                    IN_MIXER[0] = False
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)


def profile(model_name: str, tokens: int, batch: int, runs: int, clock) -> tuple[list, dict]:
    """-> (seconds of each timed prefill, part -> median seconds); one untimed warm-up prefill first."""
    import torch

    model, _ = bench_lm.build_models(model_name, hf=False)
    instrument(model, clock)
    runner = bench_lm.Runner(model, "tvm")
    totals, parts = [], collections.defaultdict(list)
    with torch.inference_mode():
        for i in range(runs + 1):
            ACC.clear()
            ids = bench_lm._ids(batch, tokens, bench_lm.MODELS[model_name][3], seed=i)
            t0 = clock()
            runner.prefill(ids)
            if i:
                totals.append(clock() - t0)
                for k, v in ACC.items():
                    parts[k].append(v)
    med = {k: statistics.median(v) for k, v in parts.items()}
    projections = sum(med.get(f"m:{k}", 0.0) for k in ("in_proj", "out_proj", "x_proj", "dt_proj"))
    med["glue"] = med.get("m:mixer", 0.0) - projections - med.pop("mixer kernels", 0.0)
    return totals, med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mamba2-130m", choices=list(bench_lm.MODELS))
    ap.add_argument("--tokens", default="256,1024")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="this thread's CPU time instead of wall time")
    args = ap.parse_args(argv)
    clock = time.thread_time if args.cpu else time.perf_counter
    import tvm_mamba

    print(f"tvm_mamba from {tvm_mamba.__file__}")
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        totals, med = profile(args.model, tokens, args.batch, args.runs, clock)
        total = statistics.median(totals)
        print(f"{args.model} b={args.batch} prefill {tokens}: {total * 1e3:.1f} ms ({args.batch * tokens / total:.0f} "
              f"tok/s), runs {', '.join(f'{t * 1e3:.0f}' for t in totals)} ms ({'CPU' if args.cpu else 'wall'})")
        for k in sorted(med, key=lambda k: -med[k]):
            print(f"  {k:28s} {med[k] * 1e3:9.2f} ms {100 * med[k] / total:6.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
