"""The roofline tool (tvm_mamba/tools/roofline/): the counting build counts a hand-made kernel exactly, the fit
refuses counts that are not affine, the minimum model matches a hand computation, and the CLI prints its
summary line."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tvm_mamba import cli
from tvm_mamba.tools.roofline import count, hardware, measure, minimum, report
from tvm_mamba.runtime import cuda_target


@T.prim_func
def vadd_exp(a_h: T.handle, b_h: T.handle, c_h: T.handle):
    """c = a + exp(b), one thread per element, guarded tail: 3 x 4 x n bytes, n flops, n exps."""
    T.func_attr({"global_symbol": "vadd_exp", "tirx.noalias": True})
    n = T.int32()
    a = T.match_buffer(a_h, (n,), "float32")
    b = T.match_buffer(b_h, (n,), "float32")
    c = T.match_buffer(c_h, (n,), "float32")
    for bx in T.thread_binding((n + 63) // 64, thread="blockIdx.x"):
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            s = T.alloc_buffer((64,), "float32", scope="shared")  # shared traffic is not global: not counted
            s[tx] = T.if_then_else(bx * 64 + tx < n, b[bx * 64 + tx], T.float32(0))
            if bx * 64 + tx < n:
                c[bx * 64 + tx] = a[bx * 64 + tx] + T.exp(s[tx])


@pytest.fixture(scope="module")
def vadd_build():
    return count.build(tvm.IRModule({"vadd_exp": vadd_exp}), cuda_target("sm_90"), "vadd_exp")


@pytest.mark.parametrize("n", [1000, 64])
def test_counting_build_counts_a_vector_add_exactly(vadd_build, n):
    args = [tvm.runtime.tensor(np.ones(n, "float32"), tvm.cpu(0)) for _ in range(3)]
    (name, launch), = count.run(vadd_build, "vadd_exp", args).items()
    # both arms of the guarded select count (the tail block's guarded b loads): b is read by every thread
    blocks = -(-n // 64)
    assert launch.counts == count.Counts(load_bytes=4 * n + 4 * 64 * blocks, store_bytes=4 * n, flops=n, exps=n)
    assert (launch.blocks, launch.threads) == (blocks, 64)
    assert launch.per_buffer == {"a": (4 * n, 0), "b": (4 * 64 * blocks, 0), "c": (0, 4 * n)}
    assert not vadd_build.tensor_cores and "tvm_mamba_count(" in vadd_build.source


def test_expr_counts_vector_lanes_and_call_families():
    x = tvm.tirx.Var("x", "float32x4")
    e = tvm.tirx.call_pure_extern("float32x4", "__expf", x * x + x) + tvm.tirx.call_pure_extern("float32x4", "log1pf", x)
    c = count.expr_counts(e)
    assert (c.flops, c.exps, c.sfu, c.load_bytes) == (12, 4, 4, 0)


def test_fit_is_exact_and_refuses_a_non_affine_count():
    names = ["batch", "seqlen"]
    pts, check = measure.fit_points(names, 256)

    def f(b, L):
        return 7 + 3 * b + 5 * b * L

    coef = measure.fit_affine([(measure.features(names, b, L), f(b, L)) for b, L in pts],
                              (measure.features(names, *check), f(*check)))
    assert measure.evaluate(coef, measure.features(names, 4, 2048)) == f(4, 2048)
    with pytest.raises(measure.NonAffineError):
        measure.fit_affine([(measure.features(names, b, L), b * L * L) for b, L in pts],
                           (measure.features(names, *check), check[0] * check[1] ** 2))


def test_minimum_of_conv_forward_is_the_hand_count():
    B, D, L, W = 2, 1536, 2048, 4
    static = dict(dim=D, width=W, activation="silu", has_bias=True)
    pbytes = {"x": 4 * B * D * L, "weight": 4 * D * W, "bias": 4 * D, "out": 4 * B * D * L}
    m = minimum.minimum("causal_conv1d", "fwd", static, B, L, pbytes)
    assert m.bytes == 4 * (2 * B * D * L + D * W + D)
    assert (m.mm, m.flops, m.exps) == (0, B * D * L * (2 * W + 1 + 3), B * D * L)
    ck = dict(pbytes, ck=123)  # scratch (checkpoints) is not part of the scan's minimum; state in place twice
    assert minimum.min_bytes("selective_scan", "fwd", ck) == sum(pbytes.values())
    assert minimum.min_bytes("selective_scan", "update", {"state": 10, "x": 1}) == 21


def test_mamba3_preset_kernels_and_their_minimum_bytes():
    """The Mamba-3 preset runs the step, the preprocess and its backward, and the SSD kernels with chunk
    matmuls as its chunked forward / backward call them (a group per head, the strict sums: diag_skip; no conv,
    no Mamba-2 SSD shapes); other presets run no Mamba-3 kernel. Their minimum bytes are the hand count (the
    step's q workspace is scratch, as are the backward's angle-term and init-term workspaces) and the
    preprocess's per-chunk tensors are sized by nchunks = seqlen / chunk (derived, not a free dim)."""
    ops = ["causal_conv1d", "selective_scan", "ssd", "mamba3"]
    keys = report.preset_keys("mamba3-130m", ops, "sm_90")
    ssd_keys = [k for k in keys if k.op == "ssd"]
    assert [k.direction for k in ssd_keys] == ["bmm_chunk", "chunk_state", "chunk_scan", "chunk_scan_bwd_dstates",
                                               "chunk_scan_bwd"]
    assert all(k.static["ngroups"] == 24 and k.static["chunk_size"] == 64 for k in ssd_keys)
    assert ssd_keys[2].static["diag_skip"] and ssd_keys[4].static["diag_skip"]
    assert "step_group" not in ssd_keys[4].static
    step, pre, bwd = [k for k in keys if k.op == "mamba3"]
    assert (step.direction, pre.direction, bwd.direction) == ("siso_step", "siso_preprocess", "siso_preprocess_bwd")
    assert not [k for k in report.preset_keys("mamba2-130m", ops, "sm_90") if k.op == "mamba3"]
    B, L, H, P, N, S = 2, 256, 24, 64, 128, 32
    f4 = 4 * (2 * B * N + 3 * B * H * P + 3 * B * H + 2 * H * N + 3 * B * H * S + H + 2 * B * H * P * N
              + 2 * B * H * N + B * H * P)  # Q K | V Z out | ADT DT Trap | biases | Angles, angle in / out | D
    assert minimum.minimum("mamba3", "siso_step", step.static, B, 1, measure.param_bytes(step, B, 1)).bytes == f4
    pb = measure.param_bytes(pre, B, L)
    assert pb["dA_cs"] == pb["scale"] == pb["skip"] == 4 * B * H * L and pb["q"] == 4 * B * L * H * N
    m = minimum.minimum("mamba3", "siso_preprocess", pre.static, B, L, pb)
    assert (m.mm, m.exps, m.sfu) == (0, B * L * H, 3 * S * B * L * H)
    pb = measure.param_bytes(bwd, B, L)
    assert pb["dq"] == pb["dQh"] == 4 * B * L * H * N and pb["dscale"] == 4 * B * H * L and pb["gdt"] == 4 * B * L * H * S
    m = minimum.minimum("mamba3", "siso_preprocess_bwd", bwd.static, B, L, pb)
    assert m.bytes == sum(pb.values()) - pb["gdt"] - pb["c0"] and (m.mm, m.exps) == (0, B * L * H)


