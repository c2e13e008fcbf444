"""A small Mamba language model: mamba_ssm 2.3.x's ``models/mixer_seq_simple.MambaLMHeadModel`` on our blocks.

State dict names match upstream (``backbone.embedding.weight``, ``backbone.layers.{i}.norm.weight``,
``backbone.layers.{i}.mixer.*``, ``.norm2`` / ``.mlp.fc1`` / ``.mlp.fc2`` with d_intermediate > 0,
``backbone.norm_f.weight``, ``lm_head.weight`` tied to the embedding), so an upstream checkpoint without
attention layers loads. The block is upstream's Block (upstream's fused_add_norm=True default: one add+norm kernel, layer_norm_fn(prenorm=True); else
residual = h + residual, h = norm(residual)), residual kept in float32 with residual_in_fp32. RMSNorm
(rms_norm=True) or LayerNorm (torch.nn.LayerNorm's parameters, as upstream): both run on layer_norm_fn.

Generation (``generate``, upstream's GenerationMixin / decode loop in generation.py): the prompt runs through
the full (chunked / scan) kernels once, filling each layer's (conv_state, ssm_state); then one ``step`` per new
token through the decode kernels, as one cached plan for the whole model where nothing needs autograd
(modules/_decode.py: the same ops on preallocated buffers, kernel launches replayed).
``from_pretrained`` / ``save_pretrained``: checkpoint.py.
"""
from __future__ import annotations

import copy
import math
from collections import namedtuple
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..torch_ops.layer_norm import layer_norm_fn
from . import _decode, checkpoint
from .generation import GenerationMixin, InferenceParams  # noqa: F401  (InferenceParams: re-exported)
from .layer_norm import RMSNorm
from .linear import Linear
from .mamba import Mamba
from .mamba2 import Mamba2
from .mamba3 import Mamba3
from .mlp import GatedMLP

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


@dataclass
class MambaConfig:
    """mamba_ssm's MambaConfig fields. ssm_cfg["layer"] picks "Mamba1" (default), "Mamba2" or "Mamba3" (SISO,
    inference only; an extension: upstream's create_block has no Mamba3); the other ssm_cfg entries go to the
    block's constructor."""
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


def _norm(norm, x):
    """norm(x) on the layer_norm kernel: RMSNorm or torch.nn.LayerNorm parameters (weight, bias, eps)."""
    return layer_norm_fn(x, norm.weight, norm.bias, eps=norm.eps, is_rms_norm=isinstance(norm, RMSNorm))


class Block(nn.Module):
    """upstream's ``modules/block.Block``: Block(dim, mixer_cls, mlp_cls=nn.Identity, norm_cls, fused_add_norm,
    residual_in_fp32), forward(h, residual) -> (out, residual'): residual' = h + residual, out =
    mixer(norm(residual')); with an MLP, residual' += out and out = mlp(norm2(residual')). The residual is float32
    with residual_in_fp32; with fused_add_norm each add + norm is one kernel (layer_norm_fn, prenorm)."""

    def __init__(self, dim, mixer_cls, mlp_cls=nn.Identity, norm_cls=RMSNorm, fused_add_norm=False,
                 residual_in_fp32=False):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.fused_add_norm = fused_add_norm
        self.norm = norm_cls(dim)
        self.mixer = mixer_cls(dim)
        if mlp_cls is not nn.Identity:
            self.norm2 = norm_cls(dim)
            self.mlp = mlp_cls(dim)
        else:
            self.mlp = None

    def _add_norm(self, norm, hidden_states, residual):
        """-> (norm(hidden_states + residual), hidden_states + residual) (residual None: hidden_states alone)."""
        if self.fused_add_norm:
            return layer_norm_fn(hidden_states, norm.weight, norm.bias, residual=residual, prenorm=True,
                                 residual_in_fp32=self.residual_in_fp32, eps=norm.eps,
                                 is_rms_norm=isinstance(norm, RMSNorm))
        residual = (hidden_states + residual) if residual is not None else hidden_states
        hidden_states = _norm(norm, residual.to(dtype=norm.weight.dtype))
        return hidden_states, (residual.to(torch.float32) if self.residual_in_fp32 else residual)

    def forward(self, hidden_states, residual=None, inference_params=None, **mixer_kwargs):
        hidden_states, residual = self._add_norm(self.norm, hidden_states, residual)
        hidden_states = self.mixer(hidden_states, inference_params=inference_params, **mixer_kwargs)
        if self.mlp is not None:
            hidden_states, residual = self._add_norm(self.norm2, hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)


