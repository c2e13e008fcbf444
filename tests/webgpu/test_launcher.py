"""The WebGPU launcher (tvm_mamba/runtime/webgpu_launch.py) on hand-written kernels: TVM's WGSL and host
function, run through wgpu against numpy; more workgroups than one dispatch dimension holds (folded into z),
a strided pool updated in place (its gaps untouched), and the argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tvm_mamba.runtime import webgpu
from tvm_mamba.runtime.target import webgpu_target
from tests.webgpu.kernels_tvmscript import THREADS, bump_rows, module, scaled

pytestmark = [pytest.mark.webgpu, pytest.mark.usefixtures("adapter")]


def _load(func, tmp_path):
    path = tmp_path / "kernel.json"
    webgpu.build(module(func), webgpu_target()).export_library(str(path))
    return webgpu.load(str(path))[func.attrs["global_symbol"]]


def test_map_over_more_workgroups_than_a_dispatch_dimension_holds(tmp_path, adapter):
    limit = adapter["limits"]["max-compute-workgroups-per-dimension"]
    n = (limit + 5) * THREADS + 7  # limit + 6 workgroups, the last one ragged
    x = torch.randn(n)
    y = torch.full((n,), float("nan"))
    _load(scaled, tmp_path)(x, y)
    want = 2 * x.numpy() + (np.arange(n) // THREADS).astype(np.float32)
    np.testing.assert_array_equal(y.numpy(), want)


def test_strided_pool_rows_updated_in_place_gaps_untouched(tmp_path):
    storage = torch.full((5, 48), 7.0)
    pool = storage[:, 8:40]  # rows 48 apart, 32 wide
    pool.zero_()
    _load(bump_rows, tmp_path)(pool, torch.tensor([3, 0], dtype=torch.int32))
    want = torch.zeros(5, 32)
    want[[3, 0]] = 1
    assert torch.equal(pool, want)
    assert (storage[:, :8] == 7).all() and (storage[:, 40:] == 7).all()


def test_arguments_checked_before_anything_runs(tmp_path):
    run = _load(scaled, tmp_path)
    x = torch.randn(10)
    y = torch.zeros(10)
    with pytest.raises(TypeError, match="y: expected float32"):
        run(x, torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"y.shape\[0\]: expected 10, got 11"):
        run(x, torch.zeros(11))
    with pytest.raises(ValueError, match="x: expected 1 dimensions"):
        run(x.view(2, 5), y)
    with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
        run(torch.randn(20)[::2], y)
    with pytest.raises(TypeError, match="2 arguments expected"):
        run(x)
    assert (y == 0).all()


def test_int64_indices_and_float16_tensors_converted_both_ways(tmp_path):
    """WGSL has no 64-bit integers and (without shader-f16) no float16: such tensors go to the adapter converted
    and come back converted where a kernel wrote them; an index beyond int32 is refused before anything runs."""
    bump = _load(bump_rows, tmp_path)
    pool = torch.zeros(4, 16)
    idx = torch.tensor([2, 0])
    bump(pool, idx)
    assert pool[[2, 0]].eq(1).all() and pool[[1, 3]].eq(0).all() and idx.dtype == torch.int64
    half = torch.zeros(4, 16, dtype=torch.float16)
    bump(half, torch.tensor([1], dtype=torch.int32))
    assert half.dtype == torch.float16 and half[1].eq(1).all() and half[0].eq(0).all()
    with pytest.raises(ValueError, match="beyond int32"):
        bump(pool, torch.tensor([2 ** 40]))
    assert pool.sum() == 32
