"""MambaLMHeadModel.from_pretrained / save_pretrained: mamba_ssm's directory layout round trip, transformers'
MambaForCausalLM / Mamba2ForCausalLM checkpoints (random tiny models saved by transformers, logits against
transformers' own CPU forward), and the refusals (hub id, unknown config keys, missing safetensors)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.modules._util import assert_rel_close
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

VOCAB = 50
M2 = dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=8)  # test_lm.py's configs: the same kernels
M1 = dict(layer="Mamba1", d_state=8)


def _ids(batch=2, seqlen=10, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ssm_cfg", [M2, M1], ids=["Mamba2", "Mamba1"])
def test_save_pretrained_round_trip_in_mamba_ssm_layout(tmp_path, ssm_cfg):
    torch.manual_seed(0)
    m = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB, ssm_cfg=dict(ssm_cfg)))
    m.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "pytorch_model.bin"]
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg == dict(m.config.__dict__)  # upstream writes config.__dict__
    state = torch.load(tmp_path / "ckpt" / "pytorch_model.bin", weights_only=True)
    assert list(state) == list(m.state_dict())
    loaded = MambaLMHeadModel.from_pretrained(str(tmp_path / "ckpt"))
    assert loaded.config == m.config and loaded.lm_head.weight is loaded.backbone.embedding.weight
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, m(ids).logits, rtol=0, atol=0)
    half = MambaLMHeadModel.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert half.backbone.embedding.weight.dtype == torch.bfloat16


def _hf_model(kind):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    if kind == "mamba":
        cfg = transformers.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2, vocab_size=VOCAB,
                                       layer_norm_epsilon=1e-4)
        model = transformers.MambaForCausalLM(cfg)
    else:
        cfg = transformers.Mamba2Config(hidden_size=32, state_size=16, num_heads=4, head_dim=16, n_groups=2,
                                        chunk_size=8, num_hidden_layers=2, vocab_size=VOCAB, layer_norm_epsilon=1e-4,
                                        time_step_limit=(0.0, 0.08))
        model = transformers.Mamba2ForCausalLM(cfg)
    with torch.no_grad():  # move every parameter off its init value (norm weights 1, D 1, zero biases ...)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_transformers_checkpoint_loads_and_matches_its_forward(tmp_path, kind):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    m = MambaLMHeadModel.from_pretrained(tmp_path / "hf")
    assert m.config.vocab_size == VOCAB and m.config.pad_vocab_size_multiple == 1
    assert m.backbone.norm_f.eps == 1e-4  # layer_norm_epsilon reaches every norm
    if kind == "mamba":
        assert m.config.tie_embeddings and m.lm_head.weight is m.backbone.embedding.weight
        assert m.config.ssm_cfg["layer"] == "Mamba1" and m.backbone.layers[0].mixer.dt_rank == 2
    else:
        mixer = m.backbone.layers[0].mixer
        assert not m.config.tie_embeddings and mixer.ngroups == 2 and mixer.norm.group_size == 32
        assert mixer.norm.eps == 1e-4 and mixer.dt_limit == (0.0, 0.08)
    ids = _ids(seqlen=13)
    with torch.no_grad():
        want = hf(ids).logits
        got = m(ids).logits
    assert_rel_close(got, want.double(), 1e-4, f"{kind} logits vs transformers")


def test_hub_id_is_refused_with_a_local_path_hint(tmp_path):
    with pytest.raises(ValueError, match="not a local directory.*pass the local path"):
        MambaLMHeadModel.from_pretrained("state-spaces/mamba-130m")
    with pytest.raises(FileNotFoundError, match="config.json"):
        MambaLMHeadModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 32, "n_layer": 1, "vocab_size": 8}))
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        MambaLMHeadModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 32, "n_layers": 1}))
    with pytest.raises(ValueError, match=r"unknown MambaConfig keys \['n_layers'\]"):
        MambaLMHeadModel.from_pretrained(tmp_path)


def test_safetensors_missing_is_a_clear_import_error(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="mamba", hidden_size=32, state_size=8,
                                                          num_hidden_layers=1, vocab_size=VOCAB)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"tvm-mamba\[hf\]"):
        MambaLMHeadModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("ssm_cfg", [dict(M2, ngroups=2), dict(M1, dt_rank=3)], ids=["Mamba2", "Mamba1"])
def test_our_model_as_transformers_model_matches_and_maps_back(ssm_cfg):
    transformers = pytest.importorskip("transformers")
    from tvm_mamba.modules import checkpoint

    torch.manual_seed(0)
    m = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB, ssm_cfg=dict(ssm_cfg))).eval()
    cfg = checkpoint.config_to_hf(m)
    assert cfg["vocab_size"] == m.backbone.embedding.num_embeddings == 56  # the padded vocabulary
    hf = transformers.AutoConfig.for_model(**cfg)
    hf = (transformers.MambaForCausalLM if cfg["model_type"] == "mamba" else transformers.Mamba2ForCausalLM)(hf)
    hf.load_state_dict(checkpoint.state_dict_to_hf(m.state_dict()), strict=True)
    ids = _ids(seqlen=13)
    with torch.no_grad():
        assert_rel_close(m(ids).logits, hf.eval()(ids).logits.double(), 1e-4, "ours vs transformers")
    back, eps = checkpoint.config_from_hf(cfg, MambaConfig)
    assert eps == 1e-5 and back.d_model == 32 and back.n_layer == 2 and back.tie_embeddings
    m2 = MambaLMHeadModel(back)
    m2.load_state_dict(checkpoint.state_dict_from_hf(checkpoint.state_dict_to_hf(m.state_dict()), True))
    torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=0, atol=0)


def test_config_to_hf_refuses_what_transformers_cannot_express():
    from tvm_mamba.modules import checkpoint

    mlp = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=1, vocab_size=VOCAB, d_intermediate=16, ssm_cfg=dict(M1)))
    with pytest.raises(ValueError, match="d_intermediate=0"):
        checkpoint.config_to_hf(mlp)
    gate = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=1, vocab_size=VOCAB,
                                        ssm_cfg=dict(M2, norm_before_gate=True)))
    with pytest.raises(ValueError, match="norm_before_gate=False"):
        checkpoint.config_to_hf(gate)
