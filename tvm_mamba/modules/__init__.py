"""nn.Module blocks with mamba_ssm's parameter names: Mamba, Mamba2, RMSNormGated, and a small LM."""
from .rmsnorm_gated import RMSNormGated  # noqa: F401
from .mamba import Mamba  # noqa: F401
from .mamba2 import Mamba2  # noqa: F401
from .lm import Block, InferenceParams, MambaConfig, MambaLMHeadModel, MixerModel, RMSNorm  # noqa: F401

__all__ = ["Mamba", "Mamba2", "RMSNormGated", "RMSNorm", "Block", "MixerModel", "MambaConfig",
           "MambaLMHeadModel", "InferenceParams"]
