"""causal_conv1d's top-level names on tvm_mamba (``import causal_conv1d`` after ``tvm_mamba.compat.install()``).
``__version__`` is the causal-conv1d release whose API this mirrors."""
__version__ = "1.7.0"

from .causal_conv1d_interface import causal_conv1d_fn, causal_conv1d_update  # noqa: E402,F401

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "__version__"]
