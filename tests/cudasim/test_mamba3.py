"""mamba3_siso_step, mamba3_mimo_step and mamba3_siso_combined on their CUDA kernels, run on the CPU by the CUDA
execution harness (tvm_mamba.simulate_cuda), against the float64 references (mirrors tests/torch_ops/test_mamba3*.py).
The steps: one thread per (batch, head, headdim_v row) lane, 128 per block: the shapes below leave the last block
partly empty. The chunked forward: the preprocess (five launches) and the four SSD pieces; the
preprocess backward against autograd of its float64 reference."""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.compute.test_mamba3_ref import make_inputs, step_inputs
from tests.conftest import assert_close_to_ref
from tvm_mamba.tools import simcheck
from tvm_mamba.tools.simcheck import ops as simcheck_ops
from tvm_mamba.compute import mamba3 as compute
from tvm_mamba.reference.mamba3 import mamba3_siso_combined_ref, mamba3_siso_step_ref
from tvm_mamba.tools.simcheck import mamba3 as sc


@pytest.mark.parametrize("nheads_qk, nheads, N, P, S", [(1, 4, 8, 4, 2), (3, 6, 6, 5, 3)])
def test_decode_loop_equals_sequence_reference(sim, nheads_qk, nheads, N, P, S):
    """Six steps chained through the returned states (fp32) == the sequence reference; 3 x 4 x 4 = 48 and
    3 x 6 x 5 = 90 lanes: one partly filled block each."""
    inp = make_inputs(batch=3, seqlen=6, nheads_qk=nheads_qk, nheads=nheads, N=N, P=P, S=S, dtype=torch.float32)
    ref, *ref_final = mamba3_siso_combined_ref(**inp, return_final_states=True)
    states, outs = list(inp["Input_States"]), []
    for t in range(6):
        out, states = tvm_mamba.mamba3_siso_step(**step_inputs(inp, t), Input_States=states)
        outs.append(out)
    assert [k.direction for k, _ in sim] == ["siso_step"]
    assert_close_to_ref(torch.stack(outs, dim=1), ref, atol=1e-4, rtol=1e-4)
    for got, want in zip(states, ref_final):
        assert_close_to_ref(got, want, atol=1e-4, rtol=1e-4)


def test_bf16_step_without_D_Z(sim):
    inp = make_inputs(batch=2, seqlen=1, nheads_qk=1, nheads=2, N=16, P=8, S=4, dtype=torch.float32)
    step = dict(step_inputs(inp, 0), D=None, Z=None)
    for k in ("Q", "K", "V"):
        step[k] = step[k].bfloat16()
    angle, ssm, kst, vst = inp["Input_States"]
    states = [angle, ssm, kst.bfloat16(), vst.bfloat16()]
    out, new = tvm_mamba.mamba3_siso_step(**step, Input_States=states)
    ref, ref_new = mamba3_siso_step_ref(**step, Input_States=states)
    low, _ = mamba3_siso_step_ref(**step, Input_States=states, dtype=torch.bfloat16)
    assert_close_to_ref(out, ref, low, name="out")
    assert_close_to_ref(new[1], ref_new[1], atol=1e-4, rtol=1e-4, name="ssm_state")


@pytest.mark.parametrize("kw", [dict(R=2, HQ=1, H=4, N=8, P=4, S=2),
                                dict(R=4, HQ=3, H=6, N=6, P=5, S=3, D=False, Z=False, outproj=False)])
def test_mimo_decode_loop_equals_sequence_reference(sim, kw):
    """mamba3_mimo_step's two launches (rotate: a thread per (batch, rank, head, pair); update: per (batch,
    head, headdim_v row), 128 per block, the last partly empty): four steps from zero states chained through
    the returned states == the float64 MIMO recurrence; rank 2 with D, Z, MIMO_Out and partial rotary; rank
    4 over 3 Q/K heads (GQA 2:1), full rotary of headdim_qk 6, R outputs."""
    from tests.torch_ops.test_mamba3_mimo_step import mimo_sequence, run_steps
    from tvm_mamba.reference.mamba3_mimo import mamba3_mimo_ref

    seq, stacked = mimo_sequence(4, **kw, batch=3)
    out, final = run_steps(seq)
    assert [k.direction for k, _ in sim] == ["mimo_step"]
    ref, *ref_final = mamba3_mimo_ref(**stacked, return_state=True)
    for name, got, want in zip(("out", "angle", "ssm", "k", "v"), (out, *final), (ref, *ref_final)):
        assert_close_to_ref(got, want, atol=1e-4, rtol=1e-4, name=name)


