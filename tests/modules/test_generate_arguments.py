"""generate's length and keyword arguments as a transformers user meets them (issue #41, item 7):
``max_new_tokens`` (transformers' name: tokens after the prompt) beside mamba_ssm's ``max_length`` (the whole
sequence), and an unknown keyword is a TypeError naming generate(), the function called, not decode()."""
from __future__ import annotations

import pytest
import torch

from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

VOCAB = 50


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB,
                                        ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=8)))


def _prompt(seqlen=5):
    return torch.randint(0, VOCAB, (2, seqlen), generator=torch.Generator().manual_seed(1))


def test_max_new_tokens_counts_after_the_prompt(model):
    prompt = _prompt()
    seq = model.generate(prompt, max_new_tokens=3)
    assert seq.shape == (2, 8) and torch.equal(seq, model.generate(prompt, max_length=8))
    out = model.generate(_prompt(7), max_new_tokens=1, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.shape == (2, 8) and len(out.scores) == 1
    teacher = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    forced = model.generate(prompt, max_new_tokens=4, teacher_outputs=teacher)  # a decode option passes through
    assert torch.equal(forced[:, 5:9], teacher[:, 5:9])


def test_length_arguments_are_checked(model):
    prompt = _prompt()
    with pytest.raises(TypeError, match=r"generate\(\) missing the length: pass max_length .* or max_new_tokens"):
        model.generate(prompt)
    with pytest.raises(ValueError, match=r"give max_length \(8\) or max_new_tokens \(3\), not both"):
        model.generate(prompt, 8, max_new_tokens=3)
    for bad in (0, -2, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"max_new_tokens: must be an int >= 1"):
            model.generate(prompt, max_new_tokens=bad)


@pytest.mark.parametrize("name", ["attention_mask", "do_sample", "model", "max_tokens"])
def test_unknown_keyword_names_generate(model, name):
    with pytest.raises(TypeError) as info:
        model.generate(_prompt(), max_new_tokens=2, **{name: None})
    message = str(info.value)
    assert message.startswith(f"generate() got an unexpected keyword argument {name!r}") and "decode()" not in message
    assert "repetition_penalty" in message and "streamer" in message  # the options it does take
