"""Mamba3 (SISO) on the TVM kernels against the block composed from the float64 references
(tvm_mamba.reference.blocks.mamba3_ref): names / shapes / init, forward in fp32 and bf16, prefill + decode ==
forward, state_dict round trip, the LM and generate with a Mamba3 layer, bad arguments, training (every parameter's
and the input's gradient against autograd of the reference) and the decode step's no-grad error; with
$TVM_MAMBA_UPSTREAM_DIR, upstream's own modules/mamba3.py (every kernel it imports resolving to tvm_mamba's)
has the same parameters and, loaded with the same weights, the same forward, and its own prefill + ``step``
(apply_rotary_qk_inference_fwd, then mamba3_step_fn) decodes as tvm_mamba's Mamba3 does."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_close_to_ref
from tvm_mamba.modules.generation import InferenceParams
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel
from tvm_mamba.modules.mamba3 import Mamba3
from tvm_mamba.reference.blocks import lm_ref, mamba3_ref

# d_inner 64, nheads 4, num_rope_angles 4 (rope 0.5) / 8 (rope 1.0), chunk 8: seqlen 12 = a ragged 2nd chunk
D_MODEL, BATCH, SEQLEN = 32, 2, 12
CFG = dict(d_state=16, headdim=16, chunk_size=8)
# GQA (2 groups of 2 heads), all of d_state rotated, the gated norm after the kernel instead of the z gate
CFG2 = dict(CFG, ngroups=2, rope_fraction=1.0, is_outproj_norm=True)
# MIMO: rank 2, chunks of 4 steps; rank 3 with GQA, full rotary and the per-rank gated norm
MIMO = dict(CFG, is_mimo=True, mimo_rank=2, chunk_size=4)
MIMO2 = dict(CFG2, is_mimo=True, mimo_rank=3, chunk_size=4)
CFGS, IDS = [CFG, CFG2, MIMO, MIMO2], ["siso", "gqa_norm", "mimo", "mimo_gqa_norm"]
F32, BF16 = torch.float32, torch.bfloat16

# upstream Mamba3(d_model=32, d_state=16, headdim=16).state_dict(): d_in_proj = 2*64 + 2*16 + 3*4 + 4 = 176
EXPECTED_STATE_DICT = [
    ("dt_bias", (4,)), ("B_bias", (4, 1, 16)), ("C_bias", (4, 1, 16)), ("D", (4,)), ("in_proj.weight", (176, 32)),
    ("B_norm.weight", (16,)), ("C_norm.weight", (16,)), ("out_proj.weight", (32, 64)),
]


def _block(seed=0, cfg=CFG, dtype=None, **kw):
    """A block with every parameter away from its init (biases, norm weights, D), so each one matters."""
    torch.manual_seed(seed)
    m = Mamba3(D_MODEL, **cfg, dtype=dtype, **kw)
    with torch.no_grad():
        for p in (m.B_bias, m.C_bias, m.D, m.B_norm.weight, m.C_norm.weight) + \
                ((m.norm.weight,) if m.is_outproj_norm else ()) + \
                ((m.mimo_x, m.mimo_z, m.mimo_o) if m.is_mimo else ()):
            p.uniform_(0.5, 1.5)
    return m


def _input(batch=BATCH, seqlen=SEQLEN, seed=1, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, D_MODEL, generator=g).to(dtype)


def _ref(m, u, dtype=torch.float64, **kw):
    """mamba3_ref on the block's parameters and u, both in ``dtype``."""
    p = {k: v.detach().to(dtype) for k, v in m.named_parameters()}
    return mamba3_ref(p, u.to(dtype), headdim=m.headdim, d_state=m.d_state, ngroups=m.num_bc_heads,
                      num_rope_angles=m.num_rope_angles, A_floor=m.A_floor, is_outproj_norm=m.is_outproj_norm, **kw)


def test_state_dict_names_and_shapes_and_init():
    m = Mamba3(D_MODEL, **CFG)
    assert [(k, tuple(v.shape)) for k, v in m.state_dict().items()] == EXPECTED_STATE_DICT
    assert m.num_rope_angles == 4 and m.nheads == 4 and m.mimo_rank == 1
    dt = F.softplus(m.dt_bias.double())
    assert dt.min() >= 0.001 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    for name in ("B_bias", "C_bias", "D", "B_norm.weight", "C_norm.weight"):
        assert torch.equal(m.state_dict()[name], torch.ones_like(m.state_dict()[name])), name
    sd = Mamba3(D_MODEL, **CFG2, dtype=BF16).state_dict()  # 2 groups, S = 8: 2*64 + 2*2*16 + 12 + 8 = 212
    assert tuple(sd["in_proj.weight"].shape) == (212, 32) and tuple(sd["norm.weight"].shape) == (64,)
    assert sd["in_proj.weight"].dtype == BF16 and sd["dt_bias"].dtype == sd["B_bias"].dtype == F32  # as upstream
    assert Mamba3(D_MODEL, d_state=10, headdim=16).num_rope_angles == 2  # floor(10 / 2) = 5 -> even 4 -> 2 pairs


