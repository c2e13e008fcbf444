"""mamba_ssm.ops.triton on tvm_mamba (see tvm_mamba.compat)."""
