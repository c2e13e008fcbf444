"""causal_conv1d: forward and forward+backward against PyTorch eager (F.conv1d + SiLU) and a copy of x (clone
forward; clone forward + clone of the gradient backward for the forward+backward rows)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from benchlib import Row, copy_fwd_bwd, median_ms

from tvm_mamba import causal_conv1d_fn


def _eager(x, w, b):
    width = w.shape[1]
    return F.silu(F.conv1d(x, w[:, None, :], b, padding=width - 1, groups=x.shape[1])[..., : x.shape[-1]])


def run(quick: bool = False) -> list[Row]:
    shapes = [(2, 256, 512)] if quick else [(4, 768, 2048), (1, 1536, 4096)]
    rows = []
    for batch, dim, seqlen in shapes:
        x = torch.randn(batch, dim, seqlen)
        w, b = torch.randn(dim, 4), torch.randn(dim)
        shape = f"b={batch}, d={dim}, L={seqlen}, w=4, silu, fp32"
        causal_conv1d_fn(x, w, b, activation="silu")  # build/load outside the timing
        tvm_f = median_ms(lambda: causal_conv1d_fn(x, w, b, activation="silu"))
        ref_f = median_ms(lambda: _eager(x, w, b))
        copy = median_ms(lambda: x.clone())
        rows.append(Row("causal_conv1d", "fwd", shape, tvm_f, ref_f, copy, "F.conv1d+silu"))
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        dout = torch.randn_like(x)

        def fb(fn):
            def step():
                for t in (xs, ws, bs):
                    t.grad = None
                fn(xs, ws, bs).backward(dout)
            return step

        fb(lambda x_, w_, b_: causal_conv1d_fn(x_, w_, b_, activation="silu"))()
        tvm_fb = median_ms(fb(lambda x_, w_, b_: causal_conv1d_fn(x_, w_, b_, activation="silu")))
        ref_fb = median_ms(fb(_eager))
        copy_fb = median_ms(copy_fwd_bwd(x, dout))
        rows.append(Row("causal_conv1d", "fwd+bwd", shape, tvm_fb, ref_fb, copy_fb, "F.conv1d+silu"))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
