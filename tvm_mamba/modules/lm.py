"""A small Mamba language model: mamba_ssm 2.3.x's ``models/mixer_seq_simple.MambaLMHeadModel`` on our blocks.

State dict names match upstream (``backbone.embedding.weight``, ``backbone.layers.{i}.norm.weight``,
``backbone.layers.{i}.mixer.*``, ``backbone.norm_f.weight``, ``lm_head.weight`` tied to the embedding), so an
upstream pure-Mamba checkpoint (no attention layers, d_intermediate = 0) loads. The block is upstream's
unfused path (``fused_add_norm`` is accepted but the add and the norm are two ops: residual = h + residual,
h = RMSNorm(residual) on the rmsnorm kernel, residual kept in float32 with residual_in_fp32).

Generation: the prompt runs through the full (chunked / scan) kernels once, filling each layer's
(conv_state, ssm_state); then one ``step`` per new token through the decode kernels.
"""
from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..torch_ops.rmsnorm_gated import rmsnorm_fn
from .mamba import Mamba
from .mamba2 import Mamba2

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])
GenerateOutput = namedtuple("GenerateOutput", ["sequences", "scores"])


@dataclass
class MambaConfig:
    """mamba_ssm's MambaConfig fields. ssm_cfg["layer"] picks "Mamba1" (default) or "Mamba2"; the other
    ssm_cfg entries go to the block's constructor."""
    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True


@dataclass
class InferenceParams:
    """mamba_ssm's utils/generation.InferenceParams: per-layer (conv_state, ssm_state) and the offset."""
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen, max_batch_size):
        self.max_seqlen, self.max_batch_size, self.seqlen_offset = max_seqlen, max_batch_size, 0


