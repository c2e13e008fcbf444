"""mamba_chunk_scan_combined with the CUDA kernels run on the CPU by the execution harness
(tvm_mamba.simulate_cuda), against the float64 step-by-step recurrence written from the math: forward, final
states and every gradient. Mirrors tests/torch_ops/test_ssd.py at small model dims.

Dims: 8 heads in 2 groups (4 heads per group, so the dB / dC sums see 1, 2 and 4 parts of a group's heads),
headdim 8, dstate 16, chunk 16; batch 2, seqlen 37 (two full chunks and a ragged one of 5). seq_idx changes
inside a chunk and exactly at a chunk start (position 32), and differs per row. Every distinct set of static
dims, flags and dtypes compiles its own 5-10 kernels (~1 s each), so the tests share a few sets.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import tvm_mamba
from tests.conftest import assert_close_to_ref
from tvm_mamba.compute.ssd import dims as ssd_dims
from tvm_mamba.compute.ssd import build_check_configs
from tvm_mamba.runtime.dispatch import record_keys
from tvm_mamba.tools.simcheck import CheckFailed
from tvm_mamba.tools.simcheck import ssd as simcheck

H, G, P, N, Q = 8, 2, 8, 16, 16
BATCH, SEQLEN = 2, 37
ALL = simcheck.FLAGS  # every optional input on, D (nheads, headdim)
SEQ_IDX = torch.tensor([[0] * 10 + [1] * 22 + [2] * 5, [0] * 20 + [3] * 17], dtype=torch.int32)
LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(autouse=True)
def sim():
    """Every kernel of the test runs simulated CUDA (sm_90 unless the test nests another arch); fails the
    test if any ran elsewhere (simcheck.check records its own keys)."""
    with record_keys() as used, tvm_mamba.simulate_cuda("sm_90"):
        yield used  # (key, plan) pairs, filled as kernels run
    targets = {k.target for k, _ in used}
    assert all(t.startswith("cudasim-") for t in targets), targets


def _case(flags=ALL, dtype="float32", chunk_size=Q, batch=BATCH, seqlen=SEQLEN, backward=True, headdim=P):
    return simcheck.Case(H, G, headdim, N, chunk_size, tuple(flags), dtype, dtype, batch, seqlen, backward)


def _inputs(case, seed=0):
    t = simcheck.make_inputs(case, seed)
    if case.on("has_seq_idx") and case.batch == BATCH and case.seqlen == SEQLEN:
        t["seq_idx"] = SEQ_IDX
    return t


def _ours(case, t, **kw):
    return simcheck.run(tvm_mamba.mamba_chunk_scan_combined, case, t, **kw)


def _assert_fp32(got, ref):
    """fp32 kernels: 1e-4 relative, atol 2e-5 of the reference's magnitude (as tests/torch_ops/test_ssd.py)."""
    for name, r in ref.items():
        if r is not None:
            scale = max(r.abs().max().item(), 1.0)
            assert_close_to_ref(got[name], r, atol=2e-5 * scale, rtol=1e-4, name=name)


def _directions(used):
    return {k.direction for k, _ in used if k.op == "ssd"}


@pytest.mark.parametrize("tasks, keep", [(1, False), (24, True), (64, False)])
def test_all_features_fp32(tasks, keep, sim, monkeypatch):
    """Ragged seqlen, D (nheads, headdim), z, dt_bias, softplus, dt_limit, initial_states, seq_idx, a loss on
    final_states; 1, 2 and 4 parts of each group's 4 heads in the dB / dC sums (head_parts: 2 x 3 (batch,
    chunk) x 2 groups = 12 tasks per part, task targets 1 / 24 / 64); both backward memory modes."""
    monkeypatch.setattr(ssd_dims, "HEAD_PART_TASKS", tasks)
    parts = ssd_dims.head_parts(BATCH, 3, H, G)
    assert parts == {1: 1, 24: 2, 64: 4}[tasks]
    case = _case()
    t = _inputs(case)
    got = _ours(case, t, keep_chunk_states=keep)
    _assert_fp32(got, simcheck.reference(case, t))
    assert got["y"].dtype == torch.float32 and got["final_states"].dtype == torch.float32
    ran = _directions(sim)
    assert {"chunk_scan", "chunk_scan_bwd", "state_passing_bwd", "chunk_cumsum_bwd"} <= ran
    assert ("head_sum" in ran) == (parts > 1)  # one part of fp32 partials: the kernel writes dB / dC itself


