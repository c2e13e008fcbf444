"""mamba3_mimo (Mamba-3 MIMO chunked scan: one SSD over (step, rank) positions, step_group R) on the CPU: the
float64 reference itself against an independent masked-attention formulation and against the SISO reference (R = 1);
the forward and its final states against the reference in fp32 and bf16 (mamba_ssm's 2 * err(bf16 reference) +
atol) over ranks, GQA, half / full rotary, ragged chunks, without D / Z / MIMO_Out; packed sequences; every
gradient against autograd of the reference; a directional finite-difference check of the kernels;
torch.compile(fullgraph=True); bad input."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref
from tvm_mamba.reference.mamba3_mimo import mamba3_mimo_chunked_ref, mamba3_mimo_ref, rotate_halves
from tvm_mamba.torch_ops.mamba3_mimo import mamba3_mimo, pair_order

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
ACT = ("Q", "K", "V", "Z")


def make(batch=2, seqlen=7, R=2, nheads_qk=1, nheads=4, N=8, P=4, div=4, seed=0, dtype=F64, out=True, D=True, Z=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=F64) * scale).to(dtype)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=F64).to(dtype)  # noqa: E731
    kw = dict(Q=r(batch, seqlen, R, nheads_qk, N, scale=0.5), K=r(batch, seqlen, R, nheads_qk, N, scale=0.5),
              V=r(batch, seqlen, nheads, P), ADT=-u(batch, nheads, seqlen), DT=u(batch, nheads, seqlen) * 0.5,
              Trap=r(batch, nheads, seqlen), Q_bias=r(nheads, R, N, scale=0.5), K_bias=r(nheads, R, N, scale=0.5),
              MIMO_V=r(nheads, R, P), MIMO_Z=r(nheads, R, P), MIMO_Out=r(nheads, R, P) if out else None,
              Angles=r(batch, seqlen, nheads, N // div), D=r(nheads) if D else None,
              Z=r(batch, seqlen, nheads, P) if Z else None)
    return kw, div


def _cast(kw, dtype):
    """Activations in ``dtype``, the rest float32 (as upstream's module passes them)."""
    return {k: None if v is None else v.to(dtype if k in ACT else F32) for k, v in kw.items()}


def _run(kw, div, dtype, chunk_size=3, **extra):
    return mamba3_mimo(**_cast(kw, dtype), chunk_size=chunk_size, rotary_dim_divisor=div, dtype=dtype, **extra)


def _attention_form(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z):
    """MIMO as a masked attention over (step, rank) pairs, float64, no recurrence: out_{t,r} = sum_{s<t}
    exp(cs_t - cs_s) scale_s sum_r' (q_tr . k_sr') x_sr' + gamma_t sum_r' (q_tr . k_tr') x_tr' + D x_tr, with
    scale_s = gamma_s + DT_{s+1} (1 - lam_{s+1}) (0 at the end), theta the cumulative angle."""
    L, rep = Q.shape[1], V.shape[2] // Q.shape[3]
    theta = torch.cumsum(math.pi * torch.tanh(Angles) * DT.transpose(1, 2)[..., None], dim=1)  # (b, L, H, S)
    heads = lambda t, bias: t.repeat_interleave(rep, dim=3) + bias.transpose(0, 1)  # noqa: E731  (b, L, R, H, N)
    q = rotate_halves(heads(Q, Q_bias), theta[:, :, None])
    k = rotate_halves(heads(K, K_bias), theta[:, :, None])
    x = V[:, :, None] * MIMO_V.transpose(0, 1)  # (b, L, R, H, P)
    lam = torch.sigmoid(Trap)
    gamma = DT * lam  # (b, H, L)
    nxt = F.pad(DT[..., 1:] * (1 - lam[..., 1:]), (0, 1))
    cs = torch.cumsum(ADT, dim=-1)
    t_idx = torch.arange(L)
    strict = (t_idx[:, None] > t_idx[None, :]).to(F64)
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(strict == 0, -math.inf))  # (b, H, t, s)
    w = decay * (gamma + nxt)[..., None, :] + torch.diag_embed(gamma)
    scores = torch.einsum("btrhn,bsuhn->bhtrsu", q, k)
    y = torch.einsum("bhts,bhtrsu,bsuhp->btrhp", w, scores, x)
    if D is not None:
        y = y + D[:, None] * x
    if Z is not None:
        y = y * F.silu(Z[:, :, None] * MIMO_Z.transpose(0, 1))
    return torch.einsum("btrhp,hrp->bthp", y, MIMO_Out) if MIMO_Out is not None else y


