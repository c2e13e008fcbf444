"""rmsnorm_fn / RMSNormGated against the float64 reference written from the math (forward and every grad)."""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.modules.rmsnorm_gated import RMSNormGated
from tvm_mamba.reference.rmsnorm_gated import rmsnorm_gated_ref
from tvm_mamba.torch_ops.rmsnorm_gated import rmsnorm_fn

HIDDEN = 64


def _inputs(shape, dtype, has_bias, has_z, seed=0, wdtype=torch.float32, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, hidden, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(wdtype).requires_grad_()
    b = (0.3 * torch.randn(hidden, generator=g)).to(wdtype).requires_grad_() if has_bias else None
    z = (2 * torch.randn(*shape, hidden, generator=g)).to(dtype).requires_grad_() if has_z else None
    return x, w, b, z


def _run(fn, x, w, b, z, dout, dtype=None, **kw):
    """Forward + backward of fn on copies of the inputs (cast to dtype if given) -> (out, grads...)."""
    ins = [t.detach().to(dtype or t.dtype).requires_grad_() if t is not None else None for t in (x, w, b, z)]
    out = fn(ins[0], ins[1], ins[2], ins[3], **kw)
    out.backward(dout.to(out.dtype))
    return [out] + [t.grad for t in ins if t is not None]


@pytest.mark.parametrize("has_bias,has_z,norm_before_gate,group_size",
                         list(itertools.product([False, True], [False, True], [True, False], [None, 16])))
def test_fp32_every_combination(has_bias, has_z, norm_before_gate, group_size):
    x, w, b, z = _inputs((2, 3), torch.float32, has_bias, has_z)
    dout = torch.randn(2, 3, HIDDEN)
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    got = _run(rmsnorm_fn, x, w, b, z, dout, **kw)
    ref = _run(rmsnorm_gated_ref, x, w, b, z, dout.double(), dtype=torch.float64, **kw)
    names = ["out", "dx", "dweight"] + (["dbias"] if has_bias else []) + (["dz"] if has_z else [])
    for name, g, r in zip(names, got, ref):
        assert_close_to_ref(g, r, name=name, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_bf16_within_twice_reference_drift(norm_before_gate):
    x, w, b, z = _inputs((4, 8), torch.bfloat16, True, True, seed=1)
    dout = torch.randn(4, 8, HIDDEN).to(torch.bfloat16)
    kw = dict(eps=1e-5, group_size=16, norm_before_gate=norm_before_gate)
    got = _run(rmsnorm_fn, x, w, b, z, dout, **kw)
    ref64 = _run(lambda *a, **k: rmsnorm_gated_ref(*a, **k), *(t.detach().double() for t in (x, w, b, z)),
                 dout.double(), **kw)
    low = _run(rmsnorm_gated_ref, x, w, b, z, dout, **kw)  # the reference itself in bf16 activations
    for name, g, r, lo in zip(["out", "dx", "dweight", "dbias", "dz"], got, ref64, low):
        assert g.dtype == lo.dtype, name
        assert_close_to_ref(g, r, lo, name=name)


@pytest.mark.parametrize("shape", [(), (5,), (2, 1, 3)])
def test_leading_dims_of_any_rank(shape):
    x, w, b, z = _inputs(shape, torch.float32, False, True, seed=2)
    out = rmsnorm_fn(x, w, None, z, 1e-5, 16, True)
    ref = rmsnorm_gated_ref(x.double(), w.double(), None, z.double(), 1e-5, 16, True)
    assert out.shape == x.shape
    assert_close_to_ref(out, ref, atol=2e-4)


def test_zero_rows():
    x, w, _, z = _inputs((0,), torch.float32, False, True)
    out = rmsnorm_fn(x, w, None, z, group_size=16)
    out.sum().backward()
    assert out.shape == (0, HIDDEN) and torch.equal(w.grad, torch.zeros_like(w))


def test_backward_is_deterministic():
    x, w, b, z = _inputs((200,), torch.float32, True, True, seed=3)
    dout = torch.randn(200, HIDDEN)
    a = _run(rmsnorm_fn, x, w, b, z, dout, group_size=16)
    c = _run(rmsnorm_fn, x, w, b, z, dout, group_size=16)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck():
    # The kernels compute in float32 (no float64 variant), so gradcheck runs on float32 inputs with
    # finite-difference step and tolerances sized for float32 (a wrong gradient formula is off by O(1)).
    x, w, b, z = _inputs((3,), torch.float32, True, True, seed=4)
    for nbg in (True, False):
        fn = lambda x_, w_, b_, z_: rmsnorm_fn(x_, w_, b_, z_, 1e-5, 16, nbg)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w, b, z), eps=1e-2, atol=2e-2, rtol=2e-2)


def test_opcheck():
    x, w, b, z = _inputs((3,), torch.float32, True, True, seed=5)
    args = (x.detach().reshape(3, HIDDEN), w.detach(), b.detach(), z.detach(), 1e-5, 16, False)
    torch.library.opcheck(torch.ops.tvm_mamba.rmsnorm_gated_fwd.default, args)
    out, rstd = torch.ops.tvm_mamba.rmsnorm_gated_fwd(*args)
    torch.library.opcheck(torch.ops.tvm_mamba.rmsnorm_gated_bwd.default,
                          args[:4] + (torch.randn_like(out), rstd) + args[4:])
    args_req = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in args)
    torch.library.opcheck(torch.ops.tvm_mamba.rmsnorm_gated_fwd.default, args_req,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_module_state_dict_and_forward():
    m = RMSNormGated(HIDDEN, eps=1e-5, group_size=16, norm_before_gate=False)
    assert [n for n, _ in m.named_parameters()] == ["weight"] and m.bias is None
    w = torch.randn(HIDDEN)
    m.load_state_dict({"weight": w})  # mamba_ssm's RMSNorm state_dict: just "weight"
    x, z = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    ref = rmsnorm_gated_ref(x.double(), w.double(), None, z.double(), 1e-5, 16, False)
    assert_close_to_ref(m(x, z), ref, atol=2e-4)
    with pytest.raises(ValueError, match="group_size"):
        RMSNormGated(HIDDEN, group_size=5)


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(x=torch.randn(2, HIDDEN).double()), TypeError, "x"),
    (dict(x=torch.randn(2, HIDDEN).int()), TypeError, "x"),
    (dict(weight=torch.randn(HIDDEN + 1)), ValueError, "weight"),
    (dict(weight=torch.randn(2, HIDDEN)), ValueError, "weight"),
    (dict(bias=torch.randn(HIDDEN + 1)), ValueError, "bias"),
    (dict(bias=torch.randn(HIDDEN).half()), TypeError, "bias"),
    (dict(z=torch.randn(3, HIDDEN)), ValueError, "z"),
    (dict(z=torch.randn(2, HIDDEN).bfloat16()), TypeError, "z"),
    (dict(group_size=24), ValueError, "group_size"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(group_size=16.0), TypeError, "group_size"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(x=[1.0]), TypeError, "x"),
])
def test_bad_input_names_the_argument(kwargs, exc, name, monkeypatch):
    from tvm_mamba.torch_ops import _dlpack, rmsnorm_gated as mod

    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran before the arguments were validated")

    monkeypatch.setattr(mod, "kernel_for", no_kernel)
    args = dict(x=torch.randn(2, HIDDEN), weight=torch.randn(HIDDEN), bias=None, z=None)
    args.update(kwargs)
    with pytest.raises(exc, match=rf"^{name}:"):
        rmsnorm_fn(**args)
    assert _dlpack is not None
