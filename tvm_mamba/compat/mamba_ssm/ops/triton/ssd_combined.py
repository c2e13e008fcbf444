"""mamba_ssm.ops.triton.ssd_combined on tvm_mamba: the Mamba-2 SSD chunked scan."""
from .....torch_ops.ssd import mamba_chunk_scan_combined  # noqa: F401

__all__ = ["mamba_chunk_scan_combined"]