@pytest.mark.parametrize("dtype, states, HQ, S", [(torch.float32, True, 1, 2), (torch.bfloat16, False, 2, 4)])
def test_combined_matches_reference(sim, dtype, states, HQ, S):
    """Two chunks of 4 and a ragged third, GQA 4:1 with partial rotary and input states (fp32); bf16 without D /
    Z or states, full rotary over 2 Q/K heads (mamba_ssm's 2 * err(bf16 reference) + atol)."""
    inp = make_inputs(batch=2, seqlen=10, nheads_qk=HQ, nheads=4, N=8, P=4, S=S, states=states, dtype=torch.float32)
    if dtype == torch.bfloat16:
        inp.update({k: inp[k].to(dtype) for k in ("Q", "K", "V")}, D=None, Z=None)
    out, *final = tvm_mamba.mamba3_siso_combined(**inp, chunk_size=4, return_final_states=True)
    assert [k.direction for k, _ in sim] == ["siso_preprocess", "bmm_chunk", "chunk_state", "state_passing",
                                             "chunk_scan"]
    ref, *ref_final = mamba3_siso_combined_ref(**inp, return_final_states=True)
    if dtype == torch.bfloat16:
        low = mamba3_siso_combined_ref(**inp, dtype=dtype)
        assert_close_to_ref(out, ref, low, name="out")
    else:
        assert_close_to_ref(out, ref, atol=1e-4, rtol=1e-4, name="out")
    for name, got, want in zip(("angle", "ssm", "k"), final, ref_final):
        assert_close_to_ref(got, want, atol=1e-4, rtol=1e-4, name=name)


@pytest.mark.parametrize("static, dtypes", [
    (dict(nheads_qk=2, headdim_angles=3, has_D=True, has_init=True), {"qk": "float32", "vstate": "float32"}),
    (dict(nheads_qk=4, headdim_angles=4, has_D=False, has_init=False), {"qk": "bfloat16", "vstate": "bfloat16"})])
def test_preprocess_bwd_matches_autograd(sim, static, dtypes):
    """The preprocess backward's three launches (a thread per (batch, head), per rotary pair, per chunk):
    every gradient against torch.autograd of the float64 preprocess reference (GQA, partial rotary, input
    states; bf16 Q / K with full rotary, no states), two chunks of 4 and a ragged third."""
    static = dict(static, nheads=4, headdim_qk=8, headdim_v=4, chunk_size=4)
    res = sc.preprocess_bwd_results(static, dtypes, batch=2, seqlen=10)
    assert [k.direction for k, _ in sim] == ["siso_preprocess_bwd"]
    assert len(res) == (11 if static["has_init"] else 8)
    for name, (got, want) in res.items():
        assert_close_to_ref(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-4, name=name)


@pytest.mark.parametrize("dtypes", [{}, {"qk": "bfloat16", "vstate": "bfloat16"}])
def test_preprocess_blocks_match_reference(sim, dtypes):
    """The preprocess's register blocks at their edges, forward and backward: seqlen 37 (three rotate / pairs
    tasks of 16 steps, the last ragged, and the backward's bias-gradient parts), chunk 8 (five chunks: the skip
    pass's 8-position blocks reach the padded slots 37..39), 8 heads over 2 Q / K heads (dot blocks of 4 heads),
    3 of 4 pairs rotated (a pass-through pair per head), input states: every output against the float64
    reference (the backward's: autograd of it)."""
    static = dict(nheads=8, nheads_qk=2, headdim_qk=8, headdim_v=4, headdim_angles=3, chunk_size=8, has_D=True,
                  has_init=True)
    res = sc.preprocess_results(static, dtypes, batch=2, seqlen=37)
    res.update(sc.preprocess_bwd_results(static, dtypes, batch=2, seqlen=37))
    assert [k.direction for k, _ in sim] == ["siso_preprocess", "siso_preprocess_bwd"] and len(res) == 7 + 11
    for name, (got, want) in res.items():
        assert_close_to_ref(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-4, name=name)


def test_packed_preprocess_matches_reference(sim):
    """has_seq_idx (three packed sequences, lengths 3, 1, 3 in seqlen 7, chunk 4: a boundary inside chunk 0,
    one on chunk 1's edge): the forward's launches (per-sequence angle_out) against the float64 reference, the
    backward's against its autograd."""
    static = dict(nheads=4, nheads_qk=2, headdim_qk=8, headdim_v=4, headdim_angles=3, chunk_size=4, has_D=True,
                  has_seq_idx=True)
    seq_idx = sc.packed_seq_idx(4)
    res = sc.preprocess_results(static, {}, 1, 7, seq_idx=seq_idx)
    res.update(sc.preprocess_bwd_results(static, {}, 1, 7, seq_idx=seq_idx))
    assert [k.direction for k, _ in sim] == ["siso_preprocess", "siso_preprocess_bwd"]
    assert len(res) == 6 + 8 and res["angle_out"][0].shape == (3, 4, 3)
    for name, (got, want) in res.items():
        assert_close_to_ref(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-4, name=name)