class RMSNorm(nn.Module):
    """mamba_ssm.ops.triton.layer_norm.RMSNorm parameters (weight (hidden,), bias None) on the rmsnorm kernel.
    x: (..., hidden) -> x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x):
        return rmsnorm_fn(x, self.weight, None, eps=self.eps)


class Block(nn.Module):
    """norm -> mixer with the residual carried outside: forward(h, residual) -> (mixer(norm(h + residual)),
    h + residual) (residual in float32 with residual_in_fp32), upstream's ``modules/block.Block``."""

    def __init__(self, dim, mixer, norm, residual_in_fp32=True):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.norm = norm
        self.mixer = mixer

    def forward(self, hidden_states, residual=None, inference_params=None, **mixer_kwargs):
        residual = (hidden_states + residual) if residual is not None else hidden_states
        hidden_states = self.norm(residual.to(dtype=self.norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        hidden_states = self.mixer(hidden_states, inference_params=inference_params, **mixer_kwargs)
        return hidden_states, residual

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)


class MixerModel(nn.Module):
    """Embedding -> n_layer Blocks -> final RMSNorm. input_ids: (batch, seqlen) -> (batch, seqlen, d_model)."""

    def __init__(self, d_model, n_layer, vocab_size, ssm_cfg=None, norm_epsilon=1e-5, rms_norm=True,
                 residual_in_fp32=True, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        cfg = dict(ssm_cfg or {})
        layer = cfg.pop("layer", "Mamba1")
        if layer not in ("Mamba1", "Mamba2"):
            raise ValueError(f"ssm_cfg: 'layer' must be 'Mamba1' or 'Mamba2', got {layer!r}")
        if not rms_norm:
            raise ValueError("rms_norm: only RMSNorm is supported (rms_norm=True)")
        mixer_cls = Mamba if layer == "Mamba1" else Mamba2
        self.residual_in_fp32 = residual_in_fp32
        self.embedding = nn.Embedding(vocab_size, d_model, **fk)
        self.layers = nn.ModuleList(
            Block(d_model, mixer_cls(d_model, layer_idx=i, **cfg, **fk), RMSNorm(d_model, eps=norm_epsilon, **fk),
                  residual_in_fp32=residual_in_fp32) for i in range(n_layer))
        self.norm_f = RMSNorm(d_model, eps=norm_epsilon, **fk)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids, inference_params=None, **mixer_kwargs):
        vocab = self.embedding.num_embeddings
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise IndexError(f"input_ids: token ids must be in [0, {vocab}) (the padded vocabulary), got "
                             f"min {int(input_ids.min())}, max {int(input_ids.max())}")
        hidden_states = self.embedding(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params=inference_params,
                                            **mixer_kwargs)
        residual = (hidden_states + residual) if residual is not None else hidden_states
        return self.norm_f(residual.to(dtype=self.norm_f.weight.dtype))


def _init_weights(module, n_layer, initializer_range=0.02, rescale_prenorm_residual=True, n_residuals_per_layer=1):
    """mamba_ssm's init: zero Linear biases (except dt_proj's), N(0, 0.02) embeddings, out_proj re-drawn
    kaiming-uniform and divided by sqrt(n_layer) (GPT-2's prenorm residual rescale)."""
    if isinstance(module, nn.Linear):
        if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(n_residuals_per_layer * n_layer)


def _sample(logits, top_k=1, top_p=0.0, temperature=1.0, generator=None):
    """logits: (batch, vocab) -> (batch,) token ids; mamba_ssm's utils/generation.sample: greedy for top_k == 1,
    else top-k then nucleus (top-p) filtering of the temperature-scaled logits and a multinomial draw."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0 when sampling, got {temperature}")
    if top_k > 0:
        top_k = min(top_k, logits.size(-1))
        logits, indices = torch.topk(logits, top_k, dim=-1)
    else:
        indices = None
    logits = logits.float() / temperature
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    choice = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator).squeeze(-1)
    return choice if indices is None else indices.gather(1, choice[:, None]).squeeze(1)


class MambaLMHeadModel(nn.Module):
    """Embedding, n_layer (RMSNorm -> Mamba/Mamba2 + residual) blocks, final RMSNorm, LM head tied to the
    embedding. forward(input_ids: (batch, seqlen)) -> CausalLMOutput(logits (batch, seqlen, padded_vocab))."""

    def __init__(self, config: MambaConfig, initializer_cfg=None, device=None, dtype=None):
        super().__init__()
        if config.d_intermediate:
            raise ValueError("config.d_intermediate: MLP layers are not supported (use 0)")
        if config.attn_layer_idx:
            raise ValueError("config.attn_layer_idx: attention layers are not supported (use [])")
        self.config = config
        vocab_size = config.vocab_size
        if vocab_size % config.pad_vocab_size_multiple:
            vocab_size += config.pad_vocab_size_multiple - vocab_size % config.pad_vocab_size_multiple
        self.backbone = MixerModel(config.d_model, config.n_layer, vocab_size, ssm_cfg=config.ssm_cfg,
                                   rms_norm=config.rms_norm, residual_in_fp32=config.residual_in_fp32,
                                   device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.d_model, vocab_size, bias=False, device=device, dtype=dtype)
        self.apply(lambda m: _init_weights(m, config.n_layer, **(initializer_cfg or {})))
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """-> {layer_idx: (conv_state, ssm_state)} for every layer (see the blocks' allocate_inference_cache)."""
        return self.backbone.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0, **mixer_kwargs):
        """input_ids: (batch, seqlen) int -> CausalLMOutput(logits: (batch, seqlen or num_last_tokens, vocab))."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("input_ids: expected an int32/int64 tensor")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected (batch, seqlen), got shape {tuple(input_ids.shape)}")
        hidden_states = self.backbone(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        return CausalLMOutput(logits=self.lm_head(hidden_states))

    @torch.inference_mode()
    def generate(self, input_ids, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0, eos_token_id=None,
                 return_dict_in_generate=False, output_scores=False, generator=None, **kwargs):
        """input_ids: (batch, prompt_len) -> sequences (batch, <= max_length) (prompt included), mamba_ssm's
        ``GenerationMixin.generate``: top_k=1 is greedy (deterministic); otherwise top-k / top-p sampling at
        ``temperature``. The prompt is one prefill forward (full kernels, states kept), then one decode
        step per token. Sampling is over the unpadded vocabulary. Stops early when every row produced
        eos_token_id. With return_dict_in_generate: GenerateOutput(sequences, scores (list of (batch, vocab)))."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids: expected (batch, prompt_len >= 1), got shape {tuple(input_ids.shape)}")
        batch, plen = input_ids.shape
        if max_length < plen:
            raise ValueError(f"max_length: must be >= the prompt length {plen}, got {max_length}")
        if min_p:
            raise ValueError("min_p: not supported (use 0.0)")
        vocab = self.config.vocab_size
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch)
        params.key_value_memory_dict = self.allocate_inference_cache(batch, max_length)
        seqs, scores = [input_ids], []
        logits = self(input_ids, inference_params=params, num_last_tokens=1).logits[:, -1, :vocab]
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        for t in range(plen, max_length):
            if output_scores:
                scores.append(logits.clone())
            tok = _sample(logits, top_k, top_p, temperature, generator)
            seqs.append(tok[:, None])
            if eos_token_id is not None:
                done |= tok == eos_token_id
                if bool(done.all()):
                    break
            if t + 1 == max_length:
                break
            params.seqlen_offset = t
            logits = self(tok[:, None], inference_params=params, num_last_tokens=1).logits[:, -1, :vocab]
        sequences = torch.cat(seqs, dim=1)
        return GenerateOutput(sequences, scores) if return_dict_in_generate else sequences
