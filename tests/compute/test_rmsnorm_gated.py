"""The TE definitions themselves (unscheduled, compiled for llvm) against the float64 references: the gated
RMSNorm / LayerNorm and the fused residual-add norm (residual_out, the residual_out gradient, dresidual_in)."""
from __future__ import annotations

import pytest
import torch
import tvm

from tvm_mamba.compute.rmsnorm_gated import NormDims, build_check_configs, rmsnorm_gated_bwd, rmsnorm_gated_fwd
from tvm_mamba.reference.rmsnorm_gated import layernorm_gated_ref
from tvm_mamba.runtime import cpu_target


def _build(func, name):
    return tvm.compile(tvm.IRModule({name: func}), target=cpu_target())[name]


@pytest.mark.parametrize("rms,has_bias,has_z,nbg,has_res,has_rs", [
    (True, True, True, True, False, False), (True, False, True, False, False, False),
    (True, True, False, True, False, False), (False, True, True, True, False, False),
    (False, False, True, False, False, False), (False, True, False, True, True, False),
    (True, False, False, True, True, True)])
def test_te_forward_backward(rms, has_bias, has_z, nbg, has_res, has_rs):
    H, gs, rows = 32, 8, 7
    fwd = _build(rmsnorm_gated_fwd(H, gs, 1e-5, has_bias, has_z, nbg, rms, has_res, has_res, has_rs),
                 "rmsnorm_gated_fwd")
    bwd = _build(rmsnorm_gated_bwd(H, gs, 1e-5, has_bias, has_z, nbg, rms, has_res, has_res, has_rs),
                 "rmsnorm_gated_bwd")
    g = torch.Generator().manual_seed(0)

    def r64(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) + 0.5

    x, w = r64(rows, H).requires_grad_(), r64(H).requires_grad_()
    b = r64(H).requires_grad_() if has_bias else None
    z = r64(rows, H).requires_grad_() if has_z else None
    res = r64(rows, H).requires_grad_() if has_res else None
    rs = r64(rows) if has_rs else None
    s = x * rs[:, None] if has_rs else x
    s = s + res if has_res else s
    ref = layernorm_gated_ref(s, w, b, z, 1e-5, gs, nbg, rms)
    d, dr = r64(rows, H), r64(rows, H)
    ((ref * d).sum() + ((s * dr).sum() if has_res else 0)).backward()

    def f(t, ndim=2):
        return t.detach().float().contiguous() if t is not None else torch.zeros((1,) * ndim)

    out, rout = torch.empty(rows, H), torch.empty(rows, H) if has_res else torch.zeros(1, 1)
    mean, rstd = torch.zeros(1, 1) if rms else torch.empty(rows, H // gs), torch.empty(rows, H // gs)
    no_seeds, no_mask = torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.uint8)
    fwd(f(x), f(w), f(b, 1), f(z), f(res), f(rs, 1), no_seeds, f(None), f(None, 1), f(None, 1), no_seeds, out, rout,
        no_mask, f(None), no_mask, mean, rstd)
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    if has_res:
        torch.testing.assert_close(rout.double(), s.detach(), atol=1e-5, rtol=1e-5)
    dx, dw = torch.empty(rows, H), torch.empty(H)
    dz, db = (torch.empty(rows, H) if has_z else torch.zeros(1, 1)), (torch.empty(H) if has_bias else torch.zeros(1))
    dri = torch.empty(rows, H) if has_res else torch.zeros(1, 1)
    bwd(rout if has_res else f(x), f(w), f(b, 1), f(z), f(d), mean, rstd, f(dr if has_res else None),
        f(rs, 1), no_seeds, f(None, 1), f(None), no_seeds, dx, dz, dw, db, dri, f(None), f(None, 1), f(None, 1),
        torch.empty(1, 2, H))  # one part of PART_ROWS (32) rows
    for got, t in ((dx, x), (dw, w), (db, b), (dz, z), (dri, res)):
        if t is not None:
            torch.testing.assert_close(got.double(), t.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rms", [True, False])
def test_te_dropout_forward_backward(rms):
    """dropout_p > 0: the kernel's own keep mask (stored as uint8), forward and backward against the reference
    run with that mask; about 1 - p of the elements kept."""
    from tvm_mamba.reference.layer_norm import layer_norm_ref

    H, rows, p = 64, 9, 0.3
    fwd = _build(rmsnorm_gated_fwd(H, H, 1e-5, True, False, True, rms, True, True, True, p, True), "rmsnorm_gated_fwd")
    bwd = _build(rmsnorm_gated_bwd(H, H, 1e-5, True, False, True, rms, True, True, True, p), "rmsnorm_gated_bwd")
    g = torch.Generator().manual_seed(0)

    def r64(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, w, b, res = (r64(rows, H).requires_grad_(), r64(H).requires_grad_(), r64(H).requires_grad_(),
                    r64(rows, H).requires_grad_())
    rs = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5
    seeds = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows,), dtype=torch.int32, generator=g)

    def f(t):
        return t.detach().float().contiguous()

    out, rout, mask = torch.empty(rows, H), torch.empty(rows, H), torch.empty(rows, H, dtype=torch.uint8)
    mean, rstd = torch.zeros(1, 1) if rms else torch.empty(rows, 1), torch.empty(rows, 1)
    z1, z11, s1, m1 = torch.zeros(1), torch.zeros(1, 1), torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1).byte()
    fwd(f(x), f(w), f(b), z11, f(res), f(rs), seeds, z11, z1, z1, s1, out, rout, mask, z11, m1, mean, rstd)
    keep = mask.bool()
    assert 0.55 < keep.float().mean().item() < 0.85
    ref, s = layer_norm_ref(x, w, b, res, 1e-5, True, False, rms, rowscale=rs, dropout_p=p, dropout_mask=keep)
    d, dr = r64(rows, H), r64(rows, H)
    ((ref * d).sum() + (s * dr).sum()).backward()
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rout.double(), s.detach(), atol=1e-5, rtol=1e-5)
    dx, dw, db, dri = torch.empty(rows, H), torch.empty(H), torch.empty(H), torch.empty(rows, H)
    bwd(rout, f(w), f(b), z11, f(d), mean, rstd, f(dr), f(rs), seeds, z1, z11, s1, dx, z11, dw, db, dri, z11, z1, z1,
        torch.empty(1, 2, H))  # one part of PART_ROWS (32) rows
    for got, t in ((dx, x), (dw, w), (db, b), (dri, res)):
        torch.testing.assert_close(got.double(), t.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rms,p", [(True, 0.0), (False, 0.0), (False, 0.25)])
def test_te_parallel_norm(rms, p):
    """x1 / weight1 / bias1 (upstream's parallel norm): s = x + x1 + residual (each of x, x1 dropped with its
    own seeds), out1 = xhat * weight1 + bias1; dx1 = dropout1(ds), dweight1 / dbias1."""
    from tvm_mamba.reference.layer_norm import layer_norm_ref

    H, rows = 32, 7
    fwd = _build(rmsnorm_gated_fwd(H, H, 1e-5, True, False, True, rms, True, True, False, p, p > 0, True, True, True),
                 "rmsnorm_gated_fwd")
    bwd = _build(rmsnorm_gated_bwd(H, H, 1e-5, True, False, True, rms, True, True, False, p, True, True, True),
                 "rmsnorm_gated_bwd")
    g = torch.Generator().manual_seed(1)

    def r64(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    x, w, b, res, x1, w1, b1 = r64(rows, H), r64(H), r64(H), r64(rows, H), r64(rows, H), r64(H), r64(H)
    seeds = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, rows), dtype=torch.int32, generator=g)

    def f(t):
        return t.detach().float().contiguous()

    z1, z11, s1 = torch.zeros(1), torch.zeros(1, 1), torch.zeros(1, dtype=torch.int32)
    out, rout, out1 = torch.empty(rows, H), torch.empty(rows, H), torch.empty(rows, H)
    masks = [torch.empty(rows, H, dtype=torch.uint8) if p > 0 else torch.zeros(1, 1).byte() for _ in range(2)]
    mean, rstd = z11 if rms else torch.empty(rows, 1), torch.empty(rows, 1)
    sd, sd1 = (seeds[0].clone(), seeds[1].clone()) if p > 0 else (s1, s1)
    fwd(f(x), f(w), f(b), z11, f(res), z1, sd, f(x1), f(w1), f(b1), sd1, out, rout, masks[0], out1, masks[1], mean,
        rstd)
    ref, ref1, s = layer_norm_ref(x, w, b, res, 1e-5, True, False, rms, x1=x1, weight1=w1, bias1=b1, dropout_p=p,
                                  dropout_mask=masks[0].bool() if p > 0 else None,
                                  dropout_mask1=masks[1].bool() if p > 0 else None)
    d, d1, dr = (torch.randn(rows, H, generator=g, dtype=torch.float64) for _ in range(3))
    ((ref * d).sum() + (ref1 * d1).sum() + (s * dr).sum()).backward()
    for got, want in ((out, ref), (out1, ref1), (rout, s)):
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
    dx, dw, db, dri, dw1, db1 = (torch.empty(rows, H), torch.empty(H), torch.empty(H), torch.empty(rows, H),
                                 torch.empty(H), torch.empty(H))
    dx1 = torch.empty(rows, H) if p > 0 else z11
    bwd(rout, f(w), f(b), z11, f(d), mean, rstd, f(dr), z1, sd, f(w1), f(d1), sd1, dx, z11, dw, db, dri, dx1, dw1, db1,
        torch.empty(1, 4, H))  # one part of PART_ROWS (32) rows
    for got, t in ((dx, x), (dx1 if p > 0 else dx, x1), (dw, w), (db, b), (dri, res), (dw1, w1), (db1, b1)):
        torch.testing.assert_close(got.double(), t.grad, atol=1e-5, rtol=1e-5)


def test_te_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        rmsnorm_gated_fwd(32, 5)
    assert all(d in ("fwd", "bwd") for d, _, _ in build_check_configs())


def test_static_keeps_the_gated_rmsnorm_keys():
    """Flags at their defaults stay out of the key (the plain gated RMSNorm's keys and tuning records are
    unchanged); a set flag is in it."""
    assert set(NormDims(64, 16).static()) == {"hidden", "group_size", "eps", "has_bias", "has_z", "norm_before_gate"}
    assert NormDims(64, 64, is_rms_norm=False, has_residual=True).static()["has_residual"] is True
