"""Which module checks which op's configurations (``sim-check``, the GPU check): one explicit table, so a
reader (and go-to-definition) goes from an op's name to its check. Apart from the package's helpers
(``__init__.py``), which every op module imports."""
from __future__ import annotations

from . import causal_conv1d, int8_dot, linear, mamba3, rmsnorm_gated, selective_scan, ssd

CHECKS = {"causal_conv1d": causal_conv1d.check, "int8_dot": int8_dot.check, "linear": linear.check,
          "mamba3": mamba3.check, "rmsnorm_gated": rmsnorm_gated.check, "selective_scan": selective_scan.check,
          "ssd": ssd.check}


def run_config(op: str, direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of ``op`` through the harness (or, inside ``on_device``, natively);
    raises CheckFailed (or the kernel's error) on a failure."""
    if op not in CHECKS:
        raise KeyError(f"sim-check: no check for op {op!r} (ops: {', '.join(CHECKS)})")
    CHECKS[op](direction, dict(static), dict(dtypes), arch)
