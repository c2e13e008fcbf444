"""tvm_mamba.modules.gguf: our MambaLMHeadModel as a llama.cpp GGUF file.

Without llama.cpp: the file's keys, tensor names, layouts and values read back with gguf's reader, checked
against the model's parameters (not against save_gguf's own tables); Q8_0 matrices dequantize to the weights
within half a quantization step; what llama.cpp cannot run is refused before a file exists. With
llama-cpp-python installed: llama.cpp's logits on the exported tiny models equal ours (prefill and 32
decode steps, 2 sequences), and greedy decoding picks the same 32 tokens. Both skip without their package."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

gguf = pytest.importorskip("gguf")
from tvm_mamba.modules.gguf import save_gguf  # noqa: E402

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
M2 = dict(layer="Mamba2", d_state=16, headdim=32, ngroups=2, chunk_size=16)


def tiny(layer="Mamba1", tie=True, d_model=64, vocab=96, **ssm):
    torch.manual_seed(0)
    cfg = dict(M2, **ssm) if layer == "Mamba2" else dict(layer="Mamba1", **ssm)
    return MambaLMHeadModel(MambaConfig(d_model=d_model, n_layer=2, vocab_size=vocab, ssm_cfg=cfg,
                                        tie_embeddings=tie, pad_vocab_size_multiple=1)).eval()


def read(path):
    reader = gguf.GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    return fields, {t.name: t for t in reader.tensors}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_keys_names_and_layouts(tmp_path, layer):
    model = tiny(layer, tie=layer == "Mamba1")
    fields, tensors = read(save_gguf(model, tmp_path / "m.gguf", name="tiny"))
    arch = "mamba" if layer == "Mamba1" else "mamba2"
    mixer = model.backbone.layers[1].mixer
    assert fields["general.architecture"] == arch and fields["general.name"] == "tiny"
    assert fields["tokenizer.ggml.model"] == "none" and fields[f"{arch}.vocab_size"] == 96
    assert (fields[f"{arch}.block_count"], fields[f"{arch}.embedding_length"]) == (2, 64)
    assert fields[f"{arch}.ssm.conv_kernel"] == 4 and fields[f"{arch}.ssm.inner_size"] == 128
    assert fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(model.backbone.norm_f.eps)
    got = {name: t.data for name, t in tensors.items() if name.startswith("blk.1.")}
    want = {"blk.1.attn_norm.weight": _np(model.backbone.layers[1].norm.weight),
            "blk.1.ssm_in.weight": _np(mixer.in_proj.weight), "blk.1.ssm_out.weight": _np(mixer.out_proj.weight),
            "blk.1.ssm_conv1d.weight": _np(mixer.conv1d.weight[:, 0, :]),
            "blk.1.ssm_conv1d.bias": _np(mixer.conv1d.bias), "blk.1.ssm_a": -np.exp(_np(mixer.A_log))}
    if layer == "Mamba1":
        assert fields["mamba.ssm.state_size"] == 16 and fields["mamba.ssm.time_step_rank"] == 4
        assert fields["mamba.ssm.dt_b_c_rms"] is False
        want.update({"blk.1.ssm_x.weight": _np(mixer.x_proj.weight), "blk.1.ssm_dt.weight": _np(mixer.dt_proj.weight),
                     "blk.1.ssm_dt.bias": _np(mixer.dt_proj.bias), "blk.1.ssm_d": _np(mixer.D)})
        assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    else:  # time_step_rank is llama.cpp's head count; A, D per head as (nheads, 1); the norm per group
        assert (fields["mamba2.ssm.time_step_rank"], fields["mamba2.ssm.group_count"]) == (4, 2)
        want.update({"blk.1.ssm_dt.bias": _np(mixer.dt_bias), "blk.1.ssm_d": _np(mixer.D)[:, None],
                     "blk.1.ssm_a": -np.exp(_np(mixer.A_log))[:, None],
                     "blk.1.ssm_norm.weight": _np(mixer.norm.weight).reshape(2, 64)})
        np.testing.assert_array_equal(tensors["output.weight"].data, _np(model.lm_head.weight))
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)  # -exp(A_log): float32 rounding
    np.testing.assert_array_equal(tensors["token_embd.weight"].data, _np(model.backbone.embedding.weight))
    np.testing.assert_array_equal(tensors["output_norm.weight"].data, _np(model.backbone.norm_f.weight))


def test_q8_0_quantizes_the_matrices_only(tmp_path):
    model = tiny("Mamba1", d_model=64, vocab=96)
    fields, tensors = read(save_gguf(model, tmp_path / "q.gguf", qtype="q8_0"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    quantized = {name for name, t in tensors.items() if t.tensor_type == q8}
    # dt_proj's rows (dt_rank 4) are not whole 32-element blocks: kept float32, as are norms, conv, A, D
    assert quantized == {"token_embd.weight"} | {f"blk.{i}.{n}.weight" for i in range(2) for n in ("ssm_in", "ssm_x",
                                                                                                   "ssm_out")}
    weight = _np(model.backbone.layers[0].mixer.in_proj.weight)
    deq = gguf.quants.dequantize(tensors["blk.0.ssm_in.weight"].data, q8)
    step = np.abs(weight.reshape(-1, 32)).max(axis=1) / 127  # one int8 step per 32-element block
    err = np.abs(deq - weight).reshape(-1, 32).max(axis=1)
    # half a step, plus the step's own fp16 rounding (2**-11 relative) carried over up to 127 steps
    assert deq.shape == weight.shape and (err <= (0.5 + 127 * 2.0 ** -11) * step).all()


@pytest.mark.parametrize("layer, ssm, match", [
    ("Mamba1", dict(expand=3), "expand=2"), ("Mamba1", dict(bias=True), "bias=False"),
    ("Mamba1", dict(conv_bias=False), "conv_bias=True"), ("Mamba2", dict(D_has_hdim=True), "D_has_hdim=False"),
    ("Mamba2", dict(norm_before_gate=True), "norm_before_gate=False"),
    ("Mamba2", dict(dt_limit=(0.0, 0.5)), "dt_limit")])
def test_refuses_what_llamacpp_cannot_run(tmp_path, layer, ssm, match):
    with pytest.raises(ValueError, match=match):
        save_gguf(tiny(layer, **ssm), tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_refuses_bad_arguments(tmp_path):
    model = tiny()
    with pytest.raises(ValueError, match="qtype"):
        save_gguf(model, tmp_path / "m.gguf", qtype="q4_0")
    with pytest.raises(TypeError, match="path"):
        save_gguf(model, 3)
    with pytest.raises(ValueError, match="MLP or attention"):
        save_gguf(MambaLMHeadModel(MambaConfig(d_model=64, n_layer=1, vocab_size=96, d_intermediate=32)),
                  tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------------------
# llama.cpp itself (llama-cpp-python)
def _import_runner(monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _llamacpp

    return _llamacpp


def _ours(model, ids, steps: int):
    """Ours' greedy decode: (tokens (batch, steps), logits per step [(batch, vocab)] * steps)."""
    with torch.inference_mode():
        out = model.generate(ids, max_length=ids.shape[1] + steps, return_dict_in_generate=True,
                             output_scores=True)
    return out.sequences[:, ids.shape[1]:], list(out.scores)


