"""layer_norm_fn / rms_norm_fn (the fused residual-add norm of mamba_ssm's layer_norm.py) and its RMSNorm module
against the float64 reference written from the math: forward, residual_out, every gradient (including the
residual's and the prenorm residual_out's), dtypes and return conventions."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tests.torch_ops.test_rmsnorm_gated import _ours, _upstream_param_names, _upstream_signature, _upstream_tree
from tvm_mamba.modules.layer_norm import RMSNorm
from tvm_mamba.reference.layer_norm import layer_norm_ref
from tvm_mamba.torch_ops.layer_norm import layer_norm_fn, rms_norm_fn

HIDDEN = 64


def _inputs(shape, dtype, has_bias, res_dtype, seed=0, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, hidden, generator=g) + 1.0).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).requires_grad_()
    b = (0.3 * torch.randn(hidden, generator=g)).requires_grad_() if has_bias else None
    r = torch.randn(*shape, hidden, generator=g).to(res_dtype).requires_grad_() if res_dtype is not None else None
    return x, w, b, r


def _run(fn, x, w, b, r, douts, dtype=None, **kw):
    """Forward (prenorm) + backward with cotangents for out and residual_out -> (out, residual_out, grads)."""
    ins = [t.detach().to(dtype or t.dtype).requires_grad_() if t is not None else None for t in (x, w, b, r)]
    out, rout = fn(ins[0], ins[1], ins[2], ins[3], prenorm=True, **kw)
    torch.autograd.backward([out, rout], [douts[0].to(out.dtype), douts[1].to(rout.dtype)])
    return [out, rout] + [t.grad for t in ins if t is not None]


def _names(has_bias, has_res):
    return ["out", "residual_out", "dx", "dweight"] + (["dbias"] if has_bias else []) + \
        (["dresidual"] if has_res else [])


CASES = [  # (is_rms_norm, has_bias, x dtype, residual dtype, residual_in_fp32)
    (True, False, torch.float32, torch.float32, False),
    (False, True, torch.float32, torch.float32, False),
    (True, False, torch.float32, None, False),
    (False, True, torch.float32, None, True),
]


@pytest.mark.parametrize("is_rms_norm,has_bias,xdt,rdt,fp32", CASES)
def test_fp32_against_float64(is_rms_norm, has_bias, xdt, rdt, fp32):
    x, w, b, r = _inputs((2, 3), xdt, has_bias, rdt, seed=1)
    g = torch.Generator().manual_seed(2)
    douts = (torch.randn(2, 3, HIDDEN, generator=g), torch.randn(2, 3, HIDDEN, generator=g))
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm, residual_in_fp32=fp32)
    got = _run(layer_norm_fn, x, w, b, r, douts, **kw)
    ref = _run(layer_norm_ref, x, w, b, r, [d.double() for d in douts], dtype=torch.float64, **kw)
    for name, gv, rv in zip(_names(has_bias, r is not None), got, ref):
        assert_close_to_ref(gv, rv, name=name, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("is_rms_norm,rdt,fp32", [(True, torch.float32, False), (False, None, True),
                                                   (True, torch.bfloat16, False)])
def test_bf16_within_twice_reference_drift(is_rms_norm, rdt, fp32):
    """Block's mixed-precision paths: bf16 hidden states with an fp32 residual (residual_in_fp32 after the
    first layer) or a bf16 one; fp32 weights."""
    x, w, b, r = _inputs((4, 8), torch.bfloat16, not is_rms_norm, rdt, seed=3)
    g = torch.Generator().manual_seed(4)
    douts = (torch.randn(4, 8, HIDDEN, generator=g), torch.randn(4, 8, HIDDEN, generator=g))
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm, residual_in_fp32=fp32)
    got = _run(layer_norm_fn, x, w, b, r, douts, **kw)
    ref64 = _run(layer_norm_ref, *(t.detach().double() if t is not None else None for t in (x, w, b, r)),
                 [d.double() for d in douts], **kw)
    low = _run(layer_norm_ref, x, w, b, r, douts, **kw)  # the reference itself on the bf16 inputs
    names = _names(b is not None, r is not None)
    lows = dict(zip(names, low))
    if rdt == torch.bfloat16:
        # the backward recomputes xhat from the stored bf16 residual_out (upstream's choice, as its Triton
        # kernel): the reference's own drift on that rounded input also bounds the gradients
        again = _run(layer_norm_ref, low[1].detach(), w, b, None, douts, **kw)
        for name, lo in zip(["dx", "dweight"] + (["dbias"] if b is not None else []), again[2:]):
            for n in (name, "dresidual") if name == "dx" else (name,):
                if (lo.double() - dict(zip(names, ref64))[n]).abs().max() > (lows[n].double() - dict(
                        zip(names, ref64))[n]).abs().max():
                    lows[n] = lo.to(lows[n].dtype)
    for name, gv, rv in zip(names, got, ref64):
        assert gv.dtype == lows[name].dtype, name
        assert_close_to_ref(gv, rv, lows[name], name=name)


@pytest.mark.parametrize("is_rms_norm,rdt", [(True, torch.float32), (False, None)])
def test_rowscale(is_rms_norm, rdt):
    """rowscale: s = x * rowscale[row] (+ residual); dx = d s * rowscale, d residual = d s (written as its own
    output); no gradient for rowscale itself (as upstream)."""
    x, w, b, r = _inputs((2, 3), torch.float32, not is_rms_norm, rdt, seed=8)
    rs = torch.rand(2, 3, generator=torch.Generator().manual_seed(9)) + 0.5
    g = torch.Generator().manual_seed(10)
    douts = (torch.randn(2, 3, HIDDEN, generator=g), torch.randn(2, 3, HIDDEN, generator=g))
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm)
    got = _run(layer_norm_fn, x, w, b, r, douts, rowscale=rs, **kw)
    ref = _run(layer_norm_ref, x, w, b, r, [d.double() for d in douts], dtype=torch.float64,
               rowscale=rs.double(), **kw)
    for name, gv, rv in zip(_names(b is not None, r is not None), got, ref):
        assert_close_to_ref(gv, rv, name=name, atol=2e-4, rtol=1e-4)
    out = layer_norm_fn(x.detach(), w.detach(), None, rowscale=rs.reshape(-1), is_rms_norm=is_rms_norm)
    assert_close_to_ref(out, layer_norm_ref(x.detach().double(), w.detach().double(), None, None, 1e-6,
                                            is_rms_norm=is_rms_norm, rowscale=rs.double()), atol=2e-4)


@pytest.mark.parametrize("is_rms_norm,rdt", [(True, torch.float32), (False, None)])
def test_dropout_against_the_returned_mask(is_rms_norm, rdt):
    """dropout_p > 0: out, residual_out and every gradient equal the reference run with the kernel's own keep
    mask (upstream's layer_norm_ref(dropout_mask=...)); the backward recomputes the same mask from the row
    seeds, also when the mask is not returned (same torch seed, same mask)."""
    x, w, b, r = _inputs((4, 16), torch.float32, not is_rms_norm, rdt, seed=11)
    rs = torch.rand(4, 16, generator=torch.Generator().manual_seed(12)) + 0.5
    g = torch.Generator().manual_seed(13)
    douts = (torch.randn(4, 16, HIDDEN, generator=g), torch.randn(4, 16, HIDDEN, generator=g))
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm, dropout_p=0.25, rowscale=rs)
    ins = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b, r)]
    torch.manual_seed(7)
    out, rout, mask, mask1 = layer_norm_fn(*ins, prenorm=True, return_dropout_mask=True, **kw)
    assert mask.dtype == torch.bool and mask.shape == x.shape and mask1 is None
    assert abs(mask.float().mean().item() - 0.75) < 0.03  # 4096 draws: 5 standard deviations
    torch.autograd.backward([out, rout], list(douts))
    got = [out, rout] + [t.grad for t in ins if t is not None]
    torch.manual_seed(7)  # the same seeds without returning the mask: the same outputs and gradients
    again = _run(layer_norm_fn, x, w, b, r, douts, **kw)
    for u, v in zip(got, again):
        assert torch.equal(u, v)
    ref = _run(layer_norm_ref, x, w, b, r, [d.double() for d in douts], dtype=torch.float64,
               dropout_mask=mask, **dict(kw, rowscale=rs.double()))
    for name, gv, rv in zip(_names(b is not None, r is not None), got, ref):
        assert_close_to_ref(gv, rv, name=name, atol=2e-4, rtol=1e-4)
    torch.manual_seed(8)
    other = layer_norm_fn(x, w, b, residual=r, prenorm=True, return_dropout_mask=True, **kw)[2]
    assert not torch.equal(other, mask)  # another torch seed, another mask


def test_module_dropout_in_training_only():
    m = RMSNorm(HIDDEN, eps=1e-5, dropout_p=0.5)
    x = torch.randn(8, HIDDEN)
    ref = layer_norm_ref(x.double(), m.weight.double(), None, None, 1e-5, is_rms_norm=True)
    assert_close_to_ref(m.eval()(x), ref, atol=2e-4)
    out, rout = m.train()(x, prenorm=True)
    zero = rout == 0
    assert 0.3 < zero.float().mean().item() < 0.7 and torch.allclose(rout[~zero], 2 * x[~zero])


@pytest.mark.parametrize("is_rms_norm,p", [(True, 0.0), (False, 0.0), (False, 0.2)])
def test_parallel_norm_x1_weight1(is_rms_norm, p):
    """x1 / weight1 / bias1 (upstream's parallel norm): s = dropout(x) + dropout(x1) + residual, out and out1
    from the same xhat; returns (out, out1, residual_out, mask, mask1); every gradient (x, x1, residual,
    weight, bias, weight1, bias1) against the float64 reference run with the kernel's masks."""
    x, w, b, r = _inputs((3, 5), torch.float32, True, torch.float32, seed=14)
    g = torch.Generator().manual_seed(15)
    x1 = torch.randn(3, 5, HIDDEN, generator=g).requires_grad_()
    w1, b1 = (1 + 0.3 * torch.randn(HIDDEN, generator=g)).requires_grad_(), torch.randn(HIDDEN, generator=g)
    b1.requires_grad_()
    douts = [torch.randn(3, 5, HIDDEN, generator=g) for _ in range(3)]
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm, dropout_p=p)
    out, out1, rout, mask, mask1 = layer_norm_fn(x, w, b, r, x1, w1, b1, prenorm=True, return_dropout_mask=True, **kw)
    assert (mask is None) == (p == 0) and (mask1 is None) == (p == 0)
    if p > 0:
        assert not torch.equal(mask, mask1)  # each input its own seeds
    torch.autograd.backward([out, out1, rout], douts)
    leaves = [x, w, b, r, x1, w1, b1]
    ins = [t.detach().double().requires_grad_() for t in leaves]
    ref = layer_norm_ref(ins[0], ins[1], ins[2], ins[3], prenorm=True, x1=ins[4], weight1=ins[5], bias1=ins[6],
                         dropout_mask=mask, dropout_mask1=mask1, **kw)
    torch.autograd.backward(list(ref), [d.double() for d in douts])
    for name, gv, rv in zip(["out", "out1", "residual_out"], (out, out1, rout), ref):
        assert_close_to_ref(gv, rv, name=name, atol=2e-4, rtol=1e-4)
    for name, t, t64 in zip(["dx", "dweight", "dbias", "dresidual", "dx1", "dweight1", "dbias1"], leaves, ins):
        assert_close_to_ref(t.grad, t64.grad, name=name, atol=2e-4, rtol=1e-4)
    two = layer_norm_fn(x.detach(), w.detach(), None, None, None, w1.detach(), None, eps=1e-5)
    assert isinstance(two, tuple) and len(two) == 2  # weight1 alone: (out, out1) from the same x


def test_return_conventions_and_dtypes():
    """prenorm returns (out, residual_out); residual_out's dtype is residual's, else float32 with
    residual_in_fp32, else x's (then x itself, as upstream); residual_in_fp32 is ignored with a residual;
    return_dropout_mask appends the (None, None) masks of dropout_p = 0."""
    x = torch.randn(3, HIDDEN).bfloat16()
    w = torch.ones(HIDDEN)
    out = rms_norm_fn(x, w, None)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    out, rout = rms_norm_fn(x, w, None, prenorm=True)
    assert rout is x
    out, rout = rms_norm_fn(x, w, None, prenorm=True, residual_in_fp32=True)
    assert rout.dtype == torch.float32 and torch.equal(rout, x.float())
    res = torch.randn(3, HIDDEN).bfloat16()
    out, rout = layer_norm_fn(x, w, None, residual=res, prenorm=True, residual_in_fp32=True)
    assert rout.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    assert torch.equal(rout, (x.float() + res.float()).bfloat16())
    got = layer_norm_fn(x, w, None, residual=res, prenorm=True, return_dropout_mask=True)
    assert len(got) == 4 and got[2] is None and got[3] is None
    got = layer_norm_fn(x, w, None, return_dropout_mask=True)
    assert len(got) == 3 and got[1] is None


def test_block_chain_like_mixer_seq_simple():
    """Upstream Block's fused_add_norm path over three layers (prenorm=True, residual_in_fp32, the first layer
    without a residual), then MixerModel's final norm (prenorm=False): forward and the gradient of the
    first hidden states against the float64 chain."""
    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(2, 5, HIDDEN, generator=g).bfloat16().requires_grad_()
    ws = [(1 + 0.3 * torch.randn(HIDDEN, generator=g)) for _ in range(4)]
    mixers = [torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5 for _ in range(3)]

    def chain(fn, h, dtype):
        residual = None
        for w, m in zip(ws, mixers):
            h, residual = fn(h, w.to(dtype) if dtype == torch.float64 else w, None, residual=residual,
                             prenorm=True, residual_in_fp32=True, eps=1e-5, is_rms_norm=True)
            h = h @ m.to(h.dtype)
        return fn(h, ws[3].to(dtype) if dtype == torch.float64 else ws[3], None, residual=residual,
                  prenorm=False, residual_in_fp32=True, eps=1e-5, is_rms_norm=True)

    out = chain(layer_norm_fn, h0, torch.float32)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    h64 = h0.detach().double().requires_grad_()
    ref = chain(layer_norm_ref, h64, torch.float64)
    ref.square().sum().backward()
    lo = chain(layer_norm_ref, h0.detach(), torch.float32)
    assert_close_to_ref(out, ref, lo, name="out")
    torch.testing.assert_close(h0.grad.double(), h64.grad, atol=0.1 * h64.grad.abs().max().item(), rtol=0.05)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck():
    # float32 kernels (no float64 variant): finite differences with eps=1e-2 and float32-sized tolerances
    x, w, b, r = _inputs((3,), torch.float32, True, torch.float32, seed=6)
    for rms in (True, False):
        def fn(x_, w_, b_, r_):
            out, rout = layer_norm_fn(x_, w_, b_, residual=r_, eps=1e-5, prenorm=True, is_rms_norm=rms)
            return out, rout * 0.5
        assert torch.autograd.gradcheck(fn, (x, w, b, r), eps=1e-2, atol=2e-2, rtol=2e-2)


def test_module_state_dict_and_forward():
    tree = _upstream_tree("layer_norm.py")
    m = RMSNorm(HIDDEN, eps=1e-5)
    assert list(m.state_dict()) == _upstream_param_names(tree, "RMSNorm") and m.bias is None
    assert _ours(RMSNorm.__init__)[1:] == _upstream_signature(tree, "__init__", "RMSNorm")[0]
    assert _ours(RMSNorm.forward)[1:] == _upstream_signature(tree, "forward", "RMSNorm")[0]
    w = torch.randn(HIDDEN)
    m.load_state_dict({"weight": w}, strict=True)
    x, r = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    out, rout = m(x, r, prenorm=True)
    ref, rref = layer_norm_ref(x.double(), w.double(), None, r.double(), 1e-5, True, False, True)
    assert_close_to_ref(out, ref, atol=2e-4)
    assert_close_to_ref(rout, rref, atol=1e-6)
    assert RMSNorm(HIDDEN, dropout_p=0.1).drop.p == 0.1  # kept as upstream's (parameter-free) drop module


def test_signatures_match_upstream():
    tree = _upstream_tree("layer_norm.py")
    for fn in (layer_norm_fn, rms_norm_fn):
        assert _ours(fn) == _upstream_signature(tree, fn.__name__)[0], fn.__name__


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(rowscale=torch.ones(3)), ValueError, "rowscale"),
    (dict(rowscale=torch.ones(2).int()), TypeError, "rowscale"),
    (dict(x1=torch.randn(3, HIDDEN)), ValueError, "x1"),
    (dict(x1=torch.randn(2, HIDDEN).bfloat16()), TypeError, "x1"),
    (dict(x1=torch.randn(2, HIDDEN), rowscale=torch.ones(2)), ValueError, "rowscale"),
    (dict(weight1=torch.randn(HIDDEN + 1)), ValueError, "weight1"),
    (dict(weight1=torch.randn(HIDDEN).bfloat16()), TypeError, "weight1"),
    (dict(bias1=torch.randn(HIDDEN)), ValueError, "bias1"),
    (dict(residual=torch.randn(3, HIDDEN)), ValueError, "residual"),
    (dict(residual=torch.randn(2, HIDDEN).double()), TypeError, "residual"),
    (dict(x=torch.randn(2, HIDDEN).double()), TypeError, "x"),
    (dict(weight=torch.randn(HIDDEN + 1)), ValueError, "weight"),
    (dict(bias=torch.randn(HIDDEN + 1)), ValueError, "bias"),
    (dict(eps=-1.0), ValueError, "eps"),
])
def test_bad_input_names_the_argument(kwargs, exc, name, monkeypatch):
    from tvm_mamba.torch_ops import rmsnorm_gated as mod

    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran before the arguments were validated")

    monkeypatch.setattr(mod, "kernel_for", no_kernel)
    args = dict(x=torch.randn(2, HIDDEN), weight=torch.randn(HIDDEN), bias=None)
    args.update(kwargs)
    with pytest.raises(exc, match=rf"^{name}:"):
        layer_norm_fn(**args)


