"""mamba_ssm.ops.triton.selective_state_update on tvm_mamba: the one-token decode step and its reference."""
from .....reference.selective_scan import selective_state_update_ref  # noqa: F401
from .....torch_ops.selective_scan import selective_state_update  # noqa: F401

__all__ = ["selective_state_update", "selective_state_update_ref"]
