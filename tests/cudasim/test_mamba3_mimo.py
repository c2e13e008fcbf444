"""mamba3_mimo on the CUDA kernels, run on the CPU by the CUDA execution harness (tvm_mamba.simulate_cuda): the
MIMO chunked scan's kernels (the SISO preprocess over rank-major virtual heads, the SSD pieces over the
flattened (step, rank) positions with step_group R, their backward); out, the final states and every gradient
against the float64 reference (mirrors tests/torch_ops/test_mamba3_mimo.py)."""
from __future__ import annotations

import torch

from tests.conftest import assert_close_to_ref
from tests.torch_ops.test_mamba3_mimo import _cast, _leaves, _run, make
from tvm_mamba.reference.mamba3_mimo import mamba3_mimo_ref


def test_mimo_forward_states_and_gradients(sim):
    """R = 2, GQA 2:1 (nheads 4), half rotary, D, Z and MIMO_Out; seqlen 7 in chunks of 3 (a ragged last one)."""
    kw, div = make(R=2, nheads_qk=2, seed=11)
    got_in, ref_in = _leaves(kw, torch.float32), _leaves(kw, torch.float64)
    out, *final = _run(got_in, div, torch.float32, chunk_size=3, return_state=True)
    assert {"siso_preprocess", "chunk_scan"} <= {k.direction for k, _ in sim}
    ref, *ref_final = mamba3_mimo_ref(**_cast(kw, torch.float32), return_state=True)
    for name, a, b in zip(("out", "angle", "ssm", "k", "v"), (out, *final), (ref, *ref_final)):
        assert_close_to_ref(a, b, atol=2e-5, rtol=1e-4, name=name)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (out.double() * cot).sum().backward()
    (mamba3_mimo_ref(**ref_in) * cot).sum().backward()
    assert any(k.direction == "chunk_scan_bwd" for k, _ in sim)
    for name, t in got_in.items():
        want = ref_in[name].grad
        assert_close_to_ref(t.grad, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4, name=name)
