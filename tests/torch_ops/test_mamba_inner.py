"""mamba_inner_fn (Mamba-1's fused path) against the float64 reference composed from the op references:
forward and every gradient, fp32 and bf16, gradcheck, checkpoint_lvl 0 = 1 bitwise, the bytes backward keeps,
torch.compile, autocast and bad input."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import ATOL, assert_close_to_ref
from tvm_mamba import mamba_inner_fn
from tvm_mamba.reference.blocks import mamba_inner_ref
from tvm_mamba.torch_ops.selective_scan import chunk_for

BATCH, DIM, SEQLEN, DSTATE, RANK, WIDTH, DOUT = 2, 8, 13, 4, 3, 4, 6


@pytest.fixture(autouse=True)
def _seed():
    """The output gradients (dout) come from the global generator: the same values whatever ran before."""
    torch.manual_seed(0)


def _inputs(seed=0, dtype=torch.float32, extras=(), given=None, batch=BATCH, seqlen=SEQLEN):
    """Leaves of one call by argument name; extras: "bias" (B/C_proj_bias), "rms" (the three RMSNorm
    weights); given: {"B": kind, "C": kind} with kind "const" (d_inner, d_state) or "var" (batch, d_state, L)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g))  # noqa: E731
    given = given or {}
    K = RANK + DSTATE * (2 - len(given))
    t = dict(xz=r(batch, 2 * DIM, seqlen).to(dtype), conv1d_weight=r(DIM, 1, WIDTH, scale=0.5),
             conv1d_bias=r(DIM, scale=0.1), x_proj_weight=r(K, DIM, scale=0.3).to(dtype),
             delta_proj_weight=r(DIM, RANK, scale=0.3).to(dtype), out_proj_weight=r(DOUT, DIM, scale=0.3).to(dtype),
             out_proj_bias=r(DOUT, scale=0.1).to(dtype), A=-torch.rand(DIM, DSTATE, generator=g) - 0.5, D=r(DIM),
             delta_bias=r(DIM, scale=0.1))
    for name, kind in given.items():
        t[name] = r(DIM, DSTATE) if kind == "const" else r(batch, DSTATE, seqlen).to(dtype)
    if "bias" in extras:
        t.update(B_proj_bias=r(DSTATE, scale=0.1), C_proj_bias=r(DSTATE, scale=0.1))
    if "rms" in extras:
        t.update(b_rms_weight=1 + r(DSTATE, scale=0.2), c_rms_weight=1 + r(DSTATE, scale=0.2),
                 dt_rms_weight=1 + r(DIM, scale=0.2))
    return {k: v.requires_grad_() for k, v in t.items()}


def _run(fn, t, dout, cast=None, **kw):
    """out and the gradient of every leaf (by name), on fresh copies of t (cast to `cast` if given)."""
    wide = lambda v: torch.complex128 if v.is_complex() and cast == torch.float64 else (cast or v.dtype)  # noqa: E731
    leaves = {k: v.detach().to(wide(v)).requires_grad_() for k, v in t.items()}
    out = fn(**leaves, **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), dout.to(out.dtype))
    return out, dict(zip(leaves, grads))


def _check_fp32(t, **kw):
    out, grads = _run(mamba_inner_fn, t, dout := torch.randn(BATCH, SEQLEN, DOUT))
    ref, rgrads = _run(mamba_inner_ref, t, dout, cast=torch.float64, **kw)
    assert out.dtype == torch.float32
    assert_close_to_ref(out, ref, atol=1e-5, name="out")
    for name, g in grads.items():
        assert g is not None and g.dtype == t[name].dtype, name
        scale = max(1.0, rgrads[name].abs().max().item())
        assert_close_to_ref(g, rgrads[name], atol=2e-5 * scale, name="d" + name)


@pytest.mark.parametrize("extras", [(), ("bias", "rms")], ids=["plain", "proj_bias_rms"])
def test_fp32_forward_and_every_gradient(extras):
    _check_fp32(_inputs(extras=extras))


def test_fp32_given_B_C_no_softplus():
    """B time-invariant (d_inner, d_state), C time-varying (batch, d_state, seqlen): not from x_proj."""
    t = _inputs(seed=1, given={"B": "const", "C": "var"})
    out, grads = _run(mamba_inner_fn, t, dout := torch.randn(BATCH, SEQLEN, DOUT), delta_softplus=False)
    ref, rgrads = _run(mamba_inner_ref, t, dout, cast=torch.float64, delta_softplus=False)
    assert_close_to_ref(out, ref, atol=1e-5)
    for name, g in grads.items():
        assert_close_to_ref(g, rgrads[name], atol=2e-5 * max(1.0, rgrads[name].abs().max().item()), name=name)


