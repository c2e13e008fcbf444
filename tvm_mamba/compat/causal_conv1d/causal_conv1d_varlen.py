"""causal_conv1d.causal_conv1d_varlen on tvm_mamba: the last state_len inputs of every packed sequence."""
from ...reference.causal_conv1d import causal_conv1d_varlen_states_ref  # noqa: F401
from ...torch_ops.causal_conv1d import causal_conv1d_varlen_states  # noqa: F401

__all__ = ["causal_conv1d_varlen_states", "causal_conv1d_varlen_states_ref"]
