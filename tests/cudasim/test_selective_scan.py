"""selective_scan_fn / selective_state_update on the CUDA kernels, run on the CPU by the CUDA execution harness
(tvm_mamba.simulate_cuda), against the float64 step-by-step reference (mirrors tests/torch_ops/).

The CUDA scan puts one (batch, channel) lane on W = the largest power of two <= 32 dividing dstate threads
(dstate 64: a full warp; 12: 4 threads x 3 states; 5: one thread, no shuffles) and runs time in chunks of
``chunk_for(dstate)`` = 48 steps here; the configurations below vary W, leave blocks partly empty (lanes not
a multiple of the lanes per block) and end every sequence in a partial chunk.
"""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.conftest import assert_close_to_ref
from tvm_mamba.tools import simcheck
from tvm_mamba.tools.simcheck import ops as simcheck_ops
from tvm_mamba.compute import selective_scan as compute
from tvm_mamba.reference.selective_scan import selective_scan_ref
from tvm_mamba.tools.simcheck import selective_scan as sc
from tvm_mamba.torch_ops.selective_scan import chunk_for

# name: (batch, seqlen, static dims: dim, dstate, b/c groups (0 time-invariant, 1 (batch, dstate, L),
# g > 1 (batch, g, dstate, L)), D, z, delta_bias, softplus, initial_state)
CONFIGS = {
    # 150 = 3 chunks of 48 + 6; every optional input; 8 lanes of 16 threads = one full block
    "var_const_all": (2, 150, dict(dim=4, dstate=16, b_groups=1, c_groups=0, has_D=True, has_z=True,
                                   has_delta_bias=True, delta_softplus=True, has_init=True)),
    "grp_var_bare": (2, 131, dict(dim=4, dstate=8, b_groups=2, c_groups=1, has_D=False, has_z=False,
                                  has_delta_bias=False, delta_softplus=False, has_init=False)),
    # dstate 64: 32-lane butterflies; B/C in different group counts: backward block of 8 channels
    "grp_grp_full_warp": (1, 53, dict(dim=32, dstate=64, b_groups=4, c_groups=2, has_D=True, has_z=True,
                                      has_delta_bias=False, delta_softplus=True, has_init=False)),
    # dstate 12: 4 threads x 3 states per lane, 15 lanes in a block of 32; one C group per channel
    "dstate12_per_channel_c": (3, 37, dict(dim=5, dstate=12, b_groups=0, c_groups=5, has_D=False, has_z=True,
                                           has_delta_bias=True, delta_softplus=False, has_init=True)),
    # dstate 5: one thread per lane (no shuffles at all), 3 lanes
    "dstate5_const_const": (1, 67, dict(dim=3, dstate=5, b_groups=0, c_groups=0, has_D=True, has_z=True,
                                        has_delta_bias=False, delta_softplus=True, has_init=False)),
}
X32 = {"x": "float32", "B": "float32", "C": "float32"}  # decode-step dtypes


def inputs(name: str, dtype: str = "float32", seqlen: int | None = None, seed: int = 0) -> dict:
    batch, L, static = CONFIGS[name]
    return sc.scan_inputs(static, {"u": dtype, "B": dtype, "C": dtype}, batch, seqlen or L, seed)


def assert_all_close(res: dict, label: str, rel: float = 2e-5) -> None:
    """Every output and gradient against the float64 reference, atol relative to its magnitude (sums over
    batch x seqlen), as tests/torch_ops/test_selective_scan.py."""
    for key, (mine, ref) in res.items():
        assert_close_to_ref(mine, ref, atol=rel * max(1.0, ref.abs().max().item()), rtol=1e-4,
                            name=f"{label}:{key}")


def expected_grads(inp: dict) -> set:
    return {"d" + k for k in sc.TENSORS if isinstance(inp[k], torch.Tensor)}


