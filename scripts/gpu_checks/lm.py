"""Whole-LM cases: a 130M and a 370M MambaLMHeadModel (Mamba-1 and Mamba-2 mixers, the released checkpoints'
dims, random weights), prefill then token-by-token decode, in fp32 and bf16, against the float64 PyTorch
model path the tests use (reference/blocks.py ``lm_ref`` over ``mamba_ref`` / ``mamba2_ref``, on the same
weights). Rows: ok, max error of the prefill and decode logits (relative to the reference's largest
magnitude), prefill ms and decode ms per token (CUDA events; wall clock on a CPU).

Small cases (and every case on a CPU) keep two layers; the GPU's full cases run every layer.
"""
from __future__ import annotations

import functools

import torch

from .common import Case, timer

MODELS = {  # preset -> (mixer, d_model, n_layer, mixer config)
    "mamba-130m": ("Mamba1", 768, 24, {"d_state": 16}),
    "mamba-370m": ("Mamba1", 1024, 48, {"d_state": 16}),
    "mamba2-130m": ("Mamba2", 768, 24, {"d_state": 128, "headdim": 64}),
    "mamba2-370m": ("Mamba2", 1024, 48, {"d_state": 128, "headdim": 64}),
}
VOCAB = 50277
REL = {"float32": 1e-3, "bfloat16": 6e-2}  # max |logits - ref| / max |ref|: fp32 rounding; bf16 activations


def cases(device_type: str, small: bool) -> list[Case]:
    """Small: the 130M models, 2 layers, 16 tokens + 4 decode steps; else both sizes, (cuda) every layer,
    batch 2, 512 tokens + 16 decode steps (cpu: 2 layers, 12 + 3)."""
    out = []
    for preset, (layer, d_model, n_layer, cfg) in MODELS.items():
        if small and not preset.endswith("130m"):
            continue
        layers = n_layer if device_type == "cuda" and not small else 2
        b, L, steps = (1, 16, 4) if small else ((2, 512, 16) if device_type == "cuda" else (1, 12, 3))
        for dtype in ("float32", "bfloat16"):
            static = dict(layer=layer, d_model=d_model, n_layer=layers, **cfg)
            out.append(Case("lm", "prefill+decode", static, {"x": dtype}, {"batch": b, "seqlen": L, "decode": steps},
                            "small" if small else "lm", preset))
    return out


def _model(case: Case):
    from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

    s = case.static
    torch.manual_seed(0)
    cfg = {k: v for k, v in s.items() if k not in ("d_model", "n_layer")}
    model = MambaLMHeadModel(MambaConfig(d_model=s["d_model"], n_layer=s["n_layer"], vocab_size=VOCAB, ssm_cfg=cfg))
    return model.to(getattr(torch, case.dtypes["x"])).eval()


def _reference(model, case: Case, ids):
    from tvm_mamba.reference.blocks import lm_ref, mamba2_ref, mamba_ref

    s = case.static
    p64 = {k: v.detach().double() for k, v in model.named_parameters()}
    p64["lm_head.weight"] = p64["backbone.embedding.weight"]  # tied
    mixer = (functools.partial(mamba2_ref, headdim=s["headdim"], d_state=s["d_state"]) if s["layer"] == "Mamba2"
             else mamba_ref)
    return lm_ref(p64, ids, mixer, n_layer=s["n_layer"])


def check(case: Case) -> dict:
    """Prefill + decode on the device (one simcheck.target block), the float64 reference's logits, the
    comparisons (simcheck.compare, so the row's errors come from its log), then the timings."""
    from tvm_mamba.tools import simcheck
    from tvm_mamba.modules.lm import InferenceParams


    b, L, steps = (case.sizes[k] for k in ("batch", "seqlen", "decode"))
    model = _model(case)
    ids = torch.randint(0, VOCAB, (b, L + steps), generator=simcheck.generator(1))
    params = InferenceParams(max_seqlen=L + steps, max_batch_size=b)
    params.key_value_memory_dict = model.allocate_inference_cache(b, L + steps)
    with torch.no_grad():
        with simcheck.target("sm_90"):
            logits = [model(ids[:, :L], inference_params=params).logits]
            for t in range(L, L + steps):
                params.seqlen_offset = t
                logits.append(model(ids[:, t:t + 1], inference_params=params).logits)
        ref = _reference(model, case, ids)[..., :VOCAB]  # both without the vocabulary's padding rows
        got = torch.cat(logits, dim=1)[..., :VOCAB]
        atol = REL[case.dtypes["x"]] * ref.abs().max().item()
        simcheck.compare("prefill logits", got[:, :L], ref[:, :L], 0.0, atol)
        simcheck.compare("decode logits", got[:, L:], ref[:, L:], 0.0, atol)
        params.seqlen_offset = 0
        prefill_ms = timer(ids.device, lambda: model(ids[:, :L], inference_params=params), 3, warmup=1)
        params.seqlen_offset = L
        decode_ms = timer(ids.device, lambda: model(ids[:, L:L + 1], inference_params=params), 10)
    return {"time_ms": prefill_ms, "decode_ms": decode_ms, "prefill_tok_s": b * L / prefill_ms * 1e3,
            "decode_tok_s": b / decode_ms * 1e3}
