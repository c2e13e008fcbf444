"""int8_matmul (K = N = 4096) against torch._int_mm at M = 32, 512, 2048, and the offload memory figure."""
from __future__ import annotations

import torch

from benchlib import Row, median_ms


def run(quick: bool) -> list[Row]:
    from tvm_mamba.torch_ops.int8_dot import int8_matmul

    K = N = 4096
    g = torch.Generator().manual_seed(0)
    b = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    bt = b.t()  # _int_mm takes (K, N); b.t() is the column-major view, its fast layout
    rows = []
    for M in ((32, 512) if quick else (32, 512, 2048)):
        a = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=g)
        c = int8_matmul(a, b)
        assert torch.equal(c, torch._int_mm(a, bt)), "int8_matmul disagrees with torch._int_mm"
        iters = 3 if M >= 2048 else 10
        tvm_ms = median_ms(lambda: int8_matmul(a, b), warmup=1, iters=iters)
        ref_ms = median_ms(lambda: torch._int_mm(a, bt), warmup=1, iters=iters)
        gops = 2 * M * N * K / tvm_ms / 1e6
        rows.append(Row("int8_matmul", f"M={M}, K=N={K} (exact int32)", tvm_ms, ref_ms,
                        median_ms(lambda: b.clone()), "torch._int_mm", f"{gops:.0f} GOPS"))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run(quick=False)))
