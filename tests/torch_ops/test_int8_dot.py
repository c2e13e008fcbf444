"""Int8 dot family: exact int64 matmul equality, pack/unpack layout and round trips, straight-through
projection / decoder tail against the float64 formulas, offload on/off, bad input."""
from __future__ import annotations

import pytest
import torch

from tvm_mamba.reference.int8_dot import (int8_decoder_tail_grads_ref, int8_decoder_tail_ref,
                                          int8_lowrank_projection_grads_ref, int8_lowrank_projection_ref,
                                          int8_matmul_ref, pack_int8x4_ref, quantize_int8_ref, unpack_int8x4_ref)
from tvm_mamba.torch_ops.int8_dot import (int8_decoder_tail, int8_lowrank_projection, int8_matmul, pack_int8x4,
                                          quantize_int8, unpack_int8x4)


def _codes(*shape, seed=0, lo=-128):
    return torch.randint(lo, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


# (131, 64, 256): M >= 128 rows take the CPU kernel's packed-b path (131 = 21 tiles of 6 rows + 5)
@pytest.mark.parametrize("M,N,K", [(1, 8, 64), (7, 12, 200), (9, 4, 3), (64 + 5, 16, 128), (131, 64, 256)])
def test_matmul_exact(M, N, K):
    a, b = _codes(M, K, seed=1), _codes(N, K, seed=2)
    c = int8_matmul(a, b)
    assert c.dtype == torch.int32 and torch.equal(c.long(), int8_matmul_ref(a, b))


def test_matmul_extremes_exact():
    # every product at its extreme (-128 * -128) exercises the +128 offset / correction path
    a = torch.full((6, 128), -128, dtype=torch.int8)
    b = torch.cat([torch.full((4, 128), -128, dtype=torch.int8), torch.full((4, 128), 127, dtype=torch.int8)])
    assert torch.equal(int8_matmul(a, b).long(), int8_matmul_ref(a, b))
    # the packed path (M >= 128, N % 64 == 0): b is the unsigned operand there, a the signed one
    a = torch.full((128, 256), -128, dtype=torch.int8)
    b = torch.cat([torch.full((32, 256), -128, dtype=torch.int8), torch.full((32, 256), 127, dtype=torch.int8)])
    assert torch.equal(int8_matmul(a, b).long(), int8_matmul_ref(a, b))


def test_matmul_empty_and_opcheck():
    assert int8_matmul(_codes(0, 8), _codes(4, 8)).shape == (0, 4)
    torch.library.opcheck(torch.ops.tvm_mamba.int8_matmul.default, (_codes(3, 8), _codes(4, 8)))


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 13), (5,), (4, 1)])
def test_pack_layout_and_round_trip(shape):
    codes = _codes(*shape, seed=3)
    packed = pack_int8x4(codes)
    assert packed.dtype == torch.int32 and packed.shape[-1] == (shape[-1] + 3) // 4
    assert torch.equal(packed, pack_int8x4_ref(codes))
    assert torch.equal(unpack_int8x4(packed, shape[-1]), codes)
    assert torch.equal(unpack_int8x4_ref(packed, shape[-1]), codes)


def test_pack_little_endian_lanes():
    codes = torch.tensor([[1, 2, 3, 4, -1]], dtype=torch.int8)
    packed = pack_int8x4(codes)
    assert packed.tolist() == [[0x04030201, 0x000000FF]]
    torch.library.opcheck(torch.ops.tvm_mamba.int8_pack.default, (codes,))
    torch.library.opcheck(torch.ops.tvm_mamba.int8_unpack.default, (packed, 5))


def test_quantize_matches_formula():
    x = torch.randn(5, 7)
    codes, scale = quantize_int8(x)
    rc, rs = quantize_int8_ref(x)
    assert scale == pytest.approx(rs, rel=1e-12) and torch.equal(codes, rc)
    assert int(codes.abs().max()) == 127
    codes2, s2 = quantize_int8(x, 0.01)
    assert s2 == 0.01 and torch.equal(codes2, quantize_int8_ref(x, 0.01)[0])


def _proj_case(hin, H=3, E=16, Lc=8, batch=2, T=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, hin, T, E, generator=g).to(dtype).requires_grad_()
    w = torch.randn(H, E, Lc, generator=g).to(dtype).requires_grad_()
    xc, sa = quantize_int8(x)
    wc, sw = quantize_int8(w)
    return x, w, xc, wc, sa, sw


