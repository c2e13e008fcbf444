"""The selective-scan kernels' typed static dims, defined in compute/_selective_scan_dims.py (importable
without TVMScript); re-exported here for the builders and the rules."""
from __future__ import annotations

from .._selective_scan_dims import IO_DTYPES, ScanBwdDims, ScanDims, UpdateDims, acc_dtype  # noqa: F401

__all__ = ["IO_DTYPES", "ScanBwdDims", "ScanDims", "UpdateDims", "acc_dtype"]