def test_mimo_preset_runs_the_mimo_step_and_virtual_head_preprocesses():
    """mamba3-mimo-130m (rank 4) runs the MIMO decode step instead of the SISO one, and the chunked forward's
    preprocesses at mamba3_mimo's 4 * 24 rank-major virtual heads over 4 * 1 Q/K heads, without D; the step's
    minimum bytes are every parameter once less the rotated-q workspace (rank 4: Q, K, the K states and q are
    (batch, 4, ...))."""
    grouped = [k for k in report.preset_keys("mamba3-mimo-130m", ["ssd"], "sm_90") if "diag_skip" in k.static]
    assert [k.static["step_group"] for k in grouped] == [4, 4]  # the SSD scans over (step, rank) positions
    keys = report.preset_keys("mamba3-mimo-130m", ["mamba3"], "sm_90")
    assert [k.direction for k in keys] == ["mimo_step", "siso_preprocess", "siso_preprocess_bwd"]
    assert all(k.static["nheads"] == 96 and k.static["nheads_qk"] == 4 and not k.static["has_D"] for k in keys[1:])
    step, B, R, H, P, N = keys[0], 2, 4, 24, 64, 128
    pb = measure.param_bytes(step, B, 1)
    assert pb["qrot"] == pb["kout"] == 4 * B * R * H * N and pb["MO"] == 4 * H * R * P
    m = minimum.minimum("mamba3", "mimo_step", step.static, B, 1, pb)
    assert m.bytes == sum(pb.values()) - pb["qrot"] and m.exps == B * H * P * R + 2 * B * H


def test_minimum_of_gated_norm_is_the_hand_count_over_token_rows():
    """rows = batch * seqlen; the forward gates before the norm (silu(z): an exp a row element)."""
    static = dict(hidden=1536, group_size=1536, has_z=True, norm_before_gate=False)
    n = 2 * 2048 * 1536
    fwd = minimum.minimum("rmsnorm_gated", "fwd", static, 2, 2048, {"x": 4 * n, "z": 4 * n, "out": 4 * n})
    assert (fwd.bytes, fwd.mm, fwd.flops, fwd.exps) == (12 * n, 0, 7 * n, n)
    bwd = minimum.minimum("rmsnorm_gated", "bwd", dict(static, has_bias=True), 2, 2048, {})
    assert (bwd.flops, bwd.exps) == (20 * n, n)


