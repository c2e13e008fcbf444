"""causal_conv1d.causal_conv1d_interface on tvm_mamba: the conv, its decode step and their references."""
from ...reference.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref  # noqa: F401
from ...torch_ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # noqa: F401

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_ref", "causal_conv1d_update_ref"]
