"""Schedule rules for causal_conv1d: they match only their kernels, every knob value is correct, the CPU
main loop really is vectorized, and the CUDA schedule binds threads (no GPU needed)."""
from __future__ import annotations

import re

import pytest
import torch
import tvm

from tvm_mamba.compute.causal_conv1d import DIMS, CausalConv1dBwd, CausalConv1dFwd
from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref
from tvm_mamba.runtime import cpu_target, cuda_target
from tvm_mamba.schedules.cpu import causal_conv1d as cpu_rule
from tvm_mamba.schedules.cuda import causal_conv1d as cuda_rule
from tvm_mamba.schedules.rule import SERIAL_WORK, Decisions
from tests.schedules._cuda_source import cuda_source, kernels

STATIC = dict(dim=8, width=4, activation="silu", has_bias=True, has_seq_idx=False, has_init=False)


def test_rules_return_none_for_foreign_patterns_and_targets():
    fwd = DIMS["fwd"](**STATIC, return_final=False)
    for kernel in ("no_such_kernel", "chunk_scan"):  # a name no op has; another op's kernel (ssd's)
        assert cpu_rule.lay_out(kernel, fwd, cpu_target(), Decisions()) is None
        assert cuda_rule.lay_out(kernel, fwd, cuda_target("sm_90"), Decisions()) is None
    assert cpu_rule.lay_out("fwd", fwd, cuda_target("sm_90"), Decisions()) is None
    assert cuda_rule.lay_out("fwd", fwd, cpu_target(), Decisions()) is None


@pytest.mark.parametrize("vector", [8, 16, 32])
def test_cpu_vector_knob_is_vectorized_and_correct(vector):
    d = Decisions({"vector": vector})
    sch = cpu_rule.lay_out("fwd", CausalConv1dFwd(**STATIC, return_final=False), cpu_target(), d)
    assert d.used == {"vector": vector} and d.space["vector"] == (8, 16, 32)
    ex = tvm.compile(sch.mod, target=cpu_target())
    assert f"<{vector} x float>" in ex.mod.inspect_source("ll")
    x, w, b = torch.randn(2, 8, 75), torch.randn(8, 4), torch.randn(8)
    out = torch.empty_like(x)
    ex["causal_conv1d_fwd"](x, w, b, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out,
                            torch.zeros(1, 1, 1))
    ref = causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")
    assert (out - ref).abs().max() < 1e-5


def test_cpu_backward_vector_knob_correct():
    x, w, b = torch.randn(2, 8, 61), torch.randn(8, 4), torch.randn(8)
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    dout = torch.randn(2, 8, 61)
    (causal_conv1d_ref(xd, wd, bd, activation="silu") * dout.double()).sum().backward()
    for vector in (8, 32):
        sch = cpu_rule.lay_out("bwd", CausalConv1dBwd(**STATIC, has_dfinal=False), cpu_target(),
                               Decisions({"vector": vector}))
        ex = tvm.compile(sch.mod, target=cpu_target())
        dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
        ex["causal_conv1d_bwd"](x, w, b, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), dout,
                                torch.zeros(1, 1, 1), dx, dw, db, torch.zeros(1, 1, 1), torch.empty(2, 8, 61),
                                torch.empty(2, 8, 5))
        assert (dx - xd.grad).abs().max() < 1e-4
        assert (dw - wd.grad).abs().max() < 1e-3 and (db - bd.grad).abs().max() < 1e-3


def test_stale_decision_falls_back_to_default():
    d = Decisions({"vector": 7})
    cpu_rule.lay_out("fwd", CausalConv1dFwd(**STATIC, return_final=False), cpu_target(), d)
    assert d.used["vector"] == 16


@pytest.mark.parametrize("threads", [64, 256])
def test_cuda_schedule_binds_threads_and_generates_source(threads):
    dims = CausalConv1dBwd(**STATIC, has_dfinal=True)
    target = cuda_target("sm_90")
    sch = cuda_rule.lay_out("bwd", dims, target, Decisions({"threads": threads}))
    script = sch.mod.script()
    assert 'thread_binding' in script and "threadIdx.x" in script and "blockIdx.x" in script
    with target:
        ex = tvm.compile(sch.mod, target=target)
    src = ex.mod.imports[0].inspect_source("cuda")
    assert "__global__" in src and f"__launch_bounds__({threads})" in src


