"""Checkpoint directories for ``MambaLMHeadModel.from_pretrained`` / ``save_pretrained`` (local paths only).

Two layouts are read:

- mamba_ssm's (``models/mixer_seq_simple.MambaLMHeadModel.save_pretrained``, the state-spaces/* hub repos):
  ``config.json`` with MambaConfig's fields + ``pytorch_model.bin`` (a state_dict with our names).
- Hugging Face transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` (``config.json`` with
  ``model_type`` "mamba" / "mamba2" + ``model.safetensors``, possibly sharded, or ``pytorch_model.bin``): the
  config keys are mapped to MambaConfig / ssm_cfg and ``backbone.embeddings.`` to ``backbone.embedding.``
  (every other parameter name is already mamba_ssm's); the norms take ``layer_norm_epsilon``.

The other direction, our model as a transformers one (``config_to_hf`` + ``state_dict_to_hf``), uses the same
key tables: ``transformers.AutoConfig.for_model(**config_to_hf(m))`` and a strict ``load_state_dict``.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import zipfile

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


# transformers' PreTrainedConfig.to_json_string writes a float JSON cannot hold as {"__float__": "Infinity"} (also
# "-Infinity", "NaN"): Mamba2Config's default time_step_limit (0.0, inf) is saved that way since transformers 5.
_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_float(obj: dict):
    """json object_hook: a {"__float__": tag} object -> its float; any other object as it is."""
    if obj.keys() == {"__float__"} and obj["__float__"] in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj["__float__"]]
    return obj


def read_config(path: str) -> dict:
    """config.json as a dict; infinities and NaN may be written either way transformers' configs do: the tagged
    object ``{"__float__": "Infinity"}`` (transformers >= 5) or Python's bare ``Infinity`` (older ones)."""
    with open(os.path.join(path, CONFIG_NAME)) as f:
        return json.load(f, object_hook=_special_float)


def _hf_get(cfg: dict, key: str, default):
    value = cfg.get(key, default)
    return default if value is None else value


# transformers config key -> (our block's constructor argument, transformers' default when the key is absent)
_HF_COMMON = {"conv_kernel": ("d_conv", 4), "expand": ("expand", 2), "use_conv_bias": ("conv_bias", True),
              "use_bias": ("bias", False), "time_step_min": ("dt_min", 0.001), "time_step_max": ("dt_max", 0.1),
              "time_step_floor": ("dt_init_floor", 1e-4)}
_HF_KEYS = {
    "mamba": {**_HF_COMMON, "state_size": ("d_state", 16), "time_step_rank": ("dt_rank", "auto"),
              "time_step_scale": ("dt_scale", 1.0), "time_step_init_scheme": ("dt_init", "random")},
    "mamba2": {**_HF_COMMON, "state_size": ("d_state", 128), "head_dim": ("headdim", 64), "n_groups": ("ngroups", 8),
               "chunk_size": ("chunk_size", 256), "time_step_limit": ("dt_limit", (0.0, float("inf")))},
}
_HF_LAYER = {"mamba": "Mamba1", "mamba2": "Mamba2"}


def _dt_limit(value) -> tuple[float, float]:
    """config.json's time_step_limit -> the block's dt_limit (low, high); anything else is a ValueError that
    names the key (instead of a TypeError from the first forward pass)."""
    try:
        low, high = value
        if isinstance(low, bool) or isinstance(high, bool):
            raise TypeError
        return float(low), float(high)
    except (TypeError, ValueError):
        raise ValueError(f"config.json: time_step_limit must be a pair of numbers [low, high], got {value!r}") \
            from None


