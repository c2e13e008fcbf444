"""mamba3_mimo_step (the MIMO decode-step kernel on the CPU: the SISO step's template at rank R) against the
float64 reference (reference/mamba3_mimo.py): fp32, bf16 (bf16 activations and K / V states, mamba_ssm's
2 * err(bf16 reference) + atol rule) and float64; ranks 1, 2, 4, GQA, partial (S = headdim_qk / 4) and full
(S = headdim_qk / 2) rotary, with and without D, Z, MIMO_Out, zero and given input states; steps chained through
the returned states == the sequence reference; opcheck, torch.compile, bad input errors."""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.compute.test_mamba3_ref import with_changes
from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.mamba3_mimo import mamba3_mimo_ref, mamba3_mimo_step_ref
from tvm_mamba.runtime.dispatch import record_keys
from tvm_mamba.tools.simcheck.mamba3 import mimo_step_inputs
from tvm_mamba.torch_ops.mamba3_mimo_step import mamba3_mimo_step, mamba3_mimo_step_op

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
NAMES = {F32: "float32", BF16: "bfloat16", F64: "float64"}
WEIGHTS = ("Q_bias", "K_bias", "MIMO_V", "MIMO_Z", "MIMO_Out", "D")  # shared by the steps of a sequence


def _inputs(dtype, R=2, HQ=1, H=2, N=8, P=4, S=2, batch=2, D=True, Z=True, outproj=True, seed=0):
    """(arguments, [angle, ssm, k, v] states): activations and K / V states in ``dtype``, the rest float32
    (float64 call: all float64)."""
    static = dict(nheads=H, nheads_qk=HQ, headdim_qk=N, headdim_v=P, headdim_angles=S, has_D=D, has_z=Z,
                  mimo_rank=R, has_outproj=outproj)
    low = {"kstate": NAMES[dtype]} if dtype != F64 else {}
    return mimo_step_inputs(static, {"qk": NAMES[dtype], "v": NAMES[dtype], **low}, batch, seed)


# (dtype, R, HQ, H, N, P, S, D, Z, MIMO_Out): every rank, GQA 2:1 and 4:1, partial and full rotary, each optional
CASES = [(F32, 4, 1, 4, 16, 8, 4, True, True, True), (F32, 2, 2, 4, 8, 4, 4, False, False, False),
         (F32, 1, 1, 2, 8, 4, 2, True, False, True), (BF16, 4, 1, 4, 16, 8, 4, True, True, True),
         (BF16, 2, 2, 4, 8, 4, 4, True, False, False), (F64, 2, 1, 2, 8, 4, 2, True, True, True),
         (F32, 2, 1, 4, 128, 32, 32, True, True, True)]  # 3 x 4 x 32 x 128 x 2 > SERIAL_WORK: the pool


@pytest.mark.parametrize("dtype, R, HQ, H, N, P, S, D, Z, outproj", CASES)
def test_step_matches_reference(dtype, R, HQ, H, N, P, S, D, Z, outproj):
    args, states = _inputs(dtype, R, HQ, H, N, P, S, batch=3, D=D, Z=Z, outproj=outproj, seed=N + S)
    with record_keys() as used:
        out, new = mamba3_mimo_step(**args, Input_States=states)
    assert [(k.op, k.direction, k.target.startswith("llvm")) for k, _ in used] == [("mamba3", "mimo_step", True)]
    assert dict(used[0][0].static)["mimo_rank"] == R
    ref, ref_states = mamba3_mimo_step_ref(**args, Input_States=states)
    assert out.shape == ((3, H, P) if outproj else (3, R, H, P)) and out.dtype == dtype
    assert [s.dtype for s in new[:3]] == [F64 if dtype == F64 else F32] * 3 and new[3] is args["V"]
    # bf16: against the reference's own bf16 drift (out at conftest's bf16 atol, the float32 states at 1e-4)
    low = mamba3_mimo_step_ref(**args, Input_States=states, dtype=BF16) if dtype == BF16 else None
    lows = (low[0], *low[1][:3]) if low is not None else (None,) * 4
    tol = 1e-12 if dtype == F64 else 1e-5
    for i, name in enumerate(("out", "angle", "ssm", "k")):
        atol = tol if low is None else (None if i == 0 else 1e-4)
        assert_close_to_ref((out, *new)[i], (ref, *ref_states)[i], lows[i], atol=atol, rtol=tol, name=name)


