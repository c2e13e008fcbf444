"""The Mamba-3 SISO float64 references (tvm_mamba/reference/mamba3.py) against each other, against independent
formulations of the same math, and (when $TVM_MAMBA_UPSTREAM_DIR holds mamba_ssm 2.3.2.post1's sdist) against
upstream's own pure-torch references, read from its files at test time (nothing of upstream is committed):
``apply_rotary_qk_inference_reference`` (ops/triton/mamba3/mamba3_mimo_rotary_step.py) followed by
``selective_state_update_fused_ref_v2`` (ops/cute/mamba3/mamba3_step_fn.py) is one SISO decode step, and the
two-function path's references (reference/mamba3_mimo.py) equal those two upstream references at rank 2."""
from __future__ import annotations

import ast
import math
import os
import typing
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tvm_mamba.reference.mamba3 import (TWO_PI, mamba3_siso_chunked_ref, mamba3_siso_combined_ref, mamba3_siso_step_ref,
                                       rotate_pairs)
from tvm_mamba.reference.ssd import ssd_recurrence_ref

F64 = torch.float64


def make_inputs(batch=2, seqlen=7, nheads_qk=1, nheads=2, N=8, P=4, S=2, seed=0, states=True, dtype=F64):
    """Random mamba3_siso_combined arguments (Trap as logits, ADT = A DT with A < 0, as the module makes them)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    DT = F.softplus(r(batch, nheads, seqlen)) * 0.5
    A = -torch.rand(nheads, generator=g, dtype=dtype) - 0.1
    inp = dict(Q=r(batch, seqlen, nheads_qk, N), K=r(batch, seqlen, nheads_qk, N), V=r(batch, seqlen, nheads, P),
               ADT=A[None, :, None] * DT, DT=DT, Trap=r(batch, nheads, seqlen), Q_bias=r(nheads, N) * 0.3,
               K_bias=r(nheads, N) * 0.3, Angles=r(batch, seqlen, nheads, S) * 2, D=r(nheads), Z=r(batch, seqlen, nheads, P))
    if states:
        inp["Input_States"] = (torch.rand(batch, nheads, S, generator=g, dtype=dtype) * TWO_PI,
                               r(batch, nheads, P, N) * 0.5, r(batch, nheads, N), r(batch, nheads, P))
    return inp


def with_changes(kw: dict, change: dict) -> dict:
    """A copy of call arguments ``kw`` with ``change`` applied: key ``state<i>`` replaces Input_States[i], any
    other key the argument of that name (the bad-input tests' one-argument changes)."""
    kw = dict(kw, Input_States=list(kw["Input_States"]))
    for key, value in change.items():
        if key.startswith("state"):
            kw["Input_States"][int(key[-1])] = value
        else:
            kw[key] = value
    return kw


def step_inputs(inp, t):
    """Time step t of combined-layout inputs in the decode step's layout."""
    return dict(Q=inp["Q"][:, t], K=inp["K"][:, t], V=inp["V"][:, t], ADT=inp["ADT"][:, :, t], DT=inp["DT"][:, :, t],
                Trap=inp["Trap"][:, :, t], Q_bias=inp["Q_bias"], K_bias=inp["K_bias"], Angles=inp["Angles"][:, t],
                D=inp["D"], Z=inp["Z"][:, t])


def test_decode_steps_equal_the_sequence_forward():
    inp = make_inputs(nheads_qk=1, nheads=4, S=3)
    out, *final = mamba3_siso_combined_ref(**inp, return_final_states=True)
    states, ys = list(inp["Input_States"]), []
    for t in range(inp["Q"].shape[1]):
        y, states = mamba3_siso_step_ref(**step_inputs(inp, t), Input_States=states)
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, dim=1), out, rtol=1e-12, atol=1e-12)
    for a, b in zip(states, final):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_split_sequence_with_states_equals_whole():
    """Running [0, 4) then [4, L) from the first part's final states == the whole sequence at once."""
    inp = make_inputs(seqlen=9)
    out, *final = mamba3_siso_combined_ref(**inp, return_final_states=True)
    cut = lambda lo, hi: {k: (v if k in ("Q_bias", "K_bias", "D", "Input_States") else  # noqa: E731
                              v[:, :, lo:hi] if k in ("ADT", "DT", "Trap") else v[:, lo:hi]) for k, v in inp.items()}
    o1, *s1 = mamba3_siso_combined_ref(**cut(0, 4), return_final_states=True)
    o2, *s2 = mamba3_siso_combined_ref(**{**cut(4, 9), "Input_States": tuple(s1)}, return_final_states=True)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), out, rtol=1e-12, atol=1e-12)
    for a, b in zip(s2, final):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_varlen_equals_separate_sequences():
    a, b = make_inputs(batch=1, seqlen=5, seed=1), make_inputs(batch=1, seqlen=3, seed=2)
    b.update(Q_bias=a["Q_bias"], K_bias=a["K_bias"], D=a["D"])
    packed = {k: (a[k] if k in ("Q_bias", "K_bias", "D") else
                  tuple(torch.cat([x, y]) for x, y in zip(a[k], b[k])) if k == "Input_States" else
                  torch.cat([a[k], b[k]], dim=2 if k in ("ADT", "DT", "Trap") else 1)) for k in a}
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    out, *final = mamba3_siso_combined_ref(**packed, cu_seqlens=cu, return_final_states=True)
    oa, *fa = mamba3_siso_combined_ref(**a, return_final_states=True)
    ob, *fb = mamba3_siso_combined_ref(**b, return_final_states=True)
    torch.testing.assert_close(out, torch.cat([oa, ob], dim=1), rtol=1e-12, atol=1e-12)
    for f, x, y in zip(final, fa, fb):
        torch.testing.assert_close(f, torch.cat([x, y]), rtol=1e-12, atol=1e-12)


