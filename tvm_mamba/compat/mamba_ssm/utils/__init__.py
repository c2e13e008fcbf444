"""mamba_ssm.utils on tvm_mamba (see tvm_mamba.compat)."""
