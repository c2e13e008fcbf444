"""The Mamba-3 kernels' typed static dims, defined in compute/_mamba3_dims.py (importable without TVMScript);
re-exported here for the builders and the rules."""
from __future__ import annotations

from .._mamba3_dims import IO_DTYPES, MimoStepDims, PreDims, StepDims, acc_dtype, mimo_chunk_steps  # noqa: F401

__all__ = ["IO_DTYPES", "MimoStepDims", "PreDims", "StepDims", "acc_dtype", "mimo_chunk_steps"]