def test_zero_states_and_unused_MIMO_Z():
    """Input_States None: zeros (the k state (batch, R, nheads, headdim_qk)); without Z, MIMO_Z may be None."""
    args, states = _inputs(F32, 2, 2, 4, 8, 4, 4, D=False, Z=False, outproj=False)
    out, new = mamba3_mimo_step(**args)
    ref, ref_states = mamba3_mimo_step_ref(**args)
    assert args["MIMO_Z"] is None and new[2].shape == (2, 2, 4, 8)
    for name, got, r in zip(("out", "angle", "ssm", "k"), (out, *new[:3]), (ref, *ref_states[:3])):
        assert_close_to_ref(got, r, atol=1e-5, rtol=1e-5, name=name)


def mimo_sequence(steps: int, **kw) -> tuple[list, dict]:
    """``steps`` steps' fp32 arguments of one sequence (activations per step, weights shared; ``kw``:
    ``_inputs``' dims) and the same steps stacked in mamba3_mimo_ref's sequence layouts."""
    first, _ = _inputs(F32, **kw)
    seq = [dict(_inputs(F32, **kw, seed=t)[0], **{k: first[k] for k in WEIGHTS}) for t in range(steps)]
    time_axis = lambda k: 2 if k in ("ADT", "DT", "Trap") else 1  # noqa: E731
    stacked = {k: v if k in WEIGHTS or v is None else torch.stack([s[k] for s in seq], dim=time_axis(k))
               for k, v in first.items()}
    return seq, stacked


def run_steps(seq: list) -> tuple[torch.Tensor, list]:
    """mamba3_mimo_step over ``seq`` from zero states, each step fed the previous one's returned states ->
    (outputs stacked on a seqlen axis, final states)."""
    states, outs = None, []
    for step in seq:
        out, states = mamba3_mimo_step(**step, Input_States=states)
        outs.append(out)
    return torch.stack(outs, dim=1), states


def test_decode_loop_equals_sequence_reference():
    """Six steps from zero states fed their own returned states == the float64 sequence recurrence
    (mamba3_mimo_ref), outputs and final states."""
    seq, stacked = mimo_sequence(6, R=4, HQ=1, H=4, N=16, P=8, S=4, batch=3)
    ref, *ref_final = mamba3_mimo_ref(**stacked, return_state=True)
    out, final = run_steps(seq)
    assert_close_to_ref(out, ref, atol=1e-4, rtol=1e-4, name="out")
    for name, got, want in zip(("angle", "ssm", "k", "v"), final, ref_final):
        assert_close_to_ref(got, want, atol=1e-4, rtol=1e-4, name=name)


def test_inputs_untouched_and_public_name():
    args, states = _inputs(F32, R=4, HQ=1, H=4, N=16, P=8, S=4, batch=3)
    kept = [s.clone() for s in states]
    mamba3_mimo_step(**args, Input_States=states)
    assert all(torch.equal(a, b) for a, b in zip(states, kept))
    assert tvm_mamba.mamba3_mimo_step is mamba3_mimo_step and "mamba3_mimo_step" in tvm_mamba.__all__


def _op_args(args, states):
    return (*(args[k] for k in ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z",
                                "MIMO_Out", "Angles", "D", "Z")), *states)


@pytest.mark.parametrize("config", [dict(R=4, HQ=1, H=4, N=16, P=8, S=4),  # D, Z, MIMO_Out
                                    dict(R=2, HQ=2, H=4, N=8, P=4, S=4, D=False, Z=False, outproj=False)])
