"""mamba_ssm.ops.triton.mamba3.mamba3_mimo_rotary_step on tvm_mamba: the decode step's rotary pass
(``apply_rotary_qk_inference_fwd``, the step template's ``step_rotate`` kernel); no Triton."""
from ......torch_ops.mamba3_step_parts import apply_rotary_qk_inference_fwd  # noqa: F401

__all__ = ["apply_rotary_qk_inference_fwd"]
