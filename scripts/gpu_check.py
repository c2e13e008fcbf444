"""Validate the library on a GPU machine that has only the TVM runtime (see scripts/gpu_check.sh).

Every check runs a public function on device tensors against the PyTorch reference on the same device
(float64 where the reference allows), then times kernel and reference with CUDA events (wall clock on a
CPU). Results go to OUT/gpu_check.json and OUT/gpu_check.md. The shapes match the kernels an AOT pack
holds (each op's build_check_configs / tuning presets), so nothing needs compiling on the GPU machine.

    python scripts/gpu_check.py --out OUT [--device cuda|cpu] [--ops causal_conv1d,...]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback

import torch


def _timer(device):
    def run(fn, iters=20):
        for _ in range(3):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    return run


def check_causal_conv1d(device, dims):
    from tvm_mamba import causal_conv1d_fn
    from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref

    from tvm_mamba.compute.causal_conv1d import build_check_configs

    rows = []
    dim = build_check_configs()[0][1]["dim"]  # the packed (build-checked) configuration
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, dim, 2048, device=device, dtype=dtype)
        w = torch.randn(dim, 4, device=device) / 2
        b = torch.randn(dim, device=device)
        xg = x.clone().requires_grad_()
        out = causal_conv1d_fn(xg, w, b, activation="silu")
        ref = causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")
        err = (out.double() - ref).abs().max().item()
        dout = torch.randn_like(out)
        out.backward(dout)
        xr = x.double().requires_grad_()
        causal_conv1d_ref(xr, w.double(), b.double(), activation="silu").backward(dout.double())
        gerr = (xg.grad.double() - xr.grad).abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        time_ms = _timer(device)
        t_k = time_ms(lambda: causal_conv1d_fn(x, w, b, activation="silu"))
        t_r = time_ms(lambda: causal_conv1d_ref(x, w, b, activation="silu"))
        t_c = time_ms(lambda: x.clone())
        rows.append({"op": "causal_conv1d", "case": f"fwd {tuple(x.shape)} {str(dtype)[6:]}", "max_err": err,
                     "max_grad_err": gerr, "ok": err < tol and gerr < 10 * tol, "kernel_ms": t_k, "ref_ms": t_r,
                     "copy_ms": t_c})
    return rows


CHECKS = {"causal_conv1d": check_causal_conv1d}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ops", default=",".join(CHECKS))
    ap.add_argument("--preset", default="mamba2-130m", help="model dims the pack was built for")
    args = ap.parse_args(argv)
    from tvm_mamba.compute._presets import PRESETS

    device = torch.device(args.device)
    dims = dict(PRESETS[args.preset])
    dims.setdefault("conv_dim", dims["d_inner"])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, failures = [], 0
    for op in args.ops.split(","):
        try:
            rows.extend(CHECKS[op](device, dims))
        except Exception:  # noqa: BLE001 - record and go on: one run must report everything
            failures += 1
            rows.append({"op": op, "case": "error", "ok": False, "error": traceback.format_exc()[-3000:]})
    failures += sum(1 for r in rows if not r.get("ok"))
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "rows": rows}
    (out / "gpu_check.json").write_text(json.dumps(info, indent=1))
    lines = [f"# gpu_check on {info['device']} (torch {torch.__version__})", "",
             "| op | case | ok | max err | grad err | kernel ms | ref ms | ref/kernel | copy ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "kernel_ms" in r:
            lines.append(f"| {r['op']} | {r['case']} | {r['ok']} | {r['max_err']:.2e} | {r['max_grad_err']:.2e} | "
                         f"{r['kernel_ms']:.3f} | {r['ref_ms']:.3f} | {r['ref_ms'] / r['kernel_ms']:.2f} | "
                         f"{r['copy_ms']:.3f} |")
        else:
            lines.append(f"| {r['op']} | {r['case']} | False | | | | | | |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"gpu_check: {len(rows)} checks, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
