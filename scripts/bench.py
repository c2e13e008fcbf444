"""Benchmarks, side by side in one run: every ``scripts/bench_<op>.py`` (medians, ratios vs reference/copy).

    python scripts/bench.py [--quick] [--ops causal_conv1d,selective_scan]
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchlib import format_table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small shapes, few iterations (smoke run)")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all bench_<op>.py)")
    args = ap.parse_args(argv)
    here = pathlib.Path(__file__).resolve().parent
    names = [p.stem[len("bench_"):] for p in sorted(here.glob("bench_*.py"))]
    if args.ops:
        names = [n for n in names if n in args.ops.split(",")]
    import torch

    import tvm_mamba
    from tvm_mamba.runtime import target_for_device

    print(f"tvm_mamba {tvm_mamba.__version__}; target {target_for_device('cpu')}; torch threads "
          f"{torch.get_num_threads()}")
    rows = []
    for name in names:
        mod = importlib.import_module(f"bench_{name}")
        rows.extend(mod.run(quick=args.quick))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