MIXERS = {"Mamba1": Mamba, "Mamba2": Mamba2, "Mamba3": Mamba3}  # ssm_cfg["layer"] -> the mixer class


def create_block(d_model, d_intermediate=0, ssm_cfg=None, attn_layer_idx=None, attn_cfg=None, norm_epsilon=1e-5,
                 rms_norm=True, residual_in_fp32=False, fused_add_norm=False, layer_idx=None, device=None,
                 dtype=None):
    """upstream's create_block without attention layers: a Mamba1/Mamba2/Mamba3 mixer (ssm_cfg["layer"]), a GatedMLP
    of d_intermediate hidden features when d_intermediate > 0, RMSNorm (rms_norm) or torch's LayerNorm, as
    upstream (both run on layer_norm_fn)."""
    if attn_layer_idx:
        raise ValueError("attn_layer_idx: attention layers are not supported (use [])")
    fk = {"device": device, "dtype": dtype}
    cfg = copy.deepcopy(ssm_cfg or {})
    layer = cfg.pop("layer", "Mamba1")
    if layer not in MIXERS:
        raise ValueError(f"ssm_cfg: 'layer' must be one of {sorted(MIXERS)}, got {layer!r}")
    mixer_cls = partial(MIXERS[layer], layer_idx=layer_idx, **cfg, **fk)
    norm_cls = partial(RMSNorm if rms_norm else nn.LayerNorm, eps=norm_epsilon, **fk)
    mlp_cls = (nn.Identity if not d_intermediate
               else partial(GatedMLP, hidden_features=d_intermediate, out_features=d_model, **fk))
    block = Block(d_model, mixer_cls, mlp_cls, norm_cls=norm_cls,
                  fused_add_norm=fused_add_norm, residual_in_fp32=residual_in_fp32)
    block.layer_idx = layer_idx
    return block