def test_upstream_xz_layout_and_seqlen_one():
    """upstream's Mamba builds xz as in_proj.weight @ x viewed (2*d_inner, batch*seqlen) -> (batch, 2*d_inner,
    seqlen): not contiguous; and a single token."""
    for seqlen in (SEQLEN, 1):
        t = _inputs(seed=8, seqlen=seqlen)
        base = torch.randn(2 * DIM, BATCH * seqlen)
        t["xz"] = base.view(2 * DIM, BATCH, seqlen).permute(1, 0, 2).requires_grad_()
        assert seqlen == 1 or not t["xz"].is_contiguous()
        dout = torch.randn(BATCH, seqlen, DOUT)
        out, grads = _run(mamba_inner_fn, t, dout)
        ref, rgrads = _run(mamba_inner_ref, t, dout, cast=torch.float64)
        assert_close_to_ref(out, ref, atol=1e-5)
        for name in ("xz", "x_proj_weight", "A"):
            assert_close_to_ref(grads[name], rgrads[name], atol=2e-5 * max(1.0, rgrads[name].abs().max().item()))


def test_bf16_within_twice_reference_drift():
    """mamba_ssm's rule per output and gradient: the kernel's error <= 2x the reference's own error when run
    in bf16 (activations and projections bf16; conv weight, A, D, delta_bias, norms float32) + atol."""
    t = _inputs(seed=2, dtype=torch.bfloat16, extras=("bias", "rms"))
    dout = torch.randn(BATCH, SEQLEN, DOUT).to(torch.bfloat16)
    out, grads = _run(mamba_inner_fn, t, dout)
    ref64, g64 = _run(mamba_inner_ref, t, dout, cast=torch.float64)
    low, glow = _run(mamba_inner_ref, t, dout)
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, ref64, low, name="out")
    for name, g in grads.items():  # weight gradients sum over tokens: the bf16 atol relative to their size
        assert g.dtype == t[name].dtype, name
        scale = 1.0 if name == "xz" else max(1.0, g64[name].abs().max().item())
        assert_close_to_ref(g, g64[name], glow[name], atol=ATOL[torch.bfloat16] * scale, name=name)


