"""mamba_ssm.ops.triton.mamba3.mamba3_siso_step on tvm_mamba: the Mamba-3 SISO decode step and its reference."""
from ......reference.mamba3 import mamba3_siso_step_ref  # noqa: F401
from ......torch_ops.mamba3 import mamba3_siso_step  # noqa: F401

__all__ = ["mamba3_siso_step", "mamba3_siso_step_ref"]
