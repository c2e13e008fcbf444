"""mamba_ssm.modules.mlp on tvm_mamba."""
from ....modules.mlp import GatedMLP  # noqa: F401

__all__ = ["GatedMLP"]
