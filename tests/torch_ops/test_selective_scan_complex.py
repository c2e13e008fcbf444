"""selective_scan_fn with a complex A (mamba_ssm 2.3.2's selective_scan_ref semantics) against the complex128
step-by-step reference: forward, every gradient (complex ones as dL/dRe + i dL/dIm), gradcheck, bf16."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.selective_scan import selective_scan_ref
from tvm_mamba.tools.simcheck import selective_scan as sc
from tvm_mamba.torch_ops.selective_scan import selective_scan_fn

# name: (batch, seqlen, static dims); b/c groups: 0 time-invariant complex (dim, dstate), 1 (batch, dstate, 2L),
# g > 1 (batch, g, dstate, 2L) real with (re, im) interleaved in time
CONFIGS = {
    # 75 steps = a checkpoint chunk of 48 (dstate 8 -> chunk_size(2 * 8)) + a partial one
    "var_const_all": (2, 75, dict(dim=4, dstate=8, b_groups=1, c_groups=0, has_D=True, has_z=True,
                                  has_delta_bias=True, delta_softplus=True, has_init=True)),
    "grp_var_bare": (2, 37, dict(dim=4, dstate=4, b_groups=2, c_groups=1, has_D=False, has_z=False,
                                 has_delta_bias=False, delta_softplus=False, has_init=False)),
    # dim 32: the backward's channel blocks of 16 (B/C group of 32 channels)
    "const_grp_blocks": (1, 20, dict(dim=32, dstate=16, b_groups=0, c_groups=2, has_D=True, has_z=True,
                                     has_delta_bias=True, delta_softplus=True, has_init=False)),
}
F32 = {"u": "float32", "B": "float32", "C": "float32"}


def inputs(name, dtype="float32", seqlen=None, seed=0):
    batch, L, static = CONFIGS[name]
    return sc.scan_inputs(static, {"u": dtype, "B": dtype, "C": dtype}, batch, seqlen or L, seed, complex_A=True)


def _grads(inp, dtype=None, seed=1):
    """{name: (ours, complex128/float64 reference)} for out, last_state and every gradient (real views)."""
    ours = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    ref = {k: (sc._to64(v).requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    out, last = selective_scan_fn(**ours, return_last_state=True)
    rout, rlast = selective_scan_ref(**ref, return_last_state=True)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlast = torch.randn(last.shape, generator=g, dtype=last.dtype)
    torch.autograd.backward([out, last], [dout, dlast])
    torch.autograd.backward([rout, rlast], [dout.double(), sc._to64(dlast)])
    res = {"out": (out, rout), "last_state": (sc._real(last), sc._real(rlast))}
    for k in sc.TENSORS:
        if isinstance(ours[k], torch.Tensor):
            res["d" + k] = (sc._real(ours[k].grad), sc._real(ref[k].grad))
    return res


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_every_gradient_fp32(name):
    inp = inputs(name)
    assert inp["A"].dtype == torch.complex64
    res = _grads(inp)
    assert res["last_state"][0].shape[-1] == 2  # complex last_state (batch, dim, dstate)
    for key, (mine, ref) in res.items():
        assert_close_to_ref(mine, ref, atol=2e-5 * max(1.0, ref.abs().max().item()), name=key)


def test_real_time_invariant_B_with_complex_A():
    """selective_scan_ref takes a real (dim, dstate) B as is with a complex A: its imaginary part is 0, and
    the gradient stays real."""
    inp = inputs("var_const_all", seqlen=9)
    inp["C"] = inp["C"].real.contiguous()
    res = _grads(inp)
    assert res["dC"][0].dtype == torch.float32 and res["dC"][0].shape == inp["C"].shape
    for key, (mine, ref) in res.items():
        assert_close_to_ref(mine, ref, atol=2e-5 * max(1.0, ref.abs().max().item()), name=key)


def test_gradcheck_float64():
    """torch.autograd.gradcheck (complex inputs: Wirtinger derivatives) on the float64 / complex128 kernels."""
    inp = inputs("var_const_all", dtype="float64", seqlen=6)
    inp.update(u=inp["u"][:1, :2], delta=inp["delta"][:1, :2], A=inp["A"][:2, :3], B=inp["B"][:1, :3],
               C=inp["C"][:2, :3], D=inp["D"][:2], z=inp["z"][:1, :2], delta_bias=inp["delta_bias"][:2],
               initial_state=inp["initial_state"][:1, :2, :3])
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]

    def fn(*ts):
        kw = dict(zip(names, ts))
        return selective_scan_fn(**kw, delta_softplus=True, return_last_state=True)

    ts = [inp[k].contiguous().clone().requires_grad_() for k in names]
    assert torch.autograd.gradcheck(fn, ts, eps=1e-6, atol=1e-6)


def test_bf16_forward_and_gradients():
    """bf16 u / delta / z / B (varying B is u's dtype, mamba_ssm's complex kernels): the output within 2x the
    drift of the reference run on the same bf16 inputs in float32 math, rounded to bf16."""
    inp = inputs("var_const_all", dtype="bfloat16", seqlen=40)
    res = _grads(inp)
    low = {k: (v.to(torch.complex64 if v.is_complex() else torch.float32) if isinstance(v, torch.Tensor) else v)
           for k, v in inp.items()}
    ref_low = selective_scan_ref(**low, dtype=torch.float32).to(torch.bfloat16)
    assert res["out"][0].dtype == torch.bfloat16
    assert_close_to_ref(res["out"][0], res["out"][1], ref_low, name="out")
    for key, (mine, ref) in res.items():
        if key != "out":
            tol = (1e-2 if mine.dtype == torch.bfloat16 else 1e-4) * max(1.0, ref.abs().max().item())
            assert (mine.double() - ref).abs().max().item() <= tol, key


def test_chaining_with_initial_state_equals_whole():
    inp = inputs("var_const_all")
    cut = 53  # not a chunk boundary (48)

    def part(lo, hi, init):
        p = dict(inp, initial_state=init)
        for k in ("u", "delta", "z"):
            p[k] = inp[k][..., lo:hi].contiguous()
        p["B"] = inp["B"][..., 2 * lo:2 * (hi if hi is not None else inp["u"].shape[-1])].contiguous()
        return selective_scan_fn(**p, return_last_state=True)

    whole, last = selective_scan_fn(**inp, return_last_state=True)
    o1, s1 = part(0, cut, inp["initial_state"])
    o2, s2 = part(cut, None, s1)
    torch.testing.assert_close(torch.cat([o1, o2], -1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, last, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqlen", [None, 30])
def test_backward_keeps_no_states_and_rebuilds_them_bitwise(seqlen):
    """Autograd keeps the inputs only; the backward op given None rebuilds the checkpoints with the forward
    kernel (one chunk: the initial state): gradients bitwise equal to passing the forward's checkpoints."""
    inp = inputs("var_const_all", seqlen=seqlen)
    leaves = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        selective_scan_fn(**leaves)
    ck_like = [x for x in saved if x.dim() == 5 and x.shape[:2] == inp["u"].shape[:2]]
    assert saved and not ck_like  # no (batch, dim, nchunk, dstate, 2) checkpoints
    L = inp["u"].shape[2]
    k = dict(inp, A=torch.view_as_real(inp["A"]), B=inp["B"].reshape(2, 1, 8, L, 2).permute(0, 1, 3, 2, 4),
             C=torch.view_as_real(inp["C"]), initial_state=torch.view_as_real(inp["initial_state"]))
    args = tuple(k[n] for n in sc.TENSORS)
    _, last, ck = torch.ops.tvm_mamba.selective_scan_complex_fwd(*args, True)
    dout, dlast = torch.randn_like(inp["u"]), torch.randn_like(last)
    given = torch.ops.tvm_mamba.selective_scan_complex_bwd(*args, ck, dout, dlast, True)
    rebuilt = torch.ops.tvm_mamba.selective_scan_complex_bwd(*args, None, dout, dlast, True)
    for a, b in zip(given, rebuilt):
        assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_scan_complex_bwd, args + (None, dout, dlast, True))


