"""quantize_weights: which layers are swapped (and dt_proj not), logits of int8 / bf16 models against the same
model with the dequantized weights in float32 (the linear op's own error) and against fp32 (the quantization's
cost, a stated bound), the cache (decode) path, generate, and the state_dict of the swapped layers."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tvm_mamba
from tvm_mamba.modules.linear import Linear
from tvm_mamba.modules.lm import InferenceParams, MambaConfig, MambaLMHeadModel
from tvm_mamba.modules.quantize import QuantizedLinear, quantize_weights
from tvm_mamba.reference.linear import dequantize_ref

VOCAB = 50
M2 = dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=8)
M1 = dict(layer="Mamba1", d_state=8)
# max |logit - fp32 logit| / max |fp32 logit| on these tiny random models (d_model 32, 2 layers): measured
# 7.3e-3 / 1.3e-2 (int8, Mamba / Mamba2) and 3.9e-3 / 5.6e-3 (bf16); each weight's rounding is at most 1/254
# of its row's absmax (int8) or 2^-9 relative (bf16). The 130M figures are in docs/linear.md.
REL_BOUND = {"int8": 3e-2, "bfloat16": 1.2e-2}


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB, ssm_cfg=dict(cfg))).eval()


def _ids(batch=2, seqlen=10, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _cached_logits(model, ids):
    """Logits of a prefill with an inference cache: the path that calls the projection layers."""
    params = InferenceParams(max_seqlen=ids.shape[1] + 4, max_batch_size=ids.shape[0])
    return model(ids, inference_params=params).logits


def _dequantized_twin(fp32: nn.Module, quant: nn.Module) -> nn.Module:
    """The fp32 model with every swapped layer's weight replaced by its dequantized value (float64 math)."""
    twin = copy.deepcopy(fp32)
    qmods = dict(quant.named_modules())
    for name, mod in twin.named_modules():
        q = qmods.get(name)
        if isinstance(q, QuantizedLinear):
            mod.weight = nn.Parameter(dequantize_ref(q.qweight, q.scale).float())
    return twin


@pytest.mark.parametrize("cfg", [M1, M2], ids=["mamba1", "mamba2"])
@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_logits_against_dequantized_and_fp32(cfg, dtype):
    fp32 = _model(cfg)
    quant = quantize_weights(copy.deepcopy(fp32), dtype)
    ids = _ids()
    with torch.no_grad():
        got = _cached_logits(quant, ids)
        twin = _cached_logits(_dequantized_twin(fp32, quant), ids)
        ref = _cached_logits(fp32, ids)
        fused = quant(ids).logits  # no cache: the fused block paths with the dequantized .weight
    scale = ref.abs().max().item()
    assert (got - twin).abs().max().item() <= 1e-5 * scale
    assert (fused - got).abs().max().item() <= 1e-5 * scale
    rel = (got - ref).abs().max().item() / scale
    assert 0 < rel <= REL_BOUND[dtype], rel


def test_swapped_layers():
    m1 = quantize_weights(_model(M1), "int8")
    mixer = m1.backbone.layers[0].mixer
    for name in ("in_proj", "x_proj", "out_proj"):
        assert isinstance(getattr(mixer, name), QuantizedLinear)
        assert getattr(mixer, name).qweight.dtype == torch.int8
    assert type(mixer.dt_proj) is Linear  # float32 (the blocks' nn.Linear subclass): see modules/quantize.py
    assert isinstance(m1.lm_head, QuantizedLinear) and m1.lm_head.qweight.shape == (56, 32)
    assert m1.backbone.embedding.weight.dtype == torch.float32  # the tied embedding is not touched
    m2 = quantize_weights(_model(M2), "bfloat16", lm_head=False)
    mixer = m2.backbone.layers[1].mixer
    assert isinstance(mixer.in_proj, QuantizedLinear) and mixer.in_proj.qweight.dtype == torch.bfloat16
    assert mixer.in_proj.scale is None and type(m2.lm_head) is Linear
    block = quantize_weights(tvm_mamba.Mamba(16, d_state=8), "int8")  # a bare block works too
    assert isinstance(block.out_proj, QuantizedLinear)


def test_generate_matches_greedy_forwards():
    model = quantize_weights(_model(M1, seed=2), "int8")
    prompt = _ids(batch=2, seqlen=4, seed=3)
    with torch.no_grad():
        seq = model.generate(prompt, max_length=10)
        assert seq.shape == (2, 10)
        logits = model(seq).logits  # teacher-forced full forward: its argmax is each next token
    assert torch.equal(seq[:, 4:], logits[:, 3:-1].argmax(-1))


def test_state_dict_round_trip():
    quant = quantize_weights(_model(M1), "int8")
    sd = quant.state_dict()
    assert sd["backbone.layers.0.mixer.in_proj.qweight"].dtype == torch.int8
    assert sd["backbone.layers.0.mixer.in_proj.scale"].shape == (128,)
    assert "backbone.layers.0.mixer.in_proj.weight" not in sd and "lm_head.qweight" in sd
    fresh = quantize_weights(_model(M1, seed=5), "int8")
    fresh.load_state_dict(sd, strict=True)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(_cached_logits(fresh, ids), _cached_logits(quant, ids))


def test_bad_input():
    with pytest.raises(ValueError, match="dtype: expected"):
        quantize_weights(_model(M1), "int4")
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        quantize_weights("model")