def test_memory_modes_and_thread_orders_agree_bitwise():
    """keep_chunk_states and the harness's thread / block order change nothing, bit for bit (no atomics,
    fixed-order sums)."""
    case = _case()
    t = _inputs(case)
    base = _ours(case, t)
    with tvm_mamba.simulate_cuda("sm_90", order="reversed", seed=7):
        other = _ours(case, t, keep_chunk_states=True)
    for name, v in base.items():
        assert torch.equal(v, other[name]), name


def test_plain_call_and_dt_limit_without_softplus(sim):
    """No D, z, dt_bias, initial_states or seq_idx, no loss on final_states; raw dt clamped by dt_limit
    (negative dt -> the low limit: zero gradient there). Then the plainest call, returning y only."""
    case = _case(flags=("has_dt_limit",))
    t = _inputs(case)
    t["dt"] = t["dt"].abs() * 0.5
    t["dt"][0, :5] = -1.0
    got = _ours(case, t)
    _assert_fp32(got, simcheck.reference(case, t))
    assert torch.all(got["ddt"][0, :5] == 0)
    assert set(got) == {"y", "final_states", "dx", "ddt", "dA", "dB", "dC"}
    y = tvm_mamba.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], Q)
    yr = simcheck.reference(_case(flags=(), backward=False), t)["y"]
    assert_close_to_ref(y, yr, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, headdim", [("bfloat16", P), ("float16", P), ("bfloat16", 16), ("float16", 16)])
def test_low_precision_within_reference_drift(dtype, headdim):
    """mamba_ssm's rule: err(kernel) <= 2 * err(reference run in bf16 / fp16) + atol; D per head (nheads,);
    the fp32 parameters' gradients (sums) relative to their magnitude. headdim 16: every chunk product's sides
    are multiples of 16, so they run on the tensor cores (the harness's wmma), the backward's too."""
    case = _case(flags=tuple(f for f in ALL if f != "D_has_hdim"), dtype=dtype, headdim=headdim)
    t = _inputs(case)
    got = _ours(case, t)
    ref = simcheck.reference(case, t)
    low = simcheck.run(_reference_fn, case, t, dtype=LOW[dtype])
    assert got["y"].dtype == LOW[dtype] and got["final_states"].dtype == torch.float32
    assert_close_to_ref(got["y"], ref["y"], low["y"], name="y")
    assert_close_to_ref(got["final_states"], ref["final_states"], low["final_states"].float(), name="final_states")
    for k in ("dx", "dz", "dB", "dC", "ddt"):
        assert_close_to_ref(got[k], ref[k], low[k], name=k)
    for k in ("dA", "dD", "ddt_bias", "dinitial_states"):
        assert_close_to_ref(got[k], ref[k], atol=2e-2 * ref[k].abs().max().item(), rtol=0, name=k)


def _reference_fn(x, dt, A, B, C, chunk_size, **kw):
    from tvm_mamba.reference.ssd import ssd_recurrence_ref

    return ssd_recurrence_ref(x, dt, A, B, C, **kw)


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_chunk_sizes(chunk_size):
    """seqlen 37 with chunk 7: 6 chunks (ragged, odd chunk, seq_idx switching inside chunks); chunk 64 >
    seqlen: a single partial chunk. Forward and every gradient."""
    case = _case(chunk_size=chunk_size)
    t = _inputs(case)
    _assert_fp32(_ours(case, t), simcheck.reference(case, t))


def test_seq_idx_matches_separate_runs():
    """Each sequence of row 0 run alone (initial_states only for the first, id 0) gives the same y as the
    packed call with seq_idx."""
    case = _case(backward=False)
    t = _inputs(case)
    y = _ours(case, t)["y"]
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], **simcheck.call_kwargs(case))
    ids = SEQ_IDX[0]
    for sid in ids.unique().tolist():
        pos = (ids == sid).nonzero().flatten()
        a, b = pos[0].item(), pos[-1].item() + 1
        part = {k: t[k][:1, a:b] for k in ("x", "dt", "B", "C")}
        kw["z"] = t["z"][:1, a:b]
        init = t["initial_states"][:1] if sid == 0 else None
        alone = tvm_mamba.mamba_chunk_scan_combined(part["x"], part["dt"], t["A"], part["B"], part["C"], Q,
                                                    initial_states=init, **kw)
        assert_close_to_ref(alone, y[:1, a:b].double(), atol=1e-4, rtol=1e-4, name=f"sequence {sid}")


