"""int8_matmul (K = N = 4096) against torch._int_mm at M = 32, 512, 2048; the straight-through backward kernels
(decoder-tail shapes: rows M = 4096, codes width 1024, g width 2048) against torch's float matmul on
codes.float(), which is what a PyTorch straight-through backward computes."""
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
        rows.append(Row("int8_matmul", "fwd (exact int32)", f"M={M}, K=N={K}", tvm_ms, ref_ms,
                        median_ms(lambda: b.clone()), "torch._int_mm", f"{gops:.0f} GOPS"))
    M, N, K = (1024 if quick else 4096), 1024, 2048
    codes = torch.randint(-127, 128, (1, M, N), dtype=torch.int8, generator=g)
    grad = torch.randn(1, M, K, generator=g)
    scale = torch.tensor(0.01)
    wg = torch.ops.tvm_mamba.int8_wgrad
    torch.testing.assert_close(wg(codes, grad, scale), (codes[0].float().t() @ grad[0] * scale)[None],
                               rtol=1e-4, atol=1e-3)
    gflop = f"{2 * M * N * K / 1e9:.1f} GFLOP"
    rows.append(Row("int8_wgrad", "codes^T g", f"M={M}, N={N}, K={K}",
                    median_ms(lambda: wg(codes, grad, scale), iters=5),
                    median_ms(lambda: codes[0].float().t() @ grad[0] * scale, iters=5), None,
                    "torch float matmul", gflop))
    dcodes = torch.randint(-127, 128, (1, K, N), dtype=torch.int8, generator=g)
    dg = torch.ops.tvm_mamba.int8_dgrad
    rows.append(Row("int8_dgrad", "g codes", f"M={M}, K={K}, N={N}",
                    median_ms(lambda: dg(grad, dcodes, scale), iters=5),
                    median_ms(lambda: grad[0] @ dcodes[0].float() * scale, iters=5), None,
                    "torch float matmul", gflop))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run(quick=False)))
