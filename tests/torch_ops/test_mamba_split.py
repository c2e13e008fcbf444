"""mamba_split_conv1d_scan_combined (Mamba-2's fused path) against the float64 reference composed from the op
references (the step-by-step SSD recurrence): forward and every gradient (through final_states too), fp32
and bf16, seq_idx, initial_states, rmsnorm / outproj None vs given, gradcheck, the bytes backward keeps,
torch.compile and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ATOL, assert_close_to_ref
from tvm_mamba import mamba_split_conv1d_scan_combined
from tvm_mamba.reference.blocks import mamba_split_conv1d_scan_ref

BATCH, SEQLEN, NHEADS, HEADDIM, DSTATE, WIDTH, DOUT, Q = 2, 13, 4, 4, 8, 4, 6, 4
DIM = NHEADS * HEADDIM
SEQ_IDX = torch.tensor([[0] * 5 + [1] * 8, [0] * 13], dtype=torch.int32)  # a boundary inside a chunk


@pytest.fixture(autouse=True)
def _seed():
    """The output gradients (dout) come from the global generator: the same values whatever ran before."""
    torch.manual_seed(0)


def _inputs(seed=0, dtype=torch.float32, ngroups=1, d_nonssm=0, rms=True, outproj=True, init=True, D2=False,
            batch=BATCH, seqlen=SEQLEN):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: scale * torch.randn(*s, generator=g)  # noqa: E731
    conv_dim = DIM + 2 * ngroups * DSTATE
    t = dict(zxbcdt=r(batch, seqlen, 2 * d_nonssm + 2 * DIM + 2 * ngroups * DSTATE + NHEADS).to(dtype),
             conv1d_weight=r(conv_dim, WIDTH, scale=0.5), conv1d_bias=r(conv_dim, scale=0.1),
             dt_bias=r(NHEADS, scale=0.1), A=-torch.rand(NHEADS, generator=g) - 0.5,
             D=r(NHEADS, HEADDIM) if D2 else r(NHEADS))
    if init:
        t["initial_states"] = r(batch, NHEADS, HEADDIM, DSTATE)
    if rms:
        t["rmsnorm_weight"] = 1 + r(DIM, scale=0.2)
    if outproj:
        t.update(outproj_weight=r(DOUT, d_nonssm + DIM, scale=0.3).to(dtype), outproj_bias=r(DOUT, scale=0.1).to(dtype))
    return {k: v.requires_grad_() for k, v in t.items()}


def _run(fn, t, douts, cast=None, **kw):
    """(out, final_states) and every leaf's gradient by name, on fresh copies (cast to `cast` if given)."""
    leaves = {k: v.detach().to(cast or v.dtype).requires_grad_() for k, v in t.items()}
    out, final = fn(**leaves, chunk_size=Q, headdim=HEADDIM, return_final_states=True, **kw)
    grads = torch.autograd.grad((out, final), list(leaves.values()), (douts[0].to(out.dtype), douts[1]))
    return (out, final), dict(zip(leaves, grads))


def _douts(t, d_out, dtype=torch.float32):
    batch, seqlen = t["zxbcdt"].shape[:2]
    return torch.randn(batch, seqlen, d_out).to(dtype), torch.randn(batch, NHEADS, HEADDIM, DSTATE)


