"""CPU rule for the SSD kernels: accepts SSD kernels only, and every scheduled kernel compiles for llvm."""
from __future__ import annotations

import pytest
import torch
import tvm

from tvm_mamba.compute import ssd
from tvm_mamba.runtime.target import cpu_target, cuda_target
from tvm_mamba.schedules.cpu import ssd as cpu_rule
from tvm_mamba.schedules.rule import Decisions


def test_rule_declines_foreign_functions():
    dims = ssd.DIMS["chunk_cumsum"](nheads=2, chunk_size=16)
    for kernel in ("no_such_kernel", "fwd"):  # a name no op has; another op's kernel (causal_conv1d's, ...)
        assert cpu_rule.lay_out(kernel, dims, cpu_target(), Decisions()) is None
    assert cpu_rule.lay_out("chunk_cumsum", dims, cuda_target("sm_90"), Decisions()) is None  # not a CPU target


@pytest.mark.parametrize("direction", ["chunk_scan", "chunk_scan_bwd"])
def test_rule_schedules_and_compiles(direction):
    dims = ssd.DIMS[direction](nheads=2, ngroups=1, headdim=4, dstate=4, chunk_size=4, has_D=True, has_z=True,
                               has_seq_idx=True, x_dtype="bfloat16")
    sch = cpu_rule.lay_out(direction, dims, cpu_target(), Decisions())
    assert sch is not None
    with cpu_target():
        ex = tvm.compile(sch.mod, target=cpu_target())
    assert ex[f"ssd_{direction}"] is not None


@pytest.mark.parametrize("rows, cols, order, cs", [(1, 128, 0, 12), (2, 16, 1, 12), (8, 64, 0, 12), (2, 16, 0, 32),
                                                  (8, 16, 1, 32), (4, 32, 1, 32)])
def test_cpu_register_blocks_agree_bitwise(rows, cols, order, cs, monkeypatch):
    """Every (rows, cols) accumulator block, in either block order, sums each output over k in the same
    order: the forward and every gradient are bitwise equal to the default block's (which the op tests
    check against float64).
    headdim 24 / dstate 16 / chunk 12: cols 64 and 128 do not divide the widths (whole width), rows 8
    does not divide the chunk (4); chunk 32 with 16 columns: the causal products (g x^T) written in
    column blocks up to each row block's end, the rest never read; ragged last chunk, seq_idx, z, D, initial
    states."""
    import torch

    import tvm_mamba
    from tvm_mamba.runtime import dispatch
    from tvm_mamba.torch_ops.ssd import mamba_chunk_scan_combined

    g = torch.Generator().manual_seed(1)
    b, L, h, p, n = 2, 29, 2, 24, 16
    inp = [torch.randn(b, L, h, p, generator=g), torch.randn(b, L, h, generator=g) - 1,
           -torch.rand(h, generator=g) - 0.5, torch.randn(b, L, 1, n, generator=g),
           torch.randn(b, L, 1, n, generator=g), torch.randn(h, generator=g), torch.randn(b, L, h, p, generator=g),
           torch.randn(b, h, p, n, generator=g)]
    seq_idx = torch.tensor([[0] * 15 + [1] * 14, [0] * 29], dtype=torch.int32)
    gy, gf = torch.randn(b, L, h, p, generator=g), torch.randn(b, h, p, n, generator=g)

    def run():
        leaves = [t.clone().requires_grad_() for t in inp]
        x, dt, A, B, C, D, z, init = leaves
        y, f = mamba_chunk_scan_combined(x, dt, A, B, C, cs, D=D, z=z, initial_states=init, seq_idx=seq_idx,
                                         dt_softplus=True, return_final_states=True)
        ((y * gy).sum() + (f * gf).sum()).backward()
        return [y.detach(), f.detach()] + [t.grad for t in leaves]

    with tvm_mamba.tuning_logs(enabled=False):
        base = run()
        blocked = ("chunk_state", "chunk_scan", "chunk_scan_bwd_dstates", "chunk_scan_bwd")
        served = []

        def hook(key):
            if key.op == "ssd" and key.direction in blocked:
                served.append(key.direction)
                return dispatch.Plan(key, (("cols", cols), ("order", order), ("rows", rows)), "test")
            return None

        monkeypatch.setattr(dispatch, "_plan_hooks", [hook])
        out = run()
    assert set(served) == set(blocked)
    for i, (u, v) in enumerate(zip(base, out)):
        assert torch.equal(u, v), f"output {i} differs with rows={rows}, cols={cols}, order={order}"


