"""mamba_ssm.ops.cute.mamba3.mamba3_step_fn on tvm_mamba: the decode step's state update and output from rotated
B / C (``mamba3_step_fn``, the step template's ``step_update`` kernel); no CuTe DSL."""
from ......torch_ops.mamba3_step_parts import mamba3_step_fn  # noqa: F401

__all__ = ["mamba3_step_fn"]