@pytest.mark.parametrize("hin,latent_out,thr", [(1, None, None), (3, 6, 0.05), (1, 5, 0.0), (3, None, None)])
def test_projection_forward_and_grads(hin, latent_out, thr):
    x, w, xc, wc, sa, sw = _proj_case(hin)
    out = int8_lowrank_projection(x, w, xc, wc, sa, sw, latent_out=latent_out, relu_threshold=thr)
    ref, pre = int8_lowrank_projection_ref(xc, wc, sa, sw, latent_out, thr)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    gi, gw = int8_lowrank_projection_grads_ref(g, pre, xc, wc, sa, sw, thr)
    torch.testing.assert_close(x.grad.double(), gi, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), gw, atol=1e-4, rtol=1e-5)
    if latent_out is not None:
        assert torch.all(w.grad[..., latent_out:] == 0)


def test_projection_tensor_scales_and_offload_identical():
    x, w, xc, wc, sa, sw = _proj_case(1)
    grads = []
    for offload, scales in ((False, (sa, sw)), (True, (torch.tensor(sa), torch.tensor(sw)))):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = int8_lowrank_projection(xi, wi, xc, wc, *scales, relu_threshold=0.02, offload_codes=offload)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), xi.grad, wi.grad))
    for u, v in zip(*grads):
        assert torch.equal(u, v)