@pytest.mark.parametrize("mcpu, lanes", [("znver1", 8), ("haswell", 8), ("znver4", 16), ("rocketlake", 16)])
def test_default_register_block_follows_the_vector_width(mcpu, lanes):
    """The default chunk-matmul block is 4 rows x 2 vector registers: cols 32 where the target has AVX-512, 16
    with AVX2 (whose 16 ymm registers a 4 x 32 block fills with accumulators); tuning records still override."""
    from tvm_mamba.schedules.rule import vector_floats

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "mtriple": "x86_64-linux-gnu"})
    assert vector_floats(target) == lanes
    dims = ssd.DIMS["chunk_state"](nheads=2, ngroups=1, headdim=4, dstate=4, chunk_size=4)
    decisions = Decisions()
    assert cpu_rule.lay_out("chunk_state", dims, target, decisions) is not None
    assert decisions.used["cols"] == 2 * lanes and decisions.used["rows"] == 4
    tuned = Decisions({"cols": 64})
    cpu_rule.lay_out("chunk_state", dims, target, tuned)
    assert tuned.used["cols"] == 64


# The CUDA strategy's tiled chunk matmuls (schedules/cuda/_tiled.py), run in the CUDA harness against the serial
# strategy with the same (CUDA) math compiled for the CPU. The dims make every tile edge, k slice and ragged
# chunk show: headdim 48, dstate 40 and chunk 64 with tile 32 give 24 x 20 / 32 x 32 tiles (several per task),
# 20- and 32-deep slices (two each), and seqlen 150 a ragged last chunk of 22; threads 64 / 256 give 2 x 4 /
# 4 x 1 register blocks (or fewer computing threads than the block has).
TILED_DIMS = dict(nheads=4, ngroups=2, headdim=48, dstate=40, chunk_size=64)
TILED_KERNELS = {
    "ssd_bmm_chunk": dict(ngroups=2, dstate=40, chunk_size=64),
    "ssd_chunk_state": dict(TILED_DIMS, has_seq_idx=True),
    "ssd_chunk_scan": dict(TILED_DIMS, has_D=True, D_has_hdim=True, has_z=True, has_seq_idx=True, has_init=True),
    "ssd_chunk_scan_bwd_dstates": dict(TILED_DIMS, has_z=True, has_seq_idx=True),
}


def _tiled_args(name, batch=2, seqlen=150, seed=0, N=40, per_position=False, D_per_head=False):
    """Inputs (and zeroed outputs) of kernel ``name`` at TILED_DIMS (dstate ``N``), in its parameter order; D per
    (head, channel), per head with ``D_per_head``, per position with ``per_position`` (Mamba-3's diag_skip, here
    without z)."""
    g = torch.Generator().manual_seed(seed)
    H, G, P, Q = 4, 2, 48, 64
    C = (seqlen + Q - 1) // Q
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dA = -torch.rand(batch, H, C, Q, generator=g).cumsum(-1) * 0.1
    seq = torch.tensor([[0] * 70 + [1] * 80, [0] * 150], dtype=torch.int32)[:batch]
    x, z, dy, yp = r(batch, seqlen, H, P), r(batch, seqlen, H, P), r(batch, seqlen, H, P), r(batch, seqlen, H, P)
    Bm, Cm, dto = r(batch, seqlen, G, N), r(batch, seqlen, G, N), torch.rand(batch, H, C, Q, generator=g)
    return {"ssd_bmm_chunk": (Bm, Cm, torch.zeros(batch, C, G, Q, Q)),
            "ssd_chunk_state": (x, Bm, dto, dA, seq, torch.zeros(batch, C, H, P, N)),
            "ssd_chunk_scan": (x, z, r(batch, C, G, Q, Q), Cm, dto, dA, r(batch, C, H, P, N),
                               r(H) if D_per_head else r(H, P), seq,
                               torch.zeros(batch, seqlen, H, P), torch.zeros(batch, seqlen, H, P)),
            "ssd_chunk_scan_bwd_dstates": (dy, z, yp, Cm, dA, seq, torch.zeros(batch, C, H, P, N),
                                           torch.zeros(batch, seqlen, H, P)),
            # gparts = ngroups (one part of each group's 2 heads); D per position with diag_skip (Mamba-3)
            "ssd_chunk_scan_bwd": (x, torch.zeros(1, 1, 1, 1) if per_position else z, dy, Bm, Cm, r(batch, C, G, Q, Q), dto, dA, r(batch, C, H, P, N),
                                   r(batch, C, H, P, N), r(batch, H, C, Q) if per_position else r(H) if D_per_head else r(H, P), seq,
                                   torch.zeros(batch, seqlen, H, P), torch.zeros(batch, seqlen, G, N),
                                   torch.zeros(batch, seqlen, G, N), torch.zeros(batch, H, C, Q),
                                   torch.zeros(batch, H, C, Q),
                                   torch.zeros(batch, H, C, Q) if per_position else torch.zeros(batch, C, H, P),
                                   torch.zeros(batch, C, G, Q, Q))}[name]


