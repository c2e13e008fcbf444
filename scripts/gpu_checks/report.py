"""gpu_check's outputs: OUT/gpu_check.json (every row), OUT/gpu_check.md (a table) and one summary line per
kernel on stdout."""
from __future__ import annotations

import json
import pathlib


def _num(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _upstream(u) -> str:
    if u is None:
        return "-"
    if isinstance(u, str):
        return u
    diff = u.get("max_diff_vs_tvm_mamba")
    return f"{u['time_ms']:.3f} ms (|diff| {_num(diff, '.1e')})"


def _estimate(e) -> str:
    return "-" if not e else f"{e['bound_us']:.1f} us {e['unit']} ({e['bytes'] / 1e6:.1f} MB, {e['flops'] / 1e9:.2f} GFLOP)"


def config(static: dict) -> str:
    """A configuration's static dims in short: ``hidden=1536 has_z`` (numbers, then the flags that are on)."""
    dims = [f"{k}={v}" for k, v in static.items() if not isinstance(v, bool) and isinstance(v, (int, str))]
    return " ".join(dims + [k for k, v in static.items() if v is True])


def cells(r: dict) -> list[str]:
    """op.direction, config, dtype, shape (kind), ok, max err (worst / tol), time, GB/s, estimate, upstream."""
    time = _num(r.get("time_ms"), ".3f") + " ms"
    if r.get("decode_ms") is not None:
        time += f" + {r['decode_ms']:.3f} ms/token"
    rate = _num(r.get("gbps"), ".1f") + " GB/s" + (f", {r['tflops']:.2f} TFLOP/s" if r.get("tflops") else "")
    shape = r["shape"] if r["kind"] == "small" else f"{r['shape']} {r['kind']}" + (f" {r['preset']}" if r["preset"] else "")
    err = f"{_num(r.get('max_err'), '.2e')} ({_num(r.get('worst'), '.2f')} of tol)"
    return [f"{r['op']}.{r['direction']}", config(r.get("static", {})), r["dtype"], shape, "ok" if r["ok"] else "FAIL", err, time, rate,
            _estimate(r.get("estimate")), _upstream(r.get("upstream"))]


def summary_line(r: dict) -> str:
    c = cells(r)
    return (f"{c[0]:<28} [{c[1]}] {c[2]:<9} {c[3]:<26} {c[4]:<4} err {c[5]:<22} {c[6]:<14} {c[7]:<16} est {c[8]} "
            f"upstream {c[9]}")


def write(out: pathlib.Path, info: dict, rows: list[dict]) -> None:
    """gpu_check.json (``info`` + rows) and gpu_check.md (a table, then every failure's message)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(dict(info, rows=rows), indent=1, default=str))
    head = ["kernel", "config", "dtype", "shape", "ok", "max err (worst/tol)", "time", "rate", "roofline estimate", "upstream"]
    lines = [f"# gpu_check on {info['device']} (torch {info['torch']})", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    failures = [r for r in rows if not r["ok"]]
    if failures:
        lines += ["", "## Failures", ""]
        for r in failures:
            lines += [f"### {r['op']}.{r['direction']} {r['shape']} {r.get('kernel') or ''}", "", "```",
                      str(r.get("error")), "```", ""]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
