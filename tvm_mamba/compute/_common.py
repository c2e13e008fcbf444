"""Helpers shared by the compute builders (no torch)."""
from __future__ import annotations

import json
from typing import Any

from tvm import tirx

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def stamp(func: tirx.PrimFunc, kernel: str, static: dict[str, Any]) -> tirx.PrimFunc:
    """Name the PrimFunc after its kernel and record its static parameters for the schedule rules."""
    return func.with_attrs({
        "global_symbol": kernel,
        "tirx.noalias": True,
        "tvm_mamba.kernel": kernel,
        "tvm_mamba.static": json.dumps(static, sort_keys=True),
    })


def check_dtype(name: str, dtype: str, allowed=FLOAT_DTYPES) -> str:
    if dtype not in allowed:
        raise ValueError(f"{name}: dtype must be one of {allowed}, got {dtype!r}")
    return dtype


def f32(expr) -> tirx.PrimExpr:
    """Widen to float32 (a float32 -> float32 cast folds away)."""
    return expr.astype("float32")


def sigmoid(v):
    """1 / (1 + exp(-v)) in float32."""
    one = tirx.const(1.0, "float32")
    return one / (one + tirx.exp(-v))


# Kernels whose whole work is at most this many elements run on the calling thread (decode-size calls): a
# thread-pool launch costs more than the work, and next to torch's spinning OpenMP threads a pinned TVM
# worker could wait a scheduler slice per launch (the small LM's decode: 920-940 ms instead of ~80 ms in 2
# of 5 processes). CPU templates test it at run time against their symbolic sizes.
SERIAL_WORK = 1 << 15