def _cuda_source(kernel, dims, decisions):
    return cuda_source(cuda_rule, kernel, dims, decisions)


def test_cuda_forward_stages_the_window_once_per_tile():
    """The design: a block per (row, tile of 1024 steps) stages x (with its width-1 halo) in a
    shared ring of 2048 (time mod 2048, tile 1024 + 2 halos), weight and bias too; x is read from global
    memory in that one copy statement only, never per tap (5.5x the minimum bytes before)."""
    d = Decisions()
    src = _cuda_source("fwd", CausalConv1dFwd(**STATIC, return_final=False), d)
    assert d.used == {"threads": 256, "tile": 1024} and d.space["tile"] == (512, 1024)
    (body,) = [b for b in kernels(src) if "out_ptr[" in b]
    assert "__shared__ alignas(64) float x_shared_ptr[2048]" in body and "& 2047)]" in body
    assert "weight_shared_ptr" in body and "bias_shared_ptr" in body
    assert body.count("x_ptr[") == 1 and "weight_ptr[" in body.split("__syncthreads")[0]


def test_cuda_backward_is_one_pass_per_row_deterministic_and_staged():
    """One kernel walks each row in tiles: x staged once per tile (with its halos), grad = dout * act'(pre)
    for the tile and its forward halo in a shared ring, then g (written, never read back), dx and the
    (width+1) per-thread sums from that ring; the sums meet in a fixed shuffle tree, then over batch in order:
    no float atomics anywhere, x / dout read by one statement each."""
    src = _cuda_source("bwd", CausalConv1dBwd(**STATIC, has_dfinal=False), Decisions())
    assert "atomic" not in src
    (body,) = [b for b in kernels(src) if "dx_ptr[" in b]
    assert "g_ptr[" in body and "float partial_rf_local_ptr[5]" in body and "__shfl_down_sync" in body
    assert "__shared__ alignas(64) float grad_shared_ptr[2048]" in body and "x_shared_ptr[2048]" in body
    assert len(re.findall(r"\bx_ptr\[", body)) == 1 and len(re.findall(r"\bdout_ptr\[", body)) == 1
    assert not any(re.search(r"\bg_ptr\[", line.split(" = ", 1)[-1]) for line in body.splitlines() if " = " in line)


def test_cuda_small_tiles_in_the_harness():
    """512-step tiles of 64 threads: seqlen 1100 crosses two tile edges (the second one a wrap of the
    1024-slot ring) and ends in a ragged tile, so the staged halos, the ring indices and the tail predicates
    all run in the CUDA harness."""
    import tempfile

    from tvm_mamba.runtime import cudasim

    dims = dict(STATIC, has_init=True)
    x, w, b, init = torch.randn(2, 8, 1100), torch.randn(8, 4), torch.randn(8), torch.randn(2, 8, 3)
    dout = torch.randn(2, 8, 1100)
    leaves = [t.double().requires_grad_() for t in (x, w, b, init)]
    ref = causal_conv1d_ref(leaves[0], leaves[1], leaves[2], initial_states=leaves[3], activation="silu")
    (ref * dout.double()).sum().backward()
    seq = torch.zeros(1, 1, dtype=torch.int32)
    out, dx, dw, db, dinit = (torch.empty_like(t) for t in (x, x, w, b, init))
    runs = (("fwd", CausalConv1dFwd(**dims, return_final=False),
             (x, w, b, seq, init, out, torch.zeros(1, 1, 1))),
            ("bwd", CausalConv1dBwd(**dims, has_dfinal=False),
             (x, w, b, seq, init, dout, torch.zeros(1, 1, 1), dx, dw, db, dinit, torch.empty(2, 8, 1100),
              torch.empty(2, 8, 5))))
    target = cuda_target("sm_90")
    for kernel, kernel_dims, args in runs:
        name = f"causal_conv1d_{kernel}"
        sch = cuda_rule.lay_out(kernel, kernel_dims, target, Decisions({"threads": 64, "tile": 512}))
        with tempfile.TemporaryDirectory() as tmp:
            cudasim.link(cudasim.build(sch.mod, target, label=name), f"{tmp}/k.so")
            module = cudasim.load(f"{tmp}/k.so")
            cudasim.call(module, module[name], args, label=name)
    assert (out - ref).abs().max() < 1e-5
    for got, leaf in zip((dx, dw, db, dinit), leaves):
        assert (got - leaf.grad).abs().max() < 1e-4 * max(1.0, leaf.grad.abs().max().item())


