"""The backward of mamba3_siso_combined (tvm_mamba::mamba3_siso_bwd: the SSD pieces' backward with diag_skip, then
the preprocess's backward kernel) on the CPU: every gradient (Q, K, V, ADT, DT, Trap, the biases, Angles, D, Z
and the four input states) against torch.autograd of the float64 reference recurrence, for a random output
gradient and random gradients of the four final states; fp32 and bf16 (mamba_ssm's 2 * err(bf16 reference) +
atol); GQA, partial / full rotary, ragged last chunk, with and without input states, D / Z; a directional
finite-difference check of the kernels themselves; opcheck of the backward op and the autograd registration."""
from __future__ import annotations

import pytest
import torch

from tests.compute.test_mamba3_ref import make_inputs
from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref
from tvm_mamba.runtime.dispatch import record_keys
from tvm_mamba.torch_ops.mamba3 import mamba3_siso_bwd_op, mamba3_siso_combined, mamba3_siso_fwd_op

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
ACT = ("Q", "K", "V", "Z")
STATE_NAMES = ("angle_state", "ssm_state", "k_state", "v_state")


def _leaves(inp: dict, dtype) -> dict:
    """Leaf copies requiring grad: activations and the K / V states in ``dtype``, the rest float32 (as
    upstream's module passes them); the reference gets float64 copies of the same values."""
    out = {}
    for k, v in inp.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(dtype if k in ACT else F32).detach().requires_grad_()
        elif k == "Input_States" and v is not None:
            out[k] = tuple(t.to(dt).detach().requires_grad_() for t, dt in zip(v, (F32, F32, dtype, dtype)))
        else:
            out[k] = v
    return out