def test_reference_against_the_attention_form_and_siso():
    """The recurrence == the masked attention form == the chunked torch composition; R = 1 with unit projections
    == the SISO reference on the pair-permuted headdim_qk."""
    kw, _ = make(nheads_qk=2, R=3, seqlen=6)
    torch.testing.assert_close(mamba3_mimo_ref(**kw), _attention_form(**kw), rtol=1e-10, atol=1e-10)
    chunked = mamba3_mimo_chunked_ref(**kw, chunk_size=4, dtype=F64)  # the benchmarks' torch composition
    torch.testing.assert_close(chunked, mamba3_mimo_ref(**kw), rtol=1e-10, atol=1e-10)
    kw, _ = make(R=1, nheads_qk=2, div=2)  # R = 1, unit projections: SISO on the pair-permuted headdim_qk
    one = torch.ones_like(kw["MIMO_V"])
    kw.update(MIMO_V=one, MIMO_Z=one, MIMO_Out=one)
    perm = pair_order(8, "cpu")
    siso = mamba3_siso_combined_ref(kw["Q"][:, :, 0][..., perm], kw["K"][:, :, 0][..., perm], kw["V"], kw["ADT"],
                                    kw["DT"], kw["Trap"], kw["Q_bias"][:, 0][..., perm], kw["K_bias"][:, 0][..., perm],
                                    kw["Angles"], kw["D"], kw["Z"])
    torch.testing.assert_close(mamba3_mimo_ref(**kw), siso, rtol=1e-12, atol=1e-12)