@pytest.mark.parametrize("extras", [(), ("rms",)], ids=["plain", "rms"])
def test_checkpoint_levels_bitwise_equal(extras):
    t = _inputs(seed=3, extras=extras)
    dout = torch.randn(BATCH, SEQLEN, DOUT)
    out0, g0 = _run(mamba_inner_fn, t, dout, checkpoint_lvl=0)
    out1, g1 = _run(mamba_inner_fn, t, dout, checkpoint_lvl=1)
    assert torch.equal(out0, out1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_gradcheck_tiny():
    """float64 leaves through the fp32 kernels (conv1d / rmsnorm are fp32-only): eps 1e-2, fp32 tolerances."""
    g = torch.Generator().manual_seed(4)
    d, N, R, L = 2, 2, 1, 5
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.5  # noqa: E731
    leaves = [r(1, 2 * d, L), r(d, 1, 3), r(d), r(R + 2 * N, d), r(d, R), r(3, d), r(3),
              -torch.rand(d, N, generator=g, dtype=torch.float64) - 0.5, r(d), r(d), r(N), r(N), 1 + r(N), 1 + r(d)]
    leaves = [t.requires_grad_() for t in leaves]

    def f(xz, cw, cb, xw, dw, ow, ob, A, D, db, Bb, Cb, brms, dtrms):
        f32 = [t.float() for t in (xz, cw, cb, xw, dw, ow, ob, A, D, db, Bb, Cb, brms, dtrms)]
        return mamba_inner_fn(*f32[:8], D=f32[8], delta_bias=f32[9], B_proj_bias=f32[10], C_proj_bias=f32[11],
                              b_rms_weight=f32[12], dt_rms_weight=f32[13]).double()

    assert torch.autograd.gradcheck(f, leaves, eps=1e-2, atol=2e-2, rtol=2e-2)


def _saved_bytes(fn, t) -> int:
    """Bytes of the distinct tensors the autograd graph keeps for backward."""
    seen = {}

    def pack(x):
        seen[(x.data_ptr(), tuple(x.shape), x.dtype)] = x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(**t)
    return sum(seen.values())


@pytest.mark.parametrize("lvl", [0, 1])
def test_saved_bytes_per_token_match_docs(lvl):
    """docs/fused.md: s*(2d + (R + 2N) + d) bytes per token at checkpoint_lvl 1 (no scan states), + 2d*s at 0;
    measured over two lengths a whole chunk of scan steps apart (a kept checkpoint would show up)."""
    Q = chunk_for(DSTATE)
    sizes = [_saved_bytes(lambda **k: mamba_inner_fn(**k, checkpoint_lvl=lvl), _inputs(batch=1, seqlen=n * Q))
             for n in (1, 2)]
    per_token = (sizes[1] - sizes[0]) / Q
    s, d = 4, DIM
    expect = s * (2 * d + RANK + 2 * DSTATE + d) + (2 * d * s if lvl == 0 else 0)
    assert per_token == expect


def test_torch_compile_fullgraph():
    t = _inputs(seed=5, extras=("rms",))
    dout = torch.randn(BATCH, SEQLEN, DOUT)
    compiled = torch.compile(mamba_inner_fn, fullgraph=True, backend="aot_eager")
    out, grads = _run(compiled, t, dout)
    eager, egrads = _run(mamba_inner_fn, t, dout)
    assert torch.allclose(out, eager, atol=1e-6)
    for name in grads:
        assert torch.allclose(grads[name], egrads[name], atol=1e-5), name


def test_autocast_bf16_with_float32_weights():
    """Under autocast xz arrives in bf16 and the projection weights are float32 parameters: they run in bf16
    (upstream's custom_fwd path) and their gradients come back in float32."""
    t = _inputs(seed=6)
    t["xz"] = t["xz"].detach().to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mamba_inner_fn(**t)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert t["x_proj_weight"].grad.dtype == torch.float32 and t["xz"].grad.dtype == torch.bfloat16
    ref = mamba_inner_ref(**{k: v.detach().double() for k, v in t.items()})
    assert (out.double() - ref).abs().max().item() < 0.1 * max(1.0, ref.abs().max().item())


BAD = [
    (dict(xz=torch.zeros(2, 7, 13)), ValueError, "xz"),
    (dict(xz=torch.zeros(2, 16, 13, dtype=torch.int32)), TypeError, "xz"),
    (dict(conv1d_weight=torch.zeros(DIM, 2, WIDTH)), ValueError, "conv1d_weight"),
    (dict(conv1d_weight=torch.zeros(DIM, 1, 9)), ValueError, "conv1d_weight"),
    (dict(conv1d_bias=torch.zeros(DIM + 1)), ValueError, "conv1d_bias"),
    (dict(x_proj_weight=torch.zeros(RANK + DSTATE, DIM)), ValueError, "x_proj_weight"),
    (dict(x_proj_weight=torch.zeros(RANK + 2 * DSTATE, DIM, dtype=torch.float64)), TypeError, "x_proj_weight"),
    (dict(delta_proj_weight=torch.zeros(DIM + 1, RANK)), ValueError, "delta_proj_weight"),
    (dict(out_proj_weight=torch.zeros(DOUT, DIM + 1)), ValueError, "out_proj_weight"),
    (dict(out_proj_bias=torch.zeros(DOUT + 1)), ValueError, "out_proj_bias"),
    (dict(A=torch.zeros(DIM, DSTATE, dtype=torch.complex128)), TypeError, "A"),
    (dict(A=torch.zeros(DIM, DSTATE, dtype=torch.complex64)), ValueError, "x_proj_weight"),  # 2*d_state per B/C
    (dict(A=torch.zeros(DIM, DSTATE, dtype=torch.complex64), x_proj_weight=torch.zeros(RANK + 4 * DSTATE, DIM),
          b_rms_weight=torch.ones(DSTATE)), ValueError, "b_rms_weight"),
    (dict(A=torch.zeros(DIM, DSTATE, dtype=torch.complex64), x_proj_weight=torch.zeros(RANK + 4 * DSTATE, DIM),
          B_proj_bias=torch.zeros(DSTATE)), ValueError, "B_proj_bias"),
    (dict(A=torch.zeros(DIM + 1, DSTATE)), ValueError, "A"),
    (dict(B=torch.zeros(3, DSTATE)), ValueError, "B"),
    (dict(D=torch.zeros(DIM, dtype=torch.bfloat16)), TypeError, "D"),
    (dict(delta_bias=torch.zeros(DIM + 1)), ValueError, "delta_bias"),
    (dict(B_proj_bias=torch.zeros(DSTATE + 1)), ValueError, "B_proj_bias"),
    (dict(C=torch.zeros(DIM, DSTATE), C_proj_bias=torch.zeros(DSTATE)), ValueError, "C_proj_bias"),
    (dict(B=torch.zeros(DIM, DSTATE), b_rms_weight=torch.ones(DSTATE)), ValueError, "b_rms_weight"),
    (dict(c_rms_weight=torch.ones(DSTATE + 1)), ValueError, "c_rms_weight"),
    (dict(dt_rms_weight=torch.ones(DIM + 1)), ValueError, "dt_rms_weight"),
    (dict(checkpoint_lvl=2), ValueError, "checkpoint_lvl"),
    (dict(x_proj_weight="w"), TypeError, "x_proj_weight"),
    (dict(b_c_dt_rms_eps=-1.0), ValueError, "b_c_dt_rms_eps"),
]


@pytest.mark.parametrize("change, exc, match", BAD, ids=[m + str(i) for i, (_, _, m) in enumerate(BAD)])
def test_bad_input_names_the_argument(change, exc, match):
    t = {k: v.detach() for k, v in _inputs().items()}
    if "B" in change or "C" in change:  # one of them given: x_proj projects only the other
        t["x_proj_weight"] = t["x_proj_weight"][:RANK + DSTATE]
    t.update(change)
    with pytest.raises(exc, match=match):
        mamba_inner_fn(**t)


def test_public_name():
    import tvm_mamba

    assert "mamba_inner_fn" in tvm_mamba.__all__ and tvm_mamba.mamba_inner_fn is mamba_inner_fn


def test_upstream_fast_path_call_equals_the_mamba_module():
    """The exact call upstream's Mamba.forward makes on its fast path (mamba_simple.py), on a tvm_mamba Mamba's
    parameters, equals that module's unfused forward: output and every parameter gradient."""
    from tvm_mamba import Mamba

    torch.manual_seed(9)
    m = Mamba(d_model=8, d_state=4, d_conv=4, expand=2)
    u = torch.randn(2, 11, 8)
    xz = m.in_proj(u).transpose(1, 2)
    A = -torch.exp(m.A_log.float())
    fused = mamba_inner_fn(xz, m.conv1d.weight, m.conv1d.bias, m.x_proj.weight, m.dt_proj.weight,
                           m.out_proj.weight, m.out_proj.bias, A, None, None, m.D.float(),
                           delta_bias=m.dt_proj.bias.float(), delta_softplus=True)
    gf = torch.autograd.grad(fused.square().sum(), list(m.parameters()))
    module = m(u)
    gm = torch.autograd.grad(module.square().sum(), list(m.parameters()))
    assert torch.allclose(fused, module, atol=1e-5)
    for (name, _), a, b in zip(m.named_parameters(), gf, gm):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), name