def test_trap_one_is_the_euler_ssd_recurrence():
    """sigmoid(Trap) = 1 (logit +60: 1 - 9e-27, exactly 1.0 in float64): beta = 0, gamma = DT, so
    h_t = exp(ADT_t) h_{t-1} + DT_t v_t k_t^T — Mamba-2's SSD recurrence with x = V, B = K, C = Q,
    A = ADT / DT; with zero angles and biases, the same outputs as tvm_mamba's SSD reference."""
    inp = make_inputs(nheads_qk=2, nheads=4, states=False)
    A = -torch.rand(4, dtype=F64) - 0.1
    inp.update(ADT=A[None, :, None] * inp["DT"], Trap=torch.full_like(inp["Trap"], 60.0),
               Angles=torch.zeros_like(inp["Angles"]), Q_bias=torch.zeros_like(inp["Q_bias"]),
               K_bias=torch.zeros_like(inp["K_bias"]))
    out, _, h, _, _ = mamba3_siso_combined_ref(**inp, return_final_states=True)
    y, hs = ssd_recurrence_ref(inp["V"], inp["DT"].transpose(1, 2), A, inp["K"], inp["Q"], D=inp["D"], z=inp["Z"],
                               return_final_states=True)
    torch.testing.assert_close(out, y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, hs, rtol=1e-12, atol=1e-12)


