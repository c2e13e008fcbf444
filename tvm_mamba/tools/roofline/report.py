"""Roofline rows (one per kernel key at a preset's shape) and their table, as text and as docs/roofline.md."""
from __future__ import annotations

import dataclasses
import datetime
import subprocess

from ...runtime import KernelKey, registry
from . import hardware, measure, minimum


@dataclasses.dataclass
class Row:
    preset: str
    label: str
    dtype: str
    launch: str  # "grid x block" of the kernel moving the most bytes
    regs: int | None
    occupancy: float | None
    bytes_actual: int  # requested by the threads
    bytes_once: int  # the same with each buffer's traffic capped at its size (a perfect cache)
    bytes_min: int
    flops: int
    exps: int  # exp-family + other SFU calls
    tensor_cores: bool
    bound_s: float
    bound_unit: str
    min_s: float
    min_unit: str

    @property
    def ratio(self) -> float:
        return self.bound_s / self.min_s if self.min_s else float("inf")


ACTIVATIONS = ("x", "bc")  # the dtype-map entries ``--dtype`` sets (activations; states / outputs stay)


def preset_keys(preset: str, ops: list[str], arch: str, dtype: str | None = None) -> list[KernelKey]:
    """The kernels a preset's model runs that have a roofline: each op's ``tuning_configs(preset)``; with
    ``dtype`` (bfloat16 / float16), their activation inputs in that dtype (a 16-bit model's kernels: the SSD
    chunk products then run on tensor cores)."""
    keys = []
    for op in ops:
        mod = registry.op(op).compute
        if not hasattr(mod, "tuning_configs"):
            continue
        for direction, static, dtypes in mod.tuning_configs(preset):
            if dtype:
                dtypes = {k: (dtype if k in ACTIVATIONS else v) for k, v in dtypes.items()}
            keys.append(KernelKey.make(op, direction, dtypes, static, "cudasim-" + arch))
    return keys


def _label(key: KernelKey) -> str:
    s = key.static
    flags = [f for f in ("tie_hdim",) if s.get(f)]
    return f"{key.op}.{key.direction}" + (f" ({', '.join(flags)})" if flags else "")


def _dtype(key: KernelKey) -> str:
    names = sorted(set(key.dtype.values()))
    return "/".join(n.replace("float", "fp").replace("bfp16", "bf16") for n in names)


def row(preset: str, key: KernelKey, batch: int, seqlen: int, arch: str) -> Row:
    """Count, fit, read ptxas and bound one kernel key at (batch, seqlen)."""
    kernels, tc = measure.counted(key, batch, seqlen)
    stats = measure.ptxas(key, arch)
    top = max(kernels, key=lambda k: k.counts.bytes)
    total = sum((k.counts for k in kernels), start=type(top.counts)())
    mn = minimum.minimum(key.op, key.direction, key.static, batch, seqlen, measure.param_bytes(key, batch, seqlen))
    bf16 = any(v in ("bfloat16", "float16") for v in key.dtype.values())
    peak = hardware.H200.tc_bf16_flops if bf16 else hardware.H200.tc_tf32_flops
    bound, unit = hardware.time_bound(total.bytes, total.flops, total.exps + total.sfu, total.mma_flops, peak)
    low, low_unit = hardware.time_bound(mn.bytes, mn.flops, mn.exps + mn.sfu, mn.mm, peak)
    st = stats.get(top.name)
    once = measure.footprint(kernels, measure.param_bytes(key, batch, seqlen, reduced=False))
    return Row(preset, _label(key), _dtype(key), f"{top.blocks if top.blocks is not None else '?'} x {top.threads}",
               max((s["registers"] for s in stats.values()), default=None), measure.occupancy_of(st, top.threads),
               total.bytes, once, mn.bytes, total.flops + total.mma_flops, total.exps + total.sfu, tc, bound, unit, low,
               low_unit)


HEAD = ("kernel", "dtype", "grid x block", "regs", "occ", "bytes actual / min (ratio)", "cached", "GFLOP", "exps",
        "TC", "bound us", "roofline-min us", "ratio")


def cells(r: Row) -> tuple[str, ...]:
    occ = f"{r.occupancy:.0%}" if r.occupancy is not None else "?"
    return (r.label, r.dtype, r.launch, str(r.regs if r.regs is not None else "?"), occ,
            f"{r.bytes_actual / 1e6:.1f} MB / {r.bytes_min / 1e6:.1f} MB ({r.bytes_actual / r.bytes_min:.2f}x)",
            f"{r.bytes_once / r.bytes_min:.2f}x",
            f"{r.flops / 1e9:.2f}", f"{r.exps / 1e6:.1f}M" if r.exps >= 1e5 else f"{r.exps / 1e6:.2g}M", "yes" if r.tensor_cores else "no",
            f"{r.bound_s * 1e6:.1f} ({r.bound_unit})", f"{r.min_s * 1e6:.1f} ({r.min_unit})", f"{r.ratio:.2f}x")


def summary(rows: list[Row], arch: str) -> str:
    above = sum(r.ratio > 2.0 for r in rows)
    tc = sum(r.tensor_cores for r in rows)
    return f"roofline: {len(rows)} kernels, {above} above 2x of their bound, {tc} on tensor cores (cuda {arch})"


def text_table(rows: list[Row]) -> str:
    table = [HEAD] + [cells(r) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table)


def markdown(rows: list[Row], arch: str, batch: int, seqlen: int, command: str, preamble: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = ["# CUDA roofline of the kernels", "",
           f"Generated by `{command}` at commit `{commit or 'unknown'}` on {date}: batch {batch}, seqlen "
           f"{seqlen}, cuda {arch}, bounds for an {hardware.H200.name}.", "", preamble.strip(), ""]
    for preset in dict.fromkeys(r.preset for r in rows):
        out += [f"## {preset}", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        out += ["| " + " | ".join(cells(r)) + " |" for r in rows if r.preset == preset]
        out.append("")
    out += ["```", summary(rows, arch), "```", ""]
    return "\n".join(out)
