"""mamba_ssm.models on tvm_mamba (see tvm_mamba.compat)."""
