"""A model's kernel set (runtime/kernel_sets.py): recorded around generate, kept outside the per-version cache
folder, and on a cold cache built by worker processes while the caller builds from the front."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tvm_mamba.runtime import KernelKey, cache, cpu_target, dispatch, kernel_sets, prebuild, target_key


def _key(dim: int) -> KernelKey:
    return KernelKey.make("causal_conv1d", "fwd", {"x": "float32", "weight": "float32"},
                          dict(dim=dim, width=4, activation="silu", has_bias=False, has_seq_idx=False, has_init=False,
                               return_final=False), target_key(cpu_target()), {"batch": 1, "seqlen": 64})


def test_recording_saves_the_keys_resolved_and_merges(fresh_cache):
    with kernel_sets.recording("abc123"):
        cache.build_and_load(_key(8))
    assert kernel_sets.load("abc123") == [_key(8)]
    with kernel_sets.recording("abc123"):
        cache.build_and_load(_key(16))
        cache.build_and_load(_key(8))
    assert kernel_sets.load("abc123") == [_key(8), _key(16)]  # first-use order kept, nothing twice
    assert kernel_sets.path("abc123").parent == fresh_cache / kernel_sets.FOLDER  # outside the version folder
    assert prebuild.missing(kernel_sets.load("abc123")) == []


def test_a_set_file_is_data(fresh_cache):
    """Keys that do not parse are left out; a broken file reads as no set; a signature is not a path."""
    path = kernel_sets.path("bad")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"keys": [{"op": "causal_conv1d"}, _key(8).to_json(), 7, "x"]}))
    assert kernel_sets.load("bad") == [_key(8)]
    for text in ("{", "[1, 2]", json.dumps({"keys": "no"}), "[" * 100000):
        path.write_text(text)
        assert kernel_sets.load("bad") == []
    with pytest.raises(ValueError, match="signature"):
        kernel_sets.path("../x")


def test_prefetch_builds_the_missing_keys_in_another_process(fresh_cache):
    keys = [_key(8), _key(16), _key(24)]
    kernel_sets.save("pool1", keys)
    cache.build_and_load(keys[0])  # already in the cache: not rebuilt
    builds = cache.stats["builds"]
    worker = prebuild.prefetch("pool1", jobs=1)
    assert worker is not None
    worker.join(timeout=300)
    assert not worker.is_alive()
    assert cache.stats["builds"] == builds  # built by the worker process, not here
    assert prebuild.missing(keys) == []
    for k in keys[1:]:  # this process now loads the worker's files
        assert cache.cache_path(k, dispatch.plan(k)).exists()
    assert prebuild.prefetch("pool1", jobs=1) is None  # nothing left to build


GENERATE = """
import sys, torch
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel
from tvm_mamba.runtime import cache, kernel_sets, prebuild
torch.manual_seed(0)
cfg = MambaConfig(d_model=64, n_layer=2, vocab_size=128, ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16,
                  chunk_size=16))
model = MambaLMHeadModel(cfg).eval()
from tvm_mamba.modules.generation import model_signature
if sys.argv[1:] == ["wait"]:  # let the pool finish first: then every kernel comes from it
    worker = prebuild.prefetch(model_signature(model), jobs=2)
    worker.join()
out = model.generate(torch.randint(0, 128, (1, 5)), max_new_tokens=3)
print("RESULT", cache.stats["builds"], len(kernel_sets.load(model_signature(model))), out.tolist())
"""


def _generate(env, *args) -> tuple[int, int, list]:
    run = subprocess.run([sys.executable, "-c", GENERATE, *args], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")][-1].split(" ", 3)
    return int(line[1]), int(line[2]), json.loads(line[3])


@pytest.mark.cold_start
def test_an_upgrade_s_cold_start_compiles_the_model_s_set_in_a_pool(tmp_path):
    """The first generate builds every kernel itself and records the set; with the version folder gone (what an
    upgrade leaves), the set is built by the pool (generate starts it; here it is waited for, so that every
    kernel comes from it), and the tokens are the same."""
    env = dict(os.environ, TVM_MAMBA_CACHE_DIR=str(tmp_path), TVM_MAMBA_QUIET="1")
    first_builds, n_keys, first = _generate(env)
    assert n_keys >= 5 and first_builds >= 5
    for folder in tmp_path.glob("tvm_mamba-*"):
        shutil.rmtree(folder)
    second_builds, n_again, second = _generate(env, "wait")
    assert second == first and n_again == n_keys
    assert second_builds == 0  # every kernel came from the pool's processes


SAVE = """
import sys, torch
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel
torch.manual_seed(0)
cfg = MambaConfig(d_model=64, n_layer=2, vocab_size=128, ssm_cfg=dict(layer="Mamba1", d_state=8))
MambaLMHeadModel(cfg).save_pretrained(sys.argv[1])
"""

LOAD = """
import sys, torch
from tvm_mamba.modules.lm import MambaLMHeadModel
from tvm_mamba.runtime import cache
model = MambaLMHeadModel.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    model.generate(torch.randint(0, 128, (1, 7)), max_new_tokens=3)
print("BUILDS", cache.stats["builds"])
"""


@pytest.mark.cold_start
def test_aot_model_builds_a_checkpoint_s_kernels_before_its_first_generate(tmp_path):
    """`aot --model DIR` learns the kernel set by a dry run and builds it into the cache: the checkpoint's first
    generate then compiles nothing; a second aot finds everything there."""
    env = dict(os.environ, TVM_MAMBA_CACHE_DIR=str(tmp_path / "cache"), TVM_MAMBA_QUIET="1")
    ckpt = tmp_path / "ckpt"
    subprocess.run([sys.executable, "-c", SAVE, str(ckpt)], env=env, check=True, timeout=300)
    aot = [sys.executable, "-m", "tvm_mamba", "aot", "--target", "cpu", "--model", str(ckpt), "--jobs", "2"]
    run = subprocess.run(aot, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "built into the kernel cache" in run.stdout and " 0 failed" in run.stdout, run.stdout
    first = subprocess.run([sys.executable, "-c", LOAD, str(ckpt)], env=env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "BUILDS 0" in first.stdout, first.stdout
    again = subprocess.run(aot, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and ", 0 built into the kernel cache" in again.stdout, again.stdout


def test_aot_model_usage_errors():
    from tvm_mamba import cli

    assert cli.main(["aot", "--target", "cuda", "--model", "x"]) == 2
    assert cli.main(["aot", "--target", "cpu", "--model", "x", "--out", "y"]) == 2
    assert cli.main(["aot", "--target", "cpu"]) == 2


def test_model_signature_names_config_dtype_and_device():
    import torch

    from tvm_mamba.modules.generation import model_signature
    from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

    cfg = dict(d_model=32, n_layer=1, vocab_size=64, ssm_cfg=dict(layer="Mamba1", d_state=4))
    a, b = MambaLMHeadModel(MambaConfig(**cfg)), MambaLMHeadModel(MambaConfig(**cfg))
    assert model_signature(a) == model_signature(b) and model_signature(a).isalnum()
    assert model_signature(a) != model_signature(MambaLMHeadModel(MambaConfig(**dict(cfg, n_layer=2))))
    assert model_signature(a) != model_signature(b.to(torch.bfloat16))

    class Plain(torch.nn.Module):  # a config object without fields of a dataclass: no address in the name
        config = object()

    assert model_signature(Plain()) == model_signature(Plain())
