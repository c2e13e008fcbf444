"""Mamba (mamba_simple.Mamba semantics) on the TVM kernels against the block composed from the float64
references: names/shapes/init, forward and every parameter gradient, prefill + decode, bf16 autocast,
torch.compile, bad input."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.modules._util import assert_rel_close, compare_grads, params64, weighted_loss
from tvm_mamba.modules.mamba import Mamba
from tvm_mamba.reference.blocks import mamba_ref, mamba_step_ref

D_MODEL, D_STATE, BATCH, SEQLEN = 32, 8, 2, 12  # one static config shared by all tests (one set of compiles)

# mamba_ssm 2.3.x Mamba(d_model=32, d_state=8).state_dict(): d_inner = 64, dt_rank = ceil(32/16) = 2; own
# parameters (A_log, D) come first, then the submodules in registration order.
EXPECTED_STATE_DICT = [
    ("A_log", (64, 8)), ("D", (64,)), ("in_proj.weight", (128, 32)), ("conv1d.weight", (64, 1, 4)),
    ("conv1d.bias", (64,)), ("x_proj.weight", (18, 64)), ("dt_proj.weight", (64, 2)), ("dt_proj.bias", (64,)),
    ("out_proj.weight", (32, 64)),
]


def _block(seed=0, **kw):
    torch.manual_seed(seed)
    return Mamba(D_MODEL, d_state=D_STATE, **kw)


def _input(batch=BATCH, seqlen=SEQLEN, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, D_MODEL, generator=g)


def test_state_dict_names_and_shapes():
    sd = _block().state_dict()
    assert [(k, tuple(v.shape)) for k, v in sd.items()] == EXPECTED_STATE_DICT
    sd_bias = _block(bias=True).state_dict()
    assert tuple(sd_bias["in_proj.bias"].shape) == (128,) and tuple(sd_bias["out_proj.bias"].shape) == (32,)
    assert "conv1d.bias" not in _block(conv_bias=False).state_dict()
    assert tuple(Mamba(40, d_state=4, dt_rank=5, expand=1.5).state_dict()["x_proj.weight"].shape) == (5 + 8, 60)


def test_init_matches_mamba_simple():
    m = _block(dt_min=0.002, dt_max=0.05)
    assert torch.equal(m.A_log, torch.log(torch.arange(1, D_STATE + 1, dtype=torch.float32)).repeat(64, 1))
    assert torch.equal(m.D, torch.ones(64))
    dt = F.softplus(m.dt_proj.bias.double())
    assert dt.min() >= 0.002 * (1 - 1e-5) and dt.max() <= 0.05 * (1 + 1e-5)
    bound = m.dt_rank ** -0.5
    assert m.dt_proj.weight.abs().max() <= bound and m.dt_proj.weight.abs().max() > 0.5 * bound
    assert m.dt_proj.bias._no_reinit and m.A_log._no_weight_decay and m.D._no_weight_decay
    c = _block(dt_init="constant", dt_scale=2.0)
    assert torch.allclose(c.dt_proj.weight, torch.full_like(c.dt_proj.weight, 2.0 / math.sqrt(c.dt_rank)))


def test_state_dict_round_trip():
    a, b = _block(seed=0), _block(seed=5)
    x = _input()
    assert not torch.allclose(a(x), b(x))
    b.load_state_dict(a.state_dict(), strict=True)
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


@pytest.mark.parametrize("fast", [True, False], ids=["mamba_inner_fn", "unfused"])
def test_forward_and_every_gradient_vs_reference(fast):
    m = _block(use_fast_path=fast)  # upstream's two training paths: the fused mamba_inner_fn, or conv + scan
    with torch.no_grad():  # a non-trivial D and conv bias
        m.D.uniform_(0.5, 1.5)
        m.conv1d.bias.uniform_(-0.3, 0.3)
    x = _input().requires_grad_(True)
    out = m(x)
    weighted_loss(out).backward()
    p64 = params64(m)
    x64 = x.detach().double().requires_grad_(True)
    ref = mamba_ref(p64, x64)
    weighted_loss(ref).backward()
    assert_rel_close(out, ref, 2e-5, "out")
    assert_rel_close(x.grad, x64.grad, 5e-5, "grad hidden_states")
    compare_grads(m, p64, rel=1e-4)


def test_prefill_then_decode_reproduces_forward():
    m = _block()
    x = _input(seqlen=SEQLEN)
    with torch.no_grad():
        full = m(x)
        p = 7
        out_p, conv_state, ssm_state = m(x[:, :p], return_final_states=True)
        _, conv_ref, ssm_ref = mamba_ref(params64(m), x[:, :p].double(), return_final_states=True)
        assert_rel_close(conv_state, conv_ref, 1e-6, "prefill conv_state")
        assert_rel_close(ssm_state, ssm_ref, 2e-5, "prefill ssm_state")
        cache = m.allocate_inference_cache(BATCH + 1, SEQLEN)  # a larger cache than needed: rows :batch used
        cache[0][:BATCH].copy_(conv_state)
        cache[1][:BATCH].copy_(ssm_state)
        steps = [out_p]
        for t in range(p, SEQLEN):
            o, c0, c1 = m.step(x[:, t:t + 1], *cache)
            assert c0 is cache[0] and c1 is cache[1]
            steps.append(o)
        assert_rel_close(torch.cat(steps, dim=1), full, 1e-5, "decode vs forward")
        # one step against the pure reference step
        conv_s, ssm_s = conv_state.double(), ssm_state.double()
        o_ref, conv_s, ssm_s = mamba_step_ref(params64(m), x[:, p:p + 1].double(), conv_s, ssm_s)
        assert_rel_close(steps[1], o_ref, 2e-5, "step vs reference step")


def test_prefill_shorter_than_conv_width():
    m = _block()
    x = _input(seqlen=3)
    with torch.no_grad():
        _, conv_state, ssm_state = m(x[:, :2], return_final_states=True)
        assert torch.equal(conv_state[..., :2], torch.zeros_like(conv_state[..., :2]))
        o, _, _ = m.step(x[:, 2:3], conv_state, ssm_state)
        assert_rel_close(o, m(x)[:, 2:3], 1e-5, "decode after a 2-token prompt")


def test_bf16_autocast_training_step():
    m = _block()
    x = _input()
    ref = m(x).detach()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 0.05 * ref.abs().max()
    (out.float() ** 2).mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    opt.step()


def test_torch_compile_fullgraph_matches_eager():
    # backend="aot_eager": traces forward AND backward through the custom ops' fake kernels with fullgraph
    # (no graph break allowed) without inductor's C++ codegen, which costs minutes on this 2-core machine.
    m = _block()
    x = _input()
    out_e = m(x)
    weighted_loss(out_e).backward()
    grads_e = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    out_c = compiled(x)
    weighted_loss(out_c).backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads_e[k], rtol=1e-5, atol=1e-6, msg=k)


def test_bad_inputs_name_the_argument():
    m = _block()
    with pytest.raises(ValueError, match="hidden_states.*d_model=32"):
        m(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="hidden_states.*d_model"):
        m(torch.randn(5, 32))
    with pytest.raises(TypeError, match="hidden_states"):
        m(torch.zeros(2, 5, 32, dtype=torch.int64))
    conv_state, ssm_state = m.allocate_inference_cache(2, 16)
    tok = torch.randn(2, 1, 32)
    with pytest.raises(ValueError, match="hidden_states.*one token"):
        m.step(torch.randn(2, 2, 32), conv_state, ssm_state)
    with pytest.raises(ValueError, match="conv_state: expected shape"):
        m.step(tok, conv_state[..., :3], ssm_state)
    with pytest.raises(ValueError, match="ssm_state: expected shape"):
        m.step(tok, conv_state, torch.zeros(2, 64, 4))
    with pytest.raises(TypeError, match="ssm_state: dtype"):
        m.step(tok, conv_state, ssm_state.double())
    with pytest.raises(TypeError, match="conv_state: dtype"):
        m.step(tok, conv_state.long(), ssm_state)
    with pytest.raises(ValueError, match="conv_state: allocated for batch 2, but the input has batch 3"):
        m.step(torch.randn(3, 1, 32), conv_state, ssm_state)
    assert conv_state.abs().sum() == 0 and ssm_state.abs().sum() == 0  # nothing ran
    with pytest.raises(ValueError, match="dt_init"):
        Mamba(32, dt_init="xavier")
