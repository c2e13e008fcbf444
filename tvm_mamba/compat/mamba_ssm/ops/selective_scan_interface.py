"""mamba_ssm.ops.selective_scan_interface on tvm_mamba: the selective scan, Mamba-1's fused inner path, and
their float64-capable references."""
from ....reference.blocks import mamba_inner_ref  # noqa: F401
from ....reference.selective_scan import selective_scan_ref  # noqa: F401
from ....torch_ops.mamba_inner import mamba_inner_fn  # noqa: F401
from ....torch_ops.selective_scan import selective_scan_fn  # noqa: F401

__all__ = ["selective_scan_fn", "selective_scan_ref", "mamba_inner_fn", "mamba_inner_ref"]
