"""mamba_ssm.ops.tilelang.mamba3.mamba3_mimo on tvm_mamba: the Mamba-3 MIMO chunked scan (forward and backward,
cu_seqlens) on tvm_mamba's kernels; no TileLang."""
from ......torch_ops.mamba3_mimo import mamba3_mimo  # noqa: F401

__all__ = ["mamba3_mimo"]
