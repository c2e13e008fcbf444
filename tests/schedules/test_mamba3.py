"""Schedule rules for the Mamba-3 decode step: the CPU layout (parallel lanes, serial at decode sizes) and the
CUDA one (a thread per lane, ``threads`` knob), compiled without a GPU; CUDA through nvcc/ptxas (0 spills). The
chunked forward's preprocess: the SSD strategies (CPU parallel tasks, CUDA a launch per pass), and the chunk
scan's ``diag_skip`` form on both (the CPU's strict triangle ``tri="lt"``); the preprocess backward likewise;
upstream's two-function decode path (each pass alone)."""
from __future__ import annotations

import re

import pytest
import tvm

from tvm_mamba.compute import mamba3 as m3
from tvm_mamba.runtime.nvcc import nvcc_path, ptxas_stats
from tvm_mamba.runtime.target import cpu_target, cuda_target
from tvm_mamba.schedules.cpu import mamba3 as cpu_rule
from tvm_mamba.schedules.cuda import mamba3 as cuda_rule
from tvm_mamba.schedules.rule import SERIAL_WORK, Decisions

STATIC = dict(nheads=4, nheads_qk=2, headdim_qk=16, headdim_v=8, headdim_angles=4, has_D=True, has_z=True)


def test_rules_take_only_their_target():
    dims = m3.DIMS["siso_step"](**STATIC)
    assert cpu_rule.lay_out("siso_step", dims, cuda_target("sm_90"), Decisions()) is None
    assert cuda_rule.lay_out("siso_step", dims, cpu_target(), Decisions()) is None


def test_cpu_rule_parallel_lanes_and_serial_decode_path():
    dec = Decisions()
    sch = cpu_rule.lay_out("siso_step", m3.DIMS["siso_step"](**STATIC), cpu_target(), dec)
    assert dec.used == {"vector": 16}
    script = sch.mod.script()
    assert "T.vectorized(16)" in script
    assert "T.parallel" in script and f"<= {SERIAL_WORK}:" in script  # the pool above SERIAL_WORK, else serial
    tvm.compile(sch.mod, target=cpu_target())


@pytest.mark.parametrize("threads", [64, 256])
def test_cuda_rule_threads_knob_and_gpu_capability(threads):
    dec = Decisions({"threads": threads})
    sch = cuda_rule.lay_out("siso_step", m3.DIMS["siso_step"](**STATIC), tvm.target.Target("rocm"), dec)
    assert dec.used == {"threads": threads, "head_rows": 4}  # the update pass: 4 rows of a head per warp lane
    script = sch.mod.script()
    assert "blockIdx.x" in script and f'T.thread_binding({threads}, thread="threadIdx.x")' in script
    assert "tvm_warp_shuffle" in script  # warp lanes: the h' . q butterfly and the broadcast row scalars


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_cuda_step_compiles_without_spills():
    tgt = cuda_target("sm_90")
    dims = m3.DIMS["siso_step"](**STATIC, qk_dtype="bfloat16", v_dtype="bfloat16", kstate_dtype="bfloat16")
    sch = cuda_rule.lay_out("siso_step", dims, tgt, Decisions())
    with tgt:
        src = tvm.compile(sch.mod, target=tgt).mod.imports[0].inspect_source("cuda")
    assert "cosf" in src and "tanhf" in src  # CUDA's own math, not the CPU polynomials
    stats = ptxas_stats(src, "sm_90")
    assert stats["ok"], stats["error"]
    assert stats["kernels"] and all(k["spill_stores"] == 0 for k in stats["kernels"]), stats["kernels"]


def _sm90_kernels(direction, dims):
    """ptxas' per-kernel stats of kernel ``direction`` at ``dims`` through the CUDA rule (sm_90); None without
    nvcc."""
    if nvcc_path() is None:
        return None
    tgt = cuda_target("sm_90")
    with tgt:
        sch = cuda_rule.lay_out(direction, dims, tgt, Decisions())
        src = tvm.compile(sch.mod, target=tgt).mod.imports[0].inspect_source("cuda")
    stats = ptxas_stats(src, "sm_90")
    assert stats["ok"], stats["error"]
    return stats["kernels"]


def test_mimo_step_rules_and_cuda_compile():
    """The MIMO step (rank 4, GQA, no MIMO_Out) through the same rules: the CPU's vectorized rows and parallel
    lanes (compiled); CUDA's two launches, nvcc-compiled without spills."""
    dims = m3.DIMS["mimo_step"](**dict(STATIC, mimo_rank=4, has_outproj=False), qk_dtype="bfloat16",
                                v_dtype="bfloat16", kstate_dtype="bfloat16")
    func = m3.mamba3_mimo_step(dims)
    assert [p.name for p in func.params][8:11] == ["MV", "MZ", "MO"]  # the SISO step has none of them
    sch = cpu_rule.lay_out("mimo_step", dims, cpu_target(), Decisions())
    assert "T.vectorized(16)" in sch.mod.script() and "T.parallel" in sch.mod.script()
    tvm.compile(sch.mod, target=cpu_target())
    kernels = _sm90_kernels("mimo_step", dims)
    assert kernels is None or (len(kernels) == 2 and all(k["spill_stores"] == 0 for k in kernels)), kernels