def test_mimo_state_dict_names_shapes_and_init():
    """is_mimo (upstream's order and init): B / C biases (nheads, R, d_state), mimo_x / mimo_o = 1 / R and
    mimo_z = 1 (nheads, R, headdim) float32; in_proj 2*64 + 2*2*16 + 3*4 + 4 = 176 + 32 = 208 rows (R = 2)."""
    m = Mamba3(D_MODEL, **MIMO)
    shapes = [(k, tuple(v.shape)) for k, v in m.state_dict().items()]
    assert shapes == [("dt_bias", (4,)), ("B_bias", (4, 2, 16)), ("C_bias", (4, 2, 16)), ("mimo_x", (4, 2, 16)),
                      ("mimo_z", (4, 2, 16)), ("mimo_o", (4, 2, 16)), ("D", (4,)), ("in_proj.weight", (208, 32)),
                      ("B_norm.weight", (16,)), ("C_norm.weight", (16,)), ("out_proj.weight", (32, 64))]
    assert m.mimo_rank == 2 and torch.equal(m.mimo_x, torch.full((4, 2, 16), 0.5))
    assert torch.equal(m.mimo_z, torch.ones(4, 2, 16)) and torch.equal(m.mimo_o, m.mimo_x)
    assert Mamba3(D_MODEL, **dict(MIMO, is_mimo=False)).mimo_rank == 1  # upstream: R = 1 without MIMO


