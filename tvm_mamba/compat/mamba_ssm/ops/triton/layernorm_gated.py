"""mamba_ssm.ops.triton.layernorm_gated on tvm_mamba: gated RMSNorm / LayerNorm (functions, modules,
references)."""
from .....modules.rmsnorm_gated import LayerNorm, RMSNorm  # noqa: F401
from .....reference.rmsnorm_gated import rmsnorm_gated_ref as rms_norm_ref  # noqa: F401
from .....torch_ops.rmsnorm_gated import layernorm_fn, rmsnorm_fn  # noqa: F401

__all__ = ["rmsnorm_fn", "layernorm_fn", "RMSNorm", "LayerNorm", "rms_norm_ref"]
