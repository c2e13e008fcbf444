"""The Mamba-3 kernels' typed static dims, defined in compute/_mamba3_dims.py (importable without TVMScript);
re-exported here for the builders and the rules."""
from __future__ import annotations

from .._mamba3_dims import (IO_DTYPES, PAIR_STEPS, MimoStepDims, PreDims, StepDims, acc_dtype,  # noqa: F401
                            mimo_chunk_steps)

__all__ = ["IO_DTYPES", "PAIR_STEPS", "MimoStepDims", "PreDims", "StepDims", "acc_dtype", "mimo_chunk_steps"]