def _flat(inp: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every differentiable argument, the input states by their names."""
    named = [(k, v) for k, v in inp.items() if isinstance(v, torch.Tensor)]
    if inp.get("Input_States") is not None:
        named += list(zip(STATE_NAMES, inp["Input_States"]))
    return named


def _grads(fn, inp: dict, cot: list) -> dict:
    """{name: gradient} of sum_i <fn(**inp)[i], cot[i]> (None where a cotangent is None)."""
    outs = fn(**inp)
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cot) if c is not None)
    named = _flat(inp)
    grads = torch.autograd.grad(loss, [t for _, t in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, grads)}


def _kernel(chunk_size, **kw):
    return mamba3_siso_combined(**kw, chunk_size=chunk_size, return_final_states=True)


def _reference(dtype):
    return lambda **kw: mamba3_siso_combined_ref(**{k: v for k, v in kw.items() if k != "chunk_size"},
                                                 return_final_states=True, dtype=dtype)


def _cotangents(inp: dict, seed: int, final_grads: bool) -> list:
    """A random gradient for out and, with ``final_grads``, for the final angle, ssm, k and v states."""
    g = torch.Generator().manual_seed(seed)
    (batch, L, H, P), N, S = inp["V"].shape, inp["Q"].shape[3], inp["Angles"].shape[3]
    shapes = [(batch, L, H, P), (batch, H, S), (batch, H, P, N), (batch, H, N), (batch, H, P)]
    return [torch.randn(*s, generator=g, dtype=F64) if i == 0 or final_grads else None for i, s in enumerate(shapes)]


# (nheads_qk, nheads, headdim_qk, headdim_v, headdim_angles, seqlen, chunk, input states, final-state grads);
# the other tests reuse the first case's dims (its kernels: each new set of dims builds about ten)
CASES = [(1, 4, 8, 4, 2, 11, 4, True, True),      # GQA 4:1, partial rotary, ragged last chunk, states both ways
         (2, 2, 16, 8, 8, 24, 8, False, False)]   # full rotary, whole chunks, no states, out's gradient only,
#                                                    two of the preprocess backward's 16-step blocks


@pytest.mark.parametrize("dtype, HQ, H, N, P, S, L, chunk, states, final_grads",
                         [(F32, *CASES[0]), (BF16, *CASES[0]), (F32, *CASES[1])])
def test_gradients_match_reference(dtype, HQ, H, N, P, S, L, chunk, states, final_grads):
    base = make_inputs(batch=2, seqlen=L, nheads_qk=HQ, nheads=H, N=N, P=P, S=S, seed=L, states=states, dtype=F64)
    cot = _cotangents(base, L + 1, final_grads)
    inp = _leaves(base, dtype)
    with record_keys() as used:
        got = _grads(_kernel, dict(inp, chunk_size=chunk), cot)
    assert ("mamba3", "siso_preprocess_bwd") in [(k.op, k.direction) for k, _ in used]
    want = _grads(_reference(F64), _leaves(base, F64), cot)
    low = _grads(_reference(BF16), _leaves(base, BF16), cot) if dtype == BF16 else None
    assert set(got) == set(want)
    for name, g in got.items():
        assert g is not None and g.dtype == dict(_flat(inp))[name].dtype, name
        if dtype == BF16:
            assert_close_to_ref(g, want[name], low[name], atol=5e-2, name=f"d{name}")
        else:
            scale = want[name].abs().max().item()
            assert_close_to_ref(g, want[name], atol=1e-4 * max(scale, 1.0), rtol=1e-4, name=f"d{name}")


def test_gradients_without_D_Z_and_states():
    """D and Z absent, no input states, one ragged chunk (upstream's default chunk 64 > seqlen)."""
    base = dict(make_inputs(batch=1, seqlen=9, nheads=2, S=3, states=False, dtype=F64), D=None, Z=None)
    cot = _cotangents(base, 3, final_grads=True)
    got = _grads(lambda **kw: _kernel(**kw, chunk_size=64), _leaves(base, F32), cot)
    want = _grads(_reference(F64), _leaves(base, F64), cot)
    assert set(got) == {"Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles"}
    for name, g in got.items():
        assert_close_to_ref(g, want[name], atol=2e-4, rtol=1e-4, name=f"d{name}")


def test_directional_derivative_of_the_kernels():
    """The backward against the forward kernels themselves: <grad, v> == (f(x + eps v) - f(x - eps v)) / 2 eps
    for a random direction v over every input at once (fp32, central differences; the gradcheck of a
    float32-only op). Catches a backward consistent with the reference but not with the forward."""
    base = make_inputs(batch=2, seqlen=7, nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=5, dtype=F64)
    cot = _cotangents(base, 6, final_grads=True)
    inp = _leaves(base, F32)
    g = _grads(lambda **kw: _kernel(**kw, chunk_size=4), inp, cot)
    gen = torch.Generator().manual_seed(7)
    dirs = {n: torch.randn(t.shape, generator=gen, dtype=F64) for n, t in _flat(inp)}
    predicted = sum((g[n].double() * dirs[n]).sum() for n in dirs).item()

    def value(sign, eps=1e-3):
        moved = {k: (v.detach().double() + sign * eps * dirs[k]).float() if isinstance(v, torch.Tensor) else v
                 for k, v in inp.items() if k != "Input_States"}
        moved["Input_States"] = tuple((t.detach().double() + sign * eps * dirs[n]).float()
                                      for n, t in zip(STATE_NAMES, inp["Input_States"]))
        with torch.no_grad():
            outs = _kernel(**moved, chunk_size=4)
        return sum((o.double() * c).sum() for o, c in zip(outs, cot) if c is not None).item()

    numeric = (value(1) - value(-1)) / 2e-3
    assert abs(numeric - predicted) <= 2e-3 * max(1.0, abs(predicted)), (numeric, predicted)


def test_bwd_op_schema_fake_and_autograd_registration():
    base = make_inputs(batch=2, seqlen=6, nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=2, dtype=F32)
    a, ssm, k, v = base["Input_States"]
    args = (base["Q"], base["K"], base["V"], base["ADT"], base["DT"], base["Trap"], base["Q_bias"], base["K_bias"],
            base["Angles"], base["D"], base["Z"], a, ssm, k, v, 4)
    out = mamba3_siso_fwd_op(*args)
    cot = [torch.randn_like(t) for t in out[:4]]
    torch.library.opcheck(mamba3_siso_bwd_op, (*cot, *args[:-1], out[4], 4),
                          test_utils=("test_schema", "test_faketensor"))
    grad_args = tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in args)
    torch.library.opcheck(mamba3_siso_fwd_op, grad_args, test_utils=("test_autograd_registration",))


def test_only_some_inputs_require_grad():
    """V alone requiring grad: its gradient equals the one from the all-inputs call; the others stay None."""
    base = make_inputs(batch=1, seqlen=6, nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=9, dtype=F32)
    v = base["V"].clone().requires_grad_()
    out = mamba3_siso_combined(**dict(base, V=v), chunk_size=4)
    out.backward(torch.ones_like(out))
    every = _leaves(base, F32)
    _kernel(**every, chunk_size=4)[0].sum().backward()
    assert torch.equal(v.grad, every["V"].grad)
    assert base["Q"].grad is None


def test_torch_compile_forward_and_backward_fullgraph():
    """torch.compile(fullgraph=True) of a loss over out and the final states, and its backward (the fake
    implementations of both ops trace): the same values and gradients as eager."""
    base = make_inputs(batch=2, seqlen=6, nheads_qk=1, nheads=4, N=8, P=4, S=2, seed=3, dtype=F32)

    def loss(**kw):
        out, angle, ssm, k, v = mamba3_siso_combined(**kw, chunk_size=4, return_final_states=True)
        return out.square().sum() + angle.sum() + ssm.sum() + k.sum() + v.sum()

    eager, compiled = _leaves(base, F32), _leaves(base, F32)
    want = loss(**eager)
    got = torch.compile(loss, fullgraph=True)(**compiled)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # inductor sums in its own order
    for (name, a), (_, b) in zip(_flat(compiled), _flat(eager)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=name)
