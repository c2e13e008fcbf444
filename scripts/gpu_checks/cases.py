"""Which cases gpu_check runs, and the kernel configurations they hit (what an AOT pack must hold).

A case is one simcheck configuration (op, direction, static dims, dtypes; see tvm_mamba/tools/simcheck) at given
sizes, or one whole LM (op "lm"):

- "small": every configuration the package ships (each op's ``build_check_configs``, plus the presets' tuning
  configurations) at simcheck's own small sizes: every kernel variant once (the sanitizer runs use these);
- "preset" / "ragged": each preset's ``tuning_configs`` (the kernels its model runs, the roofline's rows) at
  the roofline's shape (batch 4, seqlen 2048) and at a ragged one (odd batch, seqlen not a multiple of any
  chunk or block); the ops without tuning configurations (linear, int8) at those rows once;
- "lm": a 130M and a 370M Mamba-1 / Mamba-2 LM, prefill + decode, fp32 and bf16 (lm.py).

On a CPU every size is tiny (the CI rehearsal). The case list needs the compute modules (TVM's compiler for
some), so a runtime-only machine reads it from the ``configs`` file: :func:`write_configs` on the build host,
copied into the pack by ``python -m tvm_mamba aot --configs``, read back by :func:`load_cases`.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

from .common import Case, ident, sizes  # noqa: F401  (Case, sizes: the cases' API)

FORMAT = "gpu_check-configs/1"
CASES_FILE = "gpu_check_configs.json"  # the configs file's name inside a pack (aot --configs copies it)
PRESETS = ("mamba-130m", "mamba2-130m", "mamba3-130m", "mamba3-mimo-130m")
SHAPES = {"cuda": {"preset": (4, 2048), "ragged": (3, 1037)}, "cpu": {"preset": (1, 32), "ragged": (3, 13)}}
OPS = ("causal_conv1d", "selective_scan", "ssd", "mamba3", "rmsnorm_gated", "int8_dot", "linear", "lm")


def _configs(op: str, fn: str, *args) -> list:
    from tvm_mamba.runtime import registry

    f = getattr(registry.op(op).compute, fn, None)
    return [] if f is None else list(f(*args))


def enumerate_cases(device_type: str, presets=PRESETS, small: bool = False, ops=OPS) -> list[Case]:
    """Every case (module docstring) for a "cuda" or "cpu" device; ``small``: the "small" cases only."""
    from tvm_mamba.runtime import registry

    from . import lm

    seen, out = set(), []

    def add(op, direction, static, dtypes, sz, kind, preset=""):
        mark = json.dumps([op, direction, static, dtypes, sz], sort_keys=True)
        if mark not in seen:
            seen.add(mark)
            out.append(Case(op, direction, dict(static), dict(dtypes), sz, kind, preset))

    kernel_ops = [op for op in ops if op != "lm"]
    for op in kernel_ops:
        confs = _configs(op, "build_check_configs") + [c for p in presets for c in _configs(op, "tuning_configs", p)]
        for direction, static, dtypes in confs:
            add(op, direction, static, dtypes, {}, "small")
    if small:
        return out + (lm.cases(device_type, small=True) if "lm" in ops else [])
    for kind, (b, L) in SHAPES[device_type].items():
        for op in kernel_ops:
            for p in presets:
                for direction, static, dtypes in _configs(op, "tuning_configs", p):
                    add(op, direction, static, dtypes, sizes(b, L), kind, p)
            if not hasattr(registry.op(op).compute, "tuning_configs"):  # int8: no tuning workloads
                for direction, static, dtypes in _configs(op, "build_check_configs"):
                    add(op, direction, static, dtypes, sizes(b, L), kind)
    return out + (lm.cases(device_type, small=False) if "lm" in ops else [])


def kernel_configs(cases: list[Case], device_type: str, arch: str) -> list[dict]:
    """[{op, direction, static, dtypes, batches, seqlens}]: every kernel the cases call on ``device_type`` with
    the shape buckets they call it at, found by running each case dry (every kernel a no-op that records its
    key; each case stops after its first kernel block): for "cuda" in the CUDA harness, for "cpu" on the CPU."""
    from tvm_mamba.tools import simcheck

    from . import runner

    found: dict[str, dict] = {}
    with runner.dry_kernels() as resolved:
        for case in cases:
            with simcheck.on_device(None if device_type == "cuda" else "cpu", case.sizes, dry=True):
                try:
                    runner.call_case(case, arch)
                except simcheck.DryStop:
                    pass
                except Exception as err:  # noqa: BLE001 - its kernels up to the error are listed; say so
                    print(f"gpu_check configs: {case.op}.{case.direction} {case.shape()} stopped early: "
                          f"{type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
    for k in resolved:
        e = found.setdefault(ident(k.op, k.direction, k.static, k.dtype),
                             dict(op=k.op, direction=k.direction, static=dict(k.static), dtypes=dict(k.dtype),
                                  batches=[], seqlens=[]))
        bucket = dict(k.shape_bucket)
        for name, field in (("batch", "batches"), ("seqlen", "seqlens")):
            if name in bucket and bucket[name] not in e[field]:
                e[field].append(bucket[name])
    return list(found.values())


def write_configs(path, device_type: str, arch: str, presets=PRESETS, small: bool = False, ops=OPS) -> dict:
    """Write the configs file: the cases and the kernel configurations they hit (``aot --configs`` input)."""
    cases = enumerate_cases(device_type, presets, small, ops)
    data = {"format": FORMAT, "device": device_type, "arch": arch, "small": small, "presets": list(presets),
            "cases": [c.to_json() for c in cases], "configs": kernel_configs(cases, device_type, arch)}
    pathlib.Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))
    return data


def load_cases(device_type: str, small: bool, ops, cases_file: str | None = None) -> list[Case]:
    """The cases to run: from ``cases_file``, else from the active pack's copy of the configs file, else
    enumerated here (needs the compute modules). ``small``: only the "small" (and small "lm") cases."""
    pack = os.environ.get("TVM_MAMBA_KERNEL_PACK")
    path = cases_file or (pathlib.Path(pack) / CASES_FILE if pack and (pathlib.Path(pack) / CASES_FILE).exists()
                          else None)
    if path is None:
        cases = enumerate_cases(device_type, small=small, ops=ops)
    else:
        data = json.loads(pathlib.Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a gpu_check configs file (format {data.get('format')!r})")
        cases = [Case(**c) for c in data["cases"]]
    return [c for c in cases if c.op in ops and (not small or c.kind == "small")]


def estimates(arch: str = "sm_90", presets=PRESETS) -> dict:
    """{ident@shape: {bytes, flops, bound_us, unit, min_us}}: the roofline report's row (tvm_mamba/tools/roofline) of
    each "preset" case's own kernel at the roofline's shape on ``arch`` (the ragged shape has none: each row
    costs a counting build and a ptxas run, ~30 s here); a key the roofline cannot count is left out (the run
    shows no estimate for it). Build host only (TVM's compiler, nvcc)."""
    from tvm_mamba.tools.roofline import report
    from tvm_mamba.runtime import KernelKey


    out = {}
    for case in enumerate_cases("cuda", presets, ops=[op for op in OPS if op != "lm"]):
        name = ident(case.op, case.direction, case.static, case.dtypes) + "@" + case.shape()
        if case.kind != "preset" or name in out:
            continue
        key = KernelKey.make(case.op, case.direction, case.dtypes, case.static, "cudasim-" + arch)
        try:
            r = report.row(case.preset, key, case.sizes["batch"], case.sizes["seqlen"], arch)
        except Exception as err:  # noqa: BLE001 - no estimate for this one; say so and go on
            print(f"estimates: {case.op}.{case.direction} {case.shape()}: {type(err).__name__}: {str(err)[:160]}")
            continue
        out[name] = dict(
            bytes=r.bytes_actual, flops=r.flops, bound_us=r.bound_s * 1e6, unit=r.bound_unit, min_us=r.min_s * 1e6)
    return out
