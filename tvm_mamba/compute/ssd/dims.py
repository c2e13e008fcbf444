"""The SSD kernels' typed static dims, defined in compute/_ssd_dims.py: the torch op keys its kernels with them
where TVM has no compiler (runtime-only), and importing this package would import TVMScript. Re-exported here
for the builders, the strategies and the rules."""
from __future__ import annotations

from .._ssd_dims import (DIMS, F32, BmmDims, DstatesDims, DtDims, HeadSumDims, PassingBwdDims,  # noqa: F401
                         PassingDims, ScanBwdDims, ScanDims, SSDDims, StateDims, VarlenDims, check_dims, dims_of)
