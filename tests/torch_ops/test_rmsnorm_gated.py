"""rmsnorm_fn / layernorm_fn and the RMSNorm / LayerNorm modules of layernorm_gated.py against the float64
references written from the math (forward and every grad)."""
from __future__ import annotations

import ast
import inspect
import itertools
import pathlib

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.modules.rmsnorm_gated import LayerNorm, RMSNorm, RMSNormGated
from tvm_mamba.reference.rmsnorm_gated import layernorm_gated_ref, rmsnorm_gated_ref
from tvm_mamba.torch_ops.rmsnorm_gated import layernorm_fn, rmsnorm_fn

UPSTREAM = pathlib.Path("/work/upstream/mamba_ssm-2.3.2.post1/mamba_ssm/ops/triton")

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


@pytest.mark.parametrize("is_rms_norm", [True, False])
def test_opcheck(is_rms_norm):
    x, w, b, z = _inputs((3,), torch.float32, True, True, seed=5)
    args = (x.detach().reshape(3, HIDDEN), w.detach(), b.detach(), z.detach()) + (None,) * 7 + (
        1e-5, 16, False, is_rms_norm, False, 0.0, False)
    torch.library.opcheck(torch.ops.tvm_mamba.rmsnorm_gated_fwd.default, args)
    out, mean, rstd = (torch.ops.tvm_mamba.rmsnorm_gated_fwd(*args)[i] for i in (0, 5, 6))
    torch.library.opcheck(torch.ops.tvm_mamba.rmsnorm_gated_bwd.default,
                          args[:4] + (torch.randn_like(out), mean, rstd) + (None,) * 6 + args[11:15] +
                          (False, 0.0, False, False))
    args_req = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in args)
    torch.library.opcheck(torch.ops.tvm_mamba.rmsnorm_gated_fwd.default, args_req,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("has_bias,has_z,norm_before_gate,group_size",
                         [(True, True, True, 16), (True, True, False, 16), (False, True, False, None),
                          (True, False, True, None)])
def test_layernorm_fp32(has_bias, has_z, norm_before_gate, group_size):
    """layernorm_fn (the mean-subtracted gated group norm) forward and every gradient; x with a mean far
    from 0 so a missing mean subtraction or c2 term shows."""
    x, w, b, z = _inputs((2, 3), torch.float32, has_bias, has_z, seed=7)
    x = (x.detach() + 3.0).requires_grad_()
    dout = torch.randn(2, 3, HIDDEN)
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    got = _run(layernorm_fn, x, w, b, z, dout, **kw)
    ref = _run(layernorm_gated_ref, x, w, b, z, dout.double(), dtype=torch.float64, **kw)
    names = ["out", "dx", "dweight"] + (["dbias"] if has_bias else []) + (["dz"] if has_z else [])
    for name, g, r in zip(names, got, ref):
        assert_close_to_ref(g, r, name=name, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_layernorm_bf16_within_twice_reference_drift(norm_before_gate):
    x, w, b, z = _inputs((4, 8), torch.bfloat16, True, True, seed=8)
    dout = torch.randn(4, 8, HIDDEN).to(torch.bfloat16)
    kw = dict(eps=1e-5, group_size=16, norm_before_gate=norm_before_gate)
    got = _run(layernorm_fn, x, w, b, z, dout, **kw)
    ref64 = _run(layernorm_gated_ref, *(t.detach().double() for t in (x, w, b, z)), dout.double(), **kw)
    low = _run(layernorm_gated_ref, x, w, b, z, dout, **kw)
    for name, g, r, lo in zip(["out", "dx", "dweight", "dbias", "dz"], got, ref64, low):
        assert g.dtype == lo.dtype, name
        assert_close_to_ref(g, r, lo, name=name)


@pytest.mark.filterwarnings("ignore:Input #")
def test_layernorm_gradcheck():
    x, w, b, z = _inputs((3,), torch.float32, True, True, seed=9)
    for nbg in (True, False):
        fn = lambda x_, w_, b_, z_: layernorm_fn(x_, w_, b_, z_, 1e-5, 16, nbg)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w, b, z), eps=1e-2, atol=2e-2, rtol=2e-2)


def _upstream_tree(name):
    path = UPSTREAM / name
    if not path.is_file():
        pytest.skip(f"upstream source {path} not present")
    return ast.parse(path.read_text())


def _upstream_signature(tree, func, cls=None):
    nodes = tree.body
    if cls is not None:
        nodes = next(n for n in nodes if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in nodes if isinstance(n, ast.FunctionDef) and n.name == func)
    args = fn.args.args[1:] if cls is not None else fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + [ast.literal_eval(d) for d in fn.args.defaults]
    return [(a.arg, d) for a, d in zip(args, defaults)], fn


def _ours(fn):
    params = list(inspect.signature(fn).parameters.values())
    return [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]


def test_signatures_match_upstream():
    """rmsnorm_fn / layernorm_fn and the modules' constructors: upstream's names, order and defaults (bias
    positional without a default), read from upstream's source (not imported)."""
    tree = _upstream_tree("layernorm_gated.py")
    for fn in (rmsnorm_fn, layernorm_fn):
        assert _ours(fn) == _upstream_signature(tree, fn.__name__)[0], fn.__name__
    for cls, ours in (("LayerNorm", LayerNorm), ("RMSNorm", RMSNorm)):
        assert _ours(ours.__init__)[1:] == _upstream_signature(tree, "__init__", cls)[0], cls
        assert _ours(ours.forward)[1:] == _upstream_signature(tree, "forward", cls)[0], cls


def _upstream_param_names(tree, cls):
    """Parameter names an upstream module's __init__ registers (self.X = ...Parameter(...) or
    register_parameter("X", <not None>))."""
    _, init = _upstream_signature(tree, "__init__", cls)
    names = []
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "attr", None) == "Parameter":
            names.append(node.targets[0].attr)
    return names


@pytest.mark.parametrize("cls,ours", [("LayerNorm", LayerNorm), ("RMSNorm", RMSNorm)])
def test_module_state_dict_keys_match_upstream(cls, ours):
    tree = _upstream_tree("layernorm_gated.py")
    m = ours(HIDDEN, group_size=16)
    assert list(m.state_dict()) == _upstream_param_names(tree, cls)
    sd = {k: torch.randn(HIDDEN) for k in m.state_dict()}
    m.load_state_dict(sd, strict=True)
    x, z = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    ref = layernorm_gated_ref(x.double(), sd["weight"].double(), sd["bias"].double() if "bias" in sd else None,
                              z.double(), 1e-5, 16, True, is_rms_norm=cls == "RMSNorm")
    assert_close_to_ref(m(x, z), ref, atol=2e-4)


def test_layernorm_module_defaults_and_backward():
    m = LayerNorm(HIDDEN, eps=1e-5, group_size=32, norm_before_gate=False, dtype=torch.float32)
    assert torch.equal(m.weight, torch.ones(HIDDEN)) and torch.equal(m.bias, torch.zeros(HIDDEN))
    x, z = torch.randn(3, HIDDEN, requires_grad=True), torch.randn(3, HIDDEN)
    m(x, z).square().sum().backward()
    assert m.weight.grad is not None and m.bias.grad is not None and x.grad is not None
    assert RMSNormGated is RMSNorm


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
    with pytest.raises(exc, match=rf"^{name}:"):
        layernorm_fn(**args)
    assert _dlpack is not None
