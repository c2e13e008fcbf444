"""NaN semantics of Mamba-3 (issue #41) on the CPU kernels: a NaN in any one input of mamba3_siso_combined,
mamba3_siso_step, mamba3_mimo or mamba3_mimo_step reaches what the documented recurrence reaches, as in the SSD
(a NaN at step t makes the outputs from t on NaN, and every gradient it flows into). Each input gets one NaN
(the per-step inputs at a step inside a chunk, not at its start); the finiteness masks of out, the final
states and (chunked scans) every gradient equal those of the float64 recurrence (reference/mamba3*.py, torch
autograd), and the finite values agree. ADT = NaN once behaved as ADT = -inf (the decay clamp erased the state
history: a finite out), Trap and Angles were dropped by the CPU's polynomial sigmoid / tanh, which clamp their
input. tests/cudasim/test_mamba3_nan.py runs the same cases on the CUDA kernels in the harness.

Two differences from the recurrence's gradient masks are the chunked form's, and are allowed exactly where
they arise (``allowance``):
* a NaN decay step (ADT at t): within t's chunk the kernels take decays as differences of a chunk-local cumsum,
  cs_l - cs_s, NaN for two positions at or after t where the recurrence's product of the steps between is
  finite; so the gradients at positions from t to the chunk's end (+1: the trapezoid's next-step weight) may
  be NaN where the recurrence's are not (the SSD's chunked form does the same);
* a NaN in one element n of a rotary pair of Q, K or a bias: the diagonal term q_t . k_t is the unrotated dot
  (X_t . Y_t, exact: rotation preserves it), so the other side's gradient at n's rotary partner stays finite
  where the recurrence's, through R(theta)^T R(theta), is NaN.
And one of mamba3_mimo's start from no state: the recurrence's zero v state times a NaN MIMO_V is NaN (0 x NaN)
in its first step's trapezoid term, so its d ADT at step 0 (through alpha_0 = exp(ADT_0) on that term) is NaN;
the kernels have no such term (upstream's mamba3_mimo takes no input states) and give its finite value.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.compute.test_mamba3_ref import make_inputs, step_inputs
from tests.conftest import assert_close_to_ref
from tests.torch_ops.test_mamba3_mimo import _cast as mimo_cast
from tests.torch_ops.test_mamba3_mimo import make as mimo_make
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref, mamba3_siso_step_ref
from tvm_mamba.reference.mamba3_mimo import mamba3_mimo_ref, mamba3_mimo_step_ref
from tvm_mamba.torch_ops.mamba3 import mamba3_siso_combined, mamba3_siso_step
from tvm_mamba.torch_ops.mamba3_mimo import mamba3_mimo
from tvm_mamba.torch_ops.mamba3_mimo_step import mamba3_mimo_step

F32, F64 = torch.float32, torch.float64
NAN = float("nan")
T_BAD = 5  # SISO: chunk 1 (of 4), its second position; MIMO (chunks of 3): chunk 1, its third position
STATES = ("angle_state", "ssm_state", "k_state", "v_state")
# SISO: make_inputs(batch 2, seqlen 11, nheads_qk 1, nheads 4, headdim_qk 8, headdim_v 4, 2 angles: rotary
# elements 0..3), chunk 4: test_mamba3_backward's first case (its kernels). Where each input's NaN goes:
SISO_DIMS = dict(batch=2, seqlen=11, nheads_qk=1, nheads=4, N=8, P=4, S=2, states=True)
SISO_CHUNK = 4
SISO_SITES = {"Q": (0, T_BAD, 0, 1), "K": (0, T_BAD, 0, 2), "V": (0, T_BAD, 1, 0), "Z": (0, T_BAD, 1, 2),
              "ADT": (0, 1, T_BAD), "DT": (0, 1, T_BAD), "Trap": (0, 1, T_BAD), "Angles": (0, T_BAD, 1, 1),
              "Q_bias": (1, 2), "K_bias": (2, 3), "D": (1,), "angle_state": (0, 1, 0),
              "ssm_state": (0, 1, 2, 3), "k_state": (0, 1, 5), "v_state": (0, 1, 2)}
# MIMO: test_mamba3_mimo's make() (batch 2, seqlen 7, rank 2, nheads_qk 1, nheads 4, headdim_qk 8, headdim_v 4,
# 2 angles: halved pairs (0, 4), (1, 5)), chunk 3; the step's input states in zero_mimo_states' layout
MIMO_T = 5
MIMO_CHUNK = 3
MIMO_SITES = {"Q": (0, MIMO_T, 1, 0, 1), "K": (0, MIMO_T, 0, 0, 4), "V": (0, MIMO_T, 1, 0),
              "Z": (0, MIMO_T, 1, 2), "ADT": (0, 1, MIMO_T), "DT": (0, 1, MIMO_T), "Trap": (0, 1, MIMO_T),
              "Angles": (0, MIMO_T, 1, 1), "Q_bias": (1, 1, 2), "K_bias": (2, 0, 5), "MIMO_V": (1, 0, 2),
              "MIMO_Z": (1, 1, 1), "MIMO_Out": (1, 0, 3), "D": (1,), "angle_state": (0, 1, 0),
              "ssm_state": (0, 1, 2, 3), "k_state": (0, 1, 1, 5), "v_state": (0, 1, 2)}
SEQ_INPUTS = [k for k in SISO_SITES if k not in STATES]
MIMO_SEQ_INPUTS = [k for k in MIMO_SITES if k not in STATES]


# ---------------------------------------------------------------- masks
def same_finiteness(got, ref, name, extra_ok=None, missing_ok=None):
    """got's non-finite entries are ref's (up to ``extra_ok`` / ``missing_ok``: boolean masks of where got
    may be non-finite alone / finite alone), and the entries finite in both agree."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    g_bad, r_bad = ~torch.isfinite(got), ~torch.isfinite(ref)
    extra, missing = g_bad & ~r_bad, r_bad & ~g_bad
    if extra_ok is not None:
        extra = extra & ~extra_ok
    if missing_ok is not None:
        missing = missing & ~missing_ok
    assert not extra.any(), f"{name}: non-finite where the recurrence is finite at {extra.nonzero()[:6].tolist()}"
    assert not missing.any(), f"{name}: finite where the recurrence is not at {missing.nonzero()[:6].tolist()}"
    ok = ~g_bad & ~r_bad
    scale = max(1.0, ref[ok].abs().max().item()) if ok.any() else 1.0
    assert_close_to_ref(torch.where(ok, got.double(), 0.0), torch.where(ok, ref.double(), 0.0),
                        atol=1e-4 * scale, rtol=1e-4, name=name)