def test_runs_the_cuda_kernels():
    inp = inputs("var_const_all", seqlen=8)
    plan = tvm_mamba.explain(tvm_mamba.selective_scan_fn, **inp)
    with tvm_mamba.simulate_cuda("sm_90"):
        sim_plan = tvm_mamba.explain(tvm_mamba.selective_scan_fn, **inp)
    assert "cudasim-sm_90" in sim_plan and "cudasim" not in plan


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_every_gradient_fp32(name):
    inp = inputs(name)
    res, keys = sc.scan_results(inp, grads=True, arch="sm_90")
    assert expected_grads(inp) <= set(res)
    assert {(k.direction, k.target) for k in keys} == {("fwd", "cudasim-sm_90"), ("bwd", "cudasim-sm_90")}
    assert_all_close(res, name)


@pytest.mark.parametrize("name,seqlen", [("var_const_all", None), ("var_const_all", 264), ("grp_var_bare", 256)])
def test_bf16_forward_and_gradients(name, seqlen):
    """mamba_ssm's rule for the output (2x the drift of the reference run in bf16-rounded float32); the
    gradients are stored in bf16 (u, delta, z, B): 2^-8 relative rounding on top of fp32 accumulation.
    seqlen 264 / 256 (multiples of 8): the forward's 128-bit loads of 8 bf16 steps (264: the last time block
    partly, its ragged threads one step at a time), B / C staged 8 states a load (grp_var_bare: both varying)."""
    inp = inputs(name, dtype="bfloat16", seqlen=seqlen)
    res, _ = sc.scan_results(inp, grads=True, arch="sm_90")
    low = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    ref_low = selective_scan_ref(**low, dtype=torch.float32).to(torch.bfloat16)
    assert_close_to_ref(res["out"][0], res["out"][1], ref_low, name="out")
    assert expected_grads(inp) <= set(res)
    for key, (mine, ref) in res.items():
        if key == "out":
            continue
        tol = (1e-2 if mine.dtype == torch.bfloat16 else 1e-4) * max(1.0, ref.abs().max().item())
        assert (mine.double() - ref).abs().max().item() <= tol, key


def test_float64_kernels_match_reference_tightly():
    inp = inputs("grp_var_bare", dtype="float64", seqlen=60)
    res, keys = sc.scan_results(inp, grads=True, arch="sm_90")
    assert all(k.dtype["u"] == "float64" for k in keys)
    assert_all_close(res, "float64", rel=1e-11)


@pytest.mark.parametrize("seqlen", [1, 48, 49, 96])
def test_short_and_chunk_edge_lengths(seqlen):
    res, _ = sc.scan_results(inputs("var_const_all", seqlen=seqlen), grads=True, arch="sm_90")
    assert_all_close(res, f"seqlen={seqlen}")


