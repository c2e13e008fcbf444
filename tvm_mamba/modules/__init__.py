"""nn.Module blocks with mamba_ssm's parameter names: Mamba, Mamba2, Mamba3 (SISO, inference), RMSNormGated, and a small LM, with
mamba_ssm's decoding loop (generation.py) and checkpoint directories (checkpoint.py)."""
from .rmsnorm_gated import RMSNormGated  # noqa: F401
from .mamba import Mamba  # noqa: F401
from .mamba2 import Mamba2  # noqa: F401
from .mamba3 import Mamba3  # noqa: F401
from .generation import GenerateDecoderOnlyOutput, GenerationMixin, InferenceParams, decode, sample  # noqa: F401
from .mlp import GatedMLP  # noqa: F401
from .lm import Block, MambaConfig, MambaLMHeadModel, MixerModel, RMSNorm, create_block  # noqa: F401

__all__ = ["Mamba", "Mamba2", "Mamba3", "RMSNormGated", "RMSNorm", "GatedMLP", "Block", "create_block", "MixerModel", "MambaConfig",
           "MambaLMHeadModel", "InferenceParams", "GenerationMixin", "GenerateDecoderOnlyOutput", "decode", "sample"]