OUTPUTS = {"ssd_bmm_chunk": (2,), "ssd_chunk_state": (5,), "ssd_chunk_scan": (9, 10),
           "ssd_chunk_scan_bwd_dstates": (6, 7), "ssd_chunk_scan_bwd": (12, 13, 14, 15, 16, 17)}


@pytest.mark.parametrize("threads, tile", [(64, 32), (256, 32), (128, 64)])
@pytest.mark.parametrize("name", sorted(TILED_KERNELS))
def test_cuda_tiled_matmuls_match_the_serial_layout(name, threads, tile):
    src = _run_both(name, TILED_KERNELS[name], Decisions({"threads": threads, "tile": tile}), 1e-5)
    assert "__shared__" in src and "wmma" not in src


@pytest.mark.parametrize("threads, tile", [(64, 32), (128, 64)])
def test_cuda_chunk_scan_folds_D_per_head_into_the_diagonal(threads, tile):
    """D per head on the FMA tiles is the causal weights' diagonal term (``Gpu.folds_diagonal``: x is not read
    again per output for D x), against the serial layout's D x in the carry; not on tensor cores (D would be
    rounded with the weights) nor with Mamba-3's strict sums (the diagonal is outside them)."""
    from tvm_mamba.schedules.cuda.ssd import Gpu

    _run_both("ssd_chunk_scan", dict(TILED_KERNELS["ssd_chunk_scan"], D_has_hdim=False),
              Decisions({"threads": threads, "tile": tile}), 1e-5)
    assert Gpu().folds_diagonal(64, 48, 40) and not Gpu().folds_diagonal(64, 48, 40, strict=True)
    assert not Gpu(tensor_cores="bfloat16").folds_diagonal(64, 48, 32)


# ssd_chunk_scan_bwd's crossing pass (schedules/cuda/_crossing.py: d dt and d dA_step, a block per (batch, chunk,
# head), bands of 16 rows: 4 per 64-row chunk), its products' row dots (XB, the carried-state terms) and its
# per-element launches, against the serial layout: the seq_idx change at 70 inside chunk 1, the ragged last chunk
# of 22; D per head and Mamba-3's per position (on dx's diagonal, spec.folds_skip); Mamba-3 MIMO's grouped strict
# sums (D not folded).
SCAN_BWD = {"plain": dict(TILED_DIMS, has_D=True, D_has_hdim=True, has_z=True, has_seq_idx=True),
            "D_per_head": dict(TILED_DIMS, has_D=True, D_has_hdim=False, has_z=True, has_seq_idx=True),
            "diag_skip": dict(TILED_DIMS, has_D=True, D_has_hdim=False, has_z=False, has_seq_idx=True, diag_skip=True),
            "step_group": dict(TILED_DIMS, has_D=True, D_has_hdim=False, has_z=False, has_seq_idx=True,
                               diag_skip=True, step_group=4)}


@pytest.mark.parametrize("variant", sorted(SCAN_BWD))
def test_cuda_chunk_scan_bwd_matches_the_serial_layout(variant):
    static = SCAN_BWD[variant]
    src = _run_both("ssd_chunk_scan_bwd", static, Decisions({}), 1e-5)
    assert "__syncthreads()" in src


