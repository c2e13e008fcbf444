"""The int8 dot family on the CUDA kernels, run on the CPU by the CUDA execution harness
(tvm_mamba.simulate_cuda): exact int32 matmul (int8 tensor cores, or dp4a through shared memory), i8x4 pack /
unpack, and the straight-through projection / decoder tail whose backward runs the dgrad / wgrad kernels,
against the int64 / float64 references (mirrors tests/torch_ops/test_int8_dot.py).
"""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tvm_mamba.tools import simcheck
from tvm_mamba.compute import int8_dot as compute
from tvm_mamba.reference.int8_dot import int8_matmul_ref, pack_int8x4_ref, unpack_int8x4_ref
from tvm_mamba.tools.simcheck import int8_dot as sc
from tvm_mamba.torch_ops.int8_dot import int8_matmul, pack_int8x4, unpack_int8x4

sim = tvm_mamba.simulate_cuda


def assert_all_close(res: dict, label: str) -> None:
    """float32 outputs / gradients: sums of int8 x float products, atol relative to the magnitude."""
    for key, (mine, ref) in res.items():
        torch.testing.assert_close(mine.double(), ref.double(), atol=1e-5 * max(1.0, ref.abs().max().item()),
                                   rtol=1e-5, msg=lambda m: f"{label}:{key}: {m}")


# (M, N, K): N a multiple of the 32..256-column tiles or not (12: one column per block), K a multiple of the
# 64-byte shared-memory stage or not (200 = 3 stages of 64 + one of 8), M not a multiple of anything
@pytest.mark.parametrize("M,N,K", [(1, 8, 64), (7, 12, 200), (69, 64, 128), (5, 96, 256)])
def test_matmul_exact(M, N, K):
    a, b = sc.codes(M, K, seed=1), sc.codes(N, K, seed=2)
    with simcheck.recording() as keys, sim("sm_90"):
        c = int8_matmul(a, b)
    simcheck.ran(keys, "int8_dot", "matmul", dict(N=N, K=K), {})
    assert c.dtype == torch.int32 and torch.equal(c.long(), int8_matmul_ref(a, b))


def test_matmul_k_not_a_multiple_of_4_takes_the_fallback_schedule():
    """K % 4 != 0: the dp4a rule declines (schedules/cuda/int8_dot.py returns None) and the dispatcher's
    generic GPU schedule serves the plain int32 dot; still exact."""
    from tvm.target import Target

    from tvm_mamba.schedules.cuda import int8_dot as rule

    assert rule.lay_out("matmul", compute.DIMS["matmul"].of(4, 3), Target("cuda"), None) is None
    a, b = sc.codes(9, 3, seed=1), sc.codes(4, 3, seed=2)
    with simcheck.recording() as keys, sim("sm_90"):
        c = int8_matmul(a, b)
    simcheck.ran(keys, "int8_dot", "matmul", dict(N=4, K=3), {})
    assert torch.equal(c.long(), int8_matmul_ref(a, b))


def test_matmul_extremes_exact():
    # every product at its extreme: -128 * -128 = 2^14, summed over K = 256 -> 2^22; 127 * -128 the other sign
    a = torch.full((6, 256), -128, dtype=torch.int8)
    b = torch.cat([torch.full((32, 256), -128, dtype=torch.int8), torch.full((32, 256), 127, dtype=torch.int8)])
    with sim("sm_90"):
        c = int8_matmul(a, b)
    assert torch.equal(c.long(), int8_matmul_ref(a, b))


def test_matmul_empty():
    with sim("sm_90"):
        assert int8_matmul(sc.codes(0, 8), sc.codes(4, 8)).shape == (0, 4)


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 13), (5,), (4, 1)])
def test_pack_layout_and_round_trip(shape):
    codes = sc.codes(*shape, seed=3)
    with sim("sm_90"):
        packed = pack_int8x4(codes)
        back = unpack_int8x4(pack_int8x4_ref(codes), shape[-1])
    assert packed.dtype == torch.int32 and torch.equal(packed, pack_int8x4_ref(codes))
    assert torch.equal(back, codes) and torch.equal(unpack_int8x4_ref(packed, shape[-1]), codes)


def test_pack_little_endian_lanes():
    codes = torch.tensor([[1, 2, 3, 4, -1]], dtype=torch.int8)
    with sim("sm_90"):
        packed = pack_int8x4(codes)
        back = unpack_int8x4(packed, 5)
    assert packed.tolist() == [[0x04030201, 0x000000FF]]
    assert torch.equal(back, codes)