# ----------------------------------------------------------------------------------------------------
# complex A (upstream's MambaInnerFn with A.is_complex(): x_proj gives 2*d_state columns per B / C)
# ----------------------------------------------------------------------------------------------------
def complex_inputs(seed=10, dtype=torch.float32, given=None, bias=True, batch=BATCH, seqlen=SEQLEN):
    """_inputs with a complex64 A (S4D-like: Re < 0) and x_proj rows for (re, im) interleaved B / C; given:
    {"B": "const"} (complex (d_inner, d_state)) / {"C": "var"} (real (batch, d_state, 2*seqlen))."""
    given = given or {}
    t = {k: v.detach() for k, v in _inputs(seed, dtype, batch=batch, seqlen=seqlen).items()}
    g = torch.Generator().manual_seed(seed + 100)
    t["A"] = torch.complex(-torch.rand(DIM, DSTATE, generator=g) - 0.5, 2 * torch.randn(DIM, DSTATE, generator=g))
    t["x_proj_weight"] = (0.3 * torch.randn(RANK + 2 * DSTATE * (2 - len(given)), DIM, generator=g)).to(dtype)
    for name, kind in given.items():
        t[name] = (torch.randn(DIM, DSTATE, dtype=torch.complex64, generator=g) if kind == "const"
                   else torch.randn(batch, DSTATE, 2 * seqlen, generator=g).to(dtype))
    if bias:
        t.update({n + "_proj_bias": 0.1 * torch.randn(2 * DSTATE, generator=g) for n in "BC" if n not in given})
    return {k: v.requires_grad_() for k, v in t.items()}