def test_combined_backward_matches_autograd_of_reference():
    """mamba3_siso_combined's whole backward on the CUDA kernels (the forward's pieces, chunk_scan_bwd_dstates,
    state_passing_bwd, chunk_scan_bwd with diag_skip, the preprocess backward, head_sum): every gradient
    (GQA 2:1, partial rotary, input states, D and Z; random gradients of out and every final state) against
    torch.autograd of the float64 recurrence. Two chunks of 4 and a ragged third."""
    static = dict(nheads=4, nheads_qk=2, headdim_qk=8, headdim_v=4, headdim_angles=3, chunk_size=4, has_D=True,
                  has_init=True)
    res, keys = sc.backward_results(static, {"qk": "float32", "vstate": "float32"}, "sm_90")
    directions = {k.direction for k in keys}
    assert {"siso_preprocess_bwd", "chunk_scan_bwd", "state_passing_bwd", "chunk_scan_bwd_dstates",
            "head_sum"} <= directions and all(k.target.startswith("cuda") for k in keys)
    assert len(res) == 15
    for name, (got, want) in res.items():
        assert_close_to_ref(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4, name=name)


def test_packed_sequences_forward_and_backward(sim):
    """cu_seqlens (3, 6 and 2 tokens, chunk 4) on the CUDA kernels: out and the per-sequence final states against
    the float64 reference (each sequence alone), and every input's gradient for a gradient of out."""
    from tests.torch_ops.test_mamba3_varlen import CU, _cu, _packed

    inp = {k: v.requires_grad_() for k, v in _packed(torch.float32, seed=6).items()}
    out, *final = tvm_mamba.mamba3_siso_combined(**inp, chunk_size=4, return_final_states=True, cu_seqlens=_cu())
    assert {"chunk_state_varlen", "siso_preprocess"} <= {k.direction for k, _ in sim}
    ref64 = {k: v.detach().double().requires_grad_() for k, v in inp.items()}
    ref, *ref_final = mamba3_siso_combined_ref(**ref64, cu_seqlens=_cu(), return_final_states=True)
    for name, got, want in zip(("out", "angle", "ssm", "k", "v"), (out, *final), (ref, *ref_final)):
        assert_close_to_ref(got, want, atol=1e-4, rtol=1e-4, name=name)
    g = torch.randn(1, CU[-1], 4, 4, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, list(inp.values()), g)
    want = torch.autograd.grad(ref, list(ref64.values()), g.double())
    for name, a, b in zip(inp, got, want):
        assert_close_to_ref(a, b, atol=1e-4 * max(1.0, b.abs().max().item()), rtol=1e-4, name=f"d{name}")


def test_packed_sequences_with_input_states(sim):
    """cu_seqlens with per-sequence input states (3, 0 and 8 tokens, chunk 4: the left-padded batch) on the CUDA
    kernels: out, every final state and every gradient (the final ssm states' too) against the float64
    reference and autograd of it."""
    from tests.torch_ops.test_mamba3_varlen import _cu, _packed, _states

    inp = dict(_packed(torch.float32, seed=12), **dict(zip(("a", "s", "k", "v"), _states(seed=13))))
    inp = {k: v.requires_grad_() for k, v in inp.items()}
    ref64 = {k: v.detach().double().requires_grad_() for k, v in inp.items()}
    cu, outs = _cu([0, 3, 3, 11]), []
    for fn, kw in ((tvm_mamba.mamba3_siso_combined, inp), (mamba3_siso_combined_ref, ref64)):
        args = {k: v for k, v in kw.items() if k not in "askv"}
        outs.append(fn(**args, Input_States=tuple(kw[k] for k in "askv"), chunk_size=4, return_final_states=True,
                       cu_seqlens=cu))
    assert {"siso_preprocess", "chunk_scan"} <= {k.direction for k, _ in sim}
    gen = torch.Generator().manual_seed(2)
    cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs[1]]
    grads = [torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(res, cots)), list(kw.values()))
             for res, kw in zip(outs, (inp, ref64))]
    for name, got, want in zip(("out", "angle", "ssm", "k", "v"), *outs):
        assert_close_to_ref(got, want, atol=1e-4, rtol=1e-4, name=name)
    for name, a, b in zip(inp, *grads):
        assert_close_to_ref(a, b, atol=1e-4 * max(1.0, b.abs().max().item()), rtol=1e-4, name=f"d{name}")


