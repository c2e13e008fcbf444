"""mamba_ssm.ops.triton.mamba3 on tvm_mamba (see tvm_mamba.compat): the SISO decode step and chunked forward,
the decode step's rotary pass (mamba3_mimo_rotary_step)."""