def test_fake_and_schema(config):
    args, states = _inputs(F32, **config, batch=3)
    torch.library.opcheck(mamba3_mimo_step_op, _op_args(args, states), test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph():
    """The public function traces whole (checks in Python, the kernel as the custom op) and gives the eager result."""
    args, states = _inputs(F32, R=4, HQ=1, H=4, N=16, P=8, S=4, batch=3)
    compiled = torch.compile(lambda a, st: mamba3_mimo_step(**a, Input_States=st), fullgraph=True)
    out, new = compiled(args, states)
    ref, ref_new = mamba3_mimo_step(**args, Input_States=states)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(new, ref_new))


def test_empty_batch():
    args, states = _inputs(F32, R=4, HQ=1, H=4, N=16, P=8, S=4, batch=3)
    per_row = ("Q", "K", "V", "ADT", "DT", "Trap", "Angles", "Z")
    out, new = mamba3_mimo_step(**{k: v[:0] if k in per_row else v for k, v in args.items()},
                                Input_States=[s[:0] for s in states])
    assert out.shape == (0, 4, 8) and new[2].shape == (0, 4, 4, 16)


def _bad(**change):
    """Arguments (R 2, 1 Q/K head, 2 heads, headdim_qk 8, headdim_v 4, 2 angles) with ``change`` applied (key
    ``state<i>``: Input_States[i])."""
    args, states = _inputs(F32)
    return with_changes(dict(args, Input_States=states), change)


@pytest.mark.parametrize("change, err, name", [
    (dict(Q=torch.randn(2, 1, 8)), ValueError, "Q"),  # the SISO layout: no rank axis
    (dict(Q=torch.randn(3, 2, 1, 8), K=torch.randn(3, 2, 1, 8)), ValueError, "Q"),  # batch
    (dict(K=torch.randn(2, 3, 1, 8)), ValueError, "K"),  # rank differs from Q's
    (dict(Q=torch.randn(2, 2, 3, 8), K=torch.randn(2, 2, 3, 8)), ValueError, "Q"),  # 3 Q/K heads, 2 heads
    (dict(K=torch.randn(2, 2, 1, 8, dtype=BF16)), TypeError, "K"),
    (dict(Q_bias=torch.randn(2, 8)), ValueError, "Q_bias"),  # the SISO bias layout
    (dict(K_bias=torch.randn(2, 3, 8)), ValueError, "K_bias"),
    (dict(MIMO_V=torch.randn(2, 3, 4)), ValueError, "MIMO_V"),  # rank 3 against Q's 2
    (dict(MIMO_V=None), ValueError, "MIMO_V"),
    (dict(MIMO_Z=None), ValueError, "MIMO_Z"),  # Z given
    (dict(MIMO_Out=torch.randn(2, 2, 5)), ValueError, "MIMO_Out"),
    (dict(MIMO_Out=torch.randn(2, 2, 4).to(torch.int32)), TypeError, "MIMO_Out"),
    (dict(Angles=torch.randn(2, 2, 5)), ValueError, "Angles"),  # > headdim_qk // 2
    (dict(ADT=torch.randn(2, 3)), ValueError, "ADT"),
    (dict(D=torch.randn(3)), ValueError, "D"),
    (dict(Z=torch.randn(2, 2, 5)), ValueError, "Z"),
    (dict(state1=torch.randn(2, 2, 8, 4)), ValueError, "ssm_state"),  # (P, N) transposed
    (dict(state2=torch.randn(2, 2, 8)), ValueError, "k_state"),  # the SISO K state
    (dict(state2=torch.randn(2, 3, 2, 8)), ValueError, "k_state"),
    (dict(Input_States=(torch.zeros(1),)), TypeError, "Input_States"),
])
def test_bad_input_names_the_argument(change, err, name):
    with pytest.raises(err, match=name), record_keys() as used:
        mamba3_mimo_step(**_bad(**change))
    assert not used  # refused before any kernel ran


def test_float64_needs_every_tensor_float64():
    kw = _bad()
    kw["V"] = kw["V"].double()
    with pytest.raises(TypeError, match="Q"):
        mamba3_mimo_step(**kw)
