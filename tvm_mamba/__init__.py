"""tvm_mamba: Mamba kernels defined once in Apache TVM, compiled for each machine, called from PyTorch.

The functional API keeps mamba_ssm's / causal_conv1d's names, signatures and semantics, so switching is an
import change::

    from tvm_mamba import causal_conv1d_fn, causal_conv1d_update
"""
__version__ = "0.1.0"


def _map_schedules_from_checkout() -> None:
    """``schedules/`` sits beside the package in the repository and is installed as tvm_mamba.schedules
    (pyproject). When the package is imported from a checkout (PYTHONPATH, a git worktree, a GPU machine
    with only the TVM runtime), map that checkout's folder, so the schedules always match the package
    beside them, even when another checkout is editable-installed."""
    import importlib.util
    import pathlib
    import sys

    folder = pathlib.Path(__file__).resolve().parent.parent / "schedules"
    if not (folder / "__init__.py").is_file():
        return  # installed from a wheel: pyproject put the folder inside the package
    spec = importlib.util.spec_from_file_location("tvm_mamba.schedules", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["tvm_mamba.schedules"] = module
    spec.loader.exec_module(module)
    globals()["schedules"] = module


_map_schedules_from_checkout()

from .torch_ops.causal_conv1d import (causal_conv1d_fn, causal_conv1d_update,  # noqa: E402,F401
                                      causal_conv1d_varlen_states)
from .torch_ops.ssd import mamba_chunk_scan_combined  # noqa: E402,F401
from .torch_ops.selective_scan import selective_scan_fn, selective_state_update  # noqa: E402,F401
from .torch_ops.rmsnorm_gated import rmsnorm_fn  # noqa: E402,F401
from .torch_ops.int8_dot import (int8_decoder_tail, int8_lowrank_projection, int8_matmul,  # noqa: E402,F401
                                 pack_int8x4, quantize_int8, unpack_int8x4)
from .modules import Mamba, Mamba2, MambaConfig, MambaLMHeadModel, RMSNormGated  # noqa: E402,F401
from .explain import explain  # noqa: E402,F401
from .runtime.tuning import tuning_logs  # noqa: E402,F401
from .runtime.cudasim import simulate as simulate_cuda  # noqa: E402,F401

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_varlen_states", "mamba_chunk_scan_combined",
           "selective_scan_fn", "selective_state_update", "rmsnorm_fn", "quantize_int8", "pack_int8x4", "unpack_int8x4", "int8_matmul",
           "int8_lowrank_projection", "int8_decoder_tail", "Mamba", "Mamba2", "MambaConfig", "MambaLMHeadModel",
           "RMSNormGated", "explain", "tuning_logs", "simulate_cuda", "__version__"]

# the fused layer paths (their own lines, so the list above can grow without touching these)
from .torch_ops.mamba_inner import mamba_inner_fn  # noqa: E402,F401
from .torch_ops.mamba_split import mamba_split_conv1d_scan_combined  # noqa: E402,F401

__all__ += ["mamba_inner_fn", "mamba_split_conv1d_scan_combined"]

# the norms of mamba_ssm's layernorm_gated.py (layernorm_fn, LayerNorm) and layer_norm.py (the fused add-norm)
from .torch_ops.rmsnorm_gated import layernorm_fn  # noqa: E402,F401
from .torch_ops.layer_norm import layer_norm_fn, rms_norm_fn  # noqa: E402,F401
from .modules.rmsnorm_gated import LayerNorm as LayerNormGated  # noqa: E402,F401

__all__ += ["layernorm_fn", "layer_norm_fn", "rms_norm_fn", "LayerNormGated"]

# weight-only bf16 / int8 projections (the linear op) and the model-level swap
from .torch_ops.linear import linear, quantize_weight  # noqa: E402,F401
from .modules.quantize import QuantizedLinear, quantize_weights  # noqa: E402,F401

__all__ += ["linear", "quantize_weight", "QuantizedLinear", "quantize_weights"]
