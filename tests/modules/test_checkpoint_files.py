"""A truncated or corrupt checkpoint file is a ValueError naming the file and what is wrong with it (issue #41,
item 4): torch.load on a cut-off pytorch_model.bin raised a bare ``OSError: [Errno 22] Invalid argument`` (or
miniz's "failed finding central directory"), safetensors' a header error without the file's name. An error that is
not the file's (a refused pickle global) stays torch's own."""
from __future__ import annotations

import re

import pytest
import torch

from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

FRACTIONS = (0.0, 0.01, 0.1, 0.5, 0.9, 0.999)


def _model():
    torch.manual_seed(0)
    return MambaLMHeadModel(MambaConfig(d_model=32, n_layer=1, vocab_size=16, ssm_cfg=dict(layer="Mamba1",
                                                                                          d_state=8)))


def _assert_truncation_named(directory, name, data):
    path = directory / name
    for fraction in FRACTIONS:
        path.write_bytes(data[:int(len(data) * fraction)])
        what = "is empty" if fraction == 0 else "is truncated"
        with pytest.raises(ValueError, match=re.escape(f"{str(path)!r} ({path.stat().st_size} bytes) {what}")):
            MambaLMHeadModel.from_pretrained(directory)


def test_truncated_pytorch_model_bin_is_named(tmp_path):
    _model().save_pretrained(tmp_path)
    _assert_truncation_named(tmp_path, "pytorch_model.bin", (tmp_path / "pytorch_model.bin").read_bytes())


def test_truncated_or_garbled_safetensors_is_named(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=1,
                                                           vocab_size=16)).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    MambaLMHeadModel.from_pretrained(tmp_path)  # the whole file loads
    _assert_truncation_named(tmp_path, "model.safetensors", data)
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"{" + b" " * (n - 1) + data[8 + n:])  # the header is no longer JSON
    with pytest.raises(ValueError, match=r"model.safetensors' \(\d+ bytes\) is corrupt: its header is not"):
        MambaLMHeadModel.from_pretrained(tmp_path)


def test_a_whole_file_torch_refuses_keeps_torch_error(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    state = model.state_dict()
    state["extra"] = re.compile("x")  # a global weights_only=True refuses: the file itself is fine
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="Weights only load failed") as info:
        MambaLMHeadModel.from_pretrained(tmp_path)
    assert not isinstance(info.value, ValueError) or "checkpoint file" not in str(info.value)
