"""mamba_ssm.modules.mamba3 on tvm_mamba (SISO, inference; MIMO is refused)."""
from ....modules.mamba3 import Mamba3  # noqa: F401

__all__ = ["Mamba3"]
