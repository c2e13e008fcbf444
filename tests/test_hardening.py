"""Issue-16 regressions that have no better home: sizes past 32-bit indexing are refused before anything runs,
empty and degenerate inputs, in-place states that are stride-0 views, out-of-range token ids, the public int8
API, the `cache` command, build-check's streamed progress."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tvm_mamba


def test_more_elements_than_int32_indexing_is_refused_up_front():
    big = torch.zeros(1, 1, 1).expand(1, 1, 2**31)  # stride 0: no memory behind it
    with pytest.raises(ValueError, match=r"x: 2147483648 elements; .*32-bit"):
        tvm_mamba.causal_conv1d_fn(big, torch.zeros(1, 4))
    a = torch.zeros(1, 1, dtype=torch.int8).expand(2**16, 2**15)
    with pytest.raises(ValueError, match=r"a: 2147483648 elements"):
        tvm_mamba.int8_matmul(a, torch.zeros(1, 2**15, dtype=torch.int8))
    a, b = (torch.zeros(1, 1, dtype=torch.int8).expand(n, 4) for n in (2**16, 2**15))
    with pytest.raises(ValueError, match=r"out: 2147483648 elements"):  # the output, not an input, is too big
        tvm_mamba.int8_matmul(a, b)
    ok = torch.zeros(1, 1, 1).expand(1, 1, 2**31 - 1)
    with pytest.raises(ValueError, match="weight"):  # the boundary itself passes the size check
        tvm_mamba.causal_conv1d_fn(ok, torch.zeros(2, 4))


def test_selective_scan_with_batch_zero_and_time_varying_bc():
    u = torch.randn(0, 8, 10, requires_grad=True)
    A = (-torch.rand(8, 4)).requires_grad_()
    B, C = torch.randn(0, 4, 10), torch.randn(0, 4, 10)
    out, last = tvm_mamba.selective_scan_fn(u, torch.rand(0, 8, 10), A, B, C, return_last_state=True)
    assert out.shape == (0, 8, 10) and last.shape == (0, 8, 4)
    out.sum().backward()
    assert torch.equal(A.grad, torch.zeros(8, 4)) and u.grad.shape == (0, 8, 10)


def test_pack_unpack_with_k_zero():
    packed = tvm_mamba.pack_int8x4(torch.zeros(3, 0, dtype=torch.int8))
    assert packed.shape == (3, 0) and packed.dtype == torch.int32
    assert tvm_mamba.unpack_int8x4(packed, 0).shape == (3, 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_refuses_non_finite_x(bad):
    x = torch.randn(16)
    x[3] = bad
    with pytest.raises(ValueError, match="x: contains NaN or Inf"):
        tvm_mamba.quantize_int8(x)
    with pytest.raises(ValueError, match="x: contains NaN or Inf"):
        tvm_mamba.quantize_int8(x, scale=0.1)


def test_int8_api_is_public():
    for name in ("quantize_int8", "pack_int8x4", "unpack_int8x4", "int8_matmul", "int8_lowrank_projection",
                 "int8_decoder_tail"):
        assert name in tvm_mamba.__all__ and callable(getattr(tvm_mamba, name))


def test_stride0_conv_state_is_refused_before_the_kernel():
    state = torch.zeros(1, 8, 3).expand(2, 8, 3)
    with pytest.raises(ValueError, match="conv_state: it is updated in place, but it is an expanded"):
        tvm_mamba.causal_conv1d_update(torch.randn(2, 8), state, torch.randn(8, 4))


def test_token_ids_out_of_range_name_input_ids():
    lm = tvm_mamba.MambaLMHeadModel(tvm_mamba.MambaConfig(d_model=16, n_layer=1, vocab_size=30,
                                                          pad_vocab_size_multiple=8))
    with pytest.raises(IndexError, match=r"input_ids: token ids must be in \[0, 32\)"):
        lm(torch.tensor([[1, 40]]))
    with pytest.raises(IndexError, match="input_ids"):
        lm(torch.tensor([[-1, 2]]))


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tvm_mamba", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_cache_command_lists_prunes_and_clears(tmp_path):
    import os

    env = dict(os.environ, TVM_MAMBA_CACHE_DIR=str(tmp_path))
    (tmp_path / "tvm_mamba-0.0.1_old").mkdir()
    (tmp_path / "tvm_mamba-0.0.1_old" / "k.so").write_bytes(b"x" * 4096)
    assert _cli("info", env=env).returncode == 0  # builds one kernel into this version's folder
    listed = _cli("cache", env=env)
    assert listed.returncode == 0 and "(this version)" in listed.stdout and "tvm_mamba-0.0.1_old" in listed.stdout
    assert "removed 1 folder" in _cli("cache", "--prune", env=env).stdout
    assert not (tmp_path / "tvm_mamba-0.0.1_old").exists()
    assert "removed 1 folder" in _cli("cache", "--clear", env=env).stdout
    assert not any(tmp_path.iterdir())


def test_build_check_streams_results_before_the_summary():
    """The first kernel's result is printed while the others still build (not all at the end)."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "tvm_mamba", "build-check", "--ops", "rmsnorm_gated"],
                            stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    t_first = time.perf_counter()
    rest = proc.stdout.read()
    proc.wait(timeout=600)
    assert first.startswith(("ok", "SPILL", "FAIL")) and "rmsnorm_gated" in first
    from tvm_mamba.compute.rmsnorm_gated import build_check_configs

    assert rest.strip().splitlines()[-1].startswith(f"build-check: {len(build_check_configs())} kernels")
    assert time.perf_counter() - t_first > 0.3  # the other kernels (codegen + nvcc) came after the first line
