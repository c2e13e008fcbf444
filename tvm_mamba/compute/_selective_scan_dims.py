"""Static-dim choices of the selective-scan kernels, importable without TVM's compiler (the torch op uses
them to build kernel keys, also on a runtime-only machine serving an AOT pack)."""
from __future__ import annotations

import math


def chunk_size(dstate: int) -> int:
    """Default checkpoint interval (the torch op's choice; a static dim of the kernels): state memory for
    the backward's chunk recompute stays <= 4096 fp32 values per lane."""
    return max(8, min(48, 4096 // dstate))


def block_size(dim: int, b_groups: int, c_groups: int, want: int = 16) -> int:
    """Channels per backward lane: the largest divisor <= want of every group's channel count."""
    g = dim
    for groups in (b_groups, c_groups):
        if groups:
            g = math.gcd(g, dim // groups)
    return max(k for k in range(1, min(want, g) + 1) if g % k == 0)
