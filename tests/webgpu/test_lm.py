"""A 2-layer MambaLMHeadModel (Mamba-1 and Mamba-2 blocks) prefilling and decoding on WebGPU: every Mamba
kernel of its forward and its decode steps runs as WGSL through wgpu (``with tvm_mamba.webgpu():``), and its
greedy tokens equal the CPU path's. The logits of the prefill agree to float32 rounding."""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel
from tvm_mamba.runtime.dispatch import record_keys

pytestmark = [pytest.mark.webgpu, pytest.mark.usefixtures("adapter")]

CONFIGS = {"mamba1": dict(layer="Mamba1", d_state=8), "mamba2": dict(layer="Mamba2", d_state=16, headdim=16,
                                                                     chunk_size=8)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lm_generates_the_cpu_paths_tokens_on_webgpu(name):
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=50, ssm_cfg=dict(CONFIGS[name]))).eval()
    prompt = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cpu_logits, cpu_tokens = model(prompt).logits, model.generate(prompt, max_length=19)
        with tvm_mamba.webgpu(), record_keys() as keys:
            logits = model(prompt).logits
            tokens = model.generate(prompt, max_length=19)
    torch.testing.assert_close(logits, cpu_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, cpu_tokens)
    ran = {(k.op, k.direction) for k, _ in keys if k.target == "webgpu"}
    assert {("causal_conv1d", "fwd"), ("causal_conv1d", "update")} <= ran
    assert ("selective_scan", "update") in ran and all(k.target == "webgpu" for k, _ in keys)
