"""TE/TIR definitions: pure functions of static dims + dtypes -> PrimFunc (no torch).

One module per op (``causal_conv1d.py``, ...) with builders named ``<op>_<direction>`` (the compiled symbol) and
listed in its ``KERNELS`` table (direction -> builder), which runtime/registry.py reads. Batch and sequence
length are symbolic; model dims are static. Each PrimFunc is named after its kernel (``_common.stamp``).
The schedule rules receive the typed dims themselves (``lay_out(kernel, dims, target, decisions)``).
"""
from tvm_mamba.compute import _tvmscript  # noqa: E402 - TVMScript parsing without per-frame source reads

_tvmscript.install()
