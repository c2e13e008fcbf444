"""mamba_ssm.modules.mamba2 on tvm_mamba."""
from ....modules.mamba2 import Mamba2  # noqa: F401

__all__ = ["Mamba2"]