def _run_both(name, static, decisions, tol, bf16=()):
    """Kernel ``name`` at ``static`` laid out by the CUDA rule with ``decisions`` in the harness and by the
    serial layout (CUDA math) on the CPU, on the same inputs (those at the indices ``bf16`` in bfloat16); their
    outputs agree within ``tol`` of the largest. Returns the CUDA source."""
    import tempfile

    import tvm_ffi

    from tvm_mamba.runtime import cuda_target, cudasim
    from tvm_mamba.schedules.cuda import ssd as cuda_rule

    direction = name.removeprefix("ssd_")
    dims = ssd.DIMS[direction](**static)
    serial = ssd.TEMPLATES[direction](dims, ssd.strategy.ChunkStrategy(native_math=True))
    sch = cuda_rule.lay_out(direction, dims, cuda_target("sm_90"), decisions)
    got = [t.bfloat16() if i in bf16 else t
           for i, t in enumerate(_tiled_args(name, N=static["dstate"], per_position=static.get("diag_skip", False),
                                             D_per_head=static.get("has_D") and not static.get("D_has_hdim")))]
    want = [t.clone() for t in got]
    with tempfile.TemporaryDirectory() as tmp:
        built = cudasim.build(sch.mod, cuda_target("sm_90"), label=name)
        cudasim.link(built, f"{tmp}/k.so")
        module = cudasim.load(f"{tmp}/k.so")
        cudasim.call(module, module[name], got, label=name)
    ex = tvm.compile(tvm.IRModule({name: serial.with_attr("global_symbol", name)}), target="llvm")
    ex[name](*[tvm_ffi.from_dlpack(t) for t in want])
    for i in OUTPUTS[name]:
        assert got[i].abs().max() > 0, i
        torch.testing.assert_close(got[i].float(), want[i].float(), rtol=tol,
                                   atol=tol * want[i].float().abs().max().item())
    return built.source


# Tensor cores (16-bit operands; schedules/cuda/_tiled_tc.py tc_matmul, tc_causal): bf16 inputs, the fragment grid
# and k steps in several shapes (headdim 48: three fragment rows; tile 32 / 64; 2, 4 and 8 warps; chunk_scan's
# fragments below, on and above the diagonal, a ragged last chunk), against the serial layout on the same inputs.
# bmm_chunk's operands are bf16 already (only the summation order differs); chunk_state / dstates / chunk_scan
# round scale * operand (the weights, the states) to bf16, as upstream's kernels do before tl.dot.
TC_DIMS = dict(TILED_DIMS, dstate=32, x_dtype="bfloat16", bc_dtype="bfloat16")
TC_KERNELS = {"ssd_bmm_chunk": (dict(ngroups=2, dstate=32, chunk_size=64, bc_dtype="bfloat16"), 1e-5),
              "ssd_chunk_state": (dict(TC_DIMS, has_seq_idx=True), 1e-2),
              "ssd_chunk_scan_bwd_dstates": (dict(TC_DIMS, has_z=True, has_seq_idx=True), 1e-2),
              "ssd_chunk_scan": (dict(TC_DIMS, has_D=True, D_has_hdim=True, has_z=True, has_seq_idx=True,
                                      has_init=True), 1e-2)}


@pytest.mark.parametrize("threads, tile", [(64, 32), (128, 64), (256, 64)])
@pytest.mark.parametrize("name", sorted(TC_KERNELS))
def test_cuda_tensor_core_matmuls_match_the_serial_layout(name, threads, tile):
    static, tol = TC_KERNELS[name]
    src = _run_both(name, static, Decisions({"threads": threads, "tile": tile, "tensor_cores": 1}), tol,
                    _sequence_args(name))
    assert "nvcuda::wmma::mma_sync" in src


def _sequence_args(name):
    """Indices of kernel ``name``'s (batch, seqlen, ...) activations in ``_tiled_args``: x, z, dy, B, C and the
    outputs in their dtype (bfloat16 in the tensor-core tests); not chunk_scan_bwd's float32 dB / dC partials."""
    args = _tiled_args(name, N=32)
    return tuple(i for i, t in enumerate(args) if t.dim() == 4 and t.shape[1] == 150
                 and not (name == "ssd_chunk_scan_bwd" and i in (13, 14)))


