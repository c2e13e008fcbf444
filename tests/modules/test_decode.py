"""Cached decode plans (modules/_decode.py): the planned step gives the bits of the blocks' ordinary step path,
is reused while nothing changes, and is rebuilt after a weight update or for other states."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from tvm_mamba.modules import _decode
from tvm_mamba.modules.lm import InferenceParams, MambaConfig, MambaLMHeadModel
from tvm_mamba.modules.mamba import Mamba
from tvm_mamba.modules.mamba2 import Mamba2
from tvm_mamba.torch_ops.linear import fp32_linear

D_MODEL = 32
BLOCKS = {
    "mamba": lambda: Mamba(D_MODEL, d_state=8, layer_idx=0),
    "mamba2": lambda: Mamba2(D_MODEL, d_state=16, headdim=16, layer_idx=0),
    "mamba2_groups2": lambda: Mamba2(D_MODEL, d_state=16, headdim=8, ngroups=2, layer_idx=0),
    "mamba2_Dhdim": lambda: Mamba2(D_MODEL, d_state=16, headdim=16, D_has_hdim=True, layer_idx=0),
    "mamba2_Dhdim_dtlimit": lambda: Mamba2(D_MODEL, d_state=16, headdim=16, D_has_hdim=True,
                                           dt_limit=(0.0, 0.05), layer_idx=0),
    # the tied per-head kernel with no dt_bias argument (the step clamps dt itself)
    "mamba2_dtlimit": lambda: Mamba2(D_MODEL, d_state=16, headdim=16, dt_limit=(0.0, 0.05), layer_idx=0),
}


def _block(name: str, seed: int = 0):
    torch.manual_seed(seed)
    m = BLOCKS[name]()
    with torch.no_grad():  # non-trivial D, dt_bias, norm weight: every input of the step matters
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return m


def _states(m, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    conv_state, ssm_state = m.allocate_inference_cache(batch, 16)
    conv_state.copy_(torch.randn(conv_state.shape, generator=g))
    ssm_state.copy_(torch.randn(ssm_state.shape, generator=g))
    return conv_state, ssm_state


@contextlib.contextmanager
def _no_plans():
    """The blocks' ordinary path at inference: no_grad with plans turned off (the path a step takes where no
    plan applies), so its fp32 projections run the GEMV kernel as the plan's do."""
    with mock.patch.object(_decode, "eager", lambda *args: False), torch.no_grad():
        yield


def _unplanned_steps(m, xs, conv_state, ssm_state):
    """The blocks' ordinary step path at inference (:func:`_no_plans`)."""
    outs = []
    with _no_plans():
        for x in xs:
            outs.append(m.step(x, conv_state, ssm_state)[0].clone())
    assert m not in _decode._plans
    return outs


def _autograd_steps(m, xs, conv_state, ssm_state):
    """The blocks' path under autograd (parameters that need gradients): F.linear projections, never a plan."""
    outs = []
    with torch.enable_grad():
        for x in xs:
            outs.append(m.step(x, conv_state, ssm_state)[0].detach())
    assert m not in _decode._plans
    return outs


def _planned_steps(m, xs, conv_state, ssm_state):
    outs = []
    with torch.inference_mode():
        for x in xs:
            outs.append(m.step(x, conv_state, ssm_state)[0].clone())
    return outs


