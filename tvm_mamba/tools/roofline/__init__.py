"""``python -m tvm_mamba roofline``: each CUDA kernel at a preset's shapes against the machine's roofline.

count.py     the counting build: a TIR pass before CUDA codegen adds counters (global bytes, flops, exps) and
             the CUDA execution harness runs the kernel (docs/cuda_sim.md)
measure.py   counts at small lengths, an exact affine fit checked at a fourth point, the preset's shape;
             ptxas registers / shared memory (build-check's source) -> occupancy
minimum.py   the algorithm's minimum bytes / flops / exps per kernel
hardware.py  the H200's figures (with sources) and occupancy
report.py    rows, the table, docs/roofline.md
"""

METHOD = """
## How to read it

One row per kernel the preset's model runs (each op's `tuning_configs(preset)`: the kernels the tuner
covers, fp32 as the blocks call them), at the shape named above.

* **bytes actual**: the global-memory bytes the kernel's threads load and store, counted by running the
  generated CUDA through the CPU harness with a counter before every statement (a TIR pass on the device
  functions, in a separate counting build; a load written twice in one statement, the same address, once:
  the compiler keeps it in a register). These are *requests*: a GPU serves repeated requests from L1/L2,
  so DRAM traffic lies between the minimum and this figure. A ratio well above 1 means the kernel re-reads
  global memory (no shared-memory staging) or writes scratch (checkpoints, per-block partial sums).
* **cached**: the counted traffic with each buffer's loads and stores capped at the buffer's size, over the
  minimum: what a perfect cache would leave. Between *cached* and the actual ratio lie re-reads a cache can
  absorb; *cached* above 1 is extra traffic no cache removes (scratch buffers, checkpoints, partial sums).
* **min**: every input read once, every output written once (tvm_mamba/tools/roofline/minimum.py; scratch buffers
  excluded, partial sums at one part per group, in-place state twice).
* **GFLOP / exps**: counted float `+ - * /`, min/max (an FMA is two), plus the tensor cores' multiply-adds
  (2 x 16^3 per wmma `mma_sync` of a warp), and exp-family plus other SFU calls (log1p, tanh, sqrt, ...).
  Both arms of a select are counted.
* **grid x block, regs, occ**: the launch of the kernel moving the most bytes (blocks fitted like the
  counts, `?` when not affine), ptxas's registers (the largest of the key's kernels) from build-check's
  source and nvcc command, the packs' own (docs/design.md, "Compiler flags"), and the resulting
  occupancy on sm_90 (65,536 registers, 228 KB shared memory, 2,048 threads, 32 blocks per SM; static
  shared memory only).
* **TC**: tensor-core instructions in the source (wmma / mma / ldmatrix).
* **bound**: max(bytes / 4.8 TB/s, flops / 66.9 TFLOPS fp32 + tensor-core flops / their rate, SFU ops /
  4.18e12 per s) with the counted figures; **roofline-min**: the same with the minimum figures and the best unit (matrix products on tensor
  cores: 989 TFLOPS bf16, 494.7 TFLOPS TF32 for fp32 data); **ratio** = bound / roofline-min. The unit in
  brackets is the limiting one. Sources of the figures: tvm_mamba/tools/roofline/hardware.py.
* **Not a measurement**: no time here comes from a GPU. mamba_ssm's published kernel times for these shapes:
  not known (its papers report end-to-end throughput and scan speed-ups, not per-kernel times at these
  shapes), so none is shown.

## Method

Counting a preset's full shape in the harness takes minutes, so each kernel is counted at three small
lengths (seqlen a multiple of its chunk and of 128; batch 1 and 2), the counts are fitted exactly as
`c0 + c1*batch + c2*batch*seqlen` (`c0 + c1*batch` for the decode step), a fourth point (batch 2, a third length) must
match the fit exactly (else the row fails: not affine), and the fit is evaluated at the preset's (batch, seqlen).
"""