def _run_tensor_cores(name, static, args):
    """Kernel ``name`` at ``static`` on tensor cores (128 threads, tile 32) in the harness, on ``args`` (written
    in place). Returns the CUDA source."""
    import tempfile

    from tvm_mamba.runtime import cuda_target, cudasim
    from tvm_mamba.schedules.cuda import ssd as cuda_rule

    direction = name.removeprefix("ssd_")
    sch = cuda_rule.lay_out(direction, ssd.DIMS[direction](**static), cuda_target("sm_90"),
                            Decisions({"threads": 128, "tile": 32, "tensor_cores": 1}))
    with tempfile.TemporaryDirectory() as tmp:
        built = cudasim.build(sch.mod, cuda_target("sm_90"), label=name)
        cudasim.link(built, f"{tmp}/k.so")
        module = cudasim.load(f"{tmp}/k.so")
        cudasim.call(module, module[name], args, label=name)
    assert "nvcuda::wmma::mma_sync" in built.source
    return built.source


def test_cuda_tensor_core_chunk_scan_keeps_a_later_nan_out():
    """A NaN in x at position 70 (chunk 1, row 6: inside a diagonal fragment) reaches y at 70 and after, never
    before: the diagonal blocks are summed per element with the causal guard, not by mma (0 * NaN)."""
    name = "ssd_chunk_scan"
    static = dict(TC_DIMS, has_D=True, D_has_hdim=True, has_z=True, has_seq_idx=False, has_init=True)
    args = [t.bfloat16() if i in _sequence_args(name) else t for i, t in enumerate(_tiled_args(name, N=32))]
    args[0][:, 70] = float("nan")
    args[8] = torch.zeros(1, 1, dtype=torch.int32)  # (no seq_idx)
    _run_tensor_cores(name, static, args)
    y = args[9].float()
    assert torch.isfinite(y[:, :70]).all() and torch.isnan(y[:, 70:128]).all()


# ssd_chunk_scan_bwd on tensor cores (schedules/cuda/_tc_product.py: dx, gsum, dB, dC; the crossing pass stays
# on the FMA units): every variant above with bf16 x, dy, z, B, C, against the serial layout on the same inputs;
# headdim 48 / dstate 32 / chunk 64 give three fragment rows, full-width tiles for the row dots (XB, the carried
# terms) and partial diagonal blocks; 64 / 128 / 256 threads (one, two, four warps computing).
@pytest.mark.parametrize("variant, threads, tile", [("plain", 256, 64), ("D_per_head", 64, 32), ("diag_skip", 128, 32),
                                                    ("step_group", 256, 64)])
def test_cuda_tensor_core_chunk_scan_bwd_matches_the_serial_layout(variant, threads, tile):
    name = "ssd_chunk_scan_bwd"
    static = dict(SCAN_BWD[variant], dstate=32, x_dtype="bfloat16", bc_dtype="bfloat16")
    src = _run_both(name, static, Decisions({"threads": threads, "tile": tile, "tensor_cores": 1}), 1e-2,
                    _sequence_args(name))
    assert src.count("nvcuda::wmma::mma_sync") >= 4  # dx, gsum, dB, dC


def test_cuda_tensor_core_chunk_scan_bwd_keeps_nans_causal():
    """A NaN in dy at position 70 (chunk 1, row 6) reaches dx at 64..70 (the positions it follows), dB there and
    dC at 70 only; never the later positions of its chunk, whose blocks hold it as a non-causal pair (dx's
    partial diagonal blocks are summed per element with the range guard; gsum selects the causal pairs)."""
    name = "ssd_chunk_scan_bwd"
    static = dict(SCAN_BWD["plain"], dstate=32, x_dtype="bfloat16", bc_dtype="bfloat16", has_seq_idx=False)
    args = [t.bfloat16() if i in _sequence_args(name) else t for i, t in enumerate(_tiled_args(name, N=32))]
    args[2][:, 70] = float("nan")
    args[11] = torch.zeros(1, 1, dtype=torch.int32)  # (no seq_idx)
    _run_tensor_cores(name, static, args)
    dx, dB, dC = args[12].float(), args[13], args[14]
    for out, bad in ((dx, slice(64, 71)), (dB, slice(64, 71)), (dC, slice(70, 71))):
        assert torch.isnan(out[:, bad]).all()
        assert torch.isfinite(out[:, :bad.start]).all() and torch.isfinite(out[:, bad.stop:]).all()
