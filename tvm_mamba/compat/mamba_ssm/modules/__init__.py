"""mamba_ssm.modules on tvm_mamba (see tvm_mamba.compat)."""
