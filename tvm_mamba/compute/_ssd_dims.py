"""Shape-only helpers of the SSD kernels that the torch ops need without TVM's compiler (no tvm import:
they also run in runtime-only mode, TVM_USE_RUNTIME_LIB=1)."""
from __future__ import annotations

HEAD_PART_TASKS = 64  # parallel (batch, chunk, group, part) tasks ssd_chunk_scan_bwd aims for


def head_parts(batch: int, nchunks: int, nheads: int, ngroups: int) -> int:
    """Parts the heads of a group are split into by ssd_chunk_scan_bwd (one dB / dC partial per part, summed
    by ssd_head_sum): the fewest (a divisor of nheads / ngroups) that still make HEAD_PART_TASKS parallel
    (batch, chunk, group, part) tasks, else one part per head. A function of the shapes only, like the
    int8 wgrad parts: the same sums in the same order on every machine and thread count. Each part sums its
    heads' rows in head order and its heads share the staged B / C rows; fewer parts, fewer partials to
    write and sum (per head, a Mamba-2 130M layer's two partials are 50 MB at 2048 tokens)."""
    R = nheads // ngroups
    for p in range(1, R + 1):
        if R % p == 0 and batch * nchunks * ngroups * p >= HEAD_PART_TASKS:
            return p
    return R
