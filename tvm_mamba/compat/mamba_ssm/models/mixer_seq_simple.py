"""mamba_ssm.models.mixer_seq_simple on tvm_mamba."""
from ....modules.lm import MambaConfig, MambaLMHeadModel, MixerModel, create_block  # noqa: F401

__all__ = ["MambaConfig", "MambaLMHeadModel", "MixerModel", "create_block"]