def test_torch_compile_fullgraph():
    x, w, b, r = (t.detach() for t in _inputs((2,), torch.float32, True, torch.float32, seed=7))

    @torch.compile(fullgraph=True, backend="eager")
    def f(x_, r_):
        out, rout = layer_norm_fn(x_, w, b, residual=r_, prenorm=True, residual_in_fp32=True)
        return out * 2, rout

    got, rout = f(x, r)
    ref, rref = layer_norm_ref(x.double(), w.double(), b.double(), r.double(), 1e-6, True, True)
    assert_close_to_ref(got, 2 * ref, atol=4e-4)
    assert_close_to_ref(rout, rref, atol=1e-6)


def _upstream_block_class():
    """upstream's modules/block.py Block, executed (not imported, not copied) with its
    ``mamba_ssm.ops.triton.layer_norm`` import served by tvm_mamba's RMSNorm / layer_norm_fn."""
    import pathlib
    import sys
    import types

    path = pathlib.Path("/work/upstream/mamba_ssm-2.3.2.post1/mamba_ssm/modules/block.py")
    if not path.is_file():
        pytest.skip(f"upstream source {path} not present")
    shim = types.ModuleType("mamba_ssm.ops.triton.layer_norm")
    shim.RMSNorm, shim.layer_norm_fn, shim.rms_norm_fn = RMSNorm, layer_norm_fn, rms_norm_fn
    names = ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.layer_norm"]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in names[:-1]:
            sys.modules[n] = types.ModuleType(n)
        sys.modules[names[-1]] = shim
        ns = {"__name__": "upstream_block"}
        exec(compile(path.read_text(), str(path), "exec"), ns)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return ns["Block"]


