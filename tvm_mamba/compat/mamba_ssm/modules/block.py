"""mamba_ssm.modules.block on tvm_mamba."""
from ....modules.lm import Block  # noqa: F401

__all__ = ["Block"]
