"""``sim-check --full`` (simcheck.full_shapes / extent): each sequence-tiled check calls its public function
with two whole production tiles / chunks and a ragged tail, the default sim-check keeps its quick shapes. Cheap:
the public function is replaced by one that records its input's shape and stops the check before any kernel
runs (the full checks themselves take minutes to hours in the harness)."""
from __future__ import annotations

import importlib

import pytest
import tvm_mamba

from tvm_mamba.tools import simcheck

from tvm_mamba.tools.simcheck import ops as simcheck_ops
from tvm_mamba.compute.rmsnorm_gated import PART_ROWS


class _Stop(Exception):
    pass


def _first(op: str, direction: str):
    mod = importlib.import_module(f"tvm_mamba.compute.{op}")
    return next((s, t) for d, s, t in mod.build_check_configs() if d == direction)


# (op, direction, public function, its argument holding the tiled axis, the axis, the quick length)
CASES = [("causal_conv1d", "fwd", "causal_conv1d_fn", 0, -1, 19),
         ("causal_conv1d", "bwd", "causal_conv1d_fn", 0, -1, 19),
         ("selective_scan", "fwd", "selective_scan_fn", "u", -1, None),
         ("ssd", "chunk_scan", "mamba_chunk_scan_combined", 0, 1, 13),
         ("ssd", "chunk_state_varlen", "mamba_chunk_scan_combined", 0, 1, 13),
         ("mamba3", "siso_preprocess", "mamba3_siso_combined", "Q", 1, None),
         ("rmsnorm_gated", "bwd", "layernorm_fn", 0, 1, 3)]


def _tile(op: str, direction: str, static: dict, dtypes: dict) -> int:
    """The production tile along the checked axis, read independently of the simcheck modules."""
    if op == "causal_conv1d":
        return simcheck.production_knob(op, direction, static, dtypes, "sm_90", "tile")
    if op == "selective_scan":
        return static["chunk"]
    if op == "rmsnorm_gated":
        return PART_ROWS
    return static["chunk_size"]


def _shape_seen(monkeypatch, op, direction, fn, arg, full: bool) -> tuple:
    static, dtypes = _first(op, direction)
    seen = []

    def record(*args, **kwargs):
        seen.append(tuple((args[arg] if isinstance(arg, int) else kwargs[arg]).shape))
        raise _Stop

    monkeypatch.setattr(tvm_mamba, fn, record)
    with simcheck.full_shapes(full), pytest.raises(_Stop):
        simcheck_ops.run_config(op, direction, static, dtypes, "sm_90")
    return seen[0], static, dtypes


@pytest.mark.parametrize("op,direction,fn,arg,axis,quick", CASES, ids=[f"{c[0]}.{c[1]}" for c in CASES])
def test_full_runs_two_whole_production_tiles_and_a_ragged_tail(monkeypatch, op, direction, fn, arg, axis, quick):
    shape, static, dtypes = _shape_seen(monkeypatch, op, direction, fn, arg, full=True)
    tile = _tile(op, direction, static, dtypes)
    length = shape[axis]
    assert length // tile >= 2 and length % tile != 0, (shape, tile)
    quick_shape, _, _ = _shape_seen(monkeypatch, op, direction, fn, arg, full=False)
    assert quick_shape[axis] < length
    if quick is not None:
        assert quick_shape[axis] == quick  # the default sim-check keeps its quick shapes


def test_production_tiles_are_the_documented_ones():
    """The shapes --full runs at (docs/cuda_sim.md): conv's 1024-step tile, SSD's chunk 256."""
    static, dtypes = _first("causal_conv1d", "fwd")
    assert simcheck.production_knob("causal_conv1d", "fwd", static, dtypes, "sm_90", "tile") == 1024
    assert _first("ssd", "chunk_scan")[0]["chunk_size"] == 256
    with simcheck.full_shapes():
        assert simcheck.extent(13, 256) == 515
    assert simcheck.extent(13, 256) == 13
    with pytest.raises(KeyError, match="no knob"):
        simcheck.production_knob("causal_conv1d", "fwd", static, dtypes, "sm_90", "chunk")
