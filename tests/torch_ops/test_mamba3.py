"""mamba3_siso_step (the TVM decode-step kernel on the CPU) against the float64 reference: fp32, bf16 (what
Mamba3's inference cache holds: bf16 activations, bf16 K / V states) and float64; GQA, partial and full
rotary; several steps chained through the returned states == the sequence reference; bad input errors."""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.compute.test_mamba3_ref import make_inputs, step_inputs, with_changes
from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref, mamba3_siso_step_ref
from tvm_mamba.runtime.dispatch import record_keys
from tvm_mamba.torch_ops.mamba3 import mamba3_siso_step, mamba3_siso_step_op

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
ACT = ("Q", "K", "V", "Z")  # activations: in the call's dtype; the rest stays float32 (as upstream's module)


def _cast(step: dict, states, dtype):
    """The call's arguments: activations and K / V states in ``dtype``, the rest float32 (float64 call: all)."""
    rest = F64 if dtype == F64 else F32
    args = {k: v.to(dtype if k in ACT else rest) for k, v in step.items()}
    angle, ssm, k, v = states
    return args, [angle.to(rest), ssm.to(rest), k.to(dtype), v.to(dtype)]


@pytest.mark.parametrize("dtype", [F32, BF16, F64])
@pytest.mark.parametrize("nheads_qk, nheads, N, P, S", [(1, 4, 8, 4, 2), (2, 4, 16, 8, 8), (3, 3, 6, 2, 1),
                                                   (1, 4, 128, 32, 32)])  # 3 x 4 x 32 x 128 > SERIAL_WORK: the pool
def test_step_matches_reference(dtype, nheads_qk, nheads, N, P, S):
    inp = make_inputs(batch=3, seqlen=2, nheads_qk=nheads_qk, nheads=nheads, N=N, P=P, S=S, seed=N + S)
    args, states = _cast(step_inputs(inp, 1), inp["Input_States"], dtype)
    with record_keys() as used:
        out, new = mamba3_siso_step(**args, Input_States=states)
    assert [(k.op, k.direction, k.target.startswith("llvm")) for k, _ in used] == [("mamba3", "siso_step", True)]
    ref, ref_states = mamba3_siso_step_ref(**args, Input_States=states)  # float64 math on the call's inputs
    assert out.dtype == dtype and [s.dtype for s in new[:3]] == [F64 if dtype == F64 else F32] * 3
    assert new[3] is args["V"]
    if dtype == BF16:
        low, low_states = mamba3_siso_step_ref(**args, Input_States=states, dtype=BF16)
        assert_close_to_ref(out, ref, low, name="out")
        for name, got, r, lo in zip(("angle", "ssm", "k"), new, ref_states, low_states):
            assert_close_to_ref(got, r, lo, atol=1e-4, name=name)
    else:
        tol = 1e-12 if dtype == F64 else 1e-5
        for name, got, r in zip(("out", "angle", "ssm", "k"), (out, *new[:3]), (ref, *ref_states[:3])):
            assert_close_to_ref(got, r, atol=tol, rtol=tol, name=name)


@pytest.mark.parametrize("has_D, has_z", [(False, False), (True, False), (False, True)])
def test_optional_D_Z_and_zero_states(has_D, has_z):
    inp = make_inputs(batch=2, seqlen=1, S=2, dtype=F32)
    step = step_inputs(inp, 0)
    step.update(D=step["D"] if has_D else None, Z=step["Z"] if has_z else None)
    out, new = mamba3_siso_step(**step)  # Input_States None: zeros
    zeros = [torch.zeros_like(s) for s in inp["Input_States"]]
    ref, ref_states = mamba3_siso_step_ref(**step, Input_States=zeros)
    assert_close_to_ref(out, ref, atol=1e-5, rtol=1e-5)
    assert_close_to_ref(new[1], ref_states[1], atol=1e-5, rtol=1e-5)


def test_decode_loop_equals_sequence_reference():
    """Eight steps fed their own returned states (fp32 angle / ssm / k, V as the v state) == the sequence
    reference with the same input states, outputs and final states."""
    inp = make_inputs(batch=2, seqlen=8, nheads_qk=1, nheads=2, N=8, P=4, S=2, dtype=F32)
    ref, *ref_final = mamba3_siso_combined_ref(**inp, return_final_states=True)
    states, outs = list(inp["Input_States"]), []
    for t in range(8):
        out, states = mamba3_siso_step(**step_inputs(inp, t), Input_States=states)
        outs.append(out)
    assert_close_to_ref(torch.stack(outs, dim=1), ref, atol=1e-4, rtol=1e-4)
    for got, r in zip(states, ref_final):
        assert_close_to_ref(got, r, atol=1e-4, rtol=1e-4)