CASES = [dict(), dict(R=4, div=2, nheads_qk=2), dict(R=1, N=6), dict(R=3, out=False, seqlen=9),
         dict(D=False, Z=False, R=2, nheads=2), dict(seqlen=1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_forward_and_final_states_fp32(case):
    kw, div = make(**case)
    got = _run(kw, div, F32, return_state=True)
    want = mamba3_mimo_ref(**_cast(kw, F32), return_state=True)
    for name, a, b in zip(("out", "angle", "ssm", "k", "v"), got, want):
        assert a.dtype == (F32 if name != "v" else F32)
        assert_close_to_ref(a, b, atol=2e-5, rtol=1e-4, name=name)


def test_forward_bf16():
    kw, div = make(R=2, nheads_qk=2, seqlen=9, seed=4)
    got = _run(kw, div, BF16, chunk_size=4)
    assert got.dtype == BF16
    low = _cast(kw, BF16)
    ref_low = mamba3_mimo_ref(**low, dtype=BF16)
    assert_close_to_ref(got, mamba3_mimo_ref(**low), ref_low)


def test_packed_sequences():
    kw, div = make(batch=1, seqlen=10, R=2, seed=2)
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    got = _run(kw, div, F32, chunk_size=3, return_state=True, cu_seqlens=cu)
    want = mamba3_mimo_ref(**_cast(kw, F32), return_state=True, cu_seqlens=cu)
    for name, a, b in zip(("out", "angle", "ssm", "k", "v"), got, want):
        assert a.shape == b.shape, name
        assert_close_to_ref(a, b, atol=2e-5, rtol=1e-4, name=name)


def test_chunk_beyond_the_kernels_limit():
    """chunk_size R > 256 (the SSD kernels' chunk limit in flattened (step, rank) positions): the kernels run
    chunks of 256 // R steps (here 64 of the 100 asked, two chunks over 70 steps), the result unchanged."""
    kw, div = make(batch=1, seqlen=70, R=4, nheads=2, seed=5)
    got = _run(kw, div, F32, chunk_size=100, return_state=True)
    want = mamba3_mimo_ref(**_cast(kw, F32), return_state=True)
    for name, a, b in zip(("out", "angle", "ssm", "k", "v"), got, want):
        assert_close_to_ref(a, b, atol=2e-5, rtol=1e-4, name=name)


def _leaves(kw, dtype):
    return {k: None if v is None else v.detach().clone().requires_grad_() for k, v in _cast(kw, dtype).items()}


@pytest.mark.parametrize("dtype,case", [(F32, dict()), (F32, dict(R=3, out=False, nheads_qk=2, div=2)),
                                        (F32, dict(D=False, Z=False)), (BF16, dict(seed=3)),
                                        (F32, dict(batch=1, seqlen=20, nheads=2))],
                         ids=["fp32", "fp32-no-out-gqa-full", "fp32-no-D-Z", "bf16", "fp32-two-step-blocks"])
def test_gradients_against_the_reference(dtype, case):
    kw, div = make(**case)
    got_in, ref_in, low_in = _leaves(kw, dtype), _leaves(kw, F64), _leaves(kw, dtype)
    out = _run(got_in, div, dtype, chunk_size=3)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    (out.double() * cot).sum().backward()
    (mamba3_mimo_ref(**ref_in) * cot).sum().backward()
    if dtype == BF16:
        (mamba3_mimo_ref(**low_in, dtype=dtype).double() * cot).sum().backward()
    for name, t in got_in.items():
        if t is None or ref_in[name].grad is None:  # MIMO_Z without Z: unused by both
            assert t is None or t.grad is None, name
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        low = low_in[name].grad if dtype == BF16 else None
        assert_close_to_ref(t.grad, ref_in[name].grad, low, atol=None if low is not None else 1e-4, rtol=1e-4,
                            name=name)


def test_directional_derivative_of_the_kernels():
    """<grad, v> == (f(x + eps v) - f(x - eps v)) / 2 eps over every input at once (fp32 central differences:
    the gradcheck of a float32-only op): the backward is consistent with the forward kernels themselves."""
    kw, div = make(seed=6, nheads_qk=2)
    inp = _leaves(kw, F32)
    cot = torch.randn(2, 7, 4, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    (_run(inp, div, F32).double() * cot).sum().backward()
    gen = torch.Generator().manual_seed(7)
    dirs = {n: torch.randn(t.shape, generator=gen, dtype=F64) for n, t in inp.items() if t is not None}
    predicted = sum((inp[n].grad.double() * d).sum() for n, d in dirs.items()).item()

    def value(sign, eps=1e-3):
        moved = {n: None if t is None else (t.detach().double() + sign * eps * dirs[n]).float() for n, t in inp.items()}
        with torch.no_grad():
            return (_run(moved, div, F32).double() * cot).sum().item()

    assert predicted == pytest.approx((value(1) - value(-1)) / 2e-3, rel=2e-3)


def test_torch_compile_fullgraph_forward_and_backward():
    kw, div = make(seed=8)

    def loss(**inp):
        return mamba3_mimo(**inp, chunk_size=4, rotary_dim_divisor=div, dtype=F32).square().sum()

    eager, compiled = _leaves(kw, F32), _leaves(kw, F32)
    # aot_eager: the whole graph, fake implementations and the traced backward, without inductor codegen
    # of the layout glue (30 s on the 2-core box; mamba3_siso_combined's compile test covers inductor)
    want, got = loss(**eager), torch.compile(loss, fullgraph=True, backend="aot_eager")(**compiled)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for name, t in compiled.items():
        if t is not None:
            torch.testing.assert_close(t.grad, eager[name].grad, rtol=1e-5, atol=1e-6, msg=name)


BAD = [
    (dict(dtype=torch.float64), TypeError, "dtype"),
    (dict(rotary_dim_divisor=3), ValueError, "rotary_dim_divisor"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(Q=torch.zeros(2, 7, 2, 3, 8)), ValueError, "Q"),  # nheads_qk 3 does not divide 4
    (dict(Q=torch.zeros(2, 7, 2, 1, 7), K=torch.zeros(2, 7, 2, 1, 7)), ValueError, "Q"),  # odd headdim_qk
    (dict(K=torch.zeros(2, 7, 3, 1, 8)), ValueError, "K"),
    (dict(K=torch.zeros(2, 7, 2, 1, 8, dtype=BF16)), TypeError, "K"),
    (dict(ADT=torch.zeros(2, 7, 4)), ValueError, "ADT"),
    (dict(Q_bias=torch.zeros(4, 1, 8)), ValueError, "Q_bias"),
    (dict(MIMO_V=None), TypeError, "MIMO_V"),
    (dict(MIMO_Z=None), TypeError, "MIMO_Z"),
    (dict(MIMO_Out=torch.zeros(4, 2, 5)), ValueError, "MIMO_Out"),
    (dict(Angles=torch.zeros(2, 7, 4, 4)), ValueError, "Angles"),  # N // 4 = 2 angles
    (dict(D=torch.zeros(3)), ValueError, "D"),
    (dict(Z=torch.zeros(2, 7, 4, 5)), ValueError, "Z"),
    (dict(V=torch.zeros(2, 7, 4, 4, dtype=torch.int32)), TypeError, "V"),
]


@pytest.mark.parametrize("change,exc,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_argument(change, exc, name):
    kw, div = make()
    args = dict(_cast(kw, F32), chunk_size=4, rotary_dim_divisor=div, dtype=F32)
    args.update(change)
    with pytest.raises(exc, match=rf"^{name}:"):
        mamba3_mimo(**args)
