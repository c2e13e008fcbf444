"""The machine the roofline is drawn for (an H200 SXM, sm_90) and occupancy from ptxas's resource report.

Figures and sources:
* HBM bandwidth 4.8 TB/s: NVIDIA H200 datasheet (H200 SXM, 141 GB HBM3e).
* Dense bf16 / fp16 tensor-core peak 989 TFLOPS, dense TF32 494.7 TFLOPS: the H200 datasheet (it prints the
  2:4-sparse figures, 1,979 and 989; dense is half).
* fp32 on CUDA cores 66.9 TFLOPS: 132 SMs x 128 fp32 lanes x 2 (an FMA is two flops) x 1.98 GHz boost (the
  datasheet's "FP32 67 TFLOPS").
* SFU (MUFU: ex2, lg2, rcp, rsqrt, sin, cos) 4.18e12 ops/s: 16 results per clock per SM on compute capability
  9.0 (CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table) x 132 SMs x 1.98 GHz. ``expf``
  is one MUFU.EX2 plus FMAs (range reduction), so each exp-family call costs one SFU op here.
* Per SM (sm_90): 65,536 registers (allocated per warp in units of 256), 228 KB shared memory (1 KB of it
  reserved per resident block), 2,048 threads (64 warps), 32 blocks (CUDA Programming Guide, "Compute
  Capabilities" table).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    hbm_bytes_per_s: float
    fp32_flops: float
    tc_bf16_flops: float
    tc_tf32_flops: float
    sfu_per_s: float
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_block: int = 1024
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    reg_unit: int = 256  # registers are allocated per warp in units of 256


H200 = Machine("H200 SXM (sm_90)", hbm_bytes_per_s=4.8e12, fp32_flops=132 * 128 * 2 * 1.98e9,
               tc_bf16_flops=989e12, tc_tf32_flops=494.7e12, sfu_per_s=132 * 16 * 1.98e9)


def occupancy(regs: int, smem: int, threads: int, m: Machine = H200) -> float:
    """Resident warps / 64 for a kernel using ``regs`` registers per thread, ``smem`` bytes of static shared
    memory per block and ``threads`` threads per block (0.0 when a block does not fit)."""
    if threads <= 0:
        return 0.0
    warps = -(-threads // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // m.reg_unit) * m.reg_unit
    by_regs = (m.regs_per_sm // regs_per_warp) // warps
    by_smem = m.smem_per_sm // (smem + m.smem_reserved_per_block)
    by_threads = m.threads_per_sm // (warps * 32)
    blocks = min(by_regs, by_smem, by_threads, m.blocks_per_sm)
    return blocks * warps / (m.threads_per_sm // 32)


def time_bound(bytes_: float, flops: float, sfu_ops: float, mm_flops: float = 0.0, mm_peak: float = 0.0,
               m: Machine = H200) -> tuple[float, str]:
    """(seconds, limiting unit) of the roofline: the slowest of memory, arithmetic and SFU. ``flops`` run on
    the fp32 CUDA cores; ``mm_flops`` (matrix products) at ``mm_peak`` (a tensor-core rate) when given."""
    arith = flops / m.fp32_flops + (mm_flops / mm_peak if mm_flops else 0.0)
    parts = {"memory": bytes_ / m.hbm_bytes_per_s, "arith": arith, "sfu": sfu_ops / m.sfu_per_s}
    unit = max(parts, key=parts.get)
    return parts[unit], unit
