"""The gated-RMSNorm calls of the fused layer paths (mamba_inner.py, mamba_split.py), in one place.

The ``tvm_mamba::rmsnorm_gated_fwd/bwd`` custom ops are gaining arguments on the norms branch of issue #15
(residual, rowscale, seeds, mean, is_rms_norm, dropout_p, ...; more outputs). The fused paths call them by
argument name, filling the arguments they do not use from the registered schema (absent optional tensors
None, flags False, is_rms_norm True, dropout_p 0), and take the outputs they need by position (out first,
rstd last; dx, dz, dweight first), so they serve the schema on main and the extended one alike. Once the
norms branch has landed this can become a direct call.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dlpack import run_op
from .rmsnorm_gated import rmsnorm_gated_bwd, rmsnorm_gated_fwd

_FILL = {"is_rms_norm": True, "dropout_p": 0.0}  # unused arguments whose neutral value is not None / False


def _arg_names(op: str) -> tuple:
    """(name, fill) per schema argument of tvm_mamba::<op>; fill is the neutral value for an unused one."""
    out = []
    for a in getattr(torch.ops.tvm_mamba, op).default._schema.arguments:
        fill = _FILL.get(a.name, None if isinstance(a.type, torch.OptionalType) else
                         False if str(a.type) == "bool" else LookupError)
        out.append((a.name, fill))
    return tuple(out)


# read once at import: torch.compile traces _call, which must not touch the schema objects
_ARGS = {name: _arg_names(name) for name in ("rmsnorm_gated_fwd", "rmsnorm_gated_bwd")}


def _call(op, name: str, **given):
    args = []
    for arg, fill in _ARGS[name]:
        if arg in given:
            args.append(given[arg])
        elif fill is LookupError:
            raise TypeError(f"tvm_mamba::{name}: no value for its argument {arg!r}")
        else:
            args.append(fill)
    return run_op(op, *args)


def norm_fwd(x: Tensor, weight: Tensor, z, eps: float, group_size: int, norm_before_gate: bool):
    """RMSNorm (gated by z when given) of x: (rows, hidden) -> out (rows, hidden) in x's dtype, rstd
    (rows, hidden/group_size) float32."""
    res = _call(rmsnorm_gated_fwd, "rmsnorm_gated_fwd", x=x, weight=weight, bias=None, z=z, eps=eps,
                group_size=group_size, norm_before_gate=norm_before_gate)
    return res[0], res[-1]


def norm_bwd(x: Tensor, weight: Tensor, z, dout: Tensor, rstd: Tensor, eps: float, group_size: int,
             norm_before_gate: bool):
    """Gradients (dx, dz or (0,), dweight) of :func:`norm_fwd` from its rstd."""
    mean = x.new_empty((0,), dtype=torch.float32)  # RMSNorm: no mean (for the schema that takes one)
    res = _call(rmsnorm_gated_bwd, "rmsnorm_gated_bwd", x=x, weight=weight, bias=None, z=z, dout=dout.to(x.dtype),
                mean=mean, rstd=rstd, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    return res[0], res[1], res[2]
