"""Schedule rules for the selective scan: CPU loop nests (vectorized, parallel) and CUDA (warp shuffles),
compiled without a GPU; CUDA kernels through nvcc/ptxas (0 spills)."""
from __future__ import annotations

import pytest
import torch
import tvm

from tests.conftest import assert_close_to_ref
from tvm_mamba.compute import selective_scan as ss
from tvm_mamba.compute.selective_scan.update import row_work
from tvm_mamba.reference.selective_scan import selective_state_update_ref
from tvm_mamba.runtime.nvcc import nvcc_path, ptxas_stats
from tvm_mamba.runtime.target import cpu_target, cuda_target
from tvm_mamba.schedules.cpu import selective_scan as cpu_rule
from tvm_mamba.schedules.cuda import selective_scan as cuda_rule
from tvm_mamba.schedules.rule import SERIAL_WORK, Decisions

STATIC = dict(dim=32, dstate=16, b_groups=1, c_groups=1, has_D=True, has_z=True, has_delta_bias=True,
              delta_softplus=True, has_init=False, chunk=64)


def test_rules_ignore_foreign_kernels():
    fwd = ss.DIMS["fwd"].of(**STATIC)
    for kernel in ("no_such_kernel", "varlen_states"):  # a name no op has; another op's kernel (causal_conv1d's)
        assert cpu_rule.lay_out(kernel, fwd, cpu_target(), Decisions()) is None
        assert cuda_rule.lay_out(kernel, fwd, cuda_target("sm_90"), Decisions()) is None
    assert cuda_rule.lay_out("fwd", fwd, cpu_target(), Decisions()) is None  # the other target family
    assert cpu_rule.lay_out("fwd", fwd, cuda_target("sm_90"), Decisions()) is None


def test_gpu_rule_selects_by_capability():
    """The GPU rule serves any target with the "gpu" key (its loops are blockIdx x threadIdx + warp shuffles),
    not only kind "cuda"."""
    sch = cuda_rule.lay_out("fwd", ss.DIMS["fwd"].of(**STATIC), tvm.target.Target("rocm"), Decisions())
    assert sch is not None and "tvm_warp_shuffle_up" in sch.mod.script()  # the forward's scan over time
    sch = cuda_rule.lay_out("bwd", ss.DIMS["bwd"].of(**STATIC, block=2), tvm.target.Target("rocm"), Decisions())
    assert sch is not None and "tvm_warp_shuffle_xor" in sch.mod.script()  # the backward's dstate sums


@pytest.mark.parametrize("layout,used", [(None, {"layout": "channels"}),
                                         ("dstate", {"layout": "dstate", "vector": 16})])
def test_cpu_forward_layouts_are_vectorized(layout, used):
    dec = Decisions({"layout": layout} if layout else {})
    sch = cpu_rule.lay_out("fwd", ss.DIMS["fwd"].of(**STATIC), cpu_target(), dec)
    assert dec.used == used
    asm = tvm.compile(sch.mod, target=cpu_target()).mod.inspect_source("asm")
    assert "zmm" in asm or "ymm" in asm  # vector registers (AVX-512 / AVX2 hosts)


def test_cpu_forward_dim_not_multiple_of_16_uses_dstate_layout():
    dec = Decisions()
    cpu_rule.lay_out("fwd", ss.DIMS["fwd"].of(**dict(STATIC, dim=24)), cpu_target(), dec)
    assert dec.used == {"vector": 16}


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("dstate", [16, 256])
def test_cuda_scan_kernels_compile_without_spills(dstate):
    st = dict(STATIC, dim=64, dstate=dstate, chunk=ss.chunk_size(dstate))
    dt = dict(u_dtype="bfloat16", B_dtype="bfloat16", C_dtype="float32")
    tgt = cuda_target("sm_90")
    for kernel, dims, shuffle in (("fwd", ss.DIMS["fwd"].of(**st, **dt), "__shfl_up_sync"),  # the pair scan over time
                                  ("bwd", ss.DIMS["bwd"].of(**st, block=16, **dt), "__shfl_xor_sync")):  # dstate sums
        sch = cuda_rule.lay_out(kernel, dims, tgt, Decisions())
        with tgt:
            src = tvm.compile(sch.mod, target=tgt).mod.imports[0].inspect_source("cuda")
        assert shuffle in src
        if shuffle == "__shfl_up_sync":  # vector loads: u / delta / z steps 8 bf16 (128 bits); B / C staged 4
            # states a load (the float32 C's 128 bits; the bf16 B's 64)
            assert "*(uint4*)(u_ptr" in src and "*(uint4*)(delta_ptr" in src
            assert "*(nv_bfloat164*)(Bm_ptr" in src and "*(float4*)(Cm_ptr" in src
        stats = ptxas_stats(src, "sm_90")
        assert stats["ok"], stats["error"]
        assert stats["kernels"] and all(k["spill_stores"] == 0 for k in stats["kernels"]), stats["kernels"]