def test_final_states_only_gradient():
    """A loss on final_states alone (y's gradient is None: zeros go to the kernels) reaches x, dt, A, B only
    through each row's last sequence (row 0 from position 32, row 1 from 20): zero gradients before it, for
    initial_states (sequence 0), and for C and z."""
    case = _case()
    t = _inputs(case)
    t["gy"] = torch.zeros_like(t["gy"])
    got = _ours(case, t)
    _assert_fp32(got, simcheck.reference(case, t))
    for k in ("dC", "dz", "dinitial_states"):
        assert torch.all(got[k] == 0), k
    for row, start in ((0, 32), (1, 20)):
        assert torch.all(got["dx"][row, :start] == 0) and torch.all(got["dB"][row, :start] == 0)
        assert got["dx"][row, start:].abs().amax(dim=(1, 2)).min() > 0


def test_sm80(sim):
    """The sm_80 build of the same kernels (every optional input, fp32)."""
    case = _case()
    t = _inputs(case)
    with tvm_mamba.simulate_cuda("sm_80"):
        got = _ours(case, t)
    _assert_fp32(got, simcheck.reference(case, t))
    assert {k.target for k, _ in sim} == {"cudasim-sm_80"}


def test_simcheck_maps_every_build_check_config():
    """Each build-check configuration becomes a call with the configuration's dims, flags and dtypes (what
    ``ran`` then checks), forward directions without a backward; an unknown direction is refused."""
    for direction, static, dtypes in build_check_configs():
        if static.get("diag_skip"):  # Mamba-3's chunk scan: checked through mamba3_siso_combined (simcheck/mamba3.py)
            continue
        case = simcheck.case_of(direction, static, dtypes)
        for k in ("nheads", "ngroups", "headdim", "dstate", "chunk_size"):
            if k in static:
                assert getattr(case, k) == static[k], (direction, k)
        for f in simcheck.FLAGS:
            assert case.on(f) == static.get(f, False), (direction, f)
        assert case.backward == (direction in simcheck.BACKWARD)
        if direction == "head_sum":  # one dB / dC partial per head: nheads partials
            nchunks = math.ceil(case.seqlen / case.chunk_size)
            assert ssd_dims.head_parts(case.batch, nchunks, case.nheads, case.ngroups) * case.ngroups == \
                static["nheads"]
    with pytest.raises(CheckFailed, match="unknown direction"):
        simcheck.check("chunk_scan_fwd", {}, {}, "sm_90")


def test_simcheck_small_config():
    """simcheck.ssd.check end to end on a small configuration: its kernel ran, results within tolerance."""
    static = dict(nheads=H, ngroups=G, headdim=P, dstate=N, chunk_size=Q, has_D=True, D_has_hdim=True,
                  has_z=True, has_seq_idx=True)
    simcheck.check("chunk_scan", static, {"x": "float32", "bc": "float32"}, "sm_90")