def check_complex_fp32(t, atol=2e-5):
    out, grads = _run(mamba_inner_fn, t, dout := torch.randn(BATCH, SEQLEN, DOUT))
    ref, rgrads = _run(mamba_inner_ref, t, dout, cast=torch.float64)
    assert_close_to_ref(out, ref, atol=1e-5, name="out")
    for name, g in grads.items():
        assert g is not None and g.dtype == t[name].dtype, name
        r = rgrads[name]
        if r.is_complex():
            g, r = torch.view_as_real(g), torch.view_as_real(r)
        assert_close_to_ref(g, r, atol=atol * max(1.0, r.abs().max().item()), name="d" + name)


@pytest.mark.parametrize("given", [None, {"B": "const", "C": "var"}], ids=["projected", "given"])
def test_complex_A_fp32_forward_and_every_gradient(given):
    check_complex_fp32(complex_inputs(given=given))


def test_complex_A_bf16_within_twice_reference_drift():
    t = complex_inputs(seed=11, dtype=torch.bfloat16)
    dout = torch.randn(BATCH, SEQLEN, DOUT).to(torch.bfloat16)
    out, grads = _run(mamba_inner_fn, t, dout)
    ref64, g64 = _run(mamba_inner_ref, t, dout, cast=torch.float64)
    low, glow = _run(mamba_inner_ref, t, dout)
    assert_close_to_ref(out, ref64, low, name="out")
    for name, g in grads.items():
        real = (lambda x: torch.view_as_real(x)) if g.is_complex() else (lambda x: x)  # noqa: E731
        scale = 1.0 if name == "xz" else max(1.0, g64[name].abs().max().item())
        assert_close_to_ref(real(g), real(g64[name]), real(glow[name]), atol=ATOL[torch.bfloat16] * scale, name=name)


def test_complex_A_gradcheck_tiny():
    """float64 leaves through the fp32 kernels, A as (Re, Im) leaves: eps 1e-2, fp32 tolerances."""
    g = torch.Generator().manual_seed(12)
    d, N, R, L = 2, 2, 1, 5
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.5  # noqa: E731
    leaves = [r(1, 2 * d, L), r(d, 1, 3), r(d), r(R + 4 * N, d), r(d, R), r(3, d), r(3),
              -torch.rand(d, N, generator=g, dtype=torch.float64) - 0.5, r(d, N), r(d), r(d), r(2 * N)]
    leaves = [t.requires_grad_() for t in leaves]

    def f(xz, cw, cb, xw, dw, ow, ob, Are, Aim, D, db, Bb):
        f32 = [t.float() for t in (xz, cw, cb, xw, dw, ow, ob, D, db, Bb)]
        A = torch.complex(Are.float(), Aim.float())
        return mamba_inner_fn(*f32[:7], A, D=f32[7], delta_bias=f32[8], B_proj_bias=f32[9]).double()

    assert torch.autograd.gradcheck(f, leaves, eps=1e-2, atol=2e-2, rtol=2e-2)


def test_complex_A_saved_bytes_per_token():
    """docs/fused.md, complex A: s*(3d + R + 4N) per token (x_dbl's 4N state columns; no scan states, over
    two lengths a checkpoint chunk apart)."""
    from tvm_mamba.torch_ops._selective_scan_complex import complex_chunk

    Q = complex_chunk(DSTATE)
    sizes = [_saved_bytes(mamba_inner_fn, complex_inputs(batch=1, seqlen=n * Q, bias=False)) for n in (1, 2)]
    assert (sizes[1] - sizes[0]) / Q == 4 * (3 * DIM + RANK + 4 * DSTATE)


def test_complex_A_torch_compile_fullgraph():
    t = complex_inputs(seed=14)
    dout = torch.randn(BATCH, SEQLEN, DOUT)
    compiled = torch.compile(mamba_inner_fn, fullgraph=True, backend="aot_eager")
    out, grads = _run(compiled, t, dout)
    eager, egrads = _run(mamba_inner_fn, t, dout)
    assert torch.allclose(out, eager, atol=1e-6)
    for name in grads:
        assert torch.allclose(grads[name], egrads[name], atol=1e-5), name