def _replaying(plan) -> bool:
    stages = [v for v in vars(plan).values() if isinstance(v, _decode.Captured)]
    return bool(stages) and all(s.launches for s in stages if s.launches is not None)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_planned_step_matches_unplanned_bitwise(name, batch):
    m = _block(name)
    xs = [torch.randn(batch, 1, D_MODEL) for _ in range(4)]
    ref_states = _states(m, batch)
    ref = _unplanned_steps(m, xs, *ref_states)
    states = _states(m, batch)
    got = _planned_steps(m, xs, *states)
    plan = _decode.plan_of(m)
    assert _replaying(plan), "every kernel stage replays its captured launch"
    assert plan.in_proj.dense.op and plan.out_proj.op  # fp32 projections on the GEMV kernel
    for t, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), f"step {t}: max diff {(a - b).abs().max().item()}"
    for s, r in zip(states, ref_states):
        assert torch.equal(s, r)


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_planned_step_is_close_to_the_autograd_path(name):
    """Under autograd the projections are torch's F.linear, whose fp32 dot products add in another order than
    the GEMV kernel's: the outputs differ by rounding only (each dot's relative error is <= in_features x
    2^-24, here in_features <= 64 and 4 recurrent steps), so 1e-5 of the output's size is ample."""
    m = _block(name)
    xs = [torch.randn(2, 1, D_MODEL) for _ in range(4)]
    ref_states = _states(m, 2)
    ref = _autograd_steps(m, xs, *ref_states)
    states = _states(m, 2)
    got = _planned_steps(m, xs, *states)
    for a, b in zip(got + list(states), ref + list(ref_states)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_plan_is_reused_while_nothing_changes_and_rebuilt_for_other_states():
    m = _block("mamba2")
    states = _states(m, 2)
    with torch.inference_mode():
        m.step(torch.randn(2, 1, D_MODEL), *states)
        plan = _decode.plan_of(m)
        m.step(torch.randn(2, 1, D_MODEL), *states)
        assert _decode.plan_of(m) is plan
        other = _states(m, 2)
        m.step(torch.randn(2, 1, D_MODEL), *other)
        assert _decode.plan_of(m) is not plan
        m.step(torch.randn(2, 1, D_MODEL), *states)  # caches decoded in turn keep their plans
        assert _decode.plan_of(m) is plan
        m.step(torch.randn(1, 1, D_MODEL), *other)  # batch 1 on the batch-2 cache: rows :1, a new plan
        assert _decode.plan_of(m).ssm_state.shape[0] == 1


@pytest.mark.parametrize("name", ["mamba", "mamba2_Dhdim"])
def test_step_after_an_optimizer_update_uses_the_new_weights(name):
    m = _block(name)
    xs = [torch.randn(2, 1, D_MODEL) for _ in range(2)]
    states = _states(m, 2)
    _planned_steps(m, xs[:1], *states)
    old_plan = _decode.plan_of(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for p in m.parameters():  # every parameter moves, A_log included (A = -exp(A_log) is cached)
        p.grad = torch.randn_like(p)
    opt.step()
    ref_states = tuple(s.clone() for s in states)
    got = _planned_steps(m, xs[1:], *states)
    assert _decode.plan_of(m) is not old_plan
    _decode.forget(m)
    ref = _unplanned_steps(m, xs[1:], *ref_states)
    assert torch.equal(got[0], ref[0])
    with torch.no_grad():  # an in-place update outside an optimizer (load_state_dict copies in place too)
        m.A_log.mul_(0.5)
    got = _planned_steps(m, xs[:1], *states)
    _decode.forget(m)
    assert torch.equal(got[0], _unplanned_steps(m, xs[:1], *ref_states)[0])


@pytest.mark.parametrize("layout", ["strided", "unaligned"])
def test_conv_state_views_replay_only_when_updated_in_place(layout):
    """A strided conv_state view (every other element of a wider buffer) is updated in place by the kernel (it
    takes the pool's strides), so the plan replays it; an unaligned one is copied by the op, so the plan's
    capture refuses to replay and the step stays right through the op's own path."""
    m = _block("mamba")
    xs = [torch.randn(2, 1, D_MODEL) for _ in range(3)]
    conv_ref, ssm_ref = _states(m, 2)
    ref = _unplanned_steps(m, xs, conv_ref, ssm_ref)
    conv, ssm = _states(m, 2)
    if layout == "strided":
        view = torch.zeros(2, conv.shape[1], 2 * conv.shape[2])[..., ::2]
    else:  # 4 bytes past an aligned start
        view = torch.zeros(conv.numel() + 1)[1:].view(conv.shape)
    view.copy_(conv)
    got = _planned_steps(m, xs, view, ssm)
    assert (_decode.plan_of(m).conv.launches == []) == (layout == "unaligned")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.equal(view, conv_ref) and torch.equal(ssm, ssm_ref)


def test_parameters_without_version_counter_get_no_cached_plan():
    with torch.inference_mode():
        m = _block("mamba")  # inference tensors: an in-place update could not be seen
        states = _states(m, 1)
        m.step(torch.randn(1, 1, D_MODEL), *states)
    assert m not in _decode._plans


@pytest.mark.parametrize("batch", [1, 3])
def test_projection_parts_match_one_linear(batch):
    torch.manual_seed(0)
    w, x = torch.randn(100, 48), torch.randn(batch, 48)
    with torch.no_grad():  # the step path's projection: the GEMV kernel (fp32 inference, <= 8 rows)
        full = fp32_linear(x, w)
    layer = torch.nn.Linear(48, 100, bias=False)
    layer.weight.data.copy_(w)
    proj = _decode.Projection(layer, (16, 0, 68, 16), batch, torch.float32)
    with torch.no_grad():  # as plans run (eager inference)
        parts = proj(x)
    assert proj.dense.op and not torch.equal(full, torch.nn.functional.linear(x, w))  # ours, not torch's bits
    assert all(p.is_contiguous() and p.data_ptr() % 64 == 0 for p in parts if p.numel())
    assert torch.equal(torch.cat(parts, dim=1), full)


LM_SSM = {"mamba": dict(layer="Mamba1", d_state=8),
          "mamba2": dict(layer="Mamba2", d_state=16, headdim=16, ngroups=2, D_has_hdim=True),
          "mamba2_dtlimit": dict(layer="Mamba2", d_state=16, headdim=16, dt_limit=(0.01, 0.5))}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("layer", list(LM_SSM))
def test_lm_decode_plan_matches_blocks_path(layer, batch):
    """Every planned step's logits equal the blocks' path, bit for bit: the plan's first step (ops run and
    captured), its second (replayed, recorded as a Tape) and the later ones (the Tape's flat list replayed),
    which dt_limit's per-step softplus leaves unrecorded (then every step runs the plan's Python)."""
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=D_MODEL, n_layer=2, vocab_size=64, ssm_cfg=LM_SSM[layer]))
    ids = torch.randint(0, 64, (batch, 5))
    planned = model.generate(ids, max_length=11, return_dict_in_generate=True, output_scores=True)
    plan = _decode.plan_of(model)
    assert isinstance(plan, _decode.LMStep) and all(s.launches for s, *_ in plan.layers)
    assert (plan.program is None) == ("dt_limit" in LM_SSM[layer])

    def unplanned(step_ids, params):
        with _no_plans():
            return model(step_ids, inference_params=params, num_last_tokens=1).logits.clone()
    params = InferenceParams(max_seqlen=9, max_batch_size=batch)
    sequences = planned.sequences.clone()  # a normal tensor (generate ran in inference mode)
    logits = unplanned(ids, params)
    assert torch.equal(logits[:, -1], planned.scores[0])
    for t in range(1, len(planned.scores)):
        params.seqlen_offset = ids.shape[1] + t - 1
        logits = unplanned(sequences[:, ids.shape[1] + t - 1:ids.shape[1] + t], params)
        assert torch.equal(logits[:, -1], planned.scores[t]), f"token {t}"
    with pytest.raises(IndexError, match="input_ids"):
        with torch.inference_mode():
            model(torch.full((batch, 1), 64), inference_params=params)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
