"""Checkpoint directories for ``MambaLMHeadModel.from_pretrained`` / ``save_pretrained`` (local paths only).

Two layouts are read:

- mamba_ssm's (``models/mixer_seq_simple.MambaLMHeadModel.save_pretrained``, the state-spaces/* hub repos):
  ``config.json`` with MambaConfig's fields + ``pytorch_model.bin`` (a state_dict with our names).
- Hugging Face transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` (``config.json`` with
  ``model_type`` "mamba" / "mamba2" + ``model.safetensors``, possibly sharded, or ``pytorch_model.bin``): the
  config keys are mapped to MambaConfig / ssm_cfg and ``backbone.embeddings.`` to ``backbone.embedding.``
  (every other parameter name is already mamba_ssm's); the norms take ``layer_norm_epsilon``.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
HF_MODEL_TYPES = ("mamba", "mamba2")


def checkpoint_dir(path) -> str:
    """The local directory ``path``; a hub id (anything that is not an existing directory) is refused."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"pretrained_model_name: expected a local directory path, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"pretrained_model_name: {path!r} is not a local directory. tvm_mamba does not download "
                         "from the Hugging Face hub: download the checkpoint first (e.g. `huggingface-cli download "
                         f"{path} --local-dir DIR`) and pass the local path")
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise FileNotFoundError(f"pretrained_model_name: {path!r} has no {CONFIG_NAME}")
    return path


def read_config(path: str) -> dict:
    with open(os.path.join(path, CONFIG_NAME)) as f:
        return json.load(f)


def _hf_get(cfg: dict, key: str, default):
    value = cfg.get(key, default)
    return default if value is None else value


def config_from_hf(cfg: dict, config_cls):
    """transformers' MambaConfig / Mamba2Config dict -> (our MambaConfig, norm epsilon)."""
    kind = cfg["model_type"]
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (the blocks use silu)")
    hidden = cfg["hidden_size"]
    common = dict(d_state=_hf_get(cfg, "state_size", 16 if kind == "mamba" else 128),
                  d_conv=_hf_get(cfg, "conv_kernel", 4), expand=_hf_get(cfg, "expand", 2),
                  conv_bias=_hf_get(cfg, "use_conv_bias", True), bias=_hf_get(cfg, "use_bias", False),
                  dt_min=_hf_get(cfg, "time_step_min", 0.001), dt_max=_hf_get(cfg, "time_step_max", 0.1),
                  dt_init_floor=_hf_get(cfg, "time_step_floor", 1e-4))
    if kind == "mamba":
        rank = _hf_get(cfg, "time_step_rank", "auto")
        ssm_cfg = dict(layer="Mamba1", dt_rank=rank, dt_scale=_hf_get(cfg, "time_step_scale", 1.0),
                       dt_init=_hf_get(cfg, "time_step_init_scheme", "random"), **common)
        tie = _hf_get(cfg, "tie_word_embeddings", True)
    else:
        heads, headdim = _hf_get(cfg, "num_heads", 128), _hf_get(cfg, "head_dim", 64)
        if heads * headdim != common["expand"] * hidden:
            raise ValueError(f"config.json: num_heads * head_dim ({heads * headdim}) must equal expand * hidden_size "
                             f"({common['expand'] * hidden})")
        ssm_cfg = dict(layer="Mamba2", headdim=headdim, ngroups=_hf_get(cfg, "n_groups", 8),
                       chunk_size=_hf_get(cfg, "chunk_size", 256),
                       dt_limit=tuple(_hf_get(cfg, "time_step_limit", (0.0, float("inf")))), **common)
        tie = _hf_get(cfg, "tie_word_embeddings", False)
    config = config_cls(d_model=hidden, d_intermediate=0, n_layer=cfg["num_hidden_layers"],
                        vocab_size=cfg["vocab_size"], ssm_cfg=ssm_cfg, rms_norm=True,
                        residual_in_fp32=_hf_get(cfg, "residual_in_fp32", True), fused_add_norm=True,
                        pad_vocab_size_multiple=1, tie_embeddings=tie)
    return config, _hf_get(cfg, "layer_norm_epsilon", 1e-5)


def config_from_mamba_ssm(cfg: dict, config_cls):
    """mamba_ssm's config.json (MambaConfig.__dict__) -> MambaConfig; unknown keys are refused."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"config.json: unknown MambaConfig keys {unknown} (expected mamba_ssm's MambaConfig "
                         f"fields, or a transformers config with model_type in {HF_MODEL_TYPES})")
    return config_cls(**cfg)


def _load_safetensors(files, device):
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("loading model.safetensors needs the safetensors package: "
                          "pip install 'tvm-mamba[hf]' (or pip install safetensors)") from e
    state = {}
    for f in files:
        state.update(load_file(f, device=str(device or "cpu")))
    return state


def read_state_dict(path: str, device=None) -> dict:
    """The checkpoint's tensors: pytorch_model.bin, else model.safetensors (or its sharded index)."""
    bin_file = os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(bin_file):
        return torch.load(bin_file, map_location=device or "cpu", weights_only=True)
    if os.path.isfile(os.path.join(path, SAFE_WEIGHTS_NAME)):
        return _load_safetensors([os.path.join(path, SAFE_WEIGHTS_NAME)], device)
    index = os.path.join(path, SAFE_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return _load_safetensors([os.path.join(path, s) for s in shards], device)
    raise FileNotFoundError(f"pretrained_model_name: {path!r} has none of {WEIGHTS_NAME}, {SAFE_WEIGHTS_NAME}, "
                            f"{SAFE_INDEX_NAME}")


def state_dict_from_hf(state: dict, tie: bool) -> dict:
    """transformers' names -> mamba_ssm's: backbone.embeddings.* -> backbone.embedding.*; a tied checkpoint
    without lm_head.weight gets the embedding (our state_dict lists both)."""
    out = {}
    for k, v in state.items():
        if k.startswith("backbone.embeddings."):
            k = "backbone.embedding." + k[len("backbone.embeddings."):]
        out[k] = v
    if tie and "lm_head.weight" not in out and "backbone.embedding.weight" in out:
        out["lm_head.weight"] = out["backbone.embedding.weight"]
    return out


def set_norm_eps(model, eps: float) -> None:
    """Every RMSNorm of the model (block norms, norm_f, Mamba2's gated norm) takes ``eps`` (transformers'
    layer_norm_epsilon; mamba_ssm fixes 1e-5)."""
    for module in model.modules():
        if hasattr(module, "eps") and hasattr(module, "weight") and module.weight is not None \
                and module.weight.dim() == 1:
            module.eps = eps


def save(model, save_directory) -> None:
    """mamba_ssm's save_pretrained: config.json (MambaConfig.__dict__) + pytorch_model.bin (state_dict)."""
    os.makedirs(save_directory, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(save_directory, WEIGHTS_NAME))
    with open(os.path.join(save_directory, CONFIG_NAME), "w") as f:
        json.dump(dataclasses.asdict(model.config), f, indent=4)
