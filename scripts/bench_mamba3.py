"""Mamba-3 (SISO) on the CPU against the PyTorch composition of the same math, in one run:

* ``mamba3_siso_combined`` (the chunked forward: preprocess + the SSD pieces) at a 130m-like shape (batch 1,
  seqlen 1024 and 2048, 24 heads, 1 Q/K head, headdim_qk 128, headdim_v 64, 32 rotary angles, chunk 64, D
  and Z), fp32, and bf16 activations at seqlen 2048 (not with --quick); the baseline is
  ``tvm_mamba.reference.mamba3.mamba3_siso_chunked_ref`` in float32 (vectorised einsums per chunk, a loop over
  chunks for the state passing; the bf16 rows' baseline upcasts and computes in float32, as our kernels do);
* ``mamba3_siso_step`` (the decode step) at batch 1 and 8, fp32, and bf16 activations with a bf16 K / V state
  (what Mamba3's bf16 cache holds) at batch 8; the baseline is ``mamba3_siso_step_ref`` in float32 (one
  vectorised step);
* the ``Mamba3`` module's forward (inference, d_model 768, upstream's defaults: 24 heads, d_state 128, chunk
  64), batch 1, fp32; the baseline is ``reference.blocks.mamba3_ref`` in float32 on the module's parameters
  (F.linear projections, the chunked composition);
* forward + backward (training): ``mamba3_siso_combined`` at the combined rows' longest seqlen, fp32, every
  tensor argument requiring grad, against autograd through ``mamba3_siso_chunked_ref`` (float32); and the
  ``Mamba3`` module's forward + backward against autograd through ``mamba3_ref`` (float32);
* MIMO: ``mamba3_mimo`` forward and forward + backward (batch 1, seqlen 1024, 8 heads, 1 Q/K head,
  headdim_qk 128, headdim_v 64, rank 4, chunk 16 = upstream's 64 / R, half rotary, D, Z, MIMO_Out; fp32)
  against ``tvm_mamba.reference.mamba3_mimo.mamba3_mimo_chunked_ref`` (vectorised einsums per chunk) and
  autograd through it; ``mamba3_mimo_step`` (rank 4 at the step rows' dims, D, Z, MIMO_Out) at batch 1 and 8,
  fp32, against ``mamba3_mimo_step_ref`` in float32 (one vectorised step).

Before timing, each case's output is compared with its baseline's (relative max error below 1e-3; 1e-2 for a
bf16 output; for forward + backward, each input's gradient too), so a row never times two functions that
disagree.
"""
from __future__ import annotations

import torch
from benchlib import Row, median_ms

import tvm_mamba
from tvm_mamba.reference.blocks import mamba3_ref
from tvm_mamba.reference.mamba3 import mamba3_siso_chunked_ref, mamba3_siso_step_ref
from tvm_mamba.reference.mamba3_mimo import mamba3_mimo_chunked_ref, mamba3_mimo_step_ref
from tvm_mamba.tools.simcheck.mamba3 import combined_inputs, mimo_step_inputs, step_inputs

OP = "mamba3"
FULL = dict(nheads=24, nheads_qk=1, headdim_qk=128, headdim_v=64, headdim_angles=32, chunk_size=64)
QUICK = dict(nheads=4, nheads_qk=1, headdim_qk=32, headdim_v=16, headdim_angles=8, chunk_size=16)


def _agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """RuntimeError unless got matches want within 1e-3 of want's largest magnitude (1e-2 when got is bf16:
    its rounding; the baselines compute in float32)."""
    err = (got.float() - want.float()).abs().max().item() / max(want.abs().max().item(), 1e-30)
    if not err < (1e-2 if got.dtype == torch.bfloat16 else 1e-3):
        raise RuntimeError(f"bench_mamba3: {what} disagrees with its baseline (relative max error {err:.3g})")


