"""transformers' MambaConfig() / Mamba2Config() as ``save_pretrained`` writes them load in
``MambaLMHeadModel.from_pretrained`` and match transformers' logits (issue #41, item 6).

Mamba2Config's default ``time_step_limit`` is (0.0, inf): transformers >= 5 writes it to config.json as
``[0.0, {"__float__": "Infinity"}]``, older versions (and ``json.dump``) as ``[0.0, Infinity]``; both must load.
The defaults are kept except where they are too big for a test: the number of layers (2) and the vocabulary (64)
for both, and for Mamba2 hidden_size 4096 -> 256 with num_heads 128 -> 8 (num_heads * head_dim must stay
expand * hidden_size). state_size, head_dim, n_groups, chunk_size, time_step_* and the norms stay default.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.modules._util import assert_rel_close
from tvm_mamba.modules import checkpoint
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

VOCAB = 64
SHRUNK = {"mamba": dict(num_hidden_layers=2, vocab_size=VOCAB),
          "mamba2": dict(num_hidden_layers=2, vocab_size=VOCAB, hidden_size=256, num_heads=8)}


def _default_model(kind):
    """transformers' default-config model (shrunk as the module docstring says), weights moved off their init."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cls, model_cls = ((transformers.MambaConfig, transformers.MambaForCausalLM) if kind == "mamba"
                      else (transformers.Mamba2Config, transformers.Mamba2ForCausalLM))
    cfg = cls(**SHRUNK[kind])
    # every other field is the default (time_step_rank and intermediate_size follow hidden_size)
    default = cls().to_dict()
    changed = {k for k, v in cfg.to_dict().items() if default.get(k) != v}
    assert changed <= set(SHRUNK[kind]) | {"time_step_rank", "intermediate_size"}, changed
    torch.manual_seed(0)
    model = model_cls(cfg)
    with torch.no_grad():  # norm weights 1, D 1, zero biases ... would hide a mapping mistake
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _logits_match(model_dir, hf, seqlen):
    m = MambaLMHeadModel.from_pretrained(model_dir)
    ids = torch.randint(0, VOCAB, (2, seqlen), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_rel_close(m(ids).logits, hf(ids).logits.double(), 1e-4, "logits vs transformers")
    return m


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_default_config_checkpoint_matches_transformers(tmp_path, kind):
    hf = _default_model(kind)
    hf.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    # seqlen 300 > Mamba2's default chunk_size 256: two chunks, the inter-chunk state passing included
    m = _logits_match(tmp_path, hf, 300 if kind == "mamba2" else 13)
    if kind == "mamba2":
        assert '"__float__": "Infinity"' in text.replace("\n", "").replace("  ", "")  # as transformers 5 writes it
        mixer = m.backbone.layers[0].mixer
        assert mixer.dt_limit == (0.0, math.inf) and mixer.chunk_size == 256 and mixer.ngroups == 8
        assert mixer.d_state == 128 and mixer.headdim == 64
        # the same file with Python's bare Infinity (older transformers, json.dump of the config dict)
        cfg = checkpoint.read_config(str(tmp_path))
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert "[0.0, Infinity]" in (tmp_path / "config.json").read_text()
        _logits_match(tmp_path, hf, 13)
    else:
        assert m.config.tie_embeddings and m.backbone.layers[0].mixer.dt_rank == 48  # ceil(768 / 16)


def test_special_floats_decode_and_a_bad_time_step_limit_is_named():
    cfg = dict(model_type="mamba2", hidden_size=64, num_heads=2, num_hidden_layers=1, vocab_size=VOCAB)
    for limit in ([0.0, {"__float__": "Infinity"}], [0.0, math.inf], (0.0, math.inf)):
        config, _ = checkpoint.config_from_hf(
            json.loads(json.dumps(dict(cfg, time_step_limit=limit)), object_hook=checkpoint._special_float),
            MambaConfig)
        assert config.ssm_cfg["dt_limit"] == (0.0, math.inf)
    nan = json.loads('{"x": [{"__float__": "NaN"}, {"__float__": "-Infinity"}]}', object_hook=checkpoint._special_float)
    assert math.isnan(nan["x"][0]) and nan["x"][1] == -math.inf
    for bad in ([0.0, {"__float__": "Infinite"}], [0.1], 0.5, [0.0, None], [True, 1.0]):
        with pytest.raises(ValueError, match=r"config.json: time_step_limit must be a pair of numbers"):
            checkpoint.config_from_hf(dict(cfg, time_step_limit=bad), MambaConfig)