def test_chaining_with_initial_state_equals_whole():
    inp = inputs("var_const_all")
    cut = 77  # not a chunk boundary

    def part(sl, init):
        p = dict(inp, initial_state=init)
        for k in ("u", "delta", "z", "B"):
            p[k] = inp[k][..., sl].contiguous()
        return tvm_mamba.selective_scan_fn(**p, return_last_state=True)

    with tvm_mamba.simulate_cuda("sm_90"):
        whole, last = tvm_mamba.selective_scan_fn(**inp, return_last_state=True)
        o1, s1 = part(slice(0, cut), inp["initial_state"])
        o2, s2 = part(slice(cut, None), s1)
    torch.testing.assert_close(torch.cat([o1, o2], -1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, last, atol=1e-5, rtol=1e-5)


def test_backward_is_deterministic_across_thread_orders():
    inp = inputs("grp_grp_full_warp", seqlen=20)
    runs = [sc.scan_results(inp, grads=True, arch="sm_90", order=order, seed=seed)[0]
            for order, seed in (("forward", 0), ("reversed", 0), ("random", 5))]
    for key in runs[0]:
        for other in runs[1:]:
            assert torch.equal(runs[0][key][0], other[key][0]), key  # fixed-order reductions, no atomics


def test_long_sequence_uses_the_sequential_scan(monkeypatch):
    """On a 64-core CPU this shape takes the chunked forward; CUDA kernels have only the sequential one."""
    from tvm_mamba.torch_ops import selective_scan as ops

    monkeypatch.setattr(ops, "_cores", lambda: 64)
    inp = inputs("var_const_all", seqlen=301)
    assert ops.fwd_direction(2, 4, 301, chunk_for(16), "cpu") == "fwd_chunked"
    res, keys = sc.scan_results(inp, grads=True, arch="sm_90")
    assert {k.direction for k in keys} == {"fwd", "bwd"}
    assert_all_close(res, "seqlen=301")


def test_sm80():
    res, keys = sc.scan_results(inputs("dstate5_const_const"), grads=True, arch="sm_80")
    assert {k.target for k in keys} == {"cudasim-sm_80"}
    assert_all_close(res, "sm_80")


def test_decode_steps_match_the_reference_scan_mamba1():
    """Mamba-1 decode (state (batch, dim, dstate), B/C (batch, dstate)) step by step against the float64 scan
    of the same sequence, from an initial state."""
    inp = inputs("var_const_all", seqlen=6)
    inp["C"] = torch.randn(2, 16, 6, generator=torch.Generator().manual_seed(4))
    full, last = selective_scan_ref(**{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                       for k, v in inp.items()}, return_last_state=True)
    state = inp["initial_state"].clone()
    with simcheck.recording() as keys, tvm_mamba.simulate_cuda("sm_90"):
        for t in range(6):
            y = tvm_mamba.selective_state_update(state, inp["u"][..., t], inp["delta"][..., t], inp["A"],
                                                 inp["B"][..., t], inp["C"][..., t], inp["D"], inp["z"][..., t],
                                                 inp["delta_bias"], True)
            assert_close_to_ref(y, full[..., t], name=f"out[{t}]")
    assert_close_to_ref(state, last, name="state")
    assert [(k.direction, k.target) for k in keys] == [("update", "cudasim-sm_90")]


@pytest.mark.parametrize("optional", [True, False])
def test_decode_step_mamba2_heads_groups(optional):
    static = dict(nheads=4, headdim=3, dstate=8, ngroups=2, has_D=optional, has_z=optional,
                  has_dt_bias=optional, dt_softplus=optional)
    res, keys = sc.update_results(sc.update_inputs(static, X32, batch=3, seed=3), "sm_90", steps=3)
    simcheck.ran(keys, "selective_scan", "update", static, X32)
    for key, (mine, ref) in res.items():
        assert_close_to_ref(mine, ref, name=key)


def test_decode_step_bf16():
    static = dict(nheads=6, headdim=1, dstate=16, ngroups=1, has_D=True, has_z=True, has_dt_bias=True,
                  dt_softplus=True)
    inp = sc.update_inputs(static, {"x": "bfloat16", "B": "bfloat16", "C": "bfloat16"}, batch=2)
    res, _ = sc.update_results(inp, "sm_90", steps=2)
    for key, (mine, ref) in res.items():
        tol = (1e-2 if mine.dtype == torch.bfloat16 else 1e-4) * max(1.0, ref.abs().max().item())
        assert (mine.double() - ref).abs().max().item() <= tol, key


def test_simcheck_every_update_config():
    """The sim-check of build-check's decode-step configurations (d_inner 1536 at every dstate); the
    scan configurations (1536 channels) take ~10 s each here and run in ``python -m tvm_mamba sim-check``."""
    configs = [c for c in compute.build_check_configs() if c[0] == "update"]
    assert len(configs) == 6 and configs[-1][1].get("tie_hdim") is True
    for direction, static, dtypes in configs:
        simcheck_ops.run_config("selective_scan", direction, static, dtypes, "sm_90")


def test_simcheck_rejects_unknown_directions():
    _, static, dtypes = compute.build_check_configs()[0]
    with pytest.raises(simcheck.CheckFailed, match="fwd_chunked"):
        sc.check("fwd_chunked", static, dtypes, "sm_90")
    with pytest.raises(simcheck.CheckFailed, match="chunk"):
        sc.check("fwd", dict(static, chunk=7), dtypes, "sm_90")


@pytest.mark.parametrize("dtypes", [
    {"x": "float32", "B": "float32", "C": "float32", "idx": "int64"},
    {"x": "bfloat16", "B": "bfloat16", "C": "float32", "state": "bfloat16", "dt": "float32", "z": "float16",
     "idx": "int32"},
    {"x": "float16", "B": "float16", "C": "float16", "state": "float16"},
])
def test_decode_step_state_pool_and_16bit_state(dtypes):
    """state_batch_indices (rows in reverse slot order, one padding row) and 16-bit states / mixed dtypes in
    the CUDA update kernel: out of padding rows 0, unnamed slots untouched, the rest against the reference
    (which rounds a 16-bit state per step as the kernel stores it)."""
    static = dict(nheads=4, headdim=3, dstate=8, ngroups=2, has_D=True, has_z=True, has_dt_bias=True,
                  dt_softplus=True)
    inp = sc.update_inputs(static, dtypes, batch=3, seed=7)
    res, keys = sc.update_results(inp, "sm_90", steps=3)
    simcheck.ran(keys, "selective_scan", "update", static, dtypes)
    for key, (mine, ref) in res.items():
        tol = (1e-4 if mine.dtype == torch.float32 else 2e-2) * max(1.0, ref.abs().max().item())
        assert (mine.double() - ref).abs().max().item() <= tol, key
    if "idx" in dtypes:
        assert torch.equal(res["out[0]"][0][1], torch.zeros_like(res["out[0]"][0][1]))
        untouched = [s for s in range(5) if s not in inp["state_batch_indices"].tolist()]
        assert torch.equal(res["state"][0][untouched], inp["state"][untouched])


@pytest.mark.parametrize("tie", [False, True])
def test_decode_step_padding_row_inside_a_shared_warp(tie):
    """dstate 8: a warp is four 8-thread lanes; headdim 4 in lanes of four rows makes two lanes per (batch, head),
    so one warp holds rows of batch 0 and of the padding batch row 1. The padding row's threads must still
    reach the warp's shuffles (a thread skipping a __shfl_xor_sync its mask names is undefined behaviour,
    which the harness reports); its out is 0 and its slot untouched."""
    static = dict(nheads=2, headdim=4, dstate=8, ngroups=1, has_D=True, has_z=True, has_dt_bias=True,
                  dt_softplus=True, **({"tie_hdim": True} if tie else {}))
    dtypes = {"x": "float32", "B": "float32", "C": "float32", "idx": "int32"}
    inp = sc.update_inputs(static, dtypes, batch=3, seed=3)
    res, keys = sc.update_results(inp, "sm_90", steps=2)  # the checker on (its default)
    simcheck.ran(keys, "selective_scan", "update", static, dtypes)
    for key, (mine, ref) in res.items():
        assert (mine.double() - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item()), key
    assert torch.equal(res["out[0]"][0][1], torch.zeros_like(res["out[0]"][0][1]))


@pytest.mark.parametrize("dtypes, headdim", [(X32, 3), ({"x": "bfloat16", "B": "bfloat16", "C": "bfloat16",
                                                              "idx": "int32"}, 3), (X32, 8)])
def test_decode_step_tied_heads(dtypes, headdim):
    """The tie_hdim CUDA kernel (A, dt, D, dt_bias one value per head, stride-0 views as Mamba2.step passes
    them), fp32 and bf16 with a state pool, 3 steps against the float64 reference. headdim 3: a warp lane per
    row; 8: four rows per lane sharing B / C staged in registers (the rule's default head_rows)."""
    static = dict(nheads=4, headdim=headdim, dstate=8, ngroups=2, has_D=True, has_z=True, has_dt_bias=True,
                  dt_softplus=True, tie_hdim=True)
    inp = sc.update_inputs(static, dtypes, batch=3, seed=5)
    assert inp["A"].stride() == (1, 0, 0) and inp["dt"].stride()[2] == 0
    res, keys = sc.update_results(inp, "sm_90", steps=3)
    simcheck.ran(keys, "selective_scan", "update", static, dtypes)
    for key, (mine, ref) in res.items():
        tol = (1e-4 if mine.dtype == torch.float32 else 1e-2) * max(1.0, ref.abs().max().item())
        assert (mine.double() - ref).abs().max().item() <= tol, key


def test_decode_step_index_out_of_range_refused():
    static = dict(nheads=4, headdim=1, dstate=8, ngroups=1, has_D=False, has_z=False, has_dt_bias=False,
                  dt_softplus=False)
    inp = sc.update_inputs(static, dict(X32, idx="int32"), batch=2)
    inp["state_batch_indices"] = torch.tensor([0, 4], dtype=torch.int32)
    before = inp["state"].clone()
    with tvm_mamba.simulate_cuda("sm_90"), pytest.raises(ValueError, match="state_batch_indices"):
        tvm_mamba.selective_state_update(**inp)
    assert torch.equal(inp["state"], before)


# --- complex A (selective_scan_complex kernels: one thread per lane) ------------------------------------------
COMPLEX = {
    # dstate 8 -> checkpoint chunks of 48: 70 = 48 + 22; B varying (batch, dstate, 2L), C complex (dim, N)
    "var_const_all": (2, 70, dict(dim=4, dstate=8, b_groups=1, c_groups=0, has_D=True, has_z=True,
                                  has_delta_bias=True, delta_softplus=True, has_init=True)),
    # 33 lanes: a partly empty block of 64 threads; one C group per channel (backward blocks of 1 channel)
    "grp_grp_ragged_blocks": (3, 21, dict(dim=11, dstate=4, b_groups=1, c_groups=11, has_D=False, has_z=True,
                                          has_delta_bias=False, delta_softplus=False, has_init=False)),
}


def complex_inputs(name, dtype="float32", seqlen=None):
    batch, L, static = COMPLEX[name]
    return sc.scan_inputs(static, {"u": dtype, "B": dtype, "C": dtype}, batch, seqlen or L, complex_A=True)


@pytest.mark.parametrize("name", list(COMPLEX))
def test_complex_A_forward_and_every_gradient(name):
    inp = complex_inputs(name)
    res, keys = sc.scan_results(inp, grads=True, arch="sm_90")
    assert expected_grads(inp) <= set(res)
    assert {(k.direction, k.target) for k in keys} == {("fwd_complex", "cudasim-sm_90"),
                                                       ("bwd_complex", "cudasim-sm_90")}
    assert_all_close(res, name)


def test_complex_A_bf16():
    inp = complex_inputs("var_const_all", dtype="bfloat16", seqlen=40)
    res, _ = sc.scan_results(inp, grads=True, arch="sm_90")
    low = {k: (v.to(torch.complex64 if v.is_complex() else torch.float32) if isinstance(v, torch.Tensor) else v)
           for k, v in inp.items()}
    ref_low = selective_scan_ref(**low, dtype=torch.float32).to(torch.bfloat16)
    assert_close_to_ref(res["out"][0], res["out"][1], ref_low, name="out")
    for key, (mine, ref) in res.items():
        if key != "out":
            tol = (1e-2 if mine.dtype == torch.bfloat16 else 1e-4) * max(1.0, ref.abs().max().item())
            assert (mine.double() - ref).abs().max().item() <= tol, key


def test_complex_A_large_rotations():
    """Angles dt Im A up to 3e5 (Im A up to 2e5; cosf / sinf took their slow path above 105615): the CUDA
    kernels' rotation (sincospif at dt Im A / pi, then rotated on by that division's rounding) is as accurate
    as the CPU kernels' cos / sin against float64: err <= 2 err(CPU) + atol. Both errors are dominated by
    rounding dt Im A to float32 (ulp(1e5) = 0.0078); without the rounding step the CUDA error was 3.8x (out)
    and 5x (last_state) the CPU's here."""
    batch, _, static = COMPLEX["var_const_all"]
    inp = sc.scan_inputs(static, {"u": "float32", "B": "float32", "C": "float32"}, batch, 12, seed=1, complex_A=True)
    dim, N = inp["A"].shape
    sign = torch.tensor([1.0, -1.0]).repeat(N // 2)
    inp["A"] = torch.complex(inp["A"].real, (torch.logspace(0, 5.3, N) * sign).expand(dim, N).float())
    ref = {k: (sc._to64(v) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    expect = selective_scan_ref(**ref, return_last_state=True)
    cpu = tvm_mamba.selective_scan_fn(**inp, return_last_state=True)
    with tvm_mamba.simulate_cuda("sm_90"):
        sim = tvm_mamba.selective_scan_fn(**inp, return_last_state=True)
    for name, mine, base, want in zip(("out", "last_state"), sim, cpu, expect):
        err, err_cpu = ((sc._to64(x) - want).abs().max().item() for x in (mine, base))
        assert err <= 2 * err_cpu + 1e-5 * want.abs().max().item(), (name, err, err_cpu)


def test_complex_A_float64():
    """complex128 / float64 builds of the complex kernels (double sincospi and fma in the rotation)."""
    res, keys = sc.scan_results(complex_inputs("grp_grp_ragged_blocks", dtype="float64", seqlen=9), grads=True,
                                arch="sm_90")
    assert {(k.direction, k.dtype["u"]) for k in keys} == {("fwd_complex", "float64"), ("bwd_complex", "float64")}
    assert_all_close(res, "complex float64", rel=1e-11)


def test_simcheck_complex_configs_fp32():
    """sim-check of build-check's fp32 complex-A configurations (1536 channels); bf16 ones run in
    ``python -m tvm_mamba sim-check``."""
    configs = [c for c in compute.build_check_configs() if c[0].endswith("_complex") and c[2]["u"] == "float32"]
    assert [c[0] for c in configs] == ["fwd_complex", "bwd_complex"]
    for direction, static, dtypes in configs:
        simcheck_ops.run_config("selective_scan", direction, static, dtypes, "sm_90")


def test_complex_A_sm80():
    res, keys = sc.scan_results(complex_inputs("grp_grp_ragged_blocks", seqlen=9), grads=True, arch="sm_80")
    assert {k.target for k in keys} == {"cudasim-sm_80"}
    assert_all_close(res, "complex sm_80")


# The parallel-in-time kernels' knobs (schedules/cuda/selective_scan.py): steps per thread and lanes per block
# of the forward, steps per thread of the backward (its time blocks start at checkpoints: 32 x items a multiple
# of the chunk, 48 here). dstate 64: two lane-held register slots a thread, staged slices of B / C; 300 steps:
# ragged last time blocks.
@pytest.mark.parametrize("fwd, bwd", [({"items": 4, "threads": 64}, {"items": 6}),
                                      ({"items": 16, "threads": 128}, {"items": 3})])
def test_time_parallel_knobs(monkeypatch, fwd, bwd):
    from tvm_mamba.runtime import dispatch

    served = []

    def hook(key):
        if key.op == "selective_scan" and key.direction in ("fwd", "bwd"):
            served.append(key.direction)
            return dispatch.Plan(key, tuple(sorted((fwd if key.direction == "fwd" else bwd).items())), "test")
        return None

    monkeypatch.setattr(dispatch, "_plan_hooks", [hook])
    res, _ = sc.scan_results(inputs("grp_grp_full_warp", seqlen=300), grads=True, arch="sm_90")
    assert set(served) == {"fwd", "bwd"}
    assert_all_close(res, f"fwd {fwd}, bwd {bwd}")


def test_backward_falls_back_to_the_sequential_scan_where_no_time_block_fits():
    """dstate 91: checkpoint chunk 45, which no 32 x items (items <= 16) is a multiple of, so the CUDA rule keeps
    the sequential warp-lane backward (schedules/cuda/selective_scan.py); still every gradient vs float64."""
    from tvm_mamba.runtime import cuda_target
    from tvm_mamba.schedules.cuda import selective_scan as cuda_rule
    from tvm_mamba.schedules.rule import Decisions

    static = dict(dim=2, dstate=91, b_groups=1, c_groups=1, has_D=True, has_z=True, has_delta_bias=True,
                  delta_softplus=True, has_init=True)
    assert chunk_for(91) == 45
    sch = cuda_rule.lay_out("bwd", compute.DIMS["bwd"](**static, chunk=45, block=2), cuda_target("sm_90"),
                            Decisions())
    assert "tvm_warp_shuffle_down" not in sch.mod.script()
    inp = sc.scan_inputs(static, {"u": "float32", "B": "float32", "C": "float32"}, 2, 100, 0)
    res, keys = sc.scan_results(inp, grads=True, arch="sm_90")
    assert {k.direction for k in keys} == {"fwd", "bwd"}
    assert_all_close(res, "dstate=91")
