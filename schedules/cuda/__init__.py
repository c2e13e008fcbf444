"""CUDA schedules: one module per op, ``lay_out(kernel, dims, target, decisions) -> Schedule | None``."""

from . import causal_conv1d, int8_dot, linear, mamba3, rmsnorm_gated, selective_scan, ssd  # noqa: E402

# op -> its rule here (runtime/registry.py reads this table)
RULES = {"causal_conv1d": causal_conv1d, "int8_dot": int8_dot, "linear": linear, "mamba3": mamba3,
         "rmsnorm_gated": rmsnorm_gated, "selective_scan": selective_scan, "ssd": ssd}
