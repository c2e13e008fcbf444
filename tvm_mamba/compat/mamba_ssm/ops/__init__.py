"""mamba_ssm.ops on tvm_mamba (see tvm_mamba.compat)."""