def test_footprint_caps_each_buffer_at_its_size():
    k = measure.KernelCounts("k", count.Counts(), 1, 32, {"x": (400, 0), "y": (0, 40), "tmp": (8, 8)})
    assert measure.footprint([k], {"x": 100, "y": 100}) == 100 + 40 + 16


def test_occupancy_and_bound():
    assert hardware.occupancy(32, 0, 256) == 1.0  # 8 blocks x 8 warps
    assert hardware.occupancy(128, 0, 256) == 0.25  # 65536 / (128 * 256) = 2 blocks
    assert hardware.occupancy(32, 100 * 1024, 128) == 2 * 4 / 64  # shared memory: 2 blocks
    t, unit = hardware.time_bound(4.8e12, 0, 0)
    assert (t, unit) == (1.0, "memory")


def test_cli_prints_rows_and_the_summary_line(capsys, tmp_path):
    out = tmp_path / "roofline.md"
    rc = cli.main(["roofline", "--preset", "mamba-130m", "--ops", "causal_conv1d", "--batch", "1",
                   "--seqlen", "512", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert re.fullmatch(r"roofline: 2 kernels, [0-2] above 2x of their bound, [0-2] on tensor cores \(cuda sm_90\)",
                        text.strip().splitlines()[-1])
    assert "causal_conv1d.fwd" in text and "causal_conv1d.bwd" in text
    md = out.read_text()
    assert "| causal_conv1d.fwd |" in md and "at commit `" in md


def test_cli_rejects_an_unknown_preset(capsys):
    assert cli.main(["roofline", "--preset", "mamba-9b"]) == 2
    assert "unknown 'mamba-9b'" in capsys.readouterr().err


def test_tensor_core_products_are_counted_at_the_tensor_core_rate():
    """--dtype bfloat16 keys: the SSD chunk products on wmma; the counting build counts 2 x 16^3 flops per warp
    mma_sync (bmm_chunk at one chunk of 64 x 64 x 32 per group: 2 x 64 x 64 x 32 per (batch, group)), and the
    bound puts them at the bf16 tensor-core rate."""
    import torch
    import tvm_ffi

    from tvm_mamba.compute import ssd
    from tvm_mamba.schedules.cuda import ssd as cuda_rule
    from tvm_mamba.schedules.rule import Decisions

    keys = [k for k in report.preset_keys("mamba2-130m", ["ssd"], "sm_90", "bfloat16") if k.direction == "bmm_chunk"]
    assert keys and keys[0].dtype == {"bc": "bfloat16"}
    static = dict(ngroups=2, dstate=32, chunk_size=64, bc_dtype="bfloat16")
    sch = cuda_rule.lay_out("bmm_chunk", ssd.DIMS["bmm_chunk"](**static), cuda_target("sm_90"),
                            Decisions({"threads": 128, "tile": 64}))
    built = count.build(sch.mod, cuda_target("sm_90"), "ssd_bmm_chunk")
    assert built.tensor_cores
    args = [tvm_ffi.from_dlpack(torch.ones(1, 64, 2, 32, dtype=torch.bfloat16)) for _ in range(2)]
    args.append(tvm_ffi.from_dlpack(torch.zeros(1, 1, 2, 64, 64)))
    (name, launch), = count.run(built, "ssd_bmm_chunk", args).items()
    assert launch.counts.mma_flops == 2 * 64 * 64 * 32 * 2
    seconds, unit = hardware.time_bound(0, 0, 0, launch.counts.mma_flops, hardware.H200.tc_bf16_flops)
    assert unit == "arith" and seconds == pytest.approx(launch.counts.mma_flops / hardware.H200.tc_bf16_flops)


def test_dstates_writes_dz_once_from_the_gradient_copies():
    """ssd_chunk_scan_bwd_dstates on CUDA writes dz as the visit of its matmul's lhs g (strategy.py
    ``visits_lhs``): one launch; with dstate 256 (two 128-column tiles per task) dz is still stored and y_pre
    read once per element (the first column tile only), dy / z once per tile."""
    from tvm_mamba.runtime.key import KernelKey

    static = dict(nheads=2, ngroups=1, headdim=64, dstate=256, chunk_size=64, has_z=True, has_seq_idx=False)
    key = KernelKey.make("ssd", "chunk_scan_bwd_dstates", {"x": "float32", "bc": "float32"}, static,
                         "cudasim-sm_90")
    (launch,), _ = measure.counted(key, 2, 256)
    size = 2 * 256 * 2 * 64 * 4  # bytes of one (batch, seqlen, nheads, headdim) fp32 tensor
    assert launch.per_buffer["dz"] == (0, size) and launch.per_buffer["y_pre"] == (size, 0)
    assert launch.per_buffer["dy"] == (2 * size, 0) and launch.per_buffer["z"] == (2 * size, 0)
