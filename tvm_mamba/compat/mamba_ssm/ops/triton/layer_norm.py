"""mamba_ssm.ops.triton.layer_norm on tvm_mamba: the fused residual-add LayerNorm / RMSNorm (functions, the
RMSNorm module, references)."""
from .....modules.layer_norm import RMSNorm  # noqa: F401
from .....reference.layer_norm import layer_norm_ref, rms_norm_ref  # noqa: F401
from .....torch_ops.layer_norm import layer_norm_fn, rms_norm_fn  # noqa: F401

__all__ = ["layer_norm_fn", "rms_norm_fn", "RMSNorm", "layer_norm_ref", "rms_norm_ref"]