def config_from_hf(cfg: dict, config_cls):
    """transformers' MambaConfig / Mamba2Config dict -> (our MambaConfig, norm epsilon)."""
    kind = cfg["model_type"]
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (the blocks use silu)")
    hidden = cfg["hidden_size"]
    ssm_cfg = {"layer": _HF_LAYER[kind], **{ours: _hf_get(cfg, key, default)
                                            for key, (ours, default) in _HF_KEYS[kind].items()}}
    if kind == "mamba":
        tie = _hf_get(cfg, "tie_word_embeddings", True)
    else:
        ssm_cfg["dt_limit"] = _dt_limit(ssm_cfg["dt_limit"])
        heads = _hf_get(cfg, "num_heads", 128)
        if heads * ssm_cfg["headdim"] != ssm_cfg["expand"] * hidden:
            raise ValueError(f"config.json: num_heads * head_dim ({heads * ssm_cfg['headdim']}) must equal expand * "
                             f"hidden_size ({ssm_cfg['expand'] * hidden})")
        tie = _hf_get(cfg, "tie_word_embeddings", False)
    config = config_cls(d_model=hidden, d_intermediate=0, n_layer=cfg["num_hidden_layers"],
                        vocab_size=cfg["vocab_size"], ssm_cfg=ssm_cfg, rms_norm=True,
                        residual_in_fp32=_hf_get(cfg, "residual_in_fp32", True), fused_add_norm=True,
                        pad_vocab_size_multiple=1, tie_embeddings=tie)
    return config, _hf_get(cfg, "layer_norm_epsilon", 1e-5)


def _block_args(ssm_cfg: dict) -> tuple[str, dict]:
    """ssm_cfg -> (layer, every constructor argument of that block: ssm_cfg's over the block's defaults)."""
    from .mamba import Mamba
    from .mamba2 import Mamba2

    cfg = dict(ssm_cfg)
    layer = cfg.pop("layer", "Mamba1")
    params = inspect.signature((Mamba if layer == "Mamba1" else Mamba2).__init__).parameters.values()
    return layer, {**{p.name: p.default for p in params if p.default is not inspect.Parameter.empty}, **cfg}


def config_to_hf(model) -> dict:
    """Our MambaLMHeadModel -> the transformers config dict (config.json style, with model_type "mamba" /
    "mamba2") of the same network: the inverse of config_from_hf. vocab_size is the model's padded vocabulary,
    layer_norm_epsilon its final norm's eps. What transformers' MambaForCausalLM / Mamba2ForCausalLM cannot
    express (an MLP, LayerNorm, Mamba2 without its gated RMSNorm after the gate, D per head dim, d_ssm) is a
    ValueError."""
    config = model.config
    if config.d_intermediate or config.attn_layer_idx or not config.rms_norm:
        raise ValueError("model: transformers' Mamba models have no MLP / attention layers and use RMSNorm "
                         "(need d_intermediate=0, attn_layer_idx=[], rms_norm=True)")
    layer, args = _block_args(config.ssm_cfg)
    kind = "mamba" if layer == "Mamba1" else "mamba2"
    if kind == "mamba2" and (not args["rmsnorm"] or args["norm_before_gate"] or args["D_has_hdim"]
                             or args["d_ssm"] not in (None, args["expand"] * config.d_model)):
        raise ValueError("model: transformers' Mamba2 needs rmsnorm=True, norm_before_gate=False, "
                         "D_has_hdim=False and d_ssm=None")
    out = {"model_type": kind, "hidden_size": config.d_model, "num_hidden_layers": config.n_layer,
           "vocab_size": model.backbone.embedding.num_embeddings, "hidden_act": "silu",
           "residual_in_fp32": config.residual_in_fp32, "tie_word_embeddings": config.tie_embeddings,
           "layer_norm_epsilon": model.backbone.norm_f.eps,
           **{key: args[ours] for key, (ours, _) in _HF_KEYS[kind].items()}}
    if kind == "mamba2":
        out["num_heads"] = args["expand"] * config.d_model // args["headdim"]
        out["time_step_limit"] = list(out["time_step_limit"])
    return out