UPDATE = dict(dim=8, width=4, state_len=5, activation="silu", has_bias=True, has_indices=True, has_cache_seqlens=True)


def test_update_template_cuda_one_thread_per_row_and_cpu_serial_below_threshold():
    """The decode step is one template: on CUDA a thread per (batch, channel) row (threads knob), on the CPU
    parallel rows with a serial branch for decode-size calls."""
    dims = DIMS["update"](**UPDATE)
    target = cuda_target("sm_90")
    sch = cuda_rule.lay_out("update", dims, target, Decisions({"threads": 64}))
    with target:
        ex = tvm.compile(sch.mod, target=target)
    src = ex.mod.imports[0].inspect_source("cuda")
    assert "__global__" in src and "__launch_bounds__(64)" in src
    cpu = cpu_rule.lay_out("update", dims, cpu_target(), Decisions()).mod.script()
    assert "T.parallel" in cpu and f"<= {SERIAL_WORK}" in cpu


def test_varlen_states_rules():
    dims = DIMS["varlen_states"](dim=8, state_len=3)
    assert "T.parallel" in cpu_rule.lay_out("varlen_states", dims, cpu_target(), Decisions()).mod.script()
    target = cuda_target("sm_90")
    with target:
        ex = tvm.compile(cuda_rule.lay_out("varlen_states", dims, target, Decisions()).mod, target=target)
    assert "__global__" in ex.mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("bad, match", [([2, 7], "conv_state_indices: a slot is out of range"),
                                        ([5, 5], "conv_state_indices: two rows name the same conv_state slot"),
                                        ([5, -1, 2, 5], "same conv_state slot"),
                                        ("seqlens", "cache_seqlens: must be >= 0")])
def test_cpu_update_kernel_refuses_bad_values_before_it_writes(bad, match):
    """The CPU decode step checks its own slots (compute/strategy.py slot_checks) and the cache_seqlens of rows
    that are not padding, before its first write (the torch op's recipe relies on it); the CUDA layout cannot
    raise and has no such check."""
    dims = DIMS["update"](dim=6, width=4, state_len=3, activation="silu", has_bias=False, has_indices=True,
                          has_cache_seqlens=True, x_2d=True)
    fn = tvm.compile(cpu_rule.lay_out("update", dims, cpu_target(), Decisions()).mod, target=cpu_target())
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([5, -1, 2, 0] if bad == "seqlens" else bad, dtype=torch.int32)
    seqlens = torch.tensor([1, -4, 0, -2] if bad == "seqlens" else [1] * len(bad), dtype=torch.int32)
    x, pool, w = (torch.randn(*shape, generator=g) for shape in ((len(idx), 6), (7, 6, 3), (6, 4)))
    before = pool.clone()
    with pytest.raises(ValueError, match=match):
        fn(x, pool, w, torch.ones(1), idx, seqlens, torch.empty(len(idx), 6))
    assert torch.equal(pool, before)
    live = torch.tensor([5, -1, 2, 0], dtype=torch.int32)  # row 1 pads: its negative cache_seqlens is never read
    fn(torch.randn(4, 6, generator=g), pool, w, torch.ones(1), live, torch.tensor([1, -4, 0, 2], dtype=torch.int32),
       torch.empty(4, 6))
    assert not torch.equal(pool, before)
    for target, rule in ((cuda_target("sm_90"), cuda_rule), (cpu_target(), cpu_rule)):
        plain = dims if rule is cuda_rule else dims.replace(has_indices=False, has_cache_seqlens=False)
        assert "assert" not in rule.lay_out("update", plain, target, Decisions()).mod.script()
    assert "assert" in cpu_rule.lay_out("update", dims, cpu_target(), Decisions()).mod.script()
