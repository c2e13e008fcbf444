"""tvm_mamba's vLLM call forms against vLLM's own CPU ops on the same inputs (a second opinion beside the
float64 references of tests/torch_ops/test_serving*.py; marker ``vllm``): prefill conv and SSD with
per-sequence initial states from pool slots, the decode steps on 2-D block tables (null block, dst blocks) on
vLLM's page layout."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from tvm_mamba.torch_ops import serving, serving_prefill  # noqa: E402

H, P, N, G, W = 4, 16, 16, 1, 4
DIM = H * P + 2 * G * N  # the conv's channels (x, B, C), as Mamba-2 packs them
BLOCKS = 8


def _pages(g):
    """vLLM's page per block: the conv state stored (state_len, DIM), then the SSM state (H, P, N)."""
    state_len = W - 1
    pages = torch.randn(BLOCKS, state_len * DIM + H * P * N, generator=g)
    conv = pages[:, :state_len * DIM].view(BLOCKS, state_len, DIM).transpose(1, 2)
    return pages, conv, pages[:, state_len * DIM:].view(BLOCKS, H, P, N)


def _loc(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def test_prefill_conv_and_ssd_agree_with_vllms_cpu_ops():
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as vconv
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm as vssm

    g = torch.Generator().manual_seed(0)
    lens, slots = [37, 2, 70], torch.tensor([5, 2, 7], dtype=torch.int32)
    init = torch.tensor([True, False, True])
    x = torch.randn(sum(lens), DIM, generator=g).t()  # (DIM, tokens) channel-last, as MambaMixer2 passes it
    w, b = torch.randn(DIM, W, generator=g), torch.randn(DIM, generator=g)
    pages_a, conv_a, ssm_a = _pages(g)
    pages_b = pages_a.clone()
    conv_b = pages_b[:, :(W - 1) * DIM].view(BLOCKS, W - 1, DIM).transpose(1, 2)
    ours = serving_prefill.causal_conv1d_fn(x, w, b, conv_a, _loc(lens), cache_indices=slots, has_initial_state=init)
    theirs = vconv.causal_conv1d_fn_cpu(x, w, b, conv_b, _loc(lens), cache_indices=slots, has_initial_state=init)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_a, conv_b, rtol=0, atol=0)

    T = sum(lens)
    xs, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, generator=g)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g), torch.randn(H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    states = torch.where(init[:, None, None, None], ssm_a[slots.long()], 0)
    out_a, out_b = torch.empty(T, H, P), torch.empty(T, H, P)
    kw = dict(D=D, dt_bias=dt_bias, initial_states=states, dt_softplus=True, state_dtype=torch.float32)
    final_a = serving_prefill.mamba_chunk_scan_combined_varlen(xs, dt, A, B, C, 64, _loc(lens), out=out_a, **kw)
    final_b = vssm._mamba_chunk_scan_combined_fwd_cpu(xs, dt, A, B, C, 64, out_b, cu_seqlens=_loc(lens), **kw)
    torch.testing.assert_close(out_a, out_b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final_a, final_b, rtol=1e-4, atol=1e-4)


def test_decode_steps_on_block_tables_agree_with_vllms_cpu_ops():
    """One token per sequence on vLLM's (batch, 1) block table (the table vLLM's layers pass without
    speculative decoding), a padding row on the null block, a row written to another block. (vLLM's CPU op follows other rules than its
    Triton kernel for several tokens per sequence: it writes the conv state after each token to that token's
    block; the speculative forms here follow the Triton kernel's, tested in tests/torch_ops/test_serving.py.)"""
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as vconv
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm as vssm

    g = torch.Generator().manual_seed(1)
    blocks = torch.tensor([[1], [0], [6]], dtype=torch.int32)  # row 1: padding
    pages_a, conv_a, ssm_a = _pages(g)
    pages_b = pages_a.clone()
    conv_b = pages_b[:, :(W - 1) * DIM].view(BLOCKS, W - 1, DIM).transpose(1, 2)
    ssm_b = pages_b[:, (W - 1) * DIM:].view(BLOCKS, H, P, N)
    x = torch.randn(3, DIM, generator=g)
    w, b = torch.randn(DIM, W, generator=g), torch.randn(DIM, generator=g)
    ya = serving.causal_conv1d_update(x.clone(), conv_a, w, b, "silu", conv_state_indices=blocks)
    yb = vconv.causal_conv1d_update_cpu(x.clone(), conv_b, w, b, "silu", conv_state_indices=blocks)
    live = [0, 2]
    torch.testing.assert_close(ya[live], yb[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_a, conv_b, rtol=1e-6, atol=1e-6)

    xs, dt = torch.randn(3, H, P, generator=g), torch.randn(3, H, generator=g)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g), torch.randn(H, generator=g)
    B, C = torch.randn(3, G, N, generator=g), torch.randn(3, G, N, generator=g)
    args = (xs, dt[:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), B, C,
            D[:, None].expand(-1, P), None, dt_bias[:, None].expand(-1, P))
    out_a, out_b = torch.zeros(3, H, P), torch.zeros(3, H, P)
    dst = torch.tensor([[7], [0], [6]], dtype=torch.int32)  # row 0 written to another block
    kw = dict(dt_softplus=True, state_batch_indices=blocks, dst_state_batch_indices=dst)
    serving.selective_state_update(ssm_a, *args, out=out_a, **kw)
    vssm.selective_state_update(ssm_b, *args, out=out_b, **kw)
    torch.testing.assert_close(out_a[live], out_b[live], rtol=1e-4, atol=1e-4)
    # vLLM's CPU op also overwrites the source block of a row with a dst block (block 1 here); its Triton kernel
    # and tvm_mamba leave it as it was
    others = [k for k in range(BLOCKS) if k != 1]
    torch.testing.assert_close(ssm_a[others], ssm_b[others], rtol=1e-4, atol=1e-4)
