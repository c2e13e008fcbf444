"""generate / decode at mamba_ssm's utils/generation interface: the logits filters and sampling against their
definitions, teacher forcing, repetition penalty, vocab_size, eos, streamer, cg, output shapes, and bad
arguments (an unknown keyword is a TypeError)."""
from __future__ import annotations

import pytest
import torch

from tvm_mamba.modules.generation import (GenerateDecoderOnlyOutput, InferenceParams, decode,
                                          modify_logit_for_repetition_penalty, modify_logits_for_min_p_filtering,
                                          modify_logits_for_top_k_filtering, modify_logits_for_top_p_filtering,
                                          sample)
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

VOCAB = 50  # padded to 56


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB,
                                        ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=8)))


def _ids(batch=2, seqlen=5, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def test_filters_follow_their_definitions():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.5, 0.2]])
    probs = logits.softmax(-1)
    out = modify_logits_for_min_p_filtering(logits.clone(), 0.3)  # keep p >= 0.3 * p_max, per row
    torch.testing.assert_close(torch.isfinite(out), probs >= 0.3 * probs.amax(-1, keepdim=True))
    out = modify_logits_for_top_k_filtering(logits.clone(), 2)
    assert torch.isfinite(out).sum(-1).tolist() == [2, 2] and torch.isfinite(out[0, :2]).all()
    # top-p 0.7: row 0 probs (0.64, 0.24, 0.09, 0.03): the smallest whose cumulative sum <= 0.3 go
    out = modify_logits_for_top_p_filtering(logits.clone(), 0.7)
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.equal(modify_logits_for_top_p_filtering(logits.clone(), 1.0), logits)  # no-op outside (0, 1)
    prev = torch.tensor([[0, 3], [1, 1]])
    out = modify_logit_for_repetition_penalty(logits.clone(), prev, 2.0)  # positive / p, negative * p
    want = logits.clone()
    want[0, 0], want[0, 3], want[1, 1] = 1.0, -2.0, 1.5
    torch.testing.assert_close(out, want)


def test_sample_greedy_topk_and_min_p():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]] * 3)
    assert sample(logits).tolist() == [1, 1, 1]  # top_k=1: argmax
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, top_k=2, generator=g) for _ in range(50)])
    assert set(draws.unique().tolist()) == {1, 2}  # only the top 2
    draws = torch.stack([sample(logits, top_k=0, min_p=0.5, generator=g) for _ in range(50)])
    assert set(draws.unique().tolist()) == {1, 2}  # p(0), p(3) < 0.5 * p_max
    draws = torch.stack([sample(logits, top_k=0, temperature=100.0, generator=g) for _ in range(200)])
    assert set(draws.unique().tolist()) == {0, 1, 2, 3}  # near-uniform at a high temperature


def test_generate_output_shapes_and_padded_vocab(model):
    prompt = _ids()
    seq = model.generate(prompt, max_length=9)
    assert seq.shape == (2, 9) and torch.equal(seq[:, :5], prompt)
    out = model.generate(prompt, 9, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput) and out.scores is None and torch.equal(out.sequences, seq)
    out = model.generate(prompt, 9, return_dict_in_generate=True, output_scores=True)
    assert isinstance(out.scores, tuple) and len(out.scores) == 4 and out.scores[0].shape == (2, 56)
    assert torch.equal(out["sequences"], seq) and out[0] is out.sequences
    # scores[i] are the logits that chose token prompt_len + i (greedy: their argmax)
    assert torch.equal(torch.stack([s.argmax(-1) for s in out.scores], 1), seq[:, 5:])
    out = model.generate(prompt, 9, return_dict_in_generate=True, output_scores=True, vocab_size=VOCAB)
    assert out.scores[0].shape == (2, VOCAB)
    assert model.generate(prompt, 5).shape == (2, 6)  # upstream's loop: one token even at max_length == prompt
    assert torch.equal(model.generate(prompt, 9, cg=True), seq)  # cg: accepted, the same eager loop


def test_teacher_forcing_repetition_penalty_and_eos(model):
    prompt = _ids()
    teacher = _ids(seqlen=8, seed=7)
    out = model.generate(prompt, 10, teacher_outputs=teacher, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, 5:8], teacher[:, 5:8])  # positions < teacher length are the teacher's
    # past the teacher: greedy on the model's logits, whose score is what the model predicted
    assert torch.equal(out.sequences[:, 8:], torch.stack([s.argmax(-1) for s in out.scores[3:]], 1))
    # repetition penalty: with a huge penalty, greedy never repeats a token it has seen
    seq = model.generate(prompt, 14, repetition_penalty=1e6, vocab_size=VOCAB)
    for row in seq.tolist():
        assert len(set(row[5:])) == len(row[5:]) and not set(row[5:]) & set(row[:5])
    # eos: stops once every row's last token is eos
    greedy = model.generate(prompt, 12)
    eos = int(greedy[0, 6])
    forced = torch.cat([prompt, torch.full((2, 1), eos)], 1)
    stopped = model.generate(prompt, 12, eos_token_id=eos, teacher_outputs=forced)
    assert stopped.shape == (2, 6) and (stopped[:, -1] == eos).all()


def test_streamer_and_upstream_style_decode_call(model):
    class Streamer:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, t):
            self.chunks.append(t)

        def end(self):
            self.ended = True

    s = Streamer()
    prompt = _ids()
    out = decode(prompt, model, 8, streamer=s)
    assert s.ended and torch.equal(torch.cat(s.chunks, 1), out.sequences)
    assert out.scores == ()  # decode itself keeps an empty tuple without output_scores (upstream)


def test_inference_params_reset():
    p = InferenceParams(max_seqlen=4, max_batch_size=2, seqlen_offset=3,
                        lengths_per_sample=torch.ones(2, dtype=torch.int32))
    p.reset(8, 3)
    assert (p.max_seqlen, p.max_batch_size, p.seqlen_offset) == (8, 3, 0) and p.lengths_per_sample.tolist() == [0, 0]


def test_bad_arguments(model):
    prompt = _ids()
    with pytest.raises(TypeError, match="no_such_option"):
        model.generate(prompt, 8, no_such_option=True)
    with pytest.raises(TypeError, match="input_ids"):
        model.generate(prompt.float(), 8)
    with pytest.raises(ValueError, match="max_length"):
        model.generate(prompt, 3)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 8, top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, 8, top_k=0, top_p=1.5)
    with pytest.raises(ValueError, match="min_p"):
        model.generate(prompt, 8, top_k=0, min_p=-0.1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 8, top_k=0, temperature=0.0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.generate(prompt, 8, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="teacher_outputs"):
        model.generate(prompt, 8, teacher_outputs=_ids(batch=3))
