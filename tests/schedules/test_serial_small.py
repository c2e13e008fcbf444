"""Decode-size calls run on the calling thread (no thread-pool launch; compute/_common.SERIAL_WORK), larger
ones on the pool: both branches of each such CPU template against the float64 references."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba import causal_conv1d_update, rmsnorm_fn, selective_state_update
from tvm_mamba.compute._common import SERIAL_WORK
from tvm_mamba.reference.causal_conv1d import causal_conv1d_update_ref
from tvm_mamba.reference.rmsnorm_gated import rmsnorm_gated_ref
from tvm_mamba.reference.selective_scan import selective_state_update_ref


@pytest.mark.parametrize("rows", [1, 7, SERIAL_WORK // 64 + 3])  # hidden 64: the last one is above the threshold
def test_rmsnorm_both_branches(rows):
    g = torch.Generator().manual_seed(rows)
    x, z = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
    w = torch.randn(64, generator=g)
    out = rmsnorm_fn(x, w, None, z=z, group_size=32)
    assert_close_to_ref(out, rmsnorm_gated_ref(x.double(), w.double(), None, z=z.double(), group_size=32))


@pytest.mark.parametrize("batch", [1, 2, SERIAL_WORK // (48 * 4) + 1])  # dim 48, state 3 + 1 token
def test_conv1d_update_both_branches(batch):
    g = torch.Generator().manual_seed(batch)
    x, state = torch.randn(batch, 48, generator=g), torch.randn(batch, 48, 3, generator=g)
    w, b = torch.randn(48, 4, generator=g), torch.randn(48, generator=g)
    ref, ref_state = causal_conv1d_update_ref(x.double(), state.double(), w.double(), b.double(), activation="silu")
    out = causal_conv1d_update(x, state, w, b, activation="silu")
    assert_close_to_ref(out, ref)
    assert_close_to_ref(state, ref_state)


@pytest.mark.parametrize("batch", [1, SERIAL_WORK // (4 * 8 * 16) + 1])  # (nheads 4, headdim 8, dstate 16)
def test_selective_state_update_both_branches(batch):
    g = torch.Generator().manual_seed(batch)
    st = torch.randn(batch, 4, 8, 16, generator=g)
    x, dt, z = (torch.randn(batch, 4, 8, generator=g) for _ in range(3))
    A = -torch.rand(4, 8, 16, generator=g)
    B, C = torch.randn(batch, 1, 16, generator=g), torch.randn(batch, 1, 16, generator=g)
    D, bias = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    ref, ref_st = selective_state_update_ref(st.double(), x.double(), dt.double(), A.double(), B.double(),
                                             C.double(), D=D.double(), z=z.double(), dt_bias=bias.double(),
                                             dt_softplus=True)
    out = selective_state_update(st, x, dt, A, B, C, D=D, z=z, dt_bias=bias, dt_softplus=True)
    assert_close_to_ref(out, ref)
    assert_close_to_ref(st, ref_st)