@pytest.mark.parametrize("direction", ["step_rotate", "step_update"])
def test_step_parts_rules_and_cuda_compile(direction):
    """Upstream's two-function path: each pass alone through the same rules (one parallel loop on the CPU,
    compiled; one CUDA launch, nvcc-compiled without spills), upstream's flags set (rank-major, interleaved pairs,
    unreduced conjugate angle; A and a Trap probability, a bf16 state rewritten in place)."""
    flags = (dict(pairwise=True, angle_mod=False, conjugate=True, has_kbias=False) if direction == "step_rotate"
             else dict(raw_a=True, trap_logit=False, inplace=True, state_dtype="bfloat16"))
    dims = m3.MimoStepDims(**STATIC, mimo_rank=2, rank_major=True, qk_dtype="bfloat16", v_dtype="bfloat16", **flags)
    func = m3.mamba3_step_rotate(dims) if direction == "step_rotate" else m3.mamba3_step_update(dims)
    names = [p.name for p in func.params]  # each pass's own buffers; in place: no h_out
    assert len(names) == (10 if direction == "step_rotate" else 15) and "h_out" not in names
    sch = cpu_rule.lay_out(direction, dims, cpu_target(), Decisions())
    assert sch.mod.script().count("T.parallel") == 1
    tvm.compile(sch.mod, target=cpu_target())
    kernels = _sm90_kernels(direction, dims)
    assert kernels is None or (len(kernels) == 1 and kernels[0]["spill_stores"] == 0), kernels


PRE = dict(nheads=4, nheads_qk=2, headdim_qk=16, headdim_v=8, headdim_angles=4, chunk_size=8, has_D=True,
           has_init=True)


def test_preprocess_rules():
    """Five passes (angles, rotate, chunk, skip, init): five parallel loops on a CPU (the angles' and the
    pairs' lanes, init's headdim_qk lanes vectorized), five launches on CUDA; without input states four."""
    dims = m3.DIMS["siso_preprocess"](**PRE, qk_dtype="bfloat16")
    cpu = cpu_rule.lay_out("siso_preprocess", dims, cpu_target(), Decisions()).mod.script()
    assert cpu.count("T.parallel") == 5
    assert {"T.vectorized(4)", "T.vectorized(8)", "T.vectorized(16)"} <= set(re.findall(r"T.vectorized\(\d+\)", cpu))
    tvm.compile(cpu_rule.lay_out("siso_preprocess", dims, cpu_target(), Decisions()).mod, target=cpu_target())
    dec = Decisions({"threads": 64})
    script = cuda_rule.lay_out("siso_preprocess", dims, tvm.target.Target("rocm"), dec).mod.script()
    assert dec.used == {"threads": 64} and script.count('thread="blockIdx.x"') == 5
    no_init = m3.DIMS["siso_preprocess"](**dict(PRE, has_init=False))
    sch = cuda_rule.lay_out("siso_preprocess", no_init, tvm.target.Target("rocm"), Decisions())
    assert sch.mod.script().count("blockIdx.x") == 4


def test_preprocess_bwd_rules():
    """The backward's six passes (init, dots, angles, pairs, reverse, chunk): six parallel loops on a CPU
    (init's headdim_qk lanes, the angles' vectors, the rotary pairs' and the pass-through pairs' vector sweeps),
    six launches on CUDA; without input states five."""
    dims = m3.DIMS["siso_preprocess_bwd"](**dict(PRE, headdim_angles=3), qk_dtype="bfloat16")
    sch = cpu_rule.lay_out("siso_preprocess_bwd", dims, cpu_target(), Decisions())
    cpu = sch.mod.script()
    assert cpu.count("T.parallel") == 6
    assert "T.vectorized(16)" in cpu and "T.vectorized(3)" in cpu and "T.vectorized(5)" in cpu
    tvm.compile(sch.mod, target=cpu_target())
    dec = Decisions({"threads": 256})
    script = cuda_rule.lay_out("siso_preprocess_bwd", dims, tvm.target.Target("rocm"), dec).mod.script()
    assert dec.used == {"threads": 256} and script.count('thread="blockIdx.x"') == 6
    no_init = m3.DIMS["siso_preprocess_bwd"](**dict(PRE, has_init=False))
    sch = cuda_rule.lay_out("siso_preprocess_bwd", no_init, tvm.target.Target("rocm"), Decisions())
    assert sch.mod.script().count("blockIdx.x") == 5


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_preprocess_and_strict_scan_compile_without_spills():
    from tvm_mamba.compute import ssd
    from tvm_mamba.schedules.cuda import ssd as cuda_ssd

    tgt = cuda_target("sm_80")
    scan = ssd.DIMS["chunk_scan"](nheads=4, ngroups=4, headdim=8, dstate=16, chunk_size=8, has_D=True, has_z=True,
                                  diag_skip=True, x_dtype="bfloat16")
    assert "T.vectorized" in cpu_ssd_script(scan)
    for rule, kernel, dims in ((cuda_rule, "siso_preprocess", m3.DIMS["siso_preprocess"](**PRE, qk_dtype="bfloat16")),
                               (cuda_ssd, "chunk_scan", scan),
                               (cuda_rule, "siso_preprocess_bwd",
                                m3.DIMS["siso_preprocess_bwd"](**PRE, qk_dtype="bfloat16"))):
        with tgt:
            sch = rule.lay_out(kernel, dims, tgt, Decisions())
            src = tvm.compile(sch.mod, target=tgt).mod.imports[0].inspect_source("cuda")
        stats = ptxas_stats(src, "sm_80")
        assert stats["ok"], stats["error"]
        assert stats["kernels"] and all(k["spill_stores"] == 0 for k in stats["kernels"]), stats["kernels"]


def cpu_ssd_script(dims) -> str:
    """The CPU rule's chunk scan at ``dims``, compiled: its strict causal matmul (mm.py's ``tri="lt"``) builds."""
    from tvm_mamba.schedules.cpu import ssd as cpu_ssd

    sch = cpu_ssd.lay_out("chunk_scan", dims, cpu_target(), Decisions())
    tvm.compile(sch.mod, target=cpu_target())
    return sch.mod.script()
