"""mamba_ssm.models.config_mamba on tvm_mamba."""
from ....modules.lm import MambaConfig  # noqa: F401

__all__ = ["MambaConfig"]