def test_simcheck_every_config():
    """build-check's configurations (upstream's tuned shape: 32 heads, headdim_qk 128, headdim_v 64)."""
    configs = compute.build_check_configs()
    assert [c[0] for c in configs] == (["siso_step"] * 4 + ["siso_preprocess"] * 2 + ["siso_preprocess_bwd"] * 2
                                       + ["siso_preprocess", "siso_preprocess_bwd"] + ["mimo_step"] * 3
                                       + ["step_rotate"] * 2 + ["step_update"] * 3)
    for direction, static, dtypes in configs:
        simcheck_ops.run_config("mamba3", direction, static, dtypes, "sm_90")


@pytest.mark.parametrize("direction, ref_name", [("siso_step", "mamba3_siso_step_ref"),
                                                 ("siso_preprocess", "mamba3_siso_combined_ref")])
def test_simcheck_catches_a_wrong_kernel(monkeypatch, direction, ref_name):
    """The check fails when the simulated result is off: a reference with the trapezoid's left term of the
    first step (the input V state) dropped."""
    from tvm_mamba.reference import mamba3 as ref_module

    true_ref = getattr(ref_module, ref_name)

    def no_left_term(*args, **kw):
        states = list(kw.pop("Input_States"))
        states[3] = torch.zeros_like(states[3])
        return true_ref(*args, Input_States=states, **kw)

    static, dtypes = [(st, dt) for d, st, dt in compute.build_check_configs() if d == direction][0]
    small = dict(static, nheads=2, nheads_qk=1, headdim_qk=8, headdim_v=4, headdim_angles=2)
    if direction == "siso_preprocess":
        small["chunk_size"] = 4
    monkeypatch.setattr(ref_module, ref_name, no_left_term)
    with pytest.raises(simcheck.CheckFailed, match=f"mamba3.{direction}"):
        sc.check(direction, small, dtypes, "sm_90")


def test_simcheck_catches_a_wrong_backward(monkeypatch):
    """The backward's check fails when the reference differs: Trap's logits halved inside it (every gradient
    through lam changes; Trap still reaches the graph, so autograd has a gradient to give)."""
    from tvm_mamba.reference import mamba3 as ref_module

    true_ref = ref_module.mamba3_siso_preprocess_ref
    monkeypatch.setattr(ref_module, "mamba3_siso_preprocess_ref",
                        lambda *args, **kw: true_ref(*args, **dict(kw, Trap=kw["Trap"] * 0.5)))
    static, dtypes = [(st, dt) for d, st, dt in compute.build_check_configs() if d == "siso_preprocess_bwd"][0]
    small = dict(static, nheads=2, nheads_qk=1, headdim_qk=8, headdim_v=4, headdim_angles=2, chunk_size=4)
    with pytest.raises(simcheck.CheckFailed, match="mamba3.siso_preprocess_bwd"):
        sc.check("siso_preprocess_bwd", small, dtypes, "sm_90")


@torch.no_grad()
@pytest.mark.parametrize("mimo", [False, True], ids=["siso", "mimo"])
def test_mamba3_module_prefill_then_steps(sim, mimo):
    """The Mamba3 block (GQA, full rotary, the gated norm; SISO, and MIMO rank 3) on the CUDA kernels: a 9-token
    prefill through inference_params (chunked forward, ragged second chunk) then 3 decode steps == the float64
    block reference."""
    from tests.modules.test_mamba3 import CFG2, MIMO2, _block, _input, _ref
    from tvm_mamba.modules.generation import InferenceParams

    m = _block(cfg=MIMO2 if mimo else CFG2, layer_idx=0)
    u = _input()
    params = InferenceParams(max_seqlen=u.shape[1], max_batch_size=u.shape[0])
    outs = [m(u[:, :9], inference_params=params)]
    for t in range(9, u.shape[1]):
        params.seqlen_offset = t
        outs.append(m(u[:, t:t + 1], inference_params=params))
    assert {"siso_preprocess", "chunk_scan", "mimo_step" if mimo else "siso_step"} <= {k.direction for k, _ in sim}
    assert_close_to_ref(torch.cat(outs, 1), _ref(m, u), atol=1e-4, rtol=1e-4, name="prefill + steps")