def _theirs(lm, ids, tokens):
    """llama.cpp fed the prompt, then ours' tokens one step at a time -> its logits before each token."""
    lm.reset()
    logits = [lm.forward(ids.numpy())]
    for t in range(tokens.shape[1] - 1):
        logits.append(lm.forward(tokens[:, t:t + 1].numpy()))
    return [torch.from_numpy(x) for x in logits]


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_llamacpp_logits_and_greedy_tokens_equal_ours(tmp_path, monkeypatch, layer):
    llamacpp = _import_runner(monkeypatch)
    model = tiny(layer, tie=layer == "Mamba1", vocab=512)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    tokens, ours = _ours(model, ids, steps=32)
    lm = llamacpp.LlamaCpp(save_gguf(model, tmp_path / "m.gguf"), n_threads=2, n_seq=2, max_tokens=48)
    try:
        theirs = _theirs(lm, ids, tokens)
        with pytest.raises(ValueError, match="exceeds"):
            lm.forward(np.zeros((3, 1), dtype=np.int64))
    finally:
        lm.close()
    scale = max(float(x.abs().max()) for x in ours)
    for step, (a, b) in enumerate(zip(theirs, ours)):
        err = float((a - b).abs().max())
        assert err <= 1e-4 * scale, f"step {step}: max |llama.cpp - ours| {err:.3g} > 1e-4 * {scale:.3g}"
    assert torch.equal(torch.stack([x.argmax(-1) for x in theirs], 1), tokens)


def test_llamacpp_q8_0_stays_close(tmp_path, monkeypatch):
    llamacpp = _import_runner(monkeypatch)
    model = tiny("Mamba2", vocab=512)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    tokens, ours = _ours(model, ids, steps=8)
    lm = llamacpp.LlamaCpp(save_gguf(model, tmp_path / "q.gguf", qtype="q8_0"), n_threads=2)
    try:
        theirs = _theirs(lm, ids, tokens)
    finally:
        lm.close()
    scale = max(float(x.abs().max()) for x in ours)
    err = max(float((a - b).abs().max()) for a, b in zip(theirs, ours))
    # int8 weights with activations quantized to int8 per 32 (llama.cpp's q8_0 dot): ~1e-2 of the largest logit,
    # far above f32's 1e-4 (so this also shows the file's matrices really are Q8_0)
    assert 1e-4 * scale < err <= 5e-2 * scale