@pytest.mark.parametrize("hin,latent_out,thr", [(1, None, None), (3, 6, 0.05), (1, 5, 0.0), (3, None, None)])
def test_projection_forward_and_grads(hin, latent_out, thr):
    res, keys = sc.projection_results(hin=hin, H=3, E=16, Lc=8, arch="sm_90", batch=2, T=5, latent_out=latent_out,
                                      relu_threshold=thr)
    assert {k.direction for k in keys} == {"matmul", "dgrad", "wgrad"}
    assert all(k.target == "cudasim-sm_90" for k in keys)
    assert_all_close(res, f"hin={hin}")
    if latent_out is not None:
        assert torch.all(res["grad_weight"][0][..., latent_out:] == 0)


def test_projection_offload_codes_identical():
    """offload_codes saves the activation codes packed i8x4 (the pack / unpack kernels): same bits."""
    runs = []
    for offload in (False, True):
        res, keys = sc.projection_results(hin=1, H=3, E=16, Lc=8, arch="sm_90", relu_threshold=0.02,
                                          offload_codes=offload)
        runs.append(res)
        assert ({"pack", "unpack"} <= {k.direction for k in keys}) == offload
    for key in runs[0]:
        assert torch.equal(runs[0][key][0], runs[1][key][0]), key


def test_wgrad_two_stage_sum_over_many_rows():
    """1100 rows: the weight gradient's sum over rows runs in 2 parts plus the fixed-order second stage."""
    H, E, Lc = 2, 5, 19
    assert compute.wgrad_parts(1100, H, Lc) == 2
    res, _ = sc.projection_results(hin=1, H=H, E=E, Lc=Lc, arch="sm_90", batch=4, T=275)
    assert_all_close(res, "rows=1100")
    again, _ = sc.projection_results(hin=1, H=H, E=E, Lc=Lc, arch="sm_90", batch=4, T=275, order="reversed")
    assert torch.equal(res["grad_weight"][0], again["grad_weight"][0])  # deterministic: no atomics


@pytest.mark.parametrize("offload", [False, True])
def test_decoder_tail_forward_and_grads(offload):
    res, keys = sc.decoder_tail_results(H=3, L=8, D=10, arch="sm_90", batch=2, T=4, offload_codes=offload)
    assert res["out"][0].shape == (2, 1, 4, 10)
    assert {"matmul", "dgrad", "wgrad"} <= {k.direction for k in keys}
    assert_all_close(res, f"offload={offload}")


def test_sm80():
    res, keys = sc.decoder_tail_results(H=2, L=4, D=12, arch="sm_80")
    assert {k.target for k in keys} == {"cudasim-sm_80"}
    assert_all_close(res, "sm_80")


@pytest.mark.parametrize("direction", ["matmul", "pack", "unpack"])
def test_simcheck_configs(direction):
    """sim-check's own configurations (build-check's list) for the cheap directions; the 4096 x 4096 matmul
    and the dgrad / wgrad shapes (1M-2M output threads) run in ``python -m tvm_mamba sim-check``."""
    configs = [c for c in compute.build_check_configs() if c[0] == direction and c[1].get("N", 0) <= 128]
    assert configs
    for d, static, dtypes in configs:
        sc.check(d, static, dtypes, "sm_90")


def test_simcheck_rejects_unknown_direction():
    with pytest.raises(simcheck.CheckFailed, match="unknown direction"):
        sc.check("fwd", {}, {}, "sm_90")


def _source(kernel: str, dims, decisions: dict) -> str:
    import tvm

    from tvm_mamba.runtime import cuda_target
    from tvm_mamba.schedules.cuda import int8_dot as rule
    from tvm_mamba.schedules.rule import Decisions

    sch = rule.lay_out(kernel, dims, cuda_target("sm_90"), Decisions(decisions))
    return tvm.compile(sch.mod, target=cuda_target("sm_90")).mod.imports[0].inspect_source("cuda")


def test_matmul_on_tensor_cores_where_the_sides_allow():
    """N, K multiples of 16: wmma s8 x s8 -> s32 (schedules/cuda/int8_dot.py ``_tc_matmul``); else, or with
    tensor_cores 0, the dp4a kernel."""
    matmul = compute.DIMS["matmul"]
    assert "wmma::mma_sync" in (src := _source("matmul", matmul.of(64, 128), {})) and "signed char" in src
    assert "__dp4a" in (dp4a := _source("matmul", matmul.of(64, 128), {"tensor_cores": 0})) and "wmma" not in dp4a
    assert "wmma" not in _source("matmul", matmul.of(12, 128), {})


@pytest.mark.parametrize("decisions", [{"tc_rows": 32, "tile": 32, "threads": 64},
                                       {"tc_rows": 128, "tile": 128, "threads": 256}])
