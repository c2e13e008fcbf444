"""tvm_mamba: Mamba kernels defined once in Apache TVM, compiled for each machine, called from PyTorch.

The functional API keeps mamba_ssm's / causal_conv1d's names, signatures and semantics, so switching is an
import change::

    from tvm_mamba import causal_conv1d_fn, causal_conv1d_update
"""
__version__ = "0.1.0"

from .torch_ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # noqa: E402,F401
from .explain import explain  # noqa: E402,F401
from .runtime.tuning import tuning_logs  # noqa: E402,F401

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "explain", "tuning_logs", "__version__"]
