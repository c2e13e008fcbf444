"""SSD chunked scan (mamba_chunk_scan_combined) vs the PyTorch chunked einsum reference, on this machine.

Shape from the issue: batch 1, seqlen 1024, nheads 16, headdim 64, dstate 64, chunk 128 (ngroups 1),
fp32, with D, z, dt_bias and softplus. Forward, and forward + backward (default lean memory mode and
keep_chunk_states). Then one Mamba-2 130M layer (nheads 24, dstate 128, chunk 256, the shape the committed
tuning logs cover) at seqlen 2048, forward + backward. The reference is tvm_mamba.reference.ssd.ssd_chunked_ref (upstream's
ssd_minimal_discrete einsums), autograd for its backward.
"""
from __future__ import annotations

import torch
from benchlib import Row, median_ms

from tvm_mamba.reference.ssd import ssd_chunked_ref
from tvm_mamba.torch_ops.ssd import mamba_chunk_scan_combined


def _inputs(b, L, h, p, n, g=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, L, h, p, generator=gen).to(dtype)
    dt = (torch.randn(b, L, h, generator=gen) - 2).to(dtype)
    A = -torch.rand(h, generator=gen) - 0.5
    B = (torch.randn(b, L, g, n, generator=gen) * 0.3).to(dtype)
    C = (torch.randn(b, L, g, n, generator=gen) * 0.3).to(dtype)
    D = torch.randn(h, generator=gen)
    z = torch.randn(b, L, h, p, generator=gen).to(dtype)
    bias = torch.randn(h, generator=gen) * 0.1
    return [x, dt, A, B, C, D, z, bias]


def run(quick: bool = False) -> list[Row]:
    rows = _case(*((1, 256, 4, 32, 32, 64) if quick else (1, 1024, 16, 64, 64, 128)), quick)
    if not quick:
        rows += _case(1, 2048, 24, 64, 128, 256, quick, fwd=False, keep=False, iters=10)
    return rows


def _case(b, L, h, p, n, cs, quick, fwd=True, keep=True, iters=None) -> list[Row]:
    ts = _inputs(b, L, h, p, n)
    shape = f"b={b}, L={L}, h={h}, p={p}, n={n}, chunk={cs}"

    def ours(args, keep=False):
        x, dt, A, B, C, D, z, bias = args
        return mamba_chunk_scan_combined(x, dt, A, B, C, cs, D=D, z=z, dt_bias=bias, dt_softplus=True,
                                         keep_chunk_states=keep)

    def ref(args):
        x, dt, A, B, C, D, z, bias = args
        return ssd_chunked_ref(x, dt, A, B, C, cs, D=D, z=z, dt_bias=bias, dt_softplus=True)

    def fwd_bwd(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in ts]
        gy = torch.randn(b, L, h, p)

        def step():
            for t in leaves:
                t.grad = None
            fn(leaves, **kw).backward(gy)
        return step

    iters = iters or (5 if quick else 20)
    rows = []
    if fwd:
        with torch.no_grad():
            t_fwd, r_fwd = median_ms(lambda: ours(ts), iters=iters), median_ms(lambda: ref(ts), iters=iters)
        rows.append(Row("ssd", "fwd", shape, t_fwd, r_fwd, ref_name="torch chunked einsum"))
    t_fb = median_ms(fwd_bwd(ours), iters=iters)
    r_fb = median_ms(fwd_bwd(ref), iters=iters)
    rows.append(Row("ssd", "fwd+bwd", shape, t_fb, r_fb, ref_name="torch chunked einsum + autograd"))
    if keep:
        t_keep = median_ms(fwd_bwd(ours, keep=True), iters=iters)
        rows.append(Row("ssd", "fwd+bwd keep_chunk_states", shape, t_keep, r_fb,
                        ref_name="torch chunked einsum + autograd"))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
