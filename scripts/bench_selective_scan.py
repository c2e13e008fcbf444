"""selective_scan: forward and forward+backward against the PyTorch step-by-step reference (same math,
float32, eager, autograd for the backward), plus the achieved exp rate against this CPU's vector-exp peak;
and Mamba-2's decode step (selective_state_update, tied heads) against the reference and a copy of
its state.

The scan is bound by exp throughput (one exp(dt*A) per (batch, dim, dstate, step) in the forward, two in
the backward: recompute + reverse), not by memory, so the note reports Gexp/s achieved vs the peak of the
same vectorized exp (tvm_mamba.compute._math.exp) in a streaming loop on all cores.
"""
from __future__ import annotations

import torch
from benchlib import Row, copy_fwd_bwd, median_ms

from tvm_mamba.reference.selective_scan import selective_scan_ref, selective_state_update_ref
from tvm_mamba.torch_ops.selective_scan import selective_scan_fn, selective_state_update


def exp_peak_per_s(n: int = 1 << 15) -> float:
    """exps/s of the vectorized _math.exp over an L2-resident float32 buffer, all cores (the scan's ceiling)."""
    import tvm
    from tvm.script import tirx as T

    from tvm_mamba.compute import _math
    from tvm_mamba.runtime.target import cpu_target, num_cores

    rows = num_cores() * 16

    @T.prim_func
    def expk(x: T.Buffer((rows, n // rows), "float32"), y: T.Buffer((rows, n // rows), "float32")):
        T.func_attr({"global_symbol": "expk", "tirx.noalias": True})
        for r in T.parallel(rows):
            for io in range(n // rows // 16):
                for ii in T.vectorized(16):
                    y[r, io * 16 + ii] = _math.exp(x[r, io * 16 + ii])

    f = tvm.compile(expk, target=cpu_target())["expk"]
    x = -torch.rand(rows, n // rows)
    y = torch.empty_like(x)
    return n / (median_ms(lambda: f(x, y)) * 1e-3)


def _inputs(batch, dim, dstate, seqlen):
    g = torch.Generator().manual_seed(0)
    return dict(u=torch.randn(batch, dim, seqlen, generator=g),
                delta=0.5 * torch.randn(batch, dim, seqlen, generator=g),
                A=-torch.rand(dim, dstate, generator=g) - 0.5,
                B=torch.randn(batch, dstate, seqlen, generator=g), C=torch.randn(batch, dstate, seqlen, generator=g),
                D=torch.randn(dim, generator=g), z=torch.randn(batch, dim, seqlen, generator=g),
                delta_bias=0.1 * torch.randn(dim, generator=g), delta_softplus=True)


def decode_row(batch: int, nheads: int, headdim: int, dstate: int) -> Row:
    """Mamba-2's decode step as ``Mamba2.step`` calls it (A, dt, D, dt_bias one value per head: the tied
    kernel), timed as a decode step replays it (``Kernel.bind``: the launch on TVM views made once); the note
    gives the public call's time too (its argument checks and DLPack conversions)."""
    from tvm_mamba.torch_ops._dlpack import kernel_for
    from tvm_mamba.torch_ops.selective_scan import OP, _update_dims

    g = torch.Generator().manual_seed(0)
    state = torch.randn(batch, nheads, headdim, dstate, generator=g)
    x, z = torch.randn(batch, nheads, headdim, generator=g), torch.randn(batch, nheads, headdim, generator=g)
    dt, A = 0.5 * torch.randn(batch, nheads, generator=g), -0.2 - torch.rand(nheads, generator=g)
    B, C = torch.randn(batch, 1, dstate, generator=g), torch.randn(batch, 1, dstate, generator=g)
    D, dtb = torch.randn(nheads, generator=g), 0.1 * torch.randn(nheads, generator=g)
    out = torch.empty_like(x)
    dims = _update_dims(state, x, dt, A, B, C, D, z, dtb, True, None)
    launch = kernel_for(OP, "update", x.device, dims).bind(state, x, dt, A, B, C, D, z, dtb,
                                                           torch.zeros(1, dtype=torch.int32), out)
    tvm_ms = median_ms(launch, iters=200)
    kw = dict(x=x, dt=dt[:, :, None].expand(-1, -1, headdim), A=A[:, None, None].expand(-1, headdim, dstate),
              B=B, C=C, D=D[:, None].expand(-1, headdim), z=z, dt_bias=dtb[:, None].expand(-1, headdim),
              dt_softplus=True)
    public_ms = median_ms(lambda: selective_state_update(state, **kw), iters=100)
    ref_ms = median_ms(lambda: selective_state_update_ref(state, **kw), iters=20)
    copy_ms = median_ms(lambda: state.clone(), iters=200)
    shape = f"b={batch}, nheads={nheads}, headdim={headdim}, n={dstate}, tied, D, z, softplus, fp32"
    return Row("selective_scan", "decode step (replayed launch)", shape, tvm_ms, ref_ms, copy_ms,
               "torch reference (float64 math)", f"public call {public_ms * 1e3:.1f} us")


def run(quick: bool = False) -> list[Row]:
    shapes = [(1, 64, 16, 128)] if quick else [(1, 256, 16, 512), (2, 768, 16, 1024)]
    peak = exp_peak_per_s()
    rows = []
    for batch, dim, dstate, seqlen in shapes:
        inp = _inputs(batch, dim, dstate, seqlen)
        shape = f"b={batch}, d={dim}, n={dstate}, L={seqlen}, B/C var, D, z, softplus"
        n_exp = batch * dim * dstate * seqlen
        selective_scan_fn(**inp)
        tvm_f = median_ms(lambda: selective_scan_fn(**inp))
        ref_f = median_ms(lambda: selective_scan_ref(**inp, dtype=torch.float32), iters=3 if seqlen > 512 else 5,
                          warmup=1, min_time_s=0)
        copy = median_ms(lambda: inp["u"].clone())
        note = f"{n_exp / tvm_f * 1e-6:.2f} Gexp/s of {peak * 1e-9:.2f} peak"
        rows.append(Row("selective_scan", "fwd", shape, tvm_f, ref_f, copy, "torch step loop", note))
        names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
        leaves = {k: inp[k].clone().requires_grad_() for k in names}
        dout = torch.randn(batch, dim, seqlen)

        def fb(fn):
            def step():
                for t in leaves.values():
                    t.grad = None
                fn(**leaves, delta_softplus=True).backward(dout)
            return step

        fb(selective_scan_fn)()
        tvm_fb = median_ms(fb(selective_scan_fn))
        ref_fb = median_ms(fb(lambda **kw: selective_scan_ref(**kw, dtype=torch.float32)),
                           iters=3, warmup=1, min_time_s=0)
        note = f"{3 * n_exp / tvm_fb * 1e-6:.2f} Gexp/s (3 exp passes) of {peak * 1e-9:.2f} peak"
        copy_fb = median_ms(copy_fwd_bwd(inp["u"], dout))
        rows.append(Row("selective_scan", "fwd+bwd", shape, tvm_fb, ref_fb, copy_fb, "torch step loop+autograd", note))
    rows.append(decode_row(*((1, 4, 16, 16) if quick else (1, 24, 64, 128))))  # quick; Mamba-2 130M's layer
    return rows


if __name__ == "__main__":
    import sys

    from benchlib import format_table

    print(format_table(run(quick="--quick" in sys.argv)))