@pytest.mark.parametrize("offload", [False, True])
def test_decoder_tail_forward_and_grads(offload):
    g0 = torch.Generator().manual_seed(9)
    y = torch.randn(2, 3, 4, 8, generator=g0, requires_grad=True)
    dec = torch.randn(24, 10, generator=g0, requires_grad=True)
    yc, sa = quantize_int8(y)
    dc, sw = quantize_int8(dec)
    out = int8_decoder_tail(y, dec, yc, dc, sa, sw, offload_codes=offload)
    assert out.shape == (2, 1, 4, 10)
    torch.testing.assert_close(out.double(), int8_decoder_tail_ref(yc, dc, sa, sw), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    gy, gd = int8_decoder_tail_grads_ref(g, yc, dc, sa, sw)
    torch.testing.assert_close(y.grad.double(), gy, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dec.grad.double(), gd, atol=1e-4, rtol=1e-5)


def test_projection_opcheck():
    x, w, xc, wc, sa, sw = _proj_case(1)
    args = (x.detach(), w.detach(), xc, wc, torch.tensor(sa), torch.tensor(sw), 8, 0.01, False)
    torch.library.opcheck(torch.ops.tvm_mamba.int8_lowrank_projection_fwd.default, args)


def _bad_proj(**kw):
    x, w, xc, wc, sa, sw = _proj_case(1)
    args = dict(input=x, weight=w, input_codes=xc, weight_codes=wc, activation_scale=sa, weight_scale=sw)
    args.update(kw)
    return int8_lowrank_projection(**args)


@pytest.mark.parametrize("kw,exc,name", [
    (dict(input_codes=torch.zeros(2, 1, 5, 16)), TypeError, "input_codes"),
    (dict(weight_codes=torch.zeros(3, 16, 8, dtype=torch.int32)), TypeError, "weight_codes"),
    (dict(input_codes=torch.zeros(2, 1, 5, 15, dtype=torch.int8)), ValueError, "input_codes"),
    (dict(weight_codes=torch.zeros(3, 16, 7, dtype=torch.int8)), ValueError, "weight_codes"),
    (dict(latent_out=9), ValueError, "latent_out"),
    (dict(input=torch.randn(2, 2, 5, 16), input_codes=torch.zeros(2, 2, 5, 16, dtype=torch.int8)),
     ValueError, "input"),
    (dict(activation_scale=0.0), ValueError, "activation_scale"),
    (dict(weight_scale=-1.0), ValueError, "weight_scale"),
    (dict(weight_scale=torch.tensor(-1.0)), ValueError, "weight_scale"),
    (dict(activation_scale="1"), TypeError, "activation_scale"),
])
def test_projection_bad_input(kw, exc, name, monkeypatch):
    from tvm_mamba.torch_ops import int8_dot as mod

    monkeypatch.setattr(mod, "kernel_for", lambda *a, **k: (_ for _ in ()).throw(AssertionError("kernel ran")))
    with pytest.raises(exc, match=rf"^{name}:"):
        _bad_proj(**kw)


def test_other_bad_input():
    with pytest.raises(ValueError, match="^b:"):
        int8_matmul(_codes(2, 8), _codes(3, 9))
    with pytest.raises(TypeError, match="^a:"):
        int8_matmul(torch.zeros(2, 8), _codes(3, 8))
    with pytest.raises(TypeError, match="^codes:"):
        pack_int8x4(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="^packed:"):
        unpack_int8x4(torch.zeros(4, 2, dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="^scale:"):
        quantize_int8(torch.randn(3), scale=0.0)
    y, dec = torch.randn(2, 3, 4, 8), torch.randn(24, 10)
    yc, dc = torch.zeros(2, 3, 4, 8, dtype=torch.int8), torch.zeros(24, 10, dtype=torch.int8)
    with pytest.raises(TypeError, match="^decoder_codes:"):
        int8_decoder_tail(y, dec, yc, dc.float(), 1.0, 1.0)
    with pytest.raises(ValueError, match="^decoder:"):
        int8_decoder_tail(y, dec[:20], yc, dc[:20], 1.0, 1.0)


# --- the straight-through backward kernels themselves -----------------------------------------------
@pytest.mark.parametrize("H,M,N,K", [(1, 9, 37, 21), (3, 4, 64, 128)])
def test_dgrad_kernel_against_float64(H, M, N, K):
    g = torch.randn(H, M, K, generator=torch.Generator().manual_seed(5))
    codes = _codes(H, K, N, seed=6)
    out = torch.ops.tvm_mamba.int8_dgrad(g, codes, torch.tensor(0.3))
    ref = 0.3 * torch.einsum("hmk,hkn->hmn", g.double(), codes.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-4 * K, rtol=1e-5)
    torch.library.opcheck(torch.ops.tvm_mamba.int8_dgrad.default, (g, codes, torch.tensor(0.3)))


@pytest.mark.parametrize("H,CH,M,N,K", [(2, 1, 1100, 5, 19), (3, 3, 7, 16, 32)])
def test_wgrad_kernel_two_stage_against_float64(H, CH, M, N, K):
    from tvm_mamba.compute.int8_dot import wgrad_parts

    codes = _codes(CH, M, N, seed=8)
    g = torch.randn(H, M, K, generator=torch.Generator().manual_seed(9))
    out = torch.ops.tvm_mamba.int8_wgrad(codes, g, torch.tensor(0.25))
    ref = 0.25 * torch.einsum("hmn,hmk->hnk", codes.double().expand(H, -1, -1), g.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * M, rtol=1e-5)
    assert torch.equal(out, torch.ops.tvm_mamba.int8_wgrad(codes, g, torch.tensor(0.25)))  # deterministic
    if M >= 1024:
        assert wgrad_parts(M, H, K) > 1  # the multi-part path of the two-stage sum ran
    torch.library.opcheck(torch.ops.tvm_mamba.int8_wgrad.default, (codes[:, :7], g[:, :7], torch.tensor(0.25)))


def test_backward_runs_on_tvm_kernels(monkeypatch):
    from tvm_mamba.torch_ops import int8_dot as mod

    used, real = [], mod.kernel_for
    monkeypatch.setattr(mod, "kernel_for", lambda op, direction, *a, **k: used.append(direction) or
                        real(op, direction, *a, **k))
    monkeypatch.setattr(torch, "matmul", None)  # no torch float matmul fallback anywhere in the backward
    monkeypatch.setattr(torch, "einsum", None)
    for hin in (1, 3):
        x, w, xc, wc, sa, sw = _proj_case(hin)
        int8_lowrank_projection(x, w, xc, wc, sa, sw, latent_out=6).sum().backward()
    y = torch.randn(2, 3, 4, 8, requires_grad=True)
    dec = torch.randn(24, 10, requires_grad=True)
    int8_decoder_tail(y, dec, *quantize_int8(y)[:1], quantize_int8(dec)[0], 0.1, 0.1).sum().backward()
    assert used.count("dgrad") == 3 and used.count("wgrad") == 3, used