def test_complex_kernels_cpu_vectorized_and_cuda_compile():
    """The complex-A templates under both rules: CPU vector code over dstate (cos / sin); CUDA through nvcc (a
    thread per lane, the rotation through sincospif: no cosf / sinf slow path, and no spills on sm_90)."""
    sx = ss  # the complex-A builders live in the same package

    st = dict(STATIC, chunk=ss.chunk_size(32))
    kernels = (("fwd_complex", sx.DIMS["fwd_complex"].of(**st)),
               ("bwd_complex", sx.DIMS["bwd_complex"].of(**st, block=16)))
    for kernel, dims in kernels:
        dec = Decisions()
        sch = cpu_rule.lay_out(kernel, dims, cpu_target(), dec)
        assert dec.used == {"vector": 16}
        asm = tvm.compile(sch.mod, target=cpu_target()).mod.inspect_source("asm")
        assert "zmm" in asm or "ymm" in asm
    if nvcc_path() is None:
        pytest.skip("nvcc not installed")
    tgt = cuda_target("sm_90")
    for kernel, dims in kernels:
        sch = cuda_rule.lay_out(kernel, dims, tgt, Decisions())
        with tgt:
            src = tvm.compile(sch.mod, target=tgt).mod.imports[0].inspect_source("cuda")
        assert "sincospif(" in src and "cosf(" not in src and "sinf(" not in src  # one call per rotation
        stats = ptxas_stats(src, "sm_90")
        assert stats["ok"], stats["error"]
        assert all(k["spill_stores"] == 0 for k in stats["kernels"]), stats["kernels"]


def test_cpu_tied_update_head_rows_knob():
    """The tied decode step's ``head_rows`` knob (rows of a head per CPU lane, sharing the head's softplus and
    exp): 1, 2 and all 8 rows give the same bits (the operation order of a row does not change), close to the
    float64 reference on both branches (calling thread: batch 3; parallel: batch 129), padding rows 0 and their
    slots untouched. The untied kernel has no such knob."""
    d = ss.UpdateDims(nheads=4, headdim=8, dstate=16, ngroups=2, has_D=True, has_z=True, has_dt_bias=True,
                      dt_softplus=True, idx_dtype="int32", tie_hdim=True)
    assert 129 * 4 * 8 * row_work(d) > SERIAL_WORK >= 3 * 4 * 8 * row_work(d)
    g = torch.Generator().manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    pool, x, z, dt = r(131, 4, 8, 16), r(129, 4, 8), r(129, 4, 8), 0.5 * r(129, 4)
    A, B, C, D, dtb = -0.2 - torch.rand(4, generator=g), r(129, 2, 16), r(129, 2, 16), r(4), 0.1 * r(4)
    idx = torch.tensor([130 - i if i % 5 else -1 for i in range(129)], dtype=torch.int32)  # every 5th row pads
    results = {}
    for rows in (1, 2, 8):
        dec = Decisions({"head_rows": rows})
        fn = tvm.compile(cpu_rule.lay_out("update", d, cpu_target(), dec).mod, target=cpu_target())
        assert dec.used["head_rows"] == rows
        for batch in (3, 129):
            st, out = pool.clone(), torch.full((batch, 4, 8), float("nan"))
            fn(st, x[:batch], dt[:batch, :, None].expand(batch, 4, 8), A[:, None, None].expand(4, 8, 16), B[:batch],
               C[:batch], D[:, None].expand(4, 8), z[:batch], dtb[:, None].expand(4, 8), idx[:batch], out)
            o64, s64 = selective_state_update_ref(
                pool.double(), x[:batch].double(), dt[:batch, :, None].expand(batch, 4, 8).double(),
                A[:, None, None].expand(4, 8, 16).double(), B[:batch].double(), C[:batch].double(),
                D[:, None].expand(4, 8).double(), z[:batch].double(), dtb[:, None].expand(4, 8).double(), True,
                state_batch_indices=idx[:batch])
            assert_close_to_ref(out, o64, name=f"out rows={rows} batch={batch}")
            assert_close_to_ref(st, s64, name=f"state rows={rows} batch={batch}")
            assert (out[::5] == 0).all() and torch.equal(st[0], pool[0])  # padding rows; slot 0 never named
            results[rows, batch] = (out, st)
    for (rows, batch), (out, st) in results.items():
        assert torch.equal(out, results[8, batch][0]) and torch.equal(st, results[8, batch][1]), (rows, batch)


