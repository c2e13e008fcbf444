"""The TE definitions themselves (unscheduled, compiled for llvm) against the float64 references."""
from __future__ import annotations

import itertools

import pytest
import torch
import tvm

from tvm_mamba.compute.rmsnorm_gated import build_check_configs, rmsnorm_gated_bwd, rmsnorm_gated_fwd
from tvm_mamba.reference.rmsnorm_gated import rmsnorm_gated_ref
from tvm_mamba.runtime import cpu_target


def _build(func, name):
    return tvm.compile(tvm.IRModule({name: func}), target=cpu_target())[name]


@pytest.mark.parametrize("has_bias,has_z,nbg", [(True, True, True), (False, True, False), (True, False, True)])
def test_te_forward_backward(has_bias, has_z, nbg):
    H, gs, rows = 32, 8, 7
    fwd = _build(rmsnorm_gated_fwd(H, gs, 1e-5, has_bias, has_z, nbg), "rmsnorm_gated_fwd")
    bwd = _build(rmsnorm_gated_bwd(H, gs, 1e-5, has_bias, has_z, nbg), "rmsnorm_gated_bwd")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, H, generator=g, dtype=torch.float64), torch.randn(H, generator=g, dtype=torch.float64)
    b = torch.randn(H, generator=g, dtype=torch.float64) if has_bias else None
    z = torch.randn(rows, H, generator=g, dtype=torch.float64) if has_z else None
    ins = [t.requires_grad_() if t is not None else None for t in (x, w, b, z)]
    ref = rmsnorm_gated_ref(*ins, 1e-5, gs, nbg)
    d = torch.randn(rows, H, generator=g, dtype=torch.float64)
    ref.backward(d)
    f = lambda t: t.detach().float().contiguous()  # noqa: E731
    bt, zt = (f(b) if has_bias else torch.zeros(1)), (f(z) if has_z else torch.zeros(1, 1))
    out, rstd = torch.empty(rows, H), torch.empty(rows, H // gs)
    fwd(f(x), f(w), bt, zt, out, rstd)
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    dx, dw = torch.empty(rows, H), torch.empty(H)
    dz, db = (torch.empty(rows, H) if has_z else torch.empty(1, 1)), (torch.empty(H) if has_bias else torch.empty(1))
    bwd(f(x), f(w), bt, zt, f(d), rstd, dx, dz, dw, db, torch.empty(3, 2, H))
    for got, t in ((dx, x), (dw, w), (db, b), (dz, z)):
        if t is not None:
            torch.testing.assert_close(got.double(), t.grad, atol=1e-5, rtol=1e-5)


def test_te_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        rmsnorm_gated_fwd(32, 5)
    assert all(d in ("fwd", "bwd") for d, _, _ in build_check_configs())