@torch.no_grad()
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_forward_matches_reference(cfg, dtype):
    m = _block(cfg=cfg, dtype=dtype)
    u = _input(dtype=dtype)
    out = m(u)
    assert out.dtype == dtype and out.shape == u.shape
    low = _ref(m, u, dtype) if dtype != F32 else None  # mamba_ssm's rule: 2 * err(bf16 reference) + atol
    assert_close_to_ref(out, _ref(m, u), low, atol=1e-4 if dtype == F32 else None, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_prefill_then_step_equals_forward(cfg):
    """Prefill 7 tokens through inference_params (the cache gets the reference's final states), then 5 steps
    through forward(inference_params) and step() (upstream's (batch, d_model) form too) == one forward."""
    m = _block(cfg=cfg, layer_idx=0)
    u = _input()
    full = m(u)
    params = InferenceParams(max_seqlen=SEQLEN, max_batch_size=BATCH + 1)
    params.key_value_memory_dict[0] = m.allocate_inference_cache(BATCH + 1, SEQLEN)  # a larger cache: rows :batch
    outs = [m(u[:, :7], inference_params=params)]
    states = params.key_value_memory_dict[0]
    _, want = _ref(m, u[:, :7], return_final_states=True)
    k = states[2] if m.is_mimo else states[2][:, 0]
    for name, got, ref in zip(("angle", "ssm", "k", "v"), (states[0], states[1], k, states[3]), want):
        assert_close_to_ref(got[:BATCH], ref, atol=1e-5, rtol=1e-5, name=name)
    assert not states[1][BATCH:].any()
    params.seqlen_offset = 7
    for t in range(7, SEQLEN):
        if t % 2:
            outs.append(m(u[:, t:t + 1], inference_params=params))
        else:
            out, *new = m.step(u[:, t], *states)
            assert out.shape == (BATCH, D_MODEL) and all(a is b for a, b in zip(new, states))
            outs.append(out[:, None])
        params.seqlen_offset += 1
    assert_close_to_ref(torch.cat(outs, 1), full, atol=2e-5, rtol=2e-5, name="prefill + steps")
    assert_close_to_ref(torch.cat(outs, 1), _ref(m, u), atol=1e-4, name="vs the float64 reference")


@torch.no_grad()
def test_bf16_step_and_cache_layout():
    """A bf16 block: upstream's cache layout and dtypes (angle, ssm float32; k, v in the model dtype); 3 bf16
    steps after a bf16 prefill stay within mamba_ssm's rule of the float64 reference."""
    m = _block(dtype=BF16, layer_idx=0)
    angle, ssm, k, v = m.allocate_inference_cache(BATCH, SEQLEN)
    assert (angle.shape, ssm.shape, k.shape, v.shape) == ((2, 4, 4), (2, 4, 16, 16), (2, 1, 4, 16), (2, 4, 16))
    assert (angle.dtype, ssm.dtype, k.dtype, v.dtype) == (F32, F32, BF16, BF16)
    u = _input(dtype=BF16)
    params = InferenceParams(max_seqlen=SEQLEN, max_batch_size=BATCH)
    outs = [m(u[:, :9], inference_params=params)]
    params.seqlen_offset = 9
    outs += [m.step(u[:, t:t + 1], *params.key_value_memory_dict[0])[0] for t in range(9, SEQLEN)]
    assert_close_to_ref(torch.cat(outs, 1), _ref(m, u), _ref(m, u, BF16), name="bf16 prefill + steps")


@torch.no_grad()
def test_state_dict_round_trip():
    a, b = _block(seed=0, cfg=CFG2), Mamba3(D_MODEL, **CFG2)
    b.load_state_dict(a.state_dict(), strict=True)
    u = _input()
    torch.testing.assert_close(b(u), a(u), rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [CFG, MIMO], ids=["siso", "mimo"])
def test_lm_generate_with_mamba3_layers(cfg):
    """A 2-layer LM of Mamba3 mixers: logits == lm_ref over mamba3_ref (float64), and generate's
    per-token scores (prefill, then one step per token) == the logits of one forward over the sequence."""
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=D_MODEL, n_layer=2, vocab_size=50, ssm_cfg=dict(layer="Mamba3", **cfg))
    model = MambaLMHeadModel(cfg).eval()
    assert isinstance(model.backbone.layers[1].mixer, Mamba3) and model.backbone.layers[1].mixer.layer_idx == 1
    ids = torch.randint(0, 50, (BATCH, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_length=9, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.shape == (BATCH, 9) and len(out.scores) == 4
    with torch.no_grad():
        logits = model(out.sequences).logits
        p = {k: v.detach().double() for k, v in model.state_dict().items()}
        mixer = lambda q, h: mamba3_ref(q, h, headdim=16, d_state=16, num_rope_angles=4)  # noqa: E731
        ref = lm_ref(p, out.sequences, mixer, n_layer=2)
    assert_close_to_ref(logits, ref, atol=1e-4, rtol=1e-4, name="logits")
    assert_close_to_ref(torch.stack(out.scores, 1), logits[:, 4:8], atol=1e-4, rtol=1e-4, name="generate scores")
    assert torch.equal(out.sequences[:, 5:], logits[:, 4:8].argmax(-1))  # greedy


@pytest.mark.parametrize("kw, err, match", [
    (dict(rope_fraction=0.25), ValueError, "rope_fraction"),
    (dict(d_state=15), ValueError, "d_state"),
    (dict(d_state=2), ValueError, "d_state"),  # rope 0.5 of 2 leaves no rotary pair
    (dict(headdim=24), ValueError, "headdim"),
    (dict(ngroups=3), ValueError, "ngroups"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(d_conv=4), TypeError, "d_conv"),
    (dict(is_mimo=True, mimo_rank=0), ValueError, "mimo_rank"),
])
def test_bad_arguments(kw, err, match):
    with pytest.raises(err, match=match):
        Mamba3(D_MODEL, **{**CFG, **kw})


@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_training_gradients_match_reference(cfg):
    """forward + backward in fp32: the input's and every parameter's gradient == autograd of the float64
    block reference (the chunked scan's backward kernels, the norms', the projections')."""
    m = _block(cfg=cfg)
    u = _input().requires_grad_()
    g = torch.randn(u.shape, generator=torch.Generator().manual_seed(3))
    m(u).backward(g)
    p64 = {k: v.detach().double().requires_grad_() for k, v in m.named_parameters()}
    u64 = u.detach().double().requires_grad_()
    ref = mamba3_ref(p64, u64, headdim=m.headdim, d_state=m.d_state, ngroups=m.num_bc_heads,
                     num_rope_angles=m.num_rope_angles, A_floor=m.A_floor, is_outproj_norm=m.is_outproj_norm)
    ref.backward(g.double())
    assert_close_to_ref(u.grad, u64.grad, atol=1e-4, rtol=1e-3, name="du")
    for name, p in m.named_parameters():
        want = p64[name].grad
        assert_close_to_ref(p.grad, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-3, name=name)


def test_bad_inputs_and_step_needs_no_grad():
    m = _block(layer_idx=0)
    u = _input()
    states = m.allocate_inference_cache(BATCH, SEQLEN)
    with pytest.raises(NotImplementedError, match=r"Mamba3.step: the decode step has no backward"):
        m.step(u[:, :1], *states)  # parameters require grad, grad mode on: refused, never silently detached
    with torch.no_grad():
        with pytest.raises(ValueError, match="u: expected"):
            m(u[..., :16])
        with pytest.raises(ValueError, match="cu_seqlens"):
            m(u[:1], cu_seqlens=torch.tensor([0, 5, SEQLEN - 1], dtype=torch.int32))
        with pytest.raises(ValueError, match="seq_idx: must be nondecreasing"):
            m(u, seq_idx=torch.tensor([[0] * 6 + [1] * 5 + [0]] * BATCH, dtype=torch.int32)[:, :SEQLEN])
        with pytest.raises(ValueError, match="seq_idx: not with inference_params"):
            m(u, seq_idx=torch.zeros(BATCH, SEQLEN, dtype=torch.int32),
              inference_params=InferenceParams(max_seqlen=SEQLEN, max_batch_size=BATCH))
        with pytest.raises(ValueError, match="ssm_state"):
            m.step(u[:, :1], states[0], states[1][..., :8], states[2], states[3])
        with pytest.raises(ValueError, match="k_state: allocated for batch 1"):
            m.step(u[:, :1], states[0], states[1], states[2][:1], states[3])
        with pytest.raises(ValueError, match="step"):
            m.step(u[:, :2], *states)
    m.requires_grad_(False)
    assert m.step(u[:, :1], *states)[0].shape == (BATCH, 1, D_MODEL)  # frozen parameters: nothing to differentiate


@pytest.mark.parametrize("cfg", [CFG, MIMO], ids=["siso", "mimo"])
def test_seq_idx_equals_separate_calls(cfg):
    """seq_idx alone (batch 2: row 0 holds sequences of 5 and 7 tokens, row 1 one of 12) == each sequence run
    alone, out and the input's gradient."""
    m = _block(cfg=cfg)
    u = _input().requires_grad_()
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [4] * SEQLEN], dtype=torch.int32)
    g = torch.randn(u.shape, generator=torch.Generator().manual_seed(5))
    out = m(u, seq_idx=seq_idx)
    (du,) = torch.autograd.grad(out, u, g)
    parts = [(0, slice(0, 5)), (0, slice(5, SEQLEN)), (1, slice(0, SEQLEN))]
    for row, t in parts:
        piece = u[row:row + 1, t].detach().requires_grad_()
        want = m(piece)
        (dwant,) = torch.autograd.grad(want, piece, g[row:row + 1, t])
        torch.testing.assert_close(out[row:row + 1, t], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(du[row:row + 1, t], dwant, rtol=1e-5, atol=1e-6)


def test_packed_sequences_equal_separate_calls():
    """cu_seqlens: two sequences (5 and 7 tokens) packed in one row == each run alone, out and the prefill's
    cache states (rows :2 of a 3-row cache; the third untouched); and gradients flow (training on packed
    sequences) equal to the separate calls'."""
    m = _block(layer_idx=0)
    u = _input(batch=1).requires_grad_()
    cu = torch.tensor([0, 5, SEQLEN], dtype=torch.int32)
    out = m(u, cu_seqlens=cu)
    parts = torch.cat([m(u[:, :5]), m(u[:, 5:])], dim=1)
    assert_close_to_ref(out, parts.detach(), atol=1e-5, rtol=1e-5, name="packed out")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (du,) = torch.autograd.grad(out, u, g)
    (du_parts,) = torch.autograd.grad(parts, u, g)
    assert_close_to_ref(du, du_parts, atol=1e-5, rtol=1e-5, name="packed du")
    with torch.no_grad():
        cache = m.allocate_inference_cache(3, SEQLEN)
        m(u, cu_seqlens=cu, inference_params=_params(m, cache, batch=2))
        for i, (lo, hi) in enumerate(((0, 5), (5, SEQLEN))):
            alone = m.allocate_inference_cache(1, SEQLEN)
            m(u[:, lo:hi], inference_params=_params(m, alone, batch=1))
            for name, got, want in zip(("angle", "ssm", "k", "v"), cache, alone):
                assert_close_to_ref(got[i:i + 1], want, atol=1e-5, rtol=1e-5, name=f"{name} state {i}")
        assert all(not c[2].any() for c in cache)


def _params(m, cache, batch):
    params = InferenceParams(max_seqlen=SEQLEN, max_batch_size=batch)
    params.key_value_memory_dict[m.layer_idx] = cache
    return params


@pytest.fixture(scope="module")
def upstream_mamba3(tmp_path_factory):
    """upstream's modules/mamba3.py, imported from the sdist through compat.install(upstream=...): its SISO and
    MIMO kernels (mamba3_siso_combined, mamba3_mimo), its decode step's apply_rotary_qk_inference_fwd and
    mamba3_step_fn, and RMSNorm are tvm_mamba's."""
    pytest.importorskip("einops")
    from tests.test_upstream_modules import _upstream_source
    from tvm_mamba import compat

    src = _upstream_source(tmp_path_factory)
    compat.install(upstream=src)
    try:
        import mamba_ssm.modules.mamba3 as upstream_module
        yield upstream_module
    finally:
        compat.uninstall()


@torch.no_grad()
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_matches_upstream_module(upstream_mamba3, cfg):
    """MIMO too: upstream's module imports mamba_ssm.ops.tilelang.mamba3.mamba3_mimo, which is tvm_mamba's."""
    import tvm_mamba

    assert upstream_mamba3.mamba3_siso_combined is tvm_mamba.mamba3_siso_combined
    assert upstream_mamba3.mamba3_mimo_combined is tvm_mamba.mamba3_mimo
    torch.manual_seed(3)
    theirs = upstream_mamba3.Mamba3(D_MODEL, **cfg)
    ours = Mamba3(D_MODEL, **cfg)
    assert [(k, v.shape, v.dtype) for k, v in theirs.state_dict().items()] == \
        [(k, v.shape, v.dtype) for k, v in ours.state_dict().items()]
    ours.load_state_dict(_block(seed=4, cfg=cfg).state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    u = _input()
    torch.testing.assert_close(ours(u), theirs(u), rtol=1e-6, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_upstream_module_prefill_then_step(upstream_mamba3, cfg):
    """UPSTREAM's Mamba3 decodes on tvm_mamba: prefill 7 tokens through forward(inference_params), then 5 of its
    own ``step`` calls (apply_rotary_qk_inference_fwd, mamba3_step_fn: tvm_mamba's kernels); outputs == one
    forward of tvm_mamba's Mamba3 with the same weights and the float64 reference, final states == tvm_mamba's
    own step's (the angle compared as cos / sin: upstream's rotary pass does not reduce it mod 2 pi). ngroups 1:
    upstream's step broadcasts B / C from one group to every head (``expand``), which fails for more groups."""
    from tvm_mamba.torch_ops.mamba3_step_parts import apply_rotary_qk_inference_fwd, mamba3_step_fn

    assert upstream_mamba3.apply_rotary_qk_inference_fwd is apply_rotary_qk_inference_fwd
    assert upstream_mamba3.mamba3_step_fn is mamba3_step_fn
    cfg = dict(cfg, ngroups=1)
    ours = _block(seed=4, cfg=cfg, layer_idx=0)
    theirs = upstream_mamba3.Mamba3(D_MODEL, **cfg, layer_idx=0)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    u = _input()
    caches = []
    outs = {}
    for name, m in (("upstream", theirs), ("ours", ours)):
        params = InferenceParams(max_seqlen=SEQLEN, max_batch_size=BATCH)
        outs[name] = [m(u[:, :7], inference_params=params)]
        cache = params.key_value_memory_dict[0]
        for t in range(7, SEQLEN):
            out, *new = m.step(u[:, t], *cache)
            assert out.shape == (BATCH, D_MODEL)
            outs[name].append(out[:, None])
        caches.append(cache)
    got = torch.cat(outs["upstream"], 1)
    assert_close_to_ref(got, torch.cat(outs["ours"], 1), atol=1e-5, rtol=1e-5, name="upstream step vs ours")
    assert_close_to_ref(got, ours(u), atol=2e-5, rtol=2e-5, name="upstream prefill + steps vs one forward")
    assert_close_to_ref(got, _ref(ours, u), atol=1e-4, name="vs the float64 reference")
    (ta, *theirs_st), (oa, *ours_st) = caches
    for name, a, b in zip(("ssm", "k", "v"), theirs_st, ours_st):
        assert_close_to_ref(a, b, atol=1e-5, rtol=1e-5, name=f"{name} state")
    for f in (torch.cos, torch.sin):
        torch.testing.assert_close(f(ta), f(oa), atol=1e-5, rtol=0)
