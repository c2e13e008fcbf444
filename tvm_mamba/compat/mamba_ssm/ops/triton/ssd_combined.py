"""mamba_ssm.ops.triton.ssd_combined on tvm_mamba: the Mamba-2 SSD chunked scan and Mamba-2's fused path."""
from .....reference.blocks import mamba_split_conv1d_scan_ref  # noqa: F401
from .....torch_ops.mamba_split import mamba_split_conv1d_scan_combined  # noqa: F401
from .....torch_ops.ssd import mamba_chunk_scan_combined  # noqa: F401

__all__ = ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "mamba_split_conv1d_scan_ref"]