@pytest.mark.parametrize("layer", list(LM_SSM))
def test_quantized_lm_decode_plan_runs_the_linear_op(layer, dtype):
    """A quantize_weights model decodes on its plan through the linear op (no dequantized fp32 matmul):
    every planned step's logits equal the blocks' path on the same quantized model, bit for bit."""
    from tvm_mamba import quantize_weights

    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=D_MODEL, n_layer=2, vocab_size=64, ssm_cfg=LM_SSM[layer]))
    quantize_weights(model, dtype)
    ids = torch.randint(0, 64, (2, 5))
    planned = model.generate(ids, max_length=10, return_dict_in_generate=True, output_scores=True)
    plan = _decode.plan_of(model)
    assert isinstance(plan, _decode.LMStep) and plan.lm_head.quantized and plan.lm_head.call.launches
    assert (plan.program is None) == ("dt_limit" in LM_SSM[layer])  # else the later steps replayed the Tape
    assert all(mixer.out_proj.quantized and mixer.in_proj.dense.quantized for _, _, mixer, _ in plan.layers)
    params = InferenceParams(max_seqlen=8, max_batch_size=2)
    sequences = planned.sequences.clone()
    with _no_plans():  # dt_proj (Mamba) stays an fp32 layer: the GEMV kernel on both paths
        logits = model(ids, inference_params=params, num_last_tokens=1).logits.clone()
        assert torch.equal(logits[:, -1], planned.scores[0])
        for t in range(1, len(planned.scores)):
            params.seqlen_offset = ids.shape[1] + t - 1
            step = sequences[:, ids.shape[1] + t - 1:ids.shape[1] + t]
            logits = model(step, inference_params=params, num_last_tokens=1).logits.clone()
            assert torch.equal(logits[:, -1], planned.scores[t]), f"token {t}"


def test_replaced_parameter_or_submodule_rebuilds_the_plan():
    m = _block("mamba")
    xs = [torch.randn(1, 1, D_MODEL) for _ in range(2)]
    states = _states(m, 1)
    _planned_steps(m, xs[:1], *states)
    m.D = torch.nn.Parameter(m.D.detach() * 3)  # a new parameter object (load_state_dict(assign=True) does this)
    plan = _decode.plan_of(m)
    ref_states = tuple(s.clone() for s in states)
    got = _planned_steps(m, xs[1:], *states)
    assert _decode.plan_of(m) is not plan
    m.out_proj = torch.nn.Linear(m.d_inner, D_MODEL, bias=True)  # a new submodule
    plan = _decode.plan_of(m)
    got += _planned_steps(m, xs[:1], *states)
    assert _decode.plan_of(m) is not plan
    _decode.forget(m)
    ref = _unplanned_steps(m, xs[1:] + xs[:1], *ref_states)
    assert torch.equal(got[1], ref[1])
