"""Gated RMSNorm forward+backward against the PyTorch eager composition (mamba_ssm's rms_norm_ref) and a
forward+backward copy of x (benchlib.copy_fwd_bwd)."""
from __future__ import annotations

import torch

from benchlib import Row, copy_fwd_bwd, median_ms


def run(quick: bool) -> list[Row]:
    from tvm_mamba.reference.rmsnorm_gated import rmsnorm_gated_ref
    from tvm_mamba.torch_ops.rmsnorm_gated import rmsnorm_fn

    rows_n, hidden = (1024, 2048) if quick else (4096, 2048)
    out = []
    for dtype, gs, nbg in ((torch.float32, None, True), (torch.bfloat16, 256, False)):
        torch.manual_seed(0)
        x = torch.randn(rows_n, hidden, dtype=dtype, requires_grad=True)
        z = torch.randn(rows_n, hidden, dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, requires_grad=True)
        dout = torch.randn(rows_n, hidden, dtype=dtype)

        def step(fn):
            def go():
                x.grad = z.grad = w.grad = None
                fn(x, w, None, z, 1e-5, gs, nbg).backward(dout)
            return go

        tvm_ms = median_ms(step(rmsnorm_fn), iters=10 if quick else 20)
        ref_ms = median_ms(step(rmsnorm_gated_ref), iters=10 if quick else 20)
        copy_ms = median_ms(copy_fwd_bwd(x, dout))
        name = str(dtype).replace("torch.", "")
        out.append(Row("rmsnorm_gated", "fwd+bwd", f"{rows_n}x{hidden}, {name}, z, group={gs or hidden}, nbg={nbg}",
                       tvm_ms, ref_ms, copy_ms, "torch eager (rms_norm_ref)"))
    return out


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run(quick=False)))