def test_chunk_scan_bwd_diag_skip(sim, monkeypatch):
    """Mamba-3's chunk-scan backward (diag_skip: strict causal sums, D / dD per position), the CUDA kernel
    called directly: fp32, batch 2, 37 positions (3 chunks, the last ragged), 2 heads per group summed in one
    dB / dC part and in two; every gradient against autograd of the float64 strict chunk scan."""
    dims = ssd_dims.ScanBwdDims(nheads=4, ngroups=2, headdim=P, dstate=N, chunk_size=Q, has_D=True, has_z=True,
                                 diag_skip=True)
    t = simcheck.scan_bwd_inputs(dims, BATCH, SEQLEN)
    ref = simcheck.scan_bwd_reference(t)
    for tasks in (64, 1):
        monkeypatch.setattr(ssd_dims, "HEAD_PART_TASKS", tasks)
        _assert_fp32(simcheck.scan_bwd_run(dims, t), ref)
    assert _directions(sim) == {"chunk_scan_bwd"}


def test_chunk_scan_step_group(sim):
    """Mamba-3 MIMO's grouped chunk scan (step_group 2: the causal sums over strictly earlier pairs of
    positions), the CUDA forward and backward kernels called directly: fp32, batch 2, 37 positions (3 chunks,
    the last ragged inside a group); y and every gradient against the float64 grouped strict chunk scan."""
    from tvm_mamba.reference.ssd import ssd_chunk_scan_strict_ref

    flags = dict(nheads=4, ngroups=2, headdim=P, dstate=N, chunk_size=Q, has_D=True, has_z=True, diag_skip=True,
                 step_group=2)
    t = simcheck.scan_bwd_inputs(ssd_dims.ScanBwdDims(**flags), BATCH, SEQLEN)
    want, _ = ssd_chunk_scan_strict_ref(**{k: t[k].double() for k in simcheck.SCAN_BWD_GRADS}, z=t["z"].double(),
                                        states_in=t["Sin"].double(), step_group=2)
    got = dict(simcheck.scan_bwd_run(ssd_dims.ScanBwdDims(**flags), t),
               y=simcheck.scan_fwd_run(ssd_dims.ScanDims(**flags, has_init=True), t))
    _assert_fp32(got, dict(simcheck.scan_bwd_reference(t, step_group=2), y=want))
    assert _directions(sim) == {"chunk_scan", "chunk_scan_bwd"}


def test_simcheck_chunk_scan_bwd_diag_skip_config():
    """simcheck.ssd.check on a small diag_skip backward configuration (bf16 x, f32 B / C): its kernel ran in
    the harness, every gradient within tolerance."""
    static = dict(nheads=4, ngroups=4, headdim=P, dstate=N, chunk_size=Q, has_D=True, D_has_hdim=False,
                  has_z=False, has_seq_idx=False, diag_skip=True)
    simcheck.check("chunk_scan_bwd", static, {"x": "bfloat16", "bc": "float32"}, "sm_90")


# varlen states (cu_seqlens + return_varlen_states, batch 1) and state_dtype: 3 chunks of 16 over 37 positions;
# sequence 0 ends in chunk 0 (holds initial_states), 1 spans chunks 0-1, 2 is empty, 3 starts inside chunk 1 and
# ends at its last position, 4 starts at a chunk start (ragged)
CU = [0, 5, 20, 20, 32, 37]


def _varlen_case(dtype="float32", flags=ALL, state_dtype=None):
    return simcheck.Case(H, G, P, N, Q, tuple(flags), dtype, dtype, 1, CU[-1], False, True, state_dtype)


def _varlen_inputs(case):
    t = simcheck.make_inputs(case)
    cu = torch.tensor(CU, dtype=torch.int32)
    t["cu_seqlens"] = cu
    if case.on("has_seq_idx"):
        t["seq_idx"] = torch.repeat_interleave(torch.arange(len(CU) - 1, dtype=torch.int32), torch.diff(cu))[None]
    return t