def _shape(dims: dict, batch: int, seqlen: int | None, dtype: str) -> str:
    L, dtype = f", L={seqlen}" if seqlen is not None else "", {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    return (f"b={batch}{L}, h={dims['nheads']}, hqk={dims['nheads_qk']}, n={dims['headdim_qk']}, "
            f"p={dims['headdim_v']}, S={dims['headdim_angles']}" + (f", chunk={dims['chunk_size']}" if L else "")
            + f", D, Z, {dtype}")


def _combined_rows(dims: dict, seqlens, quick: bool) -> list[Row]:
    rows, cs = [], dims["chunk_size"]
    bf16 = [] if quick else [(seqlens[-1], "bfloat16")]  # quick: fp32 only (5 kernels fewer to build)
    for seqlen, dtype in [(L, "float32") for L in seqlens] + bf16:
        args = combined_inputs(dict(dims, has_D=True), {"qk": dtype, "vstate": dtype}, 1, seqlen, has_z=True)

        def ours():
            return tvm_mamba.mamba3_siso_combined(**args, chunk_size=cs)

        def ref():
            return mamba3_siso_chunked_ref(**args, chunk_size=cs, dtype=torch.float32)
        with torch.no_grad():
            _agree(ours(), ref(), f"mamba3_siso_combined at seqlen {seqlen}, {dtype}")
            iters = 3 if quick else 5
            t, r = (median_ms(f, warmup=1, iters=iters, min_time_s=0) for f in (ours, ref))
        tok = seqlen / t * 1e3
        rows.append(Row(OP, "fwd (mamba3_siso_combined)", _shape(dims, 1, seqlen, dtype), t, r, None,
                        "torch chunked einsum (fp32)", f"{tok:,.0f} tokens/s"))
    return rows


def _step_rows(dims: dict, quick: bool) -> list[Row]:
    rows = []
    static = {k: v for k, v in dims.items() if k != "chunk_size"} | dict(has_D=True, has_z=True)
    for batch, dtype in ((1, "float32"), (8, "float32"), (8, "bfloat16")):
        dtypes = {"qk": dtype, "v": dtype} | ({"kstate": dtype} if dtype != "float32" else {})
        args, states = step_inputs(static, dtypes, batch)

        def ours():
            return tvm_mamba.mamba3_siso_step(**args, Input_States=states)

        def ref():
            return mamba3_siso_step_ref(**args, Input_States=states, dtype=torch.float32)
        _agree(ours()[0], ref()[0], f"mamba3_siso_step at batch {batch}, {dtype}")
        t, r = (median_ms(f, iters=20 if quick else 200, min_time_s=0 if quick else 0.2) for f in (ours, ref))
        rows.append(Row(OP, "decode step (mamba3_siso_step)", _shape(dims, batch, None, dtype), t, r,
                        median_ms(lambda: states[1].clone()), "torch step (fp32)",
                        f"{t * 1e3:.0f} us per step; copy = the ssm state"))
    return rows


def _module_rows(quick: bool) -> list[Row]:
    dims, seqlen = (QUICK, 64) if quick else (FULL, 2048)  # quick: the combined rows' kernels again
    d_model = dims["nheads"] * dims["headdim_v"] // 2
    torch.manual_seed(0)
    m = tvm_mamba.Mamba3(d_model, d_state=dims["headdim_qk"], headdim=dims["headdim_v"],
                         chunk_size=dims["chunk_size"]).eval()
    p = {k: v.detach() for k, v in m.state_dict().items()}
    u = torch.randn(1, seqlen, d_model)
    kw = dict(headdim=m.headdim, d_state=m.d_state, ngroups=m.num_bc_heads, num_rope_angles=m.num_rope_angles,
              chunk_size=m.chunk_size)
    with torch.no_grad():
        _agree(m(u), mamba3_ref(p, u, **kw), "Mamba3 forward")
        iters = 3 if quick else 5
        t, r = (median_ms(f, warmup=1, iters=iters, min_time_s=0)
                for f in (lambda: m(u), lambda: mamba3_ref(p, u, **kw)))
    shape = f"b=1, L={seqlen}, d_model={d_model}, heads={m.nheads}, d_state={m.d_state}, chunk={m.chunk_size}, fp32"
    return [Row(OP, "Mamba3 forward (inference)", shape, t, r, None, "mamba3_ref (F.linear + chunked einsum)",
                f"{seqlen / t * 1e3:,.0f} tokens/s")]


def _fwd_bwd(fn, leaves: dict, grad_out: torch.Tensor):
    """Run fn(**leaves) and its backward for grad_out -> {name: gradient} (the leaves' .grad reset first)."""
    for t in leaves.values():
        if isinstance(t, torch.Tensor):
            t.grad = None
    fn(**leaves).backward(grad_out)
    return {k: t.grad for k, t in leaves.items() if isinstance(t, torch.Tensor)}


def _combined_train_row(dims: dict, seqlen: int, quick: bool) -> Row:
    cs = dims["chunk_size"]
    args = combined_inputs(dict(dims, has_D=True), {"qk": "float32", "vstate": "float32"}, 1, seqlen, has_z=True)
    args.pop("Input_States", None)
    leaves = {k: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    g = torch.randn(args["V"].shape, generator=torch.Generator().manual_seed(0))
    ours = lambda: _fwd_bwd(lambda **kw: tvm_mamba.mamba3_siso_combined(**kw, chunk_size=cs), leaves, g)  # noqa
    ref = lambda: _fwd_bwd(lambda **kw: mamba3_siso_chunked_ref(**kw, chunk_size=cs, dtype=torch.float32),  # noqa
                           leaves, g)
    want = {k: v.clone() for k, v in ref().items()}
    for name, got in ours().items():
        _agree(got, want[name], f"d{name} of mamba3_siso_combined at seqlen {seqlen}")
    t, r = (median_ms(f, warmup=1, iters=3 if quick else 5, min_time_s=0) for f in (ours, ref))
    return Row(OP, "fwd+bwd (mamba3_siso_combined)", _shape(dims, 1, seqlen, "float32"), t, r, None,
               "autograd of torch chunked einsum (fp32)", f"{seqlen / t * 1e3:,.0f} tokens/s")


def _module_train_row(quick: bool) -> Row:
    dims, seqlen = (QUICK, 64) if quick else (FULL, 2048)
    d_model = dims["nheads"] * dims["headdim_v"] // 2
    torch.manual_seed(0)
    m = tvm_mamba.Mamba3(d_model, d_state=dims["headdim_qk"], headdim=dims["headdim_v"], chunk_size=dims["chunk_size"])
    p = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    kw = dict(headdim=m.headdim, d_state=m.d_state, ngroups=m.num_bc_heads, num_rope_angles=m.num_rope_angles,
              chunk_size=m.chunk_size)
    u = torch.randn(1, seqlen, d_model)
    g = torch.randn(u.shape, generator=torch.Generator().manual_seed(1))
    ours = lambda: _fwd_bwd(lambda **a: m(**a), {"u": u.clone().requires_grad_()}, g)  # noqa: E731
    ref = lambda: _fwd_bwd(lambda **a: mamba3_ref(p, **a, **kw), {"u": u.clone().requires_grad_()}, g)  # noqa: E731
    _agree(ours()["u"], ref()["u"], "du of Mamba3 forward + backward")
    t, r = (median_ms(f, warmup=1, iters=3 if quick else 5, min_time_s=0) for f in (ours, ref))
    shape = f"b=1, L={seqlen}, d_model={d_model}, heads={m.nheads}, d_state={m.d_state}, chunk={m.chunk_size}, fp32"
    return Row(OP, "Mamba3 forward + backward (training)", shape, t, r, None, "autograd of mamba3_ref (fp32)",
               f"{seqlen / t * 1e3:,.0f} tokens/s")


def _mimo_inputs(quick: bool) -> tuple[dict, dict]:
    """(shape dims, mamba3_mimo's tensor arguments): random, fp32, small decays and rates."""
    d = dict(L=64, H=4, N=32, P=16, R=2, chunk=8) if quick else dict(L=1024, H=8, N=128, P=64, R=4, chunk=16)
    g = torch.Generator().manual_seed(0)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    L, H, N, P, R = d["L"], d["H"], d["N"], d["P"], d["R"]
    args = dict(Q=r(1, L, R, 1, N, scale=0.1), K=r(1, L, R, 1, N, scale=0.1), V=r(1, L, H, P),
                ADT=-torch.rand(1, H, L, generator=g) * 0.1, DT=torch.rand(1, H, L, generator=g) * 0.1,
                Trap=r(1, H, L), Q_bias=r(H, R, N, scale=0.1), K_bias=r(H, R, N, scale=0.1), MIMO_V=r(H, R, P),
                MIMO_Z=r(H, R, P), MIMO_Out=r(H, R, P), Angles=r(1, L, H, N // 4), D=r(H), Z=r(1, L, H, P))
    return d, args


def _mimo_rows(quick: bool) -> list[Row]:
    d, args = _mimo_inputs(quick)
    cs = d["chunk"]
    ours_fn = lambda **kw: tvm_mamba.mamba3_mimo(**kw, chunk_size=cs, rotary_dim_divisor=4, dtype=torch.float32)  # noqa
    ref_fn = lambda **kw: mamba3_mimo_chunked_ref(**kw, chunk_size=cs)  # noqa: E731
    shape = f"b=1, L={d['L']}, h={d['H']}, hqk=1, n={d['N']}, p={d['P']}, R={d['R']}, chunk={cs}, D, Z, fp32"
    iters = 3 if quick else 5
    with torch.no_grad():
        _agree(ours_fn(**args), ref_fn(**args), "mamba3_mimo")
        t, r = (median_ms(lambda f=f: f(**args), warmup=1, iters=iters, min_time_s=0) for f in (ours_fn, ref_fn))
    rows = [Row(OP, "MIMO fwd (mamba3_mimo)", shape, t, r, None, "torch chunked einsum (fp32)",
                f"{d['L'] / t * 1e3:,.0f} tokens/s")]
    leaves = {k: v.clone().requires_grad_() for k, v in args.items()}
    g = torch.randn(args["V"].shape, generator=torch.Generator().manual_seed(1))
    ours, ref = (lambda f=f: _fwd_bwd(f, leaves, g) for f in (ours_fn, ref_fn))
    want = {k: v.clone() for k, v in ref().items()}
    for name, got in ours().items():
        _agree(got, want[name], f"d{name} of mamba3_mimo")
    t, r = (median_ms(f, warmup=1, iters=iters, min_time_s=0) for f in (ours, ref))
    return rows + [Row(OP, "MIMO fwd+bwd (mamba3_mimo)", shape, t, r, None, "autograd of torch chunked einsum",
                       f"{d['L'] / t * 1e3:,.0f} tokens/s")]


def _mimo_step_rows(dims: dict, quick: bool) -> list[Row]:
    rows, R = [], 2 if quick else 4
    static = {k: v for k, v in dims.items() if k != "chunk_size"} | dict(has_D=True, has_z=True, mimo_rank=R)
    for batch in (1, 8):
        args, states = mimo_step_inputs(static, {"qk": "float32", "v": "float32"}, batch)
        ours = lambda: tvm_mamba.mamba3_mimo_step(**args, Input_States=states)  # noqa: E731
        ref = lambda: mamba3_mimo_step_ref(**args, Input_States=states, dtype=torch.float32)  # noqa: E731
        _agree(ours()[0], ref()[0], f"mamba3_mimo_step at batch {batch}")
        t, r = (median_ms(f, iters=20 if quick else 200, min_time_s=0 if quick else 0.2) for f in (ours, ref))
        rows.append(Row(OP, "MIMO decode step (mamba3_mimo_step)", _shape(dims, batch, None, "float32")
                        .replace(", D, Z", f", R={R}, D, Z"), t, r, None, "mamba3_mimo_step_ref (fp32)", ""))
    return rows


def run(quick: bool = False) -> list[Row]:
    dims = QUICK if quick else FULL
    seqlens = (64,) if quick else (1024, 2048)
    return (_combined_rows(dims, seqlens, quick) + [_combined_train_row(dims, seqlens[-1], quick)]
            + _step_rows(dims, quick) + _module_rows(quick) + [_module_train_row(quick)] + _mimo_rows(quick)
            + _mimo_step_rows(dims, quick))


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