def test_matmul_tensor_core_tiles_exact(monkeypatch, decisions):
    """Other tile shapes (rows of a per block, columns of b, warps), M ragged against them, and int32 sums
    beyond float's 2^24 (K = 2048 products of -128 * -128 = 2^25: the harness holds integer fragments)."""
    from tvm_mamba.runtime import dispatch

    monkeypatch.setattr(dispatch, "_plan_hooks", [
        lambda key: dispatch.Plan(key, tuple(sorted(decisions.items())), "test") if key.op == "int8_dot" else None])
    a, b = sc.codes(131, 2048, seed=3), sc.codes(256, 2048, seed=4)
    a[:3] = -128
    b[:5] = -128
    with sim("sm_90"):
        c = int8_matmul(a, b)
    assert c[0, 0].item() == 2 ** 25 and torch.equal(c.long(), int8_matmul_ref(a, b))


def _knobs(monkeypatch, decisions: dict) -> None:
    from tvm_mamba.runtime import dispatch

    monkeypatch.setattr(dispatch, "_plan_hooks", [
        lambda key: dispatch.Plan(key, tuple(sorted(decisions.items())), "test") if key.op == "int8_dot" else None])


def test_backward_on_tensor_cores_where_the_sides_allow():
    """dgrad / wgrad with N, K multiples of 16: bf16 wmma (g in three bf16 parts, _tiled_tc._copy_split); else,
    or with tensor_cores 0, one thread per output on float FMA."""
    dgrad, wgrad = compute.DIMS["dgrad"], compute.DIMS["wgrad"]
    for kernel, dims in (("dgrad", dgrad.of(2, 32, 16)), ("wgrad", wgrad.of(2, 1, 32, 16))):
        assert "wmma::mma_sync" in (src := _source(kernel, dims, {})) and "nv_bfloat16" in src
        assert "wmma" not in _source(kernel, dims, {"tensor_cores": 0})
    assert "wmma" not in _source("dgrad", dgrad.of(2, 32, 8), {})
    assert "wmma" not in _source("wgrad", wgrad.of(2, 1, 24, 16), {})


@pytest.mark.parametrize("decisions", [{}, {"tc_rows": 32, "tile": 32, "threads": 64},
                                       {"tc_rows": 128, "tile": 128, "threads": 256}])
def test_backward_tensor_cores_float32_accurate(monkeypatch, decisions):
    """The straight-through backward on tensor cores (projection E = 32, Lc = 16: dgrad (K 16, N 32) and wgrad
    (N 32, K 16)) and the decoder tail (D = 48), 14 / 10 rows (ragged against every row tile): the split g gives
    float32's accuracy (1e-5 relative, the FMA kernels' tolerance), not bfloat16's 4e-3."""
    _knobs(monkeypatch, decisions)
    res, keys = sc.projection_results(hin=3, H=3, E=32, Lc=16, arch="sm_90", batch=2, T=7, latent_out=12,
                                      relu_threshold=0.01)
    assert {"dgrad", "wgrad"} <= {k.direction for k in keys}
    assert_all_close(res, f"tc {decisions}")
    res, _ = sc.decoder_tail_results(H=2, L=8, D=48, arch="sm_90", batch=2, T=5)
    assert_all_close(res, f"tail tc {decisions}")


def test_backward_tensor_cores_wide_range_and_parts():
    """g over 40 binades through the op (dgrad: the columns of g scaled by 10^-6 .. 10^6) is float32-accurate
    per output; the weight gradient over 1100 rows (2 parts of 550: the last k slice of each part masked) sums
    the same as float64 and is deterministic (reversed block order: same bits)."""
    from tvm_mamba.torch_ops.int8_dot import int8_dgrad_op, int8_wgrad_op

    gen = torch.Generator().manual_seed(5)
    g = torch.randn(2, 37, 32, generator=gen) * torch.logspace(-6, 6, 32, base=10.0)
    codes = torch.randint(-128, 128, (2, 32, 48), dtype=torch.int8, generator=gen)
    with sim("sm_90"):
        out = int8_dgrad_op(g, codes, torch.tensor([0.25]))
    ref = 0.25 * torch.einsum("hmk,hkn->hmn", g.double(), codes.double())
    bound = 0.25 * torch.einsum("hmk,hkn->hmn", g.double().abs(), codes.double().abs())
    assert ((out.double() - ref).abs() <= 2e-6 * bound + 1e-30).all()
    assert compute.wgrad_parts(1100, 2, 16) == 2
    cw, gw = torch.randint(-128, 128, (1, 1100, 32), dtype=torch.int8, generator=gen), torch.randn(2, 1100, 16, generator=gen)
    with sim("sm_90"):
        w = int8_wgrad_op(cw, gw, torch.tensor([0.5]))
    with sim("sm_90", order="reversed"):
        again = int8_wgrad_op(cw, gw, torch.tensor([0.5]))
    refw = 0.5 * torch.einsum("mn,hmk->hnk", cw[0].double(), gw.double())
    torch.testing.assert_close(w.double(), refw, atol=1e-5 * refw.abs().max().item(), rtol=1e-5)
    assert torch.equal(w, again)