def _quadratic_form(inp):
    """The output as a masked attention, an independent formulation of the recurrence (upstream's chunked
    kernel computes this form): v_s k_s^T enters the state with weight gamma_s and once more at s + 1 with
    beta_{s+1}, so out_t = sum_{s<=t} w_ts (q_t . k_s) v_s with w_tt = gamma_t and, for s < t,
    w_ts = exp(ADT_{s+1} + ... + ADT_t) (gamma_s + DT_{s+1} (1 - sigmoid(Trap_{s+1}))); no input states."""
    b, L, hq, N = inp["Q"].shape
    H = inp["V"].shape[2]
    theta = torch.remainder(torch.cumsum(math.pi * torch.tanh(inp["Angles"]) * inp["DT"].transpose(1, 2)[..., None],
                                         dim=1), TWO_PI)  # (b, L, H, S)
    q = rotate_pairs(inp["Q"].repeat_interleave(H // hq, dim=2) + inp["Q_bias"], theta)
    k = rotate_pairs(inp["K"].repeat_interleave(H // hq, dim=2) + inp["K_bias"], theta)
    lam = torch.sigmoid(inp["Trap"])
    gamma = inp["DT"] * lam  # (b, H, L)
    shifted = torch.zeros_like(gamma)
    shifted[..., :-1] = (inp["DT"] * (1 - lam))[..., 1:]
    cs = torch.cumsum(inp["ADT"], dim=-1)
    decay = torch.exp(cs[..., :, None] - cs[..., None, :])  # (b, H, t, s)
    t_idx = torch.arange(L)
    w = torch.where(t_idx[:, None] > t_idx[None, :], decay * (gamma + shifted)[..., None, :], 0.0)
    w = w + torch.diag_embed(gamma)
    scores = torch.einsum("bthn,bshn->bhts", q, k) * w
    y = torch.einsum("bhts,bshp->bthp", scores, inp["V"]) + inp["D"][:, None] * inp["V"]
    return y * F.silu(inp["Z"])


def test_recurrence_equals_the_quadratic_form():
    inp = make_inputs(nheads_qk=1, nheads=2, seqlen=8, S=4, states=False)
    torch.testing.assert_close(mamba3_siso_combined_ref(**inp), _quadratic_form(inp), rtol=1e-10, atol=1e-10)


def test_zero_angles_is_no_rotary():
    """Zero angle rates keep theta at its zero start: the same as a call with no rotated pairs (headdim_angles 0)."""
    inp = make_inputs(states=False)
    inp["Angles"] = torch.zeros_like(inp["Angles"])
    plain = dict(inp, Angles=inp["Angles"][..., :0])
    torch.testing.assert_close(mamba3_siso_combined_ref(**inp), mamba3_siso_combined_ref(**plain), rtol=0, atol=0)
    x = torch.randn(3, 8, dtype=F64)
    torch.testing.assert_close(rotate_pairs(x, torch.zeros(3, 4, dtype=F64)), x, rtol=0, atol=0)


def test_rotary_is_relative():
    """Only angle differences reach the output: a common start angle (the input angle state, with zero ssm /
    k / v states) leaves it unchanged, while a rotated pair does change."""
    inp = make_inputs(states=False, S=2)
    base = mamba3_siso_combined_ref(**inp)
    b, H, S, P, N = 2, 2, 2, 4, 8
    start = torch.rand(b, H, S, dtype=F64) * TWO_PI
    zeros = (start, torch.zeros(b, H, P, N, dtype=F64), torch.zeros(b, H, N, dtype=F64), torch.zeros(b, H, P, dtype=F64))
    torch.testing.assert_close(mamba3_siso_combined_ref(**inp, Input_States=zeros), base, rtol=1e-10, atol=1e-10)
    rolled = dict(inp, Angles=inp["Angles"].roll(1, dims=1))
    assert not torch.allclose(mamba3_siso_combined_ref(**rolled), base)


def test_gradcheck_combined_ref():
    inp = make_inputs(batch=1, seqlen=3, nheads=2, N=4, P=2, S=1)
    names = [k for k in inp if k != "Input_States"]
    tensors = [inp[k].clone().requires_grad_() for k in names]
    states = [s.clone().requires_grad_() for s in inp["Input_States"]]

    def fn(*args):
        kw = dict(zip(names, args[:len(names)]))
        return mamba3_siso_combined_ref(**kw, Input_States=tuple(args[len(names):]), return_final_states=True)

    assert torch.autograd.gradcheck(fn, (*tensors, *states))


# --- upstream's own pure-torch references, read from the sdist at test time ---------------------------
SDIST = "mamba_ssm-2.3.2.post1"


def _upstream_function(relpath: str, name: str):
    root = os.environ.get("TVM_MAMBA_UPSTREAM_DIR")
    if not root:
        pytest.skip("TVM_MAMBA_UPSTREAM_DIR is not set (a folder holding mamba_ssm-2.3.2.post1/)")
    path = Path(root) / SDIST / relpath
    if not path.is_file():
        pytest.skip(f"{path} does not exist")
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch, "math": math, "Optional": typing.Optional, "Tuple": typing.Tuple}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace[name]


def test_step_matches_upstream_pure_torch_references():
    rotary = _upstream_function("mamba_ssm/ops/triton/mamba3/mamba3_mimo_rotary_step.py",
                                "apply_rotary_qk_inference_reference")
    fused = _upstream_function("mamba_ssm/ops/cute/mamba3/mamba3_step_fn.py", "selective_state_update_fused_ref_v2")
    inp = step_inputs(make_inputs(nheads_qk=1, nheads=2, S=3), 2)
    states = make_inputs(nheads_qk=1, nheads=2, S=3)["Input_States"]
    out, (theta, h, k, v) = mamba3_siso_step_ref(**inp, Input_States=states)
    H, P = 2, 4
    # upstream's layouts: q, k (B, R, N, D) with R = 1 (SISO), biases (R, N, D); A (B, N) is ADT / DT
    qr, kr, theta_up = rotary(inp["Q"].expand(-1, H, -1)[:, None], inp["K"].expand(-1, H, -1)[:, None],
                              states[0], inp["Angles"], inp["DT"], inp["Q_bias"][None], inp["K_bias"][None],
                              rotate_pairwise=True)
    ones = torch.ones(1, H, P, dtype=F64)
    out_up, h_up = fused(states[1].clone(), inp["ADT"] / inp["DT"], kr, qr, ones, inp["V"], ones, inp["Z"],
                         inp["DT"], states[2][:, None], states[3], torch.sigmoid(inp["Trap"]), inp["D"], ones,
                         compute_dtype=F64)
    torch.testing.assert_close(torch.remainder(theta_up, TWO_PI), theta, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kr[:, 0], k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h_up, h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_up, out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pairwise, conj, gate", [(True, False, True), (False, True, False)])
def test_two_function_references_match_upstreams(pairwise, conj, gate):
    """reference/mamba3_mimo.py's apply_rotary_qk_inference_ref / mamba3_step_fn_ref (written from the math)
    == upstream's apply_rotary_qk_inference_reference / selective_state_update_fused_ref_v2, rank 2, float64:
    interleaved and halved pairs, conjugate, with and without the z gate and the out projection."""
    from tvm_mamba.reference.mamba3_mimo import apply_rotary_qk_inference_ref, mamba3_step_fn_ref

    rotary = _upstream_function("mamba_ssm/ops/triton/mamba3/mamba3_mimo_rotary_step.py",
                                "apply_rotary_qk_inference_reference")
    fused = _upstream_function("mamba_ssm/ops/cute/mamba3/mamba3_step_fn.py", "selective_state_update_fused_ref_v2")
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    B, R, H, N, P, S = 2, 2, 3, 8, 4, 3
    rot = (r(B, R, H, N), r(B, R, H, N), 5 * r(B, H, S), r(B, H, S), r(B, H).abs(), r(R, H, N), r(R, H, N))
    for ours, theirs in zip(apply_rotary_qk_inference_ref(*rot, conjugate=conj, rotate_pairwise=pairwise),
                            rotary(*rot, conjugate=conj, rotate_pairwise=pairwise)):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    state, A, dt, trap = r(B, H, P, N), -r(B, H).abs(), r(B, H).abs(), torch.rand(B, H, generator=g, dtype=F64)
    Bk, C, Bstate, x, Xstate, D, xproj = r(B, R, H, N), r(B, R, H, N), r(B, R, H, N), r(B, H, P), r(B, H, P), r(H), \
        r(R, H, P)
    z, zproj, outproj = (r(B, H, P), r(R, H, P), r(R, H, P)) if gate else (None, None, None)
    want = fused(state, A, Bk, C, xproj, x, zproj, z, dt, Bstate, Xstate, trap, D, outproj, compute_dtype=F64)
    got = mamba3_step_fn_ref(state, Bstate, Xstate, A, Bk, C, D, x, dt, trap, xproj, outproj, z, zproj)
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("states", [True, False])
def test_chunked_form_equals_the_recurrence(states):
    """mamba3_siso_chunked_ref (the benchmarks' torch composition) == the recurrence: output and final states,
    a ragged last chunk, GQA, input states in."""
    inp = make_inputs(batch=2, seqlen=11, nheads_qk=1, nheads=2, S=3, states=states)
    want = mamba3_siso_combined_ref(**inp, return_final_states=True)
    got = mamba3_siso_chunked_ref(**inp, chunk_size=4, return_final_states=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_preprocess_ref_agrees_with_the_recurrence():
    """mamba3_siso_preprocess_ref's final angle and last rotated k are the sequence reference's final angle / K
    states; its clamp is the SSD pieces' DA_MIN; dA_cs slots past seqlen repeat the chunk's last cumsum."""
    from tvm_mamba.compute.ssd.common import DA_MIN
    from tvm_mamba.reference.mamba3 import DA_MIN as REF_DA_MIN, mamba3_siso_preprocess_ref

    assert REF_DA_MIN == DA_MIN
    inp = make_inputs(seqlen=7, nheads_qk=1, nheads=2, S=3)
    _, angle, _, k_last, _ = mamba3_siso_combined_ref(**inp, return_final_states=True)
    pre = {k: v for k, v in inp.items() if k not in ("V", "Z")}
    q, k, dA_cs, scale, skip, aout, init = mamba3_siso_preprocess_ref(**pre, chunk_size=4)
    torch.testing.assert_close(aout, angle, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k[:, -1], k_last, rtol=1e-12, atol=1e-12)
    assert (dA_cs[:, :, 1, 3] == dA_cs[:, :, 1, 2]).all() and (scale[:, :, 1, 3] == 0).all()
    assert init.shape == inp["Input_States"][1].shape
