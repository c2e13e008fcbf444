"""MambaLMHeadModel-like LM: state_dict names, vocab padding, tied head, logits and every gradient against
the LM composed from the float64 references, generate() (prefill + decode) equal to greedy decoding by
full forwards, sampling, bad input, and the training script in CI form."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.modules._util import assert_rel_close, compare_grads, params64
from tvm_mamba.modules.lm import InferenceParams, MambaConfig, MambaLMHeadModel
from tvm_mamba.reference.blocks import lm_ref, mamba2_ref, mamba_ref

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 50  # padded to 56 (multiple of 8)
# the block configs of test_mamba.py / test_mamba2.py: the same compiled kernels
M2 = dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=8)
M1 = dict(layer="Mamba1", d_state=8)


def _model(ssm_cfg=M2, seed=0, n_layer=2):
    torch.manual_seed(seed)
    return MambaLMHeadModel(MambaConfig(d_model=32, n_layer=n_layer, vocab_size=VOCAB, ssm_cfg=dict(ssm_cfg)))


def _ids(batch=2, seqlen=10, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def test_state_dict_names_padding_and_tied_head():
    m = _model()
    sd = m.state_dict()
    mixer = ["dt_bias", "A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "norm.weight",
             "out_proj.weight"]
    expected = ["backbone.embedding.weight"]
    for i in range(2):
        expected += [f"backbone.layers.{i}.norm.weight"] + [f"backbone.layers.{i}.mixer.{k}" for k in mixer]
    expected += ["backbone.norm_f.weight", "lm_head.weight"]
    assert list(sd) == expected
    assert tuple(sd["backbone.embedding.weight"].shape) == (56, 32)
    assert m.lm_head.weight is m.backbone.embedding.weight
    # upstream's init: N(0, 0.02) embedding, out_proj rescaled by 1/sqrt(n_layer)
    assert 0.015 < sd["backbone.embedding.weight"].std() < 0.025
    untied = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=1, vocab_size=VOCAB, tie_embeddings=False,
                                          pad_vocab_size_multiple=1, ssm_cfg=dict(M2)))
    assert untied.lm_head.weight is not untied.backbone.embedding.weight
    assert tuple(untied.lm_head.weight.shape) == (VOCAB, 32)
    m2 = _model(seed=3)
    m2.load_state_dict(sd, strict=True)
    ids = _ids()
    torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=0, atol=0)


def test_fused_add_norm_and_layernorm_variants():
    """fused_add_norm (one add+norm kernel) equals the unfused add then norm; rms_norm=False: upstream's
    torch.nn.LayerNorm parameters (norm.weight and norm.bias) on the layer_norm kernel."""
    ids = _ids()
    for rms in (True, False):
        torch.manual_seed(0)
        fused = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB, ssm_cfg=dict(M2), rms_norm=rms))
        torch.manual_seed(0)
        plain = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB, ssm_cfg=dict(M2), rms_norm=rms,
                                             fused_add_norm=False))
        plain.load_state_dict(fused.state_dict(), strict=True)
        assert_rel_close(plain(ids).logits, fused(ids).logits.double(), 1e-5, f"fused_add_norm rms_norm={rms}")
    assert "backbone.layers.0.norm.bias" in fused.state_dict() and "backbone.norm_f.bias" in fused.state_dict()
    assert isinstance(fused.backbone.norm_f, torch.nn.LayerNorm)


@pytest.mark.parametrize("ssm_cfg", [pytest.param(M2, marks=pytest.mark.smoke), M1], ids=["Mamba2", "Mamba1"])
def test_logits_and_every_gradient_vs_reference(ssm_cfg):
    m = _model(ssm_cfg)
    ids = _ids()
    tgt = _ids(seed=2)
    logits = m(ids).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)).backward()
    p64 = params64(m)
    p64["lm_head.weight"] = p64["backbone.embedding.weight"]  # tied
    mixer = (functools.partial(mamba2_ref, headdim=16, d_state=16) if ssm_cfg["layer"] == "Mamba2"
             else mamba_ref)
    ref = lm_ref(p64, ids, mixer, n_layer=2)
    F.cross_entropy(ref.reshape(-1, ref.shape[-1]), tgt.reshape(-1)).backward()
    assert_rel_close(logits, ref, 2e-5, "logits")
    compare_grads(m, p64, rel=2e-4)


@pytest.mark.parametrize("ssm_cfg", [M2, M1], ids=["Mamba2", "Mamba1"])
def test_greedy_generate_equals_full_forward_decoding(ssm_cfg):
    m = _model(ssm_cfg)
    prompt = _ids(seqlen=5)
    out = m.generate(prompt, max_length=12)
    assert out.shape == (2, 12) and torch.equal(out[:, :5], prompt)
    assert torch.equal(m.generate(prompt, max_length=12), out)  # deterministic
    # greedy decoding by re-running the whole sequence each time (no states): same tokens
    seq = prompt
    with torch.no_grad():
        for _ in range(7):
            nxt = m(seq).logits[:, -1].argmax(-1)  # upstream's decode: the padded vocabulary
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert torch.equal(out, seq)


def test_generate_prefill_and_step_logits_match_forward():
    m = _model()
    ids = _ids(seqlen=11)
    with torch.no_grad():
        full = m(ids).logits
        params = InferenceParams(max_seqlen=11, max_batch_size=2)
        params.key_value_memory_dict = m.allocate_inference_cache(2, 11)
        outs = [m(ids[:, :6], inference_params=params).logits]
        for t in range(6, 11):
            params.seqlen_offset = t
            outs.append(m(ids[:, t:t + 1], inference_params=params).logits)
    assert_rel_close(torch.cat(outs, dim=1), full, 1e-5, "prefill + steps vs forward")


def test_sampling_is_seeded_and_in_vocab():
    m = _model()
    prompt = _ids(seqlen=3)
    kw = dict(max_length=10, top_k=5, top_p=0.9, temperature=0.7, vocab_size=VOCAB)
    a = m.generate(prompt, generator=torch.Generator().manual_seed(0), **kw)
    b = m.generate(prompt, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a, b) and a.max() < VOCAB
    res = m.generate(prompt, max_length=6, top_k=0, top_p=0.5, return_dict_in_generate=True, output_scores=True,
                     generator=torch.Generator().manual_seed(1))
    assert res.sequences.shape == (2, 6) and len(res.scores) == 3 and res.scores[0].shape == (2, 56)  # padded


def test_bad_inputs_name_the_argument():
    m = _model()
    with pytest.raises(TypeError, match="input_ids"):
        m(torch.randn(2, 5))
    with pytest.raises(ValueError, match="input_ids"):
        m(_ids()[0])
    with pytest.raises(ValueError, match="max_length"):
        m.generate(_ids(seqlen=5), max_length=3)
    params = InferenceParams(max_seqlen=8, max_batch_size=1)
    params.key_value_memory_dict = m.allocate_inference_cache(1, 8)
    with pytest.raises(ValueError, match="conv_state: allocated for batch 1, but the input has batch 2"):
        m(_ids(), inference_params=params)
    with pytest.raises(ValueError, match="ssm_cfg"):
        _model(dict(layer="Mamba4"))
    with pytest.raises(ValueError, match="attn_layer_idx"):
        MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=8, attn_layer_idx=[1]))


def test_train_tiny_ci_reaches_target(tmp_path):
    png = tmp_path / "loss.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--ci", "--png", str(png)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sgd_training_trajectory_matches_reference():
    """10 SGD steps through the kernels (fp32) and through the float64 reference LM from the same init: the
    losses and the final parameters agree (every backward is right, including across optimizer steps)."""
    m = _model()
    p64 = params64(m)
    mixer = functools.partial(mamba2_ref, headdim=16, d_state=16)
    opt, opt64 = torch.optim.SGD(m.parameters(), lr=0.5), torch.optim.SGD(p64.values(), lr=0.5)
    losses, losses64 = [], []
    ids, tgt = _ids(seed=10), _ids(seed=100)  # one batch, fitted: the loss must fall
    for _ in range(10):
        logits = m(ids).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        q = dict(p64, **{"lm_head.weight": p64["backbone.embedding.weight"]})
        ref = lm_ref(q, ids, mixer, n_layer=2)
        loss64 = F.cross_entropy(ref.reshape(-1, ref.shape[-1]), tgt.reshape(-1))
        for o, l_ in ((opt, loss), (opt64, loss64)):
            o.zero_grad()
            l_.backward()
            o.step()
        losses.append(loss.item())
        losses64.append(loss64.item())
    assert losses[-1] < losses[0] - 0.05  # it learned something
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(losses64, dtype=torch.float64),
                               rtol=5e-5, atol=0)
    for name, p in m.named_parameters():
        assert_rel_close(p, p64[name], 1e-4, name)
