"""mamba_ssm.ops.triton.mamba3.mamba3_siso_combined on tvm_mamba: the Mamba-3 SISO chunked scan (forward and
backward; no cu_seqlens yet) and its reference."""
from ......reference.mamba3 import mamba3_siso_combined_ref  # noqa: F401
from ......torch_ops.mamba3 import mamba3_siso_combined  # noqa: F401

__all__ = ["mamba3_siso_combined", "mamba3_siso_combined_ref"]
