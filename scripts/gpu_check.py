"""Check every kernel the package ships on a device against the float64 references, and time it (see
scripts/gpu_check.sh for the GPU machine, which has only the TVM runtime; the checks are in scripts/gpu_checks).

    python scripts/gpu_check.py configs --out FILE.json [--presets mamba2-130m,...] [--device cuda|cpu] [--small]
        the cases and every kernel configuration they hit: `python -m tvm_mamba aot --configs FILE.json` builds
        exactly those (and copies FILE into the pack, where `run` finds the case list)
    python scripts/gpu_check.py estimates --out FILE.json      the roofline estimate per case (build host)
    python scripts/gpu_check.py run --out OUT --device cuda|cpu [--ops a,b] [--small] [--estimates FILE.json]
        [--repeats N]
        OUT/gpu_check.json and OUT/gpu_check.md, one summary line per kernel, `gpu_check: N checks, M failed`;
        exit 1 if any failed. --small: every kernel once at a small shape, no timing (the sanitizer runs).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpu_checks import cases, report, runner  # noqa: E402


def _ops(text: str) -> list[str]:
    ops = [o for o in text.split(",") if o] if text else list(cases.OPS)
    bad = [o for o in ops if o not in cases.OPS]
    if bad:
        raise SystemExit(f"gpu_check: --ops: unknown {bad}; choose from {','.join(cases.OPS)}")
    return ops


def run(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch sees no CUDA device")
    estimates = json.loads(pathlib.Path(args.estimates).read_text()) if args.estimates else {}
    todo = cases.load_cases(device.type, args.small, _ops(args.ops), args.cases)
    rows, t0 = [], time.perf_counter()
    for case in todo:
        for row in runner.run_case(case, device, args.repeats, not args.small, estimates):
            rows.append(row)
            print(report.summary_line(row), flush=True)
    failed = sum(not r["ok"] for r in rows)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "small": args.small, "seconds": round(time.perf_counter() - t0, 1)}
    report.write(pathlib.Path(args.out), info, rows)
    print(f"gpu_check: {len(rows)} checks, {failed} failed ({info['seconds']} s on {info['device']})")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    co = sub.add_parser("configs", help="the cases and the kernel configurations they hit (aot --configs input)")
    co.add_argument("--out", required=True)
    co.add_argument("--presets", default=",".join(cases.PRESETS))
    co.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    co.add_argument("--arch", default="sm_90")
    co.add_argument("--ops", default="")
    co.add_argument("--small", action="store_true", help="only the small cases (every kernel once)")
    es = sub.add_parser("estimates", help="the roofline estimate of each case's kernel (build host)")
    es.add_argument("--out", required=True)
    es.add_argument("--presets", default=",".join(cases.PRESETS))
    es.add_argument("--arch", default="sm_90")
    ru = sub.add_parser("run", help="run the checks")
    ru.add_argument("--out", required=True)
    ru.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ru.add_argument("--ops", default="")
    ru.add_argument("--small", action="store_true")
    ru.add_argument("--estimates", default=None)
    ru.add_argument("--repeats", type=int, default=20)
    ru.add_argument("--cases", default=None, help="a configs file (default: the pack's copy, else enumerate here)")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    presets = [p for p in args.presets.split(",") if p]
    if args.cmd == "configs":
        data = cases.write_configs(args.out, args.device, args.arch, presets, args.small, _ops(args.ops))
        print(f"gpu_check configs: {len(data['cases'])} cases, {len(data['configs'])} kernel configurations "
              f"({args.device}) -> {args.out}")
        return 0
    est = cases.estimates(args.arch, presets)
    pathlib.Path(args.out).write_text(json.dumps(est, indent=1, sort_keys=True))
    print(f"gpu_check estimates: {len(est)} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
