"""mamba_ssm.ops.selective_scan_interface on tvm_mamba: the selective scan and its float64-capable reference."""
from ....reference.selective_scan import selective_scan_ref  # noqa: F401
from ....torch_ops.selective_scan import selective_scan_fn  # noqa: F401

__all__ = ["selective_scan_fn", "selective_scan_ref"]
