"""Decode steps on a server's state pools, in place: slots a page apart (the page also holds the other state),
vLLM's conv state stored (state_len, dim) and passed transposed. The kernels take the pool's strides (no copy
of the pool), write only their slots' elements, and match the float64 references, on the CPU kernels and on
the CUDA kernels through the harness (whose guarded copy keeps the strides and checks the bytes between
elements)."""
from __future__ import annotations

import ctypes
import contextlib

import pytest
import torch

import tvm_mamba
from tvm_mamba.reference.causal_conv1d import causal_conv1d_update_ref
from tvm_mamba.reference.selective_scan import selective_state_update_ref
from tvm_mamba.runtime import cudasim
from tvm_mamba.torch_ops._dlpack import capture_launches

POOL, BATCH = 6, 3
IDX = torch.tensor([5, -1, 2], dtype=torch.int32)  # one padding row; slots 0, 1, 3, 4 named by none


def _target(sim: bool):
    return tvm_mamba.simulate_cuda("sm_90") if sim else contextlib.nullcontext()


def _pages(inner: int, extra: int, dtype, g):
    """vLLM-style pages: [conv state | SSM state | ...], ``extra`` elements of something else per page."""
    return torch.randn(POOL, inner + extra, generator=g).to(dtype)


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "cudasim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 64])  # the SSM state first in its page, or after 64 elements of it
@pytest.mark.parametrize("layer", ["mamba2", "mamba1"])  # (pool, H, P, N) heads, or Mamba-1's (pool, dim, N)
def test_selective_state_update_on_a_page_strided_pool(sim, dtype, offset, layer):
    g = torch.Generator().manual_seed(offset)
    H, P, N = 2, 4, 16
    hp = (H, P) if layer == "mamba2" else (H * P,)
    page = _pages(H * P * N, 64 + 5, dtype, g)
    before = page.clone()
    state = page[:, offset:offset + H * P * N].view(POOL, *hp, N)
    x, z = torch.randn(BATCH, *hp, generator=g).to(dtype), torch.randn(BATCH, *hp, generator=g).to(dtype)
    dt, A = torch.rand(BATCH, *hp, generator=g).to(dtype), -torch.rand(*hp, N, generator=g)
    bc = (BATCH, 1, N) if layer == "mamba2" else (BATCH, N)
    B, C = torch.randn(*bc, generator=g).to(dtype), torch.randn(*bc, generator=g).to(dtype)
    D, dt_bias = torch.randn(*hp, generator=g), torch.randn(*hp, generator=g)
    want_out, want_state = selective_state_update_ref(
        state.double(), x.double(), dt.double(), A.double(), B.double(), C.double(), D.double(), z.double(),
        dt_bias.double(), True, IDX, state_dtype=dtype)
    with _target(sim), capture_launches() as launches:
        out = tvm_mamba.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True,
                                               state_batch_indices=IDX)
    assert launches[0].args[0].data_ptr() == state.data_ptr()  # the pool itself, not a copy
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(state.double(), want_state.to(dtype).double(), **tol)
    outside = torch.ones(page.shape, dtype=torch.bool)
    outside[[5, 2], offset:offset + H * P * N] = False
    assert torch.equal(page[outside], before[outside])  # the rest of each page, and unnamed slots


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "cudasim"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_on_vllm_conv_state_layouts(sim, layout, dtype):
    """SD (vLLM's default): each page stores (state_len, dim), the kernel gets its (dim, state_len) transpose;
    DS: (dim, state_len). Both a page apart, the page's SSM state after them."""
    g = torch.Generator().manual_seed(len(layout))
    D, W = 24, 4
    S = W - 1
    page = _pages(D * S, 64, dtype, g)
    before = page.clone()
    flat = page[:, :D * S]
    state = flat.view(POOL, S, D).transpose(1, 2) if layout == "SD" else flat.view(POOL, D, S)
    x = torch.randn(BATCH, D, 2, generator=g).to(dtype)  # two tokens per row
    w, b = torch.randn(D, W, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
    want_out, want_state = causal_conv1d_update_ref(x.double(), state.double(), w.double(), b.double(), "silu",
                                                    None, IDX)
    with _target(sim), capture_launches() as launches:
        out = tvm_mamba.causal_conv1d_update(x, state, w, b, "silu", None, IDX)
    assert launches[0].args[1].data_ptr() == state.data_ptr()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(state.double(), want_state.to(dtype).double(), **tol)
    outside = torch.ones(page.shape, dtype=torch.bool)
    outside[[5, 2], :D * S] = False
    assert torch.equal(page[outside], before[outside])


def test_an_unaligned_pool_is_copied_and_written_back():
    """A pool whose base is not 64-byte aligned (the kernels assume aligned buffers) runs on an aligned copy,
    which is then written back: the same result, the rest of the page untouched."""
    g = torch.Generator().manual_seed(5)
    H, P, N = 2, 4, 16
    page = _pages(H * P * N, 8, torch.float32, g)
    before = page.clone()
    state = page[:, 5:5 + H * P * N].view(POOL, H, P, N)  # 20 bytes into each page
    x, dt, A = torch.randn(BATCH, H, P, generator=g), torch.rand(BATCH, H, P, generator=g), -torch.rand(H, P, N, generator=g)
    B, C = torch.randn(BATCH, 1, N, generator=g), torch.randn(BATCH, 1, N, generator=g)
    want_out, want_state = selective_state_update_ref(state.double(), x.double(), dt.double(), A.double(),
                                                      B.double(), C.double(), state_batch_indices=IDX)
    with capture_launches() as launches:
        out = tvm_mamba.selective_state_update(state, x, dt, A, B, C, state_batch_indices=IDX)
    assert launches[0].args[0].data_ptr() != state.data_ptr()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_state, rtol=1e-5, atol=1e-5)
    outside = torch.ones(page.shape, dtype=torch.bool)
    outside[:, 5:5 + H * P * N] = False
    assert torch.equal(page[outside], before[outside])


def test_harness_reports_a_write_between_a_strided_arguments_elements():
    page = torch.zeros(4, 10)
    view = page[:, :6]  # 4 elements of each 10-element page are no element of the argument
    guarded = cudasim._Guarded(0, cudasim._dltensor_of(view))
    try:
        assert guarded.strides == [10, 1] and guarded.nbytes == (3 * 10 + 6) * 4
        assert guarded.check_canaries() is None
        ctypes.memset(guarded.data + 7 * 4, 0x11, 1)  # page 0, element 7: between the elements
        assert "lies between its elements" in guarded.check_canaries()
    finally:
        guarded.free()
