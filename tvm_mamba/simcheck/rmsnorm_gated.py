"""sim-check for rmsnorm_gated: the build-check configurations (fwd, bwd) run through the CUDA execution
harness via ``rmsnorm_fn``, against the float64 reference.

Model dims are the configuration's (hidden 2048); leading dims (2, 3) give 6 rows (one block per row,
and for the backward 6 weight/bias parts: min(rows, 64)), about a second per check in the harness.
"""
from __future__ import annotations

import torch

from . import CheckFailed, compare, ran, recording, tolerance

OP = "rmsnorm_gated"
LEAD = (2, 3)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _inputs(static: dict, dtypes: dict, gen: torch.Generator) -> dict:
    """x, weight (, bias, z), already in their kernel dtypes; weight near 1 and z spread over silu's bend."""
    xdt, wdt = DTYPES[dtypes["x"]], DTYPES[dtypes["weight"]]
    hidden = static["hidden"]
    t = {"x": torch.randn(*LEAD, hidden, generator=gen).to(xdt),
         "weight": (1 + 0.5 * torch.randn(hidden, generator=gen)).to(wdt)}
    if static["has_bias"]:
        t["bias"] = (0.3 * torch.randn(hidden, generator=gen)).to(wdt)
    if static["has_z"]:
        t["z"] = (2 * torch.randn(*LEAD, hidden, generator=gen)).to(xdt)
    return t


def _call(fn, t: dict, static: dict):
    return fn(t["x"], t["weight"], t.get("bias"), t.get("z"), eps=static["eps"],
              group_size=static["group_size"], norm_before_gate=static["norm_before_gate"])


def _check_fwd(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:
    import tvm_mamba
    from ..reference.rmsnorm_gated import rmsnorm_gated_ref

    t = _inputs(static, dtypes, gen)
    with recording() as keys, tvm_mamba.simulate_cuda(arch):
        out = _call(tvm_mamba.rmsnorm_fn, t, static)
    ran(keys, OP, "fwd", static, dtypes)
    ref = _call(rmsnorm_gated_ref, {k: v.double() for k, v in t.items()}, static)
    compare("out", out, ref, *tolerance(out.dtype))


def _check_bwd(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:
    """Forward then autograd backward with a random cotangent in x's dtype; dx, dweight (, dbias, dz)
    against the float64 reference's autograd."""
    import tvm_mamba
    from ..reference.rmsnorm_gated import rmsnorm_gated_ref

    t = _inputs(static, dtypes, gen)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    refs = {k: v.double().requires_grad_() for k, v in t.items()}
    with recording() as keys, tvm_mamba.simulate_cuda(arch):
        out = _call(tvm_mamba.rmsnorm_fn, leaves, static)
        dout = torch.randn(out.shape, generator=gen).to(out.dtype)
        out.backward(dout)
    ran(keys, OP, "bwd", static, dtypes)
    ref_out = _call(rmsnorm_gated_ref, refs, static)
    ref_out.backward(dout.double())
    compare("out", out, ref_out, *tolerance(out.dtype))
    for name in leaves:
        got, ref = leaves[name].grad, refs[name].grad
        if got is None:
            raise CheckFailed(f"d{name}: no gradient")
        rtol, atol = tolerance(got.dtype)
        if name in ("weight", "bias"):  # sums over rows: the error grows with the magnitude
            atol *= max(1.0, ref.abs().max().item())
        compare(f"d{name}", got, ref, rtol, atol)


CHECKS = {"fwd": _check_fwd, "bwd": _check_bwd}


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of rmsnorm_gated through the harness (see the package docstring)."""
    if direction not in CHECKS:
        raise CheckFailed(f"rmsnorm_gated: unknown direction {direction!r} (expected one of {sorted(CHECKS)})")
    CHECKS[direction](dict(static), dict(dtypes), arch, torch.Generator().manual_seed(0))
