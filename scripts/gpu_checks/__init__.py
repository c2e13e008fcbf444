"""The checks behind scripts/gpu_check.py: every kernel configuration the package ships, run natively on a
device (CUDA, or the CPU for a rehearsal) against the float64 references, timed kernel by kernel.

The cases themselves are tvm_mamba/tools/simcheck's (one definition per op: inputs, public call, reference and
tolerances), run inside ``simcheck.on_device`` instead of the CUDA harness:

- cases.py: which cases (every build-check configuration at simcheck's small sizes; each preset's tuning
  configurations at the roofline's shape and at a ragged one; the whole LMs), and the kernel configurations
  they hit (for an AOT pack: ``gpu_check.py configs``);
- runner.py: one case on a device -> one row per kernel it ran (ok, max error, replay time, GB/s, estimate);
- lm.py: a 130M / 370M Mamba-1 / Mamba-2 LM, prefill + decode, against the float64 PyTorch model path;
- upstream.py: mamba_ssm's Triton kernels on the same tensors where they import;
- report.py: gpu_check.json / gpu_check.md and the summary lines.

Nothing here imports TVM's compiler on the ``run`` path: on a runtime-only machine the case list comes from the
``configs`` file carried in the kernel pack (aot --configs copies it there).
"""
