"""mamba_ssm.ops.cute.mamba3 on tvm_mamba (see tvm_mamba.compat): ``mamba3_step_fn``."""
