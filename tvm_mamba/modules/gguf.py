"""Our MambaLMHeadModel as a GGUF file that llama.cpp runs natively (architectures ``mamba`` / ``mamba2``).

``save_gguf(model, path, qtype="f32")`` writes the model's config as llama.cpp's hyperparameter keys and its
state_dict as llama.cpp's tensors, with the ``gguf`` package's writer (``pip install 'tvm-mamba[llamacpp]'``).
The names, shapes and conventions are llama.cpp's (its ``llama_model_mamba`` / ``llama_model_mamba2`` loaders,
``src/models/mamba*.cpp``), not transformers' or mamba_ssm's:

- tensors are named ``token_embd``, ``output_norm``, ``output`` (left out when the embedding is tied: llama.cpp
  then reuses ``token_embd``) and per layer ``blk.{i}.attn_norm``, ``ssm_in``, ``ssm_conv1d`` (weight and
  bias), ``ssm_x``, ``ssm_dt`` (Mamba-1: weight and bias; Mamba-2: the bias only, our ``dt_bias``), ``ssm_a``,
  ``ssm_d``, ``ssm_norm`` (Mamba-2's gated RMSNorm), ``ssm_out``;
- ``ssm_a`` holds A = -exp(A_log), not A_log (llama.cpp's scan uses A directly);
- the depthwise conv weight drops its singleton axis: (channels, 1, d_conv) -> (channels, d_conv);
- Mamba-2's per-head A and D become (nheads, 1) and its norm weight (ngroups, d_ssm / ngroups), the layouts
  llama.cpp broadcasts against (one RMS norm per group, as mamba_ssm's RMSNormGated with group_size);
- a tokenizer is required by the loader but we feed token ids only: ``tokenizer.ggml.model = "none"`` with
  ``{arch}.vocab_size`` makes llama.cpp create that many placeholder tokens (its no-vocab path) — text
  in or out (llama_tokenize / detokenize) is then unavailable, which a converted checkpoint with a real
  tokenizer would add.

qtype "q8_0" stores the 2-D ``.weight`` matrices (projections, embedding, LM head) as ggml's Q8_0 (blocks of
32 int8 with one fp16 scale) and keeps in float32 what llama.cpp's converter keeps in float32: 1-D tensors,
norms, the conv weight, A and D. A matrix whose rows are not a multiple of 32 (Mamba-1's dt_proj: rows of
dt_rank = 48 at d_model 768) stays float32 too, where llama.cpp's converter would fall back to fp16.

Every norm in llama.cpp uses the one ``attention.layer_norm_rms_epsilon``: the model's final-norm eps.
What llama.cpp's Mamba graphs cannot express is a ValueError before anything is written: an MLP, attention
layers, LayerNorm, biases on in_proj / out_proj, no conv bias, Mamba-1 with expand != 2, Mamba-2 without its
gated RMSNorm after the gate, with D per head dim, d_ssm < d_inner or a dt_limit.
"""
from __future__ import annotations

import os
import pathlib

import numpy as np
import torch

from .checkpoint import _block_args

QTYPES = ("f32", "q8_0")
ARCH = {"Mamba1": "mamba", "Mamba2": "mamba2"}
Q8_BLOCK = 32  # ggml's QK8_0: elements per Q8_0 block (one fp16 scale each)


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("save_gguf needs the gguf package: pip install 'tvm-mamba[llamacpp]' "
                          "(or pip install gguf)") from e
    return gguf


def _check_supported(model) -> tuple[str, dict]:
    """model -> (our layer name "Mamba1" / "Mamba2", the block's constructor arguments); ValueError naming
    what llama.cpp's graph for that architecture has no place for."""
    config = model.config
    if config.d_intermediate or config.attn_layer_idx or not config.rms_norm:
        raise ValueError("model: llama.cpp's mamba / mamba2 graphs have no MLP or attention layers and use "
                         "RMSNorm (need d_intermediate=0, attn_layer_idx=[], rms_norm=True)")
    layer, args = _block_args(config.ssm_cfg)
    if args["bias"] or not args["conv_bias"]:
        raise ValueError("model: llama.cpp's Mamba layers have no in_proj / out_proj bias and a required conv "
                         f"bias (need bias=False, conv_bias=True; got bias={args['bias']}, "
                         f"conv_bias={args['conv_bias']})")
    if layer == "Mamba1" and args["expand"] != 2:
        raise ValueError(f"model: llama.cpp's mamba graph supports expand=2 only, got {args['expand']}")
    if layer == "Mamba2":
        problems = [name for name, bad in (
            ("rmsnorm=True", not args["rmsnorm"]), ("norm_before_gate=False", args["norm_before_gate"]),
            ("D_has_hdim=False", args["D_has_hdim"]),
            ("d_ssm=None", args["d_ssm"] not in (None, args["expand"] * config.d_model)),
            ("dt_limit=(0.0, inf)", tuple(args["dt_limit"]) != (0.0, float("inf")))) if bad]
        if problems:
            raise ValueError(f"model: llama.cpp's mamba2 graph needs {', '.join(problems)}")
    return layer, args


