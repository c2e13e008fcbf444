"""mamba_ssm.ops.cute on tvm_mamba (see tvm_mamba.compat): Mamba-3's decode step function; no CuTe DSL."""