def test_inputs_untouched_and_public_name():
    inp = make_inputs(batch=1, seqlen=1, dtype=F32)
    states = [s.clone() for s in inp["Input_States"]]
    tvm_mamba.mamba3_siso_step(**step_inputs(inp, 0), Input_States=states)
    for a, b in zip(states, inp["Input_States"]):
        assert torch.equal(a, b)
    assert tvm_mamba.mamba3_siso_step is mamba3_siso_step


def test_fake_and_schema():
    inp = make_inputs(batch=2, seqlen=1, dtype=F32)
    s = step_inputs(inp, 0)
    a, ssm, k, v = inp["Input_States"]
    torch.library.opcheck(mamba3_siso_step_op, (s["Q"], s["K"], s["V"], s["ADT"], s["DT"], s["Trap"], s["Q_bias"],
                                                s["K_bias"], s["Angles"], s["D"], s["Z"], a, ssm, k, v),
                          test_utils=("test_schema", "test_faketensor"))


def _bad(**change):
    inp = make_inputs(batch=2, seqlen=1, nheads_qk=1, nheads=2, N=8, P=4, S=2, dtype=F32)
    return with_changes(dict(step_inputs(inp, 0), Input_States=inp["Input_States"]), change)


@pytest.mark.parametrize("change, err, name", [
    (dict(Q=torch.randn(2, 3, 8)), ValueError, "Q"),  # 3 Q/K heads do not divide 2 heads
    (dict(Q=torch.randn(2, 1, 7), K=torch.randn(2, 1, 7)), ValueError, "Q"),  # odd headdim_qk
    (dict(K=torch.randn(2, 1, 8, dtype=BF16)), TypeError, "K"),
    (dict(V=torch.randn(2, 2, 4).to(torch.int32)), TypeError, "V"),
    (dict(ADT=torch.randn(2, 3)), ValueError, "ADT"),
    (dict(Trap=[0.0]), TypeError, "Trap"),
    (dict(Q_bias=torch.randn(2, 4)), ValueError, "Q_bias"),
    (dict(Angles=torch.randn(2, 2, 5)), ValueError, "Angles"),  # > headdim_qk // 2
    (dict(D=torch.randn(3)), ValueError, "D"),
    (dict(Z=torch.randn(2, 2, 5)), ValueError, "Z"),
    (dict(state1=torch.randn(2, 2, 8, 4)), ValueError, "ssm_state"),  # (P, N) transposed
    (dict(state2=torch.randn(2, 1, 2, 8)), ValueError, "k_state"),  # the module's (batch, 1, nheads, N) cache
    (dict(Input_States=(torch.zeros(1),)), TypeError, "Input_States"),
])
def test_bad_input_names_the_argument(change, err, name):
    with pytest.raises(err, match=name):
        mamba3_siso_step(**_bad(**change))


def test_float64_needs_every_tensor_float64():
    kw = _bad()
    kw["V"] = kw["V"].double()
    with pytest.raises(TypeError, match="Q"):
        mamba3_siso_step(**kw)


def test_empty_batch():
    inp = make_inputs(batch=1, seqlen=1, dtype=F32)
    step = {k: (v[:0] if k not in ("Q_bias", "K_bias", "D") else v) for k, v in step_inputs(inp, 0).items()}
    out, new = mamba3_siso_step(**step, Input_States=[s[:0] for s in inp["Input_States"]])
    assert out.shape == (0, 2, 4) and new[1].shape == (0, 2, 4, 8)


def test_torch_compile_fullgraph():
    """The public function traces whole (checks in Python, the kernel as the custom op) and gives the eager result."""
    inp = make_inputs(batch=2, seqlen=1, dtype=F32)
    step, states = step_inputs(inp, 0), list(inp["Input_States"])
    compiled = torch.compile(lambda s, st: mamba3_siso_step(**s, Input_States=st), fullgraph=True)
    out, new = compiled(step, states)
    ref, ref_new = mamba3_siso_step(**step, Input_States=states)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(new, ref_new))