def _add_hparams(writer, gguf, model, layer: str) -> int:
    """The hyperparameter keys llama.cpp's loader reads for mamba / mamba2 -> the vocabulary size."""
    mixer = model.backbone.layers[0].mixer
    n_vocab, d_model = model.backbone.embedding.weight.shape
    writer.add_context_length(2 ** 20)  # a recurrent model has no trained context; the loader requires a value
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(0)   # read (required) by the generic loader, unused by the SSM graphs
    writer.add_head_count(0)
    writer.add_block_count(len(model.backbone.layers))
    writer.add_layer_norm_rms_eps(model.backbone.norm_f.eps)
    writer.add_ssm_conv_kernel(mixer.d_conv)
    writer.add_ssm_state_size(mixer.d_state)
    if layer == "Mamba1":
        writer.add_ssm_inner_size(mixer.d_inner)
        writer.add_ssm_time_step_rank(mixer.dt_rank)
        writer.add_ssm_dt_b_c_rms(False)  # falcon-mamba's extra norms on dt / B / C: not in Mamba-1
    else:
        writer.add_ssm_inner_size(mixer.d_ssm)
        writer.add_ssm_time_step_rank(mixer.nheads)  # llama.cpp's name for Mamba-2's head count
        writer.add_ssm_group_count(mixer.ngroups)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("none")
    return n_vocab


def _layer_tensors(gguf, layer: str, i: int, mixer, norm_weight) -> dict:
    """One block's tensors, llama.cpp's name -> float32 numpy array in llama.cpp's layout (see the module
    docstring)."""
    def name(kind, suffix="weight"):
        base = gguf.TENSOR_NAMES[kind].format(bid=i)
        return f"{base}.{suffix}" if suffix else base

    t = gguf.MODEL_TENSOR
    out = {name(t.ATTN_NORM): norm_weight, name(t.SSM_IN): mixer.in_proj.weight,
           name(t.SSM_CONV1D): mixer.conv1d.weight.squeeze(1), name(t.SSM_CONV1D, "bias"): mixer.conv1d.bias,
           name(t.SSM_A, None): -torch.exp(mixer.A_log.float()), name(t.SSM_OUT): mixer.out_proj.weight}
    if layer == "Mamba1":
        out.update({name(t.SSM_X): mixer.x_proj.weight, name(t.SSM_DT): mixer.dt_proj.weight,
                    name(t.SSM_DT, "bias"): mixer.dt_proj.bias, name(t.SSM_D, None): mixer.D})
    else:
        out[name(t.SSM_A, None)] = out[name(t.SSM_A, None)].reshape(-1, 1)
        out.update({name(t.SSM_DT, "bias"): mixer.dt_bias, name(t.SSM_D, None): mixer.D.reshape(-1, 1),
                    name(t.SSM_NORM): mixer.norm.weight.reshape(mixer.ngroups, -1)})
    return {k: v.detach().float().cpu().contiguous().numpy() for k, v in out.items()}


def model_tensors(model) -> dict:
    """Every tensor of the GGUF file, llama.cpp's name -> float32 numpy array, in the order written."""
    gguf = _import_gguf()
    layer, _ = _check_supported(model)
    t = gguf.MODEL_TENSOR
    backbone = model.backbone

    def weight(kind):
        return gguf.TENSOR_NAMES[kind] + ".weight"

    out = {weight(t.TOKEN_EMBD): backbone.embedding.weight.detach().float().cpu().numpy()}
    for i, block in enumerate(backbone.layers):
        out.update(_layer_tensors(gguf, layer, i, block.mixer, block.norm.weight))
    out[weight(t.OUTPUT_NORM)] = backbone.norm_f.weight.detach().float().cpu().numpy()
    if not model.config.tie_embeddings:
        out[weight(t.OUTPUT)] = model.lm_head.weight.detach().float().cpu().numpy()
    return out


def _quantizable(name: str, array: np.ndarray) -> bool:
    """Q8_0 for 2-D ``.weight`` matrices other than norms and the conv (llama.cpp's converter's rule) whose
    rows split into whole 32-element blocks."""
    return (array.ndim == 2 and name.endswith(".weight") and not name.endswith("_norm.weight")
            and ".ssm_conv1d." not in name and array.shape[-1] % Q8_BLOCK == 0)


def save_gguf(model, path, qtype: str = "f32", name: str | None = None) -> pathlib.Path:
    """Write ``model`` (our MambaLMHeadModel, Mamba-1 or Mamba-2 blocks) to ``path`` as a GGUF file for
    llama.cpp: architecture ``mamba`` / ``mamba2``, weights in float32 (qtype "f32") or Q8_0 matrices
    (qtype "q8_0"; see the module docstring for which tensors). name: the file's ``general.name``.
    Returns the path. The file is written whole or not at all (a temporary name, then a rename)."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype: expected one of {QTYPES}, got {qtype!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path, got {type(path).__name__}")
    gguf = _import_gguf()
    layer, _ = _check_supported(model)
    tensors = model_tensors(model)
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), ARCH[layer])
    try:
        if name:
            writer.add_name(name)
        _add_hparams(writer, gguf, model, layer)
        q8 = qtype == "q8_0"
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
        if q8:
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for tensor_name, array in tensors.items():
            if q8 and _quantizable(tensor_name, array):
                writer.add_tensor(tensor_name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(tensor_name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
