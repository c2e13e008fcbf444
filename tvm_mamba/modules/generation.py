"""Decoding at mamba_ssm 2.3.x's ``utils/generation`` interface: ``InferenceParams``, ``sample``, ``decode`` and
``GenerationMixin.generate``, for any model with upstream's calling convention
(``model(input_ids, position_ids=..., inference_params=..., num_last_tokens=1).logits``).

The loop is upstream's: one prefill forward over the prompt (every layer writes its (conv_state, ssm_state)
into ``inference_params.key_value_memory_dict[layer_idx]``), then one forward per new token with
``seqlen_offset > 0`` (the layers take their decode step). Scores are over the model's full (padded)
vocabulary unless ``vocab_size`` is given. Pure torch glue: the model's kernels do the work.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..runtime import kernel_sets, prebuild


@dataclass
class InferenceParams:
    """mamba_ssm's utils/generation.InferenceParams: the decode position and each layer's cache.
    key_value_memory_dict: {layer_idx: (conv_state, ssm_state)}; seqlen_offset: tokens already consumed
    (0 = prefill); lengths_per_sample: (batch,) int32 or None."""
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[Tensor] = None

    def reset(self, max_seqlen, max_batch_size):
        """Start a new sequence with the same caches (upstream's reset: offset 0, lengths zeroed)."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


@dataclass
class GenerateDecoderOnlyOutput:
    """What ``decode`` / ``generate(return_dict_in_generate=True)`` return, transformers' field names:
    sequences (batch, total_len) with the prompt; scores: tuple of (batch, vocab) logits, one per new token,
    or None. Indexable like a transformers ModelOutput: out["sequences"], out[0]."""
    sequences: Tensor
    scores: Optional[tuple] = None

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return tuple(v for v in (self.sequences, self.scores) if v is not None)[key]


# ------------------------------------------------------------------------------------------------------------
# logits filters (in place, as upstream's modify_logits_* helpers)
def modify_logits_for_min_p_filtering(logits, min_p):
    """logits: (batch, vocab). Mask (-inf) every token whose probability is below min_p * the row's top
    probability; no-op unless 0 < min_p < 1. In place."""
    if min_p <= 0.0 or min_p >= 1.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    logits.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def modify_logits_for_top_k_filtering(logits, top_k):
    """logits: (batch, vocab). Mask every logit below the row's k-th largest. In place."""
    kth = torch.topk(logits, top_k, dim=-1)[0][..., -1:]
    logits.masked_fill_(logits < kth, float("-inf"))
    return logits


def modify_logits_for_top_p_filtering(logits, top_p):
    """logits: (batch, vocab). Nucleus filter: mask the smallest tokens whose cumulative probability stays
    <= 1 - top_p (the token that crosses the threshold is kept); no-op unless 0 < top_p < 1. In place."""
    if top_p <= 0.0 or top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)
    drop_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    logits.masked_fill_(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return logits


def modify_logit_for_repetition_penalty(logits, prev_output_tokens, repetition_penalty=1.0):
    """logits: (batch, vocab); prev_output_tokens: (batch, seq_len). Every token already in the row has its
    logit divided by the penalty (multiplied when negative), CTRL's rule (arXiv 1909.05858). In place."""
    if repetition_penalty == 1.0:
        return logits
    score = torch.gather(logits, 1, prev_output_tokens)
    score = torch.where(score < 0, score * repetition_penalty, score / repetition_penalty)
    logits.scatter_(1, prev_output_tokens, score)
    return logits


def sample(logits, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0, generator=None):
    """logits: (batch, vocab) -> (batch,) token ids. top_k == 1: greedy (argmax). Otherwise: top-k (0 = all
    tokens), min_p, then temperature scaling and top-p filtering, and one multinomial draw per row
    (``generator`` seeds it). Upstream's order; min_p also applies with top_k > 0 (upstream ignores it there)."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    indices = None
    if top_k > 0:
        logits, indices = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)
    logits = logits.float().clone()
    modify_logits_for_min_p_filtering(logits, min_p)
    if temperature != 1.0:
        logits /= temperature
    modify_logits_for_top_p_filtering(logits, top_p)
    choice = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator).squeeze(-1)
    return choice if indices is None else indices.gather(1, choice[:, None]).squeeze(1)


def _check_sampling(input_ids, max_length, top_k, top_p, min_p, temperature, repetition_penalty, teacher_outputs):
    if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("input_ids: expected an int32/int64 tensor")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected (batch, prompt_len >= 1), got shape {tuple(input_ids.shape)}")
    if not isinstance(max_length, int) or max_length < input_ids.shape[1]:
        raise ValueError(f"max_length: must be an int >= the prompt length {input_ids.shape[1]}, got {max_length!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k: must be an int >= 0 (1 = greedy, 0 = no limit), got {top_k!r}")
    for name, v in (("top_p", top_p), ("min_p", min_p)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}: must be in [0, 1], got {v}")
    if top_k != 1 and not temperature > 0:
        raise ValueError(f"temperature: must be > 0 when sampling (top_k != 1), got {temperature}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty: must be > 0, got {repetition_penalty}")
    if teacher_outputs is not None and (not isinstance(teacher_outputs, Tensor) or teacher_outputs.dim() != 2
                                        or teacher_outputs.shape[0] != input_ids.shape[0]):
        raise ValueError(f"teacher_outputs: expected (batch={input_ids.shape[0]}, seq_len) token ids, got "
                         f"{getattr(teacher_outputs, 'shape', type(teacher_outputs).__name__)}")


@torch.inference_mode()
def decode(input_ids, model, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0, repetition_penalty=1.0,
           eos_token_id=None, teacher_outputs=None, vocab_size=None, cg=False, enable_timing=False,
           output_scores=False, streamer=None, generator=None):
    """input_ids: (batch, prompt_len) -> GenerateDecoderOnlyOutput(sequences (batch, <= max_length),
    scores: tuple of (batch, vocab) logits per new token, empty unless output_scores), upstream's decode loop.

    At least one token is generated (as upstream, also when max_length == prompt_len); stops when every row's
    last token is eos_token_id or the sequence reaches max_length. teacher_outputs (batch, seq_len): positions
    < seq_len take the teacher's token instead of sampling (scores are still the model's). vocab_size: slice
    the logits to the first vocab_size entries (else the padded vocabulary). cg (CUDA graphs) is accepted
    and runs the same eager loop; enable_timing prints the wall time; streamer gets put()/end() calls."""
    _check_sampling(input_ids, max_length, top_k, top_p, min_p, temperature, repetition_penalty, teacher_outputs)
    del cg  # CUDA-graph capture is not implemented: the eager loop below is what runs on every device
    if streamer is not None:
        streamer.put(input_ids.cpu())
    batch_size = input_ids.shape[0]
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

    def get_logits(ids):
        position_ids = None
        if params.seqlen_offset > 0:
            position_ids = torch.full((batch_size, 1), params.seqlen_offset, dtype=torch.long, device=ids.device)
        logits = model(ids, position_ids=position_ids, inference_params=params, num_last_tokens=1).logits
        logits = logits.squeeze(dim=1)
        return logits[..., :vocab_size] if vocab_size is not None else logits

    def next_tokens(logits):
        if teacher_len > params.seqlen_offset:
            return teacher_outputs[:, params.seqlen_offset].unsqueeze(1)
        return sample(logits, top_k, top_p, min_p, temperature, generator).unsqueeze(1)

    def should_stop(last):
        if params.seqlen_offset == 0:
            return False
        if eos_token_id is not None and bool((last == eos_token_id).all()):
            return True
        return params.seqlen_offset >= max_length - 1

    start = time.perf_counter()
    scores, sequences, seen = [], [input_ids], input_ids
    signature = model_signature(model)
    prebuild.prefetch(signature)  # a cold cache: the model's saved kernel set compiled by a pool meanwhile
    with kernel_sets.recording(signature):
        while not should_stop(sequences[-1]):
            logits = get_logits(sequences[-1])
            if output_scores:
                scores.append(logits.clone())
            params.seqlen_offset += sequences[-1].shape[1]
            if repetition_penalty != 1.0:
                logits = modify_logit_for_repetition_penalty(logits.clone(), seen, repetition_penalty)
            tokens = next_tokens(logits).to(input_ids.dtype)
            if repetition_penalty != 1.0:
                seen = torch.cat([seen, tokens], dim=1)
            sequences.append(tokens)
            if streamer is not None:
                streamer.put(tokens.cpu())
    if streamer is not None:
        streamer.end()
    if enable_timing:
        print(f"Prompt processing + decoding time: {(time.perf_counter() - start) * 1000:.0f}ms")
    return GenerateDecoderOnlyOutput(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


def model_signature(model) -> str:
    """What names a model's kernel set (runtime/kernel_sets.py): its class, its config's fields, the dtypes of
    its parameters and buffers (a quantized model runs other kernels) and its device type; 24 hex digits."""
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        fields = dataclasses.asdict(cfg)
    elif callable(getattr(cfg, "to_dict", None)):  # a transformers PretrainedConfig
        fields = cfg.to_dict()
    else:  # never a repr: one with an object's address would name a new set in every process
        fields = vars(cfg) if hasattr(cfg, "__dict__") else type(cfg).__name__
    tensors = [*model.parameters(), *model.buffers()]
    facts = [type(model).__name__, fields, sorted({str(t.dtype) for t in tensors}),
             sorted({t.device.type for t in tensors})]
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class GenerationMixin:
    """upstream's GenerationMixin: ``generate`` over ``decode``; the model provides allocate_inference_cache."""

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """The model's decode caches, {layer_idx: (conv_state, ssm_state)}: each model class defines it (as in
        upstream's mixin, which declares it the same way)."""
        raise NotImplementedError(f"{type(self).__name__}.allocate_inference_cache: a model using GenerationMixin "
                                  "must define it (MambaLMHeadModel does)")

    def generate(self, input_ids, max_length=None, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
                 return_dict_in_generate=False, output_scores=False, max_new_tokens=None, **kwargs):
        """input_ids: (batch, prompt_len) -> sequences (batch, <= max_length), or with return_dict_in_generate a
        GenerateDecoderOnlyOutput (scores None unless output_scores). The length is upstream's max_length (the
        whole sequence, prompt included) or transformers' max_new_tokens (tokens after the prompt:
        max_length = prompt_len + max_new_tokens); give one of them. kwargs: decode's (repetition_penalty,
        eos_token_id, teacher_outputs, vocab_size, cg, enable_timing, streamer, generator); any other keyword
        is a TypeError naming generate()."""
        unknown = sorted(set(kwargs) - set(_DECODE_OPTIONS))
        if unknown:
            raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r} (decoding options: "
                            f"{', '.join(_DECODE_OPTIONS)})")
        max_length = _total_length(input_ids, max_length, max_new_tokens)
        output = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature,
                        output_scores=output_scores, **kwargs)
        if not output_scores:
            output.scores = None
        return output if return_dict_in_generate else output.sequences


# decode's keywords that generate passes through **kwargs (the others are generate's own parameters)
_DECODE_OPTIONS = tuple(name for name in inspect.signature(decode).parameters
                        if name not in inspect.signature(GenerationMixin.generate).parameters and name != "model")


def _total_length(input_ids, max_length, max_new_tokens):
    """generate's length: max_length as given, or the prompt length + max_new_tokens (transformers' meaning)."""
    if max_new_tokens is None:
        if max_length is None:
            raise TypeError("generate() missing the length: pass max_length (the whole sequence, mamba_ssm) or "
                            "max_new_tokens (tokens after the prompt, transformers)")
        return max_length
    if max_length is not None:
        raise ValueError(f"generate(): give max_length ({max_length!r}) or max_new_tokens ({max_new_tokens!r}), "
                         "not both")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be an int >= 1 (at least one token is generated), got "
                         f"{max_new_tokens!r}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        return max_new_tokens  # decode's input check names input_ids
    return input_ids.shape[1] + max_new_tokens
