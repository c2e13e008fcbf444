"""tvm_mamba: Mamba kernels defined once in Apache TVM, compiled for each machine, called from PyTorch.

The functional API keeps mamba_ssm's / causal_conv1d's names, signatures and semantics, so switching is an
import change::

    from tvm_mamba import causal_conv1d_fn, causal_conv1d_update
"""
__version__ = "0.1.0"


# Public name -> the module that defines it. Resolved on first use (PEP 562), so ``import tvm_mamba.compute``
# or ``tvm_mamba.runtime`` (the torch-free layers: an AOT host with only TVM) does not import torch through
# this file, and no module of the package imports this one to get at a sibling.
_PUBLIC = {
    ".torch_ops.causal_conv1d": ("causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_varlen_states"),
    ".torch_ops.ssd": ("mamba_chunk_scan_combined",),
    ".torch_ops.selective_scan": ("selective_scan_fn", "selective_state_update"),
    ".torch_ops.mamba3": ("mamba3_siso_step", "mamba3_siso_combined"),
    ".torch_ops.mamba3_mimo": ("mamba3_mimo",),
    ".torch_ops.mamba3_mimo_step": ("mamba3_mimo_step",),
    ".torch_ops.rmsnorm_gated": ("rmsnorm_fn", "layernorm_fn"),
    ".torch_ops.int8_dot": ("quantize_int8", "pack_int8x4", "unpack_int8x4", "int8_matmul",
                            "int8_lowrank_projection", "int8_decoder_tail"),
    ".modules": ("Mamba", "Mamba2", "Mamba3", "MambaConfig", "MambaLMHeadModel", "RMSNormGated"),
    ".explain": ("explain",),
    ".runtime.tuning": ("tuning_logs",),
    ".torch_ops.mamba_inner": ("mamba_inner_fn",),  # the fused layer paths
    ".torch_ops.mamba_split": ("mamba_split_conv1d_scan_combined",),
    ".torch_ops.layer_norm": ("layer_norm_fn", "rms_norm_fn"),  # mamba_ssm's layer_norm.py (fused add-norm)
    # weight-only bf16 / int8 projections (the linear op) and the model-level swap
    ".torch_ops.linear": ("linear", "quantize_weight"),
    ".modules.quantize": ("QuantizedLinear", "quantize_weights"),
}
_RENAMED = {"simulate_cuda": (".runtime.cudasim", "simulate"), "webgpu": (".runtime.webgpu", "use"),
            "LayerNormGated": (".modules.rmsnorm_gated", "LayerNorm")}  # layernorm_gated.py's LayerNorm
_WHERE = {name: (module, name) for module, names in _PUBLIC.items() for name in names} | _RENAMED

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_varlen_states", "mamba_chunk_scan_combined",
           "selective_scan_fn", "selective_state_update", "mamba3_siso_step", "mamba3_siso_combined", "mamba3_mimo", "rmsnorm_fn", "quantize_int8", "pack_int8x4", "unpack_int8x4", "int8_matmul",
           "int8_lowrank_projection", "int8_decoder_tail", "Mamba", "Mamba2", "Mamba3", "MambaConfig", "MambaLMHeadModel",
           "RMSNormGated", "explain", "tuning_logs", "simulate_cuda", "webgpu", "__version__",
           "mamba_inner_fn", "mamba_split_conv1d_scan_combined",
           "mamba3_mimo_step",
           "layernorm_fn", "layer_norm_fn", "rms_norm_fn", "LayerNormGated",
           "linear", "quantize_weight", "QuantizedLinear", "quantize_weights"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(where[0], __name__), where[1])
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