def time_axis(name: str):
    """The time axis of a sequence layout's argument (None: no time axis)."""
    return {"ADT": 2, "DT": 2, "Trap": 2, "Q": 1, "K": 1, "V": 1, "Z": 1, "Angles": 1}.get(name)


def allowance(bad: str, site: tuple, grad: str, shape, chunk: int, partner):
    """(extra_ok, missing_ok) masks of gradient ``grad`` (shape ``shape``) for a NaN in ``bad`` at ``site``: the
    chunked form's two differences from the recurrence (module docstring); None where there is none.
    ``partner(n)``: the rotary partner of element n of headdim_qk."""
    qk = {"Q": "K", "K": "Q", "Q_bias": "K", "K_bias": "Q"}
    if bad == "ADT" and time_axis(grad) is not None:
        t, ax = site[2], time_axis(grad)
        hi = min((t // chunk + 1) * chunk + 1, shape[ax])
        ok = torch.zeros(shape, dtype=torch.bool)
        ok.narrow(0, site[0], 1).narrow(ax, t, hi - t).fill_(True)
        return ok, None
    if qk.get(bad) == grad:
        ok = torch.zeros(shape, dtype=torch.bool)
        ok[..., partner(site[-1])] = True
        return None, ok
    if bad == "MIMO_V" and grad == "ADT":
        ok = torch.zeros(shape, dtype=torch.bool)
        ok[:, site[0], 0] = True
        return None, ok
    return None, None


def with_nan(tensor: torch.Tensor, site: tuple) -> torch.Tensor:
    out = tensor.clone()
    out[site] = NAN
    return out


# ---------------------------------------------------------------- SISO
def siso_inputs(bad: str) -> dict:
    """make_inputs (float64) with a NaN in ``bad`` (an argument or an input state) at SISO_SITES[bad]."""
    inp = make_inputs(**SISO_DIMS)
    if bad in STATES:
        states = list(inp["Input_States"])
        states[STATES.index(bad)] = with_nan(states[STATES.index(bad)], SISO_SITES[bad])
        inp["Input_States"] = tuple(states)
    else:
        inp[bad] = with_nan(inp[bad], SISO_SITES[bad])
    return inp


def _leaves(inp: dict, dtype) -> dict:
    """Leaf copies in ``dtype`` requiring grad (the input states too)."""
    out = {k: v.to(dtype).detach().requires_grad_() for k, v in inp.items() if isinstance(v, torch.Tensor)}
    out["Input_States"] = tuple(s.to(dtype).detach().requires_grad_() for s in inp["Input_States"])
    return out


def _named(leaves: dict) -> list:
    """(name, tensor) of every differentiable argument, the input states by their names."""
    return [(k, v) for k, v in leaves.items() if k != "Input_States"] + list(zip(STATES, leaves["Input_States"]))


def _siso_run(fn, leaves: dict, cot: list):
    """fn's five outputs and {name: gradient} of sum_i <output_i, cot_i>."""
    outs = fn(**leaves)
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cot))
    named = _named(leaves)
    grads = torch.autograd.grad(loss, [t for _, t in named])
    return [o.detach() for o in outs], dict(zip((n for n, _ in named), grads))