def test_opcheck_and_compile():
    inp = inputs("grp_var_bare", seqlen=7)
    fwd_args = (inp["u"], inp["delta"], torch.view_as_real(inp["A"]),
                inp["B"].reshape(2, 2, 4, 7, 2).permute(0, 1, 3, 2, 4).contiguous(),
                inp["C"].reshape(2, 1, 4, 7, 2).permute(0, 1, 3, 2, 4).contiguous(), None, None, None, None, False)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_scan_complex_fwd, fwd_args)
    leaves = {k: inp[k].clone().requires_grad_() for k in ("u", "delta", "A", "B", "C")}
    want = selective_scan_fn(**leaves, return_last_state=True)
    fn = torch.compile(selective_scan_fn, fullgraph=True, backend="aot_eager")
    leaves2 = {k: inp[k].clone().requires_grad_() for k in ("u", "delta", "A", "B", "C")}
    got = fn(**leaves2, return_last_state=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    (got[0].sum() + got[1].abs().sum()).backward()
    (want[0].sum() + want[1].abs().sum()).backward()
    for k in leaves:
        torch.testing.assert_close(leaves2[k].grad, leaves[k].grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mutate,exc,arg", [
    (lambda p: p.update(A=p["A"].to(torch.complex128)), TypeError, "A"),
    (lambda p: p.update(B=torch.complex(p["B"], p["B"])), ValueError, "B: with a complex A"),
    (lambda p: p.update(B=p["B"][..., :9]), ValueError, "B"),  # seqlen, not 2 * seqlen, steps
    (lambda p: p.update(C=torch.randn(4, 7, dtype=torch.complex64)), ValueError, "C"),
    (lambda p: p.update(initial_state=p["initial_state"].real.contiguous()), TypeError, "initial_state"),
    (lambda p: p.update(D=torch.randn(4, dtype=torch.complex64)), TypeError, "D"),
])
def test_bad_inputs_name_the_argument(mutate, exc, arg, monkeypatch):
    import tvm_mamba.torch_ops._dlpack as dl

    monkeypatch.setattr(dl, "build_and_load", lambda key: pytest.fail("kernel built before validation"))
    p = inputs("var_const_all", seqlen=9)
    mutate(p)
    with pytest.raises(exc, match=arg):
        selective_scan_fn(**p)
