"""mamba_ssm.ops.triton.layernorm_gated on tvm_mamba: gated RMSNorm (function, module, reference)."""
from .....modules.rmsnorm_gated import RMSNormGated as RMSNorm  # noqa: F401
from .....reference.rmsnorm_gated import rmsnorm_gated_ref as rms_norm_ref  # noqa: F401
from .....torch_ops.rmsnorm_gated import rmsnorm_fn  # noqa: F401

__all__ = ["rmsnorm_fn", "RMSNorm", "rms_norm_ref"]