class MixerModel(nn.Module):
    """Embedding -> n_layer Blocks -> final RMSNorm. input_ids: (batch, seqlen) -> (batch, seqlen, d_model).
    upstream's constructor (attention layers are refused)."""

    def __init__(self, d_model, n_layer, d_intermediate=0, vocab_size=50277, ssm_cfg=None, attn_layer_idx=None,
                 attn_cfg=None, norm_epsilon=1e-5, rms_norm=True, initializer_cfg=None, fused_add_norm=False,
                 residual_in_fp32=False, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.residual_in_fp32 = residual_in_fp32
        self.fused_add_norm = fused_add_norm
        self.embedding = nn.Embedding(vocab_size, d_model, **fk)
        self.layers = nn.ModuleList(
            create_block(d_model, d_intermediate, ssm_cfg, attn_layer_idx, attn_cfg, norm_epsilon, rms_norm,
                         residual_in_fp32, fused_add_norm, layer_idx=i, **fk) for i in range(n_layer))
        self.norm_f = (RMSNorm if rms_norm else nn.LayerNorm)(d_model, eps=norm_epsilon, **fk)
        self.apply(partial(_init_weights, n_layer=n_layer, **(initializer_cfg or {}),
                           n_residuals_per_layer=1 if d_intermediate == 0 else 2))

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def check_ids(self, input_ids):
        """IndexError for a token id outside the (padded) vocabulary, before anything runs."""
        vocab = self.embedding.num_embeddings
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise IndexError(f"input_ids: token ids must be in [0, {vocab}) (the padded vocabulary), got "
                             f"min {int(input_ids.min())}, max {int(input_ids.max())}")

    def forward(self, input_ids, inference_params=None, **mixer_kwargs):
        self.check_ids(input_ids)
        hidden_states = self.embedding(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params=inference_params,
                                            **mixer_kwargs)
        if self.fused_add_norm:
            return layer_norm_fn(hidden_states, self.norm_f.weight, self.norm_f.bias, residual=residual,
                                 prenorm=False, residual_in_fp32=self.residual_in_fp32, eps=self.norm_f.eps,
                                 is_rms_norm=isinstance(self.norm_f, RMSNorm))
        residual = (hidden_states + residual) if residual is not None else hidden_states
        return _norm(self.norm_f, residual.to(dtype=self.norm_f.weight.dtype))


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


class MambaLMHeadModel(nn.Module, GenerationMixin):
    """Embedding, n_layer (RMSNorm -> Mamba/Mamba2 + residual) blocks, final RMSNorm, LM head tied to the
    embedding. forward(input_ids: (batch, seqlen)) -> CausalLMOutput(logits (batch, seqlen, padded_vocab))."""

    def __init__(self, config: MambaConfig, initializer_cfg=None, device=None, dtype=None):
        super().__init__()
        if config.attn_layer_idx:
            raise ValueError("config.attn_layer_idx: attention layers are not supported (use [])")
        self.config = config
        vocab_size = config.vocab_size
        if vocab_size % config.pad_vocab_size_multiple:
            vocab_size += config.pad_vocab_size_multiple - vocab_size % config.pad_vocab_size_multiple
        self.backbone = MixerModel(config.d_model, config.n_layer, config.d_intermediate, vocab_size,
                                   ssm_cfg=config.ssm_cfg, attn_layer_idx=config.attn_layer_idx,
                                   attn_cfg=config.attn_cfg, rms_norm=config.rms_norm,
                                   initializer_cfg=initializer_cfg, fused_add_norm=config.fused_add_norm,
                                   residual_in_fp32=config.residual_in_fp32, device=device, dtype=dtype)
        self.lm_head = Linear(config.d_model, vocab_size, bias=False, device=device, dtype=dtype)
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
        if inference_params is not None and inference_params.seqlen_offset > 0 and not mixer_kwargs:
            plan = _decode.lm_plan(self, input_ids, inference_params)
            if plan is not None:  # one decode token, no autograd / tracing: the cached plan, same ops and bits
                self.backbone.check_ids(input_ids)
                return CausalLMOutput(logits=plan.step(input_ids))
        hidden_states = self.backbone(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        return CausalLMOutput(logits=_decode.project(self.lm_head, hidden_states))  # the decode plan's LM head

    @classmethod
    def from_pretrained(cls, pretrained_model_name, device=None, dtype=None, **kwargs):
        """A local checkpoint directory -> model (strict load). mamba_ssm's layout (config.json with
        MambaConfig's fields + pytorch_model.bin) or a transformers MambaForCausalLM / Mamba2ForCausalLM
        directory (config.json with model_type mamba / mamba2 + model.safetensors; needs safetensors). Tensors
        are cast to the model's dtype (float32 unless dtype is given). A hub id is refused (no downloads)."""
        path = checkpoint.checkpoint_dir(pretrained_model_name)
        cfg = checkpoint.read_config(path)
        hf = cfg.get("model_type") in checkpoint.HF_MODEL_TYPES
        config, eps = (checkpoint.config_from_hf(cfg, MambaConfig) if hf
                       else (checkpoint.config_from_mamba_ssm(cfg, MambaConfig), None))
        model = cls(config, device=device, dtype=dtype, **kwargs)
        state = checkpoint.read_state_dict(path)
        if hf:
            state = checkpoint.state_dict_from_hf(state, config.tie_embeddings)
            checkpoint.set_norm_eps(model, eps)
        model.load_state_dict(state, strict=True)
        return model

    def save_pretrained(self, save_directory):
        """mamba_ssm's layout: save_directory/config.json (the MambaConfig) + pytorch_model.bin (state_dict)."""
        checkpoint.save(self, save_directory)