@pytest.mark.parametrize("layout", ["mamba1", "tied", "heads"])
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
def test_cpu_update_kernel_refuses_bad_slots_before_it_writes(layout, idx_dtype):
    """The CPU decode step checks its slots itself (compute/strategy.py slot_checks: each < the pool's slots,
    no two alike; negative = padding, any number of them) before its first write, in every layout; the CUDA
    layout cannot raise and has no such check (its torch op reads the indices first)."""
    H, P = (6, 1) if layout == "mamba1" else (2, 4)
    d = ss.UpdateDims(nheads=H, headdim=P, dstate=8, ngroups=1, has_D=False, has_z=False, has_dt_bias=False,
                      dt_softplus=False, idx_dtype=idx_dtype, tie_hdim=layout == "tied",
                      mamba1_layout=layout == "mamba1")
    fn = tvm.compile(cpu_rule.lay_out("update", d, cpu_target(), Decisions()).mod, target=cpu_target())
    g = torch.Generator().manual_seed(2)
    heads = (H,) if layout == "mamba1" else (H, P)
    pool = torch.randn(5, *heads, 8, generator=g)
    A = -torch.rand(*heads, 8, generator=g)
    A = A[:, :1, :1].expand(H, P, 8) if layout == "tied" else A
    one = torch.ones((1,) if layout == "mamba1" else (1, 1))

    def call(slots):
        n, dtype = len(slots), getattr(torch, idx_dtype)
        x, dt = torch.randn(n, *heads, generator=g), torch.rand(n, H, P, generator=g)
        B, C = (torch.randn(n, 8, generator=g) if layout == "mamba1" else torch.randn(n, 1, 8, generator=g)
                for _ in range(2))
        dt = dt[:, :, :1].expand(n, H, P) if layout == "tied" else dt.reshape(n, *heads)
        fn(pool, x, dt, A, B, C, one, torch.ones((1,) * (len(heads) + 1)), one, torch.tensor(slots, dtype=dtype),
           torch.empty(n, *heads))

    before = pool.clone()
    for slots, match in (([1, 5], "state_batch_indices: a slot is out of range for state"),
                         ([4, -1, 2, 4], "state_batch_indices: two rows name the same state slot")):
        with pytest.raises(ValueError, match=match):
            call(slots)
        assert torch.equal(pool, before)
    call([4, -1, 2, -1, 0])  # padding rows may repeat
    assert torch.equal(pool[[1, 3]], before[[1, 3]]) and not torch.equal(pool[4], before[4])
    cuda = cuda_rule.lay_out("update", d, cuda_target("sm_90"), Decisions()).mod.script()
    assert "assert" not in cuda and "assert" in cpu_rule.lay_out("update", d, cpu_target(), Decisions()).mod.script()