CASES = {  # name: (inputs, call keywords)
    "rms_outproj_init": (dict(), dict(norm_before_gate=True)),
    "gate_outproj_nonssm_seq_idx_groups": (dict(rms=False, d_nonssm=2, ngroups=2, D2=True),
                                           dict(seq_idx=SEQ_IDX, dt_limit=(0.0, 5.0), ngroups=2)),
    "rms_after_gate_no_outproj_nonssm_seq_idx": (dict(outproj=False, d_nonssm=3, ngroups=2),
                                                 dict(seq_idx=SEQ_IDX, norm_before_gate=False, ngroups=2)),
    "bare_no_activation": (dict(rms=False, outproj=False, init=False), dict(activation=None)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_forward_and_every_gradient(name):
    spec, kw = CASES[name]
    t = _inputs(**spec)
    d_out = DOUT if spec.get("outproj", True) else spec.get("d_nonssm", 0) + DIM
    douts = _douts(t, d_out)
    (out, final), grads = _run(mamba_split_conv1d_scan_combined, t, douts, **kw)
    (ref, rfinal), rgrads = _run(mamba_split_conv1d_scan_ref, t, douts, cast=torch.float64, **kw)
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    assert_close_to_ref(out, ref, atol=1e-5, name="out")
    assert_close_to_ref(final, rfinal, atol=1e-5, name="final_states")
    for key, g in grads.items():
        assert g is not None and g.dtype == t[key].dtype, key
        assert_close_to_ref(g, rgrads[key], atol=2e-5 * max(1.0, rgrads[key].abs().max().item()), name="d" + key)


def test_bf16_within_twice_reference_drift():
    t = _inputs(seed=1, dtype=torch.bfloat16, ngroups=2, d_nonssm=2)
    douts = _douts(t, DOUT, torch.bfloat16)
    kw = dict(seq_idx=SEQ_IDX, norm_before_gate=False, ngroups=2)
    (out, final), grads = _run(mamba_split_conv1d_scan_combined, t, douts, **kw)
    (ref, rfinal), g64 = _run(mamba_split_conv1d_scan_ref, t, douts, cast=torch.float64, **kw)
    (low, lfinal), glow = _run(mamba_split_conv1d_scan_ref, t, douts, **kw)
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, ref, low, name="out")
    assert_close_to_ref(final, rfinal, lfinal.float(), atol=ATOL[torch.bfloat16], name="final_states")
    for key, g in grads.items():  # weight gradients sum over tokens: the bf16 atol relative to their size
        assert g.dtype == t[key].dtype, key
        scale = 1.0 if key == "zxbcdt" else max(1.0, g64[key].abs().max().item())
        assert_close_to_ref(g, g64[key], glow[key], atol=ATOL[torch.bfloat16] * scale, name="d" + key)


def test_outproj_and_rmsnorm_none_vs_given_agree():
    """out_proj given = F.linear of the output without it; rmsnorm_weight None = the plain z gate (the
    mamba_chunk_scan_combined path)."""
    t = {k: v.detach() for k, v in _inputs(seed=2).items()}
    kw = dict(chunk_size=Q, headdim=HEADDIM)
    with_proj = mamba_split_conv1d_scan_combined(**t, **kw)
    bare = {k: v for k, v in t.items() if not k.startswith("outproj")}
    without = mamba_split_conv1d_scan_combined(**bare, **kw)
    assert torch.allclose(with_proj, F.linear(without, t["outproj_weight"], t["outproj_bias"]), atol=1e-5)
    gated = mamba_split_conv1d_scan_combined(**{k: v for k, v in bare.items() if k != "rmsnorm_weight"}, **kw)
    ref = mamba_split_conv1d_scan_ref(**{k: v.double() for k, v in bare.items() if k != "rmsnorm_weight"}, **kw)
    assert_close_to_ref(gated, ref, atol=1e-5)


def test_seq_idx_equals_separate_sequences():
    """Two sequences packed in one row (seq_idx) give what each gives alone (state and conv reset)."""
    t = {k: v.detach() for k, v in _inputs(seed=3, batch=1, init=False).items()}
    kw = dict(chunk_size=Q, headdim=HEADDIM)
    seq = torch.tensor([[0] * 6 + [1] * 7], dtype=torch.int32)
    packed = mamba_split_conv1d_scan_combined(**t, seq_idx=seq, **kw)
    parts = [mamba_split_conv1d_scan_combined(**dict(t, zxbcdt=t["zxbcdt"][:, sl]), **kw)
             for sl in (slice(0, 6), slice(6, 13))]
    assert torch.allclose(packed, torch.cat(parts, dim=1), atol=1e-5)


def test_gradcheck_tiny():
    """float64 leaves through the fp32 kernels: eps 1e-2, fp32 tolerances; final_states included."""
    g = torch.Generator().manual_seed(4)
    H, P, N = 2, 2, 2
    dim, conv_dim = H * P, H * P + 2 * N
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.5  # noqa: E731
    leaves = [r(1, 6, 2 * dim + 2 * N + H), r(conv_dim, 3), r(conv_dim), r(H),
              -torch.rand(H, generator=g, dtype=torch.float64) - 0.5, r(H), r(1, H, P, N), 1 + r(dim), r(3, dim)]
    leaves = [x.requires_grad_() for x in leaves]

    def f(zx, cw, cb, dtb, A, D, init, rw, ow):
        out, final = mamba_split_conv1d_scan_combined(
            zx.float(), cw.float(), cb.float(), dtb.float(), A.float(), D.float(), 4, initial_states=init.float(),
            return_final_states=True, rmsnorm_weight=rw.float(), outproj_weight=ow.float(), headdim=P)
        return out.double(), final.double()

    assert torch.autograd.gradcheck(f, leaves, eps=1e-2, atol=2e-2, rtol=2e-2)


def _saved_bytes(t, **kw) -> int:
    seen = {}

    def pack(x):
        seen[(x.data_ptr(), tuple(x.shape), x.dtype)] = x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        mamba_split_conv1d_scan_combined(**t, chunk_size=Q, headdim=HEADDIM, **kw)
    return sum(seen.values())


@pytest.mark.parametrize("rms", [True, False])
def test_saved_bytes_per_token_match_docs(rms):
    """docs/fused.md: s*(width + dim) + 4*ngroups (rms) + 2*nheads*4 (dt_out, dA_cumsum) + dim*s (no rms, with
    out_proj) + 4 (seq_idx) bytes per token."""
    seq = [torch.zeros(1, n * Q, dtype=torch.int32) for n in (1, 2)]
    sizes = [_saved_bytes(_inputs(batch=1, seqlen=n * Q, rms=rms), seq_idx=seq[n - 1]) for n in (1, 2)]
    per_token = (sizes[1] - sizes[0]) / Q
    s, ngroups = 4, 1
    width = 2 * DIM + 2 * ngroups * DSTATE + NHEADS
    expect = s * (width + DIM) + 2 * NHEADS * 4 + 4 + (4 * ngroups if rms else DIM * s)
    assert per_token == expect


def test_torch_compile_fullgraph():
    t = _inputs(seed=5, d_nonssm=2)
    douts = _douts(t, DOUT)
    compiled = torch.compile(mamba_split_conv1d_scan_combined, fullgraph=True, backend="aot_eager")
    (out, final), grads = _run(compiled, t, douts, seq_idx=SEQ_IDX)
    (eout, efinal), egrads = _run(mamba_split_conv1d_scan_combined, t, douts, seq_idx=SEQ_IDX)
    assert torch.allclose(out, eout, atol=1e-6) and torch.allclose(final, efinal, atol=1e-6)
    for key in grads:
        assert torch.allclose(grads[key], egrads[key], atol=1e-5), key


BAD = [
    (dict(zxbcdt=torch.zeros(2, 13)), ValueError, "zxbcdt"),
    (dict(zxbcdt=torch.zeros(2, 13, 2 * DIM + 2 * DSTATE + NHEADS + 1)), ValueError, "zxbcdt"),
    (dict(D=torch.zeros(NHEADS), headdim=None), ValueError, "headdim"),
    (dict(D=torch.zeros(NHEADS, HEADDIM + 1)), ValueError, "headdim"),
    (dict(ngroups=3), ValueError, "ngroups"),
    (dict(conv1d_weight=torch.zeros(DIM + 2 * DSTATE + 1, WIDTH)), ValueError, "conv1d_weight"),
    (dict(conv1d_bias=torch.zeros(3)), ValueError, "conv1d_bias"),
    (dict(dt_bias=torch.zeros(NHEADS + 1)), ValueError, "dt_bias"),
    (dict(A=torch.zeros(NHEADS, 1)), ValueError, "A"),
    (dict(initial_states=torch.zeros(2, NHEADS, HEADDIM, DSTATE + 1)), ValueError, "initial_states"),
    (dict(seq_idx=torch.zeros(2, 13, dtype=torch.int64)), TypeError, "seq_idx"),
    (dict(seq_idx=torch.tensor([[0] * 6 + [1] * 6 + [0]] * 2, dtype=torch.int32)), ValueError, "seq_idx"),
    (dict(rmsnorm_weight=torch.ones(DIM + 1)), ValueError, "rmsnorm_weight"),
    (dict(outproj_weight=torch.zeros(DOUT, DIM + 1)), ValueError, "outproj_weight"),
    (dict(outproj_weight=None), ValueError, "outproj_bias"),
    (dict(outproj_bias=torch.zeros(DOUT + 1)), ValueError, "outproj_bias"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size=4.0), TypeError, "chunk_size"),
    (dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit"),
    (dict(activation="relu"), ValueError, "activation"),
    (dict(rmsnorm_eps=-1.0), ValueError, "rmsnorm_eps"),
    (dict(A=[-1.0] * NHEADS), TypeError, "A"),
]


@pytest.mark.parametrize("change, exc, match", BAD, ids=[m + str(i) for i, (_, _, m) in enumerate(BAD)])
def test_bad_input_names_the_argument(change, exc, match):
    kw, change = dict(chunk_size=Q, headdim=HEADDIM), dict(change)
    kw.update({k: change.pop(k) for k in list(change) if k in ("headdim", "chunk_size", "ngroups", "dt_limit",
                                                               "activation", "rmsnorm_eps")})
    t = {k: v.detach() for k, v in _inputs().items()}
    t.update(change)
    with pytest.raises(exc, match=match):
        mamba_split_conv1d_scan_combined(**t, **kw)


def test_public_name():
    import tvm_mamba

    assert "mamba_split_conv1d_scan_combined" in tvm_mamba.__all__
    assert tvm_mamba.mamba_split_conv1d_scan_combined is mamba_split_conv1d_scan_combined


def test_upstream_fast_path_call_equals_the_mamba2_module():
    """The call upstream's Mamba2.forward makes on its fused path (mamba2.py, use_mem_eff_path), on a tvm_mamba
    Mamba2's parameters, equals that module's unfused forward: output and every parameter gradient."""
    from tvm_mamba import Mamba2

    torch.manual_seed(10)
    m = Mamba2(d_model=16, d_state=8, d_conv=4, expand=2, headdim=8, ngroups=2, chunk_size=8,
               use_mem_eff_path=False)  # the module's separate-ops path, so the comparison is fused vs unfused
    u = torch.randn(2, 11, 16)
    seq = torch.tensor([[0] * 4 + [1] * 7, [0] * 11], dtype=torch.int32)
    fused = mamba_split_conv1d_scan_combined(
        m.in_proj(u), m.conv1d.weight.squeeze(1), m.conv1d.bias, m.dt_bias, -torch.exp(m.A_log.float()), m.D,
        chunk_size=m.chunk_size, seq_idx=seq, activation=m.activation, rmsnorm_weight=m.norm.weight,
        rmsnorm_eps=m.norm.eps, outproj_weight=m.out_proj.weight, outproj_bias=m.out_proj.bias,
        headdim=m.headdim, ngroups=m.ngroups, norm_before_gate=m.norm_before_gate)
    gf = torch.autograd.grad(fused.square().sum(), list(m.parameters()))
    module = m(u, seq_idx=seq)
    gm = torch.autograd.grad(module.square().sum(), list(m.parameters()))
    assert torch.allclose(fused, module, atol=1e-5)
    for (name, _), a, b in zip(m.named_parameters(), gf, gm):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), name
