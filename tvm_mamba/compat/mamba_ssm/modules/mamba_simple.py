"""mamba_ssm.modules.mamba_simple on tvm_mamba."""
from ....modules.mamba import Mamba  # noqa: F401

__all__ = ["Mamba"]