def config_from_mamba_ssm(cfg: dict, config_cls):
    """mamba_ssm's config.json (MambaConfig.__dict__) -> MambaConfig; unknown keys are refused."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"config.json: unknown MambaConfig keys {unknown} (expected mamba_ssm's MambaConfig "
                         f"fields, or a transformers config with model_type in {HF_MODEL_TYPES})")
    return config_cls(**cfg)


def _zip_damage(file: str, size: int) -> str | None:
    """What is wrong with a torch.save zip archive that torch.load refused, or None when its structure is whole
    (then the error is not the file's: a CUDA tensor without CUDA, a refused pickle global ...)."""
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        return None if magic[:1] == b"\x80" else "is not a torch.save file (no zip or pickle signature)"
    if not zipfile.is_zipfile(file):  # the central directory is the archive's last record: cut off first
        return "is truncated: the zip archive torch.save writes ends before its central directory"
    with zipfile.ZipFile(file) as z:
        try:
            bad = z.testzip()
        except (OSError, EOFError, zipfile.BadZipFile) as e:
            return f"is corrupt: its zip archive cannot be read ({e})"
    return None if bad is None else f"is corrupt: {bad!r} inside it fails its CRC check"


def _safetensors_damage(file: str, size: int) -> str | None:
    """What is wrong with a .safetensors file (8-byte little-endian header length, JSON header giving each
    tensor's data_offsets, then the data), or None when its layout is whole."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "is truncated: shorter than the 8-byte header length that starts a safetensors file"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"is truncated: its header claims {n} bytes after the first 8"
        try:
            header = json.loads(f.read(n))
            end = max([0] + [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"])
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "is corrupt: its header is not safetensors JSON"
    if 8 + n + end > size:
        return f"is truncated: its tensors end at byte {8 + n + end}"
    return None


def _load_checked(file: str, load, diagnose):
    """load(file); a failure that diagnose(file, size) traces to the file itself -> ValueError naming the file,
    its size and what is wrong (instead of e.g. a bare ``OSError: [Errno 22]`` from a cut-off zip archive)."""
    try:
        return load(file)
    except Exception as e:  # torch.load: EOFError, OSError, RuntimeError...; safetensors: SafetensorError
        if not os.path.isfile(file):
            raise
        size = os.path.getsize(file)
        damage = "is empty" if size == 0 else diagnose(file, size)
        if damage is None:
            raise
        raise ValueError(f"checkpoint file {file!r} ({size} bytes) {damage}; download or save it again "
                         f"({type(e).__name__}: {e})") from e


def _load_safetensors(files, device):
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("loading model.safetensors needs the safetensors package: "
                          "pip install 'tvm-mamba[hf]' (or pip install safetensors)") from e
    state = {}
    for f in files:
        state.update(_load_checked(f, lambda name: load_file(name, device=str(device or "cpu")),
                                   _safetensors_damage))
    return state


def read_state_dict(path: str, device=None) -> dict:
    """The checkpoint's tensors: pytorch_model.bin, else model.safetensors (or its sharded index). A truncated
    or corrupt file is a ValueError naming it."""
    bin_file = os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(bin_file):
        return _load_checked(bin_file, lambda name: torch.load(name, map_location=device or "cpu",
                                                               weights_only=True), _zip_damage)
    if os.path.isfile(os.path.join(path, SAFE_WEIGHTS_NAME)):
        return _load_safetensors([os.path.join(path, SAFE_WEIGHTS_NAME)], device)
    index = os.path.join(path, SAFE_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return _load_safetensors([os.path.join(path, s) for s in shards], device)
    raise FileNotFoundError(f"pretrained_model_name: {path!r} has none of {WEIGHTS_NAME}, {SAFE_WEIGHTS_NAME}, "
                            f"{SAFE_INDEX_NAME}")


# the one parameter-name difference between the layouts (every other name is the same in both)
HF_EMBED, OUR_EMBED = "backbone.embeddings.", "backbone.embedding."


def _rename_prefix(state: dict, old: str, new: str) -> dict:
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}


def state_dict_from_hf(state: dict, tie: bool) -> dict:
    """transformers' names -> mamba_ssm's: backbone.embeddings.* -> backbone.embedding.*; a tied checkpoint
    without lm_head.weight gets the embedding (our state_dict lists both)."""
    out = _rename_prefix(state, HF_EMBED, OUR_EMBED)
    if tie and "lm_head.weight" not in out and "backbone.embedding.weight" in out:
        out["lm_head.weight"] = out["backbone.embedding.weight"]
    return out


def state_dict_to_hf(state: dict) -> dict:
    """mamba_ssm's names -> transformers': backbone.embedding.* -> backbone.embeddings.* (the inverse of
    state_dict_from_hf; lm_head.weight is kept, tied or not, as transformers' own state_dict lists it)."""
    return _rename_prefix(state, OUR_EMBED, HF_EMBED)


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
