"""mamba_ssm.ops.tilelang.mamba3 on tvm_mamba (see tvm_mamba.compat): the MIMO chunked scan."""
