"""mamba_ssm.ops.tilelang on tvm_mamba (see tvm_mamba.compat)."""