def check_siso_combined(bad: str):
    """Forward (out, four final states) and every gradient for random cotangents of all five outputs."""
    inp = siso_inputs(bad)
    g = torch.Generator().manual_seed(7)
    ref_fn = lambda **kw: mamba3_siso_combined_ref(**kw, return_final_states=True)  # noqa: E731
    cot = [torch.randn(o.shape, generator=g, dtype=F64) for o in ref_fn(**inp)]
    ref_outs, ref_grads = _siso_run(ref_fn, _leaves(inp, F64), cot)
    outs, grads = _siso_run(lambda **kw: mamba3_siso_combined(**kw, chunk_size=SISO_CHUNK, return_final_states=True),
                            _leaves(inp, F32), cot)
    assert not torch.isfinite(ref_outs[0]).all(), "the NaN must reach out"
    for name, o, r in zip(("out", *STATES), outs, ref_outs):
        same_finiteness(o, r, name)
    for name, r in ref_grads.items():
        extra_ok, missing_ok = allowance(bad, SISO_SITES[bad], name, r.shape, SISO_CHUNK, lambda n: n ^ 1)
        same_finiteness(grads[name], r, "d" + name, extra_ok, missing_ok)


def check_siso_step(bad: str, dtype=F32):
    """The decode step chained over the sequence (each step fed its returned states) against the float64 step
    reference chained alike: out at every step and the final states."""
    inp = siso_inputs(bad)
    steps = [step_inputs(inp, t) for t in range(SISO_DIMS["seqlen"])]
    kernel = lambda args, st: mamba3_siso_step(**{k: v.to(dtype) for k, v in args.items()},  # noqa: E731
                                               Input_States=st)
    chain_steps(steps, kernel, mamba3_siso_step_ref, inp["Input_States"], T_BAD if time_axis(bad) else 0, dtype)


def chain_steps(steps: list, kernel, reference, states, t_bad: int, dtype):
    """Each step's float64 arguments in ``steps`` through ``kernel(args, states)`` and the float64 ``reference``,
    each chain fed its own returned states (from ``states``, float64; the kernel's in ``dtype``): out's masks at
    every step, finite before ``t_bad`` (the NaN's step; 0 for an input of every step), then the final states'."""
    states, ref_states, reached = [s.to(dtype) for s in states], list(states), False
    for t, args in enumerate(steps):
        out, states = kernel(args, states)
        ref, ref_states = reference(**args, Input_States=ref_states)
        same_finiteness(out, ref, f"out[{t}]")
        reached = reached or not torch.isfinite(ref).all()
        assert t >= t_bad or torch.isfinite(out).all(), f"out[{t}]: non-finite before the NaN's step"
    assert reached, "the NaN must reach out"
    for name, s, r in zip(STATES, states, ref_states):
        same_finiteness(s, r, name)