@pytest.mark.parametrize("norm", ["rms", "layernorm"])
def test_upstream_block_fused_add_norm(norm):
    """upstream's Block with fused_add_norm=True and residual_in_fp32 (RMSNorm, or nn.LayerNorm with bias)
    over two layers gives what its unfused path (norm(residual) in plain modules) gives, forward and
    backward: the prenorm residual and the gradient paths through layer_norm_fn."""
    import functools

    class Mixer(torch.nn.Linear):
        def forward(self, h, inference_params=None):
            return torch.tanh(super().forward(h))

    block_cls = _upstream_block_class()
    norm_cls = functools.partial(RMSNorm, eps=1e-5) if norm == "rms" else functools.partial(torch.nn.LayerNorm,
                                                                                            eps=1e-5)

    def make(fused):
        torch.manual_seed(0)
        return torch.nn.ModuleList([block_cls(HIDDEN, lambda d: Mixer(d, d), torch.nn.Identity, norm_cls,
                                              fused_add_norm=fused, residual_in_fp32=True) for _ in range(2)])

    def run(layers, h):
        residual = None
        for layer in layers:
            h, residual = layer(h, residual)
        return h, residual

    x = torch.randn(2, 7, HIDDEN)
    fused, plain = make(True), make(False)
    for m in fused.modules():
        if isinstance(m, torch.nn.LayerNorm):
            torch.nn.init.normal_(m.bias, std=0.3)
    plain.load_state_dict(fused.state_dict())
    xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    hf, rf = run(fused, xf)
    hp, rp = run(plain, xp)
    assert rf.dtype == torch.float32 and hf.shape == hp.shape
    torch.testing.assert_close(hf, hp, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(rf, rp, atol=2e-5, rtol=1e-4)
    (hf.square().sum() + rf.sum()).backward()
    (hp.square().sum() + rp.sum()).backward()
    torch.testing.assert_close(xf.grad, xp.grad, atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-4, rtol=1e-4, msg=name)
