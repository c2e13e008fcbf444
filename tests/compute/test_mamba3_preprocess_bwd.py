"""The Mamba-3 chunked forward's preprocess backward (compute/mamba3/preprocess_bwd.py) on the CPU: every
gradient it returns against torch.autograd of the float64 ``mamba3_siso_preprocess_ref`` (random upstream
gradients for every forward output; simcheck/mamba3.py ``preprocess_bwd_case``), and that reference against
the forward kernel it differentiates. Two chunks of 4 and a ragged third (seqlen 10), ADT of one position below
DA_MIN. The CUDA layout: tests/cudasim/test_mamba3.py."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.compute._mamba3_dims import PreDims
from tvm_mamba.reference.mamba3 import mamba3_siso_preprocess_ref
from tvm_mamba.simcheck.mamba3 import combined_inputs, preprocess_bwd_results
from tvm_mamba.torch_ops._dlpack import kernel_for

BASE = dict(nheads=4, headdim_qk=8, headdim_v=4, chunk_size=4)


def _check(res: dict, expected: set) -> None:
    assert set(res) == expected
    for name, (got, want) in res.items():
        assert_close_to_ref(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-4, name=name)


@pytest.mark.parametrize("static, dtypes", [
    # GQA 2:1, partial rotary (3 of 4 pairs), input states and D, fp32
    (dict(BASE, nheads_qk=2, headdim_angles=3, has_D=True, has_init=True), {"qk": "float32", "vstate": "float32"}),
    # bf16 Q / K, full rotary, no states, no D
    (dict(BASE, nheads_qk=4, headdim_angles=4, has_D=False, has_init=False), {"qk": "bfloat16", "vstate": "float32"}),
    # bf16 Q / K and K / V states (the inference cache's), one angle of 4 pairs, MQA
    (dict(BASE, nheads_qk=1, headdim_angles=1, has_D=True, has_init=True),
     {"qk": "bfloat16", "vstate": "bfloat16", "kstate": "bfloat16"}),
])
def test_kernel_matches_autograd_of_reference(static, dtypes):
    res = preprocess_bwd_results(static, dtypes, batch=2, seqlen=10)
    states = {"dangle_state", "dk_state", "dv_state"} if static["has_init"] else set()
    _check(res, {"dQh", "dKh", "dADT", "dDT", "dTrap", "dQb_part", "dKb_part", "dAngles"} | states)
    dadt, _ = res["dADT"]
    assert (dadt[:, :, 1] == 0).all() and (dadt[:, :, 0] != 0).all()  # the clamped step passes no gradient


def test_reference_matches_the_forward_kernel():
    """The reference's outputs (q, k, dA_cs with its padded slots, scale, skip, final angle, init) == the
    forward preprocess kernel's in fp32: the backward differentiates the function the forward computes."""
    static = dict(BASE, nheads_qk=2, headdim_angles=3, has_D=True, has_init=True)
    inp = combined_inputs(static, {}, batch=2, seqlen=10, has_z=False)
    inp["ADT"][..., 1] = -200.0
    (b, L, _, N), H, P, A, Qc = inp["Q"].shape, 4, 4, 3, 4
    nc = -(-L // Qc)
    outs = [torch.empty(b, L, H, N), torch.empty(b, L, H, N)] + [torch.empty(b, H, nc, Qc) for _ in range(3)]
    outs += [torch.empty(b, H, A), torch.empty(b, H, P, N)]
    kern = kernel_for("mamba3", "siso_preprocess", torch.device("cpu"), PreDims(**static), batch=b, seqlen=L)
    kern(*(inp[k] for k in ("Q", "K", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D")),
         *inp["Input_States"], *outs)
    ref = mamba3_siso_preprocess_ref(**{k: v for k, v in inp.items() if k not in ("V", "Z")}, chunk_size=Qc)
    for name, got, want in zip(("q", "k", "dA_cs", "scale", "skip", "angle_out", "init"), outs, ref):
        assert_close_to_ref(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5, name=name)