@pytest.mark.parametrize("dtype, seq", [("float32", True), ("float32", False), ("bfloat16", True)])
def test_varlen_states(dtype, seq, sim):
    """ssd_chunk_state_varlen on the harness: each packed sequence's final state against the float64
    reference (with seq_idx: the sequence run alone; without: upstream's chunk_state_varlen semantics), in
    C's dtype; y / final_states as usual. bf16: err <= 2 err(reference in bf16) + atol."""
    flags = ALL if seq else tuple(f for f in ALL if f != "has_seq_idx")
    case = _varlen_case(dtype, flags)
    t = _varlen_inputs(case)
    got = _ours(case, t)
    ref = simcheck.reference(case, t)
    assert got["varlen_states"].dtype == LOW.get(dtype, torch.float32)
    assert "chunk_state_varlen" in _directions(sim)
    if dtype == "float32":
        _assert_fp32(got, ref)
    else:
        low = simcheck.run(_reference_fn_varlen, case, t, dtype=LOW[dtype])
        for k in ("y", "varlen_states"):
            assert_close_to_ref(got[k], ref[k], low[k], name=k)
    if seq:  # the last sequence's state is the row's final state; the empty one is zero
        assert torch.all(got["varlen_states"][2] == 0)


def _reference_fn_varlen(x, dt, A, B, C, chunk_size, cu_seqlens=None, return_varlen_states=False, **kw):
    from tvm_mamba.reference.ssd import ssd_recurrence_ref, ssd_varlen_states_ref

    y, f = ssd_recurrence_ref(x, dt, A, B, C, **kw)
    v = ssd_varlen_states_ref(x, dt, A, B, C, chunk_size, cu_seqlens, dt_bias=kw["dt_bias"],
                              initial_states=kw["initial_states"], seq_idx=kw["seq_idx"],
                              dt_softplus=kw["dt_softplus"], dt_limit=kw["dt_limit"])
    return y, f, v


def test_state_dtype_bf16(sim):
    """Chunk states stored in bf16 (state_passing writes them, chunk_scan and the varlen kernel read them) on
    the harness: varlen states in bf16, final_states float32; y off the float32-state call by the rounding
    only (the rounded states' effect, within the bf16 tolerance of the float64 reference)."""
    case = _varlen_case(state_dtype="bfloat16")
    t = _varlen_inputs(case)
    got = _ours(case, t)
    assert got["varlen_states"].dtype == torch.bfloat16 and got["y"].dtype == torch.float32
    simcheck.compare_all(got, simcheck.reference(case, t), "bfloat16")
    exact = _ours(dataclasses.replace(case, state_dtype=None), t)
    assert not torch.equal(got["y"], exact["y"])  # the states were rounded
    assert torch.equal(got["final_states"], exact["final_states"])  # the running state stays float32
    torch.testing.assert_close(got["y"], exact["y"], atol=2e-2 * exact["y"].abs().max().item(), rtol=0)


def test_simcheck_varlen_config():
    """simcheck.ssd.check end to end on a small varlen-states configuration (bf16 chunk states)."""
    static = dict(nheads=H, ngroups=G, headdim=P, dstate=N, chunk_size=Q, has_seq_idx=False)
    simcheck.check("chunk_state_varlen", static, {"x": "float32", "bc": "float32", "state": "bfloat16",
                                                  "out": "bfloat16"}, "sm_90")


def test_tensor_core_tiles_above_the_causal_diagonal_race_free():
    """bf16 at chunk 256 (the production chunk) with 40 positions: most of bmm_chunk's tensor-core tiles lie
    above the causal diagonal and run no k slice, so the warps' fragment stores into shared memory follow the
    block's zero fill of that memory with no slice barrier between; the checker (on) reported the write-write
    race until a barrier followed the fill (schedules/cuda/_tiled_tc.py, _tc_product.py)."""
    from tvm_mamba.reference.ssd import ssd_recurrence_ref

    g = torch.Generator().manual_seed(0)
    b, L, H, P, G, N, Q = 1, 40, 2, 16, 1, 16, 256
    x, dt = torch.randn(b, L, H, P, generator=g).bfloat16(), torch.rand(b, L, H, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.5
    B, C = torch.randn(b, L, G, N, generator=g).bfloat16(), torch.randn(b, L, G, N, generator=g).bfloat16()
    with tvm_mamba.simulate_cuda("sm_90", checks=True):
        y = tvm_mamba.mamba_chunk_scan_combined(x, dt, A, B, C, Q)
    ref = ssd_recurrence_ref(x.double(), dt.double(), A.double(), B.double(), C.double())
    assert (y.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