@pytest.mark.parametrize("bad", list(SISO_SITES))
def test_siso_combined_nan(bad):
    check_siso_combined(bad)


@pytest.mark.parametrize("bad", list(SISO_SITES))
def test_siso_step_nan(bad):
    check_siso_step(bad)


@pytest.mark.parametrize("bad", ["ADT", "Trap", "Angles"])
def test_siso_step_nan_float64(bad):
    """The float64 step kernel (native exp / tanh, no polynomial clamps) keeps NaN too."""
    check_siso_step(bad, F64)


# ---------------------------------------------------------------- MIMO
def mimo_inputs(bad: str, **dims):
    """mimo_make's float64 arguments (``dims``: its keywords; and the rotary divisor) with a NaN in ``bad`` at
    MIMO_SITES[bad]; input states (for the step) in zero_mimo_states' layout."""
    kw, div = mimo_make(**dims)
    g = torch.Generator().manual_seed(5)
    batch, _, R, _, N = kw["Q"].shape
    H, P, S = kw["V"].shape[2], kw["V"].shape[3], kw["Angles"].shape[3]
    states = [torch.rand(batch, H, S, generator=g, dtype=F64) * 2 * math.pi,
              torch.randn(batch, H, P, N, generator=g, dtype=F64) * 0.5,
              torch.randn(batch, R, H, N, generator=g, dtype=F64), torch.randn(batch, H, P, generator=g, dtype=F64)]
    if bad in STATES:
        states[STATES.index(bad)] = with_nan(states[STATES.index(bad)], MIMO_SITES[bad])
    else:
        kw[bad] = with_nan(kw[bad], MIMO_SITES[bad])
    return kw, div, states


def check_mimo(bad: str, **dims):
    """Forward (out, final states) and every gradient of out (``dims``: mimo_make's keywords)."""
    kw, div, _ = mimo_inputs(bad, **dims)
    got_in = {k: v.detach().requires_grad_() for k, v in mimo_cast(kw, F32).items()}
    ref_in = {k: v.detach().requires_grad_() for k, v in kw.items()}
    out, *final = mamba3_mimo(**got_in, chunk_size=MIMO_CHUNK, rotary_dim_divisor=div, dtype=F32, return_state=True)
    ref, *ref_final = mamba3_mimo_ref(**ref_in, return_state=True)
    assert not torch.isfinite(ref).all(), "the NaN must reach out"
    for name, o, r in zip(("out", *STATES), (out, *final), (ref, *ref_final)):
        same_finiteness(o.detach(), r.detach(), name)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    grads = torch.autograd.grad((out.double() * cot).sum(), list(got_in.values()))
    ref_grads = torch.autograd.grad((ref * cot).sum(), list(ref_in.values()))
    N = kw["Q"].shape[-1]
    for name, got, want in zip(got_in, grads, ref_grads):
        extra_ok, missing_ok = allowance(bad, MIMO_SITES[bad], name, want.shape, MIMO_CHUNK,
                                         lambda n: (n + N // 2) % N)
        same_finiteness(got, want, "d" + name, extra_ok, missing_ok)


def check_mimo_step(bad: str):
    """mamba3_mimo_step chained over the sequence against mamba3_mimo_step_ref chained alike."""
    kw, _, states = mimo_inputs(bad)
    steps = [{k: v if time_axis(k) is None else v.select(time_axis(k), t) for k, v in kw.items()}
             for t in range(kw["Q"].shape[1])]
    kernel = lambda args, st: mamba3_mimo_step(**mimo_cast(args, F32), Input_States=st)  # noqa: E731
    chain_steps(steps, kernel, mamba3_mimo_step_ref, states, MIMO_T if time_axis(bad) else 0, F32)


@pytest.mark.parametrize("bad", MIMO_SEQ_INPUTS)
def test_mimo_nan(bad):
    check_mimo(bad)


@pytest.mark.parametrize("bad", list(MIMO_SITES))
def test_mimo_step_nan(bad):
    check_mimo_step(bad)
