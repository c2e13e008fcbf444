"""sim-check for rmsnorm_gated: the build-check configurations (fwd, bwd) run through the CUDA execution
harness via the public function that serves them (``rmsnorm_fn`` / ``layernorm_fn`` for the gated norms,
``layer_norm_fn`` with a residual and prenorm for the fused add-norm), against the float64 references.

Model dims are the configuration's (hidden 2048); leading dims (2, 3) give 6 rows (one block of rows, and
for the backward one weight/bias part of 32 rows, 6 of them present), about a second per check in the harness.
"""
from __future__ import annotations

import torch

from . import CheckFailed, compare, ran, recording, tolerance, extent, generator, size, target

OP = "rmsnorm_gated"
LEAD = (2, 3)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _lead() -> tuple:
    """The leading dims: LEAD; under sim-check --full one dim of two whole backward parts of PART_ROWS rows and
    a ragged tail (67 rows: also eight forward blocks of up to 8 rows_per_block, and a partial one); on a
    device (gpu_check) the sizes on_device gives."""
    from ...compute.rmsnorm_gated import PART_ROWS

    rows = extent(LEAD[0] * LEAD[1], PART_ROWS)
    lead = LEAD if rows == LEAD[0] * LEAD[1] else (1, rows)
    return size("batch", lead[0]), size("seqlen", lead[1])


def _inputs(static: dict, dtypes: dict, gen: torch.Generator) -> dict:
    """x, weight (, bias, z), already in their kernel dtypes; weight near 1 and z spread over silu's bend."""
    xdt, wdt = DTYPES[dtypes["x"]], DTYPES[dtypes["weight"]]
    hidden, lead = static["hidden"], _lead()
    t = {"x": torch.randn(*lead, hidden, generator=gen).to(xdt),
         "weight": (1 + 0.5 * torch.randn(hidden, generator=gen)).to(wdt)}
    if static["has_bias"]:
        t["bias"] = (0.3 * torch.randn(hidden, generator=gen)).to(wdt)
    if static["has_z"]:
        t["z"] = (2 * torch.randn(*lead, hidden, generator=gen)).to(xdt)
    if _fused(static):  # the fused add-norm's residual, in the forward's residual dtype (the bwd's x dtype)
        rdt = DTYPES[dtypes.get("residual", dtypes["x"])] if "dout" not in dtypes else DTYPES[dtypes["x"]]
        t["residual"] = torch.randn(*lead, hidden, generator=gen).to(rdt)
        if "dout" in dtypes:
            t["x"] = t["x"].to(DTYPES[dtypes["dout"]])
    if static.get("has_x1"):  # upstream's parallel norm: a second input and a second weight (and bias)
        t["x1"] = torch.randn(*lead, hidden, generator=gen).to(t["x"].dtype)
    if static.get("has_weight1"):
        t["weight1"] = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(wdt)
    if static.get("has_bias1"):
        t["bias1"] = (0.3 * torch.randn(hidden, generator=gen)).to(wdt)
    return t


def _rowscale(static: dict, gen: torch.Generator):
    """The fused add-norm's rowscale (not a gradient leaf: upstream gives it none), or None."""
    return torch.rand(*_lead(), generator=gen) + 0.5 if static.get("has_rowscale") else None


def _fused(static: dict) -> bool:
    return static.get("has_residual", False) or static.get("has_dresidual", False)


def _call(t: dict, static: dict, kernel: bool = True, extra: dict | None = None):
    """The configuration's public function (kernel) or its reference; the fused add-norm returns
    (out, (out1,) residual_out). ``extra``: the fused add-norm's rowscale and, with dropout, the keep masks
    (the kernel call stores its masks there, the reference call reads them)."""
    from ...reference.layer_norm import layer_norm_ref
    from ...reference.rmsnorm_gated import layernorm_gated_ref

    rms = static.get("is_rms_norm", True)
    if _fused(static):
        extra = {} if extra is None else extra
        p = static.get("dropout_p", 0.0)
        args = (t["x"], t["weight"], t.get("bias"), t["residual"])
        kw = dict(eps=static["eps"], prenorm=True, is_rms_norm=rms, dropout_p=p, x1=t.get("x1"),
                  weight1=t.get("weight1"), bias1=t.get("bias1"))
        nout = 3 if "weight1" in t else 2
        if not kernel:
            rs = extra.get("rowscale")
            return layer_norm_ref(*args, **kw, rowscale=rs.double() if rs is not None else None,
                                  dropout_mask=extra.get("mask"), dropout_mask1=extra.get("mask1"))
        res = tvm_mamba_fn("layer_norm_fn")(*args, **kw, rowscale=extra.get("rowscale"), return_dropout_mask=p > 0)
        if p > 0:
            extra["mask"], extra["mask1"] = res[nout], res[nout + 1]
        return res[:nout]
    f = tvm_mamba_fn("layernorm_fn") if kernel else layernorm_gated_ref
    return f(t["x"], t["weight"], t.get("bias"), t.get("z"), eps=static["eps"], group_size=static["group_size"],
             norm_before_gate=static["norm_before_gate"], is_rms_norm=rms)


def tvm_mamba_fn(name: str):
    import tvm_mamba

    return getattr(tvm_mamba, name)


def _outputs(res) -> dict:
    if not isinstance(res, tuple):
        return {"out": res}
    return dict(zip(["out", "out1", "residual_out"] if len(res) == 3 else ["out", "residual_out"], res))


def _check_fwd(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:

    t = _inputs(static, dtypes, gen)
    extra = {"rowscale": _rowscale(static, gen)}
    with recording() as keys, target(arch):
        got = _outputs(_call(t, static, extra=extra))
    ran(keys, OP, "fwd", static, dtypes)
    ref = _outputs(_call({k: v.double() for k, v in t.items()}, static, kernel=False, extra=extra))
    for name, g in got.items():
        compare(name, g, ref[name], *tolerance(g.dtype))


def _check_bwd(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:
    """Forward then autograd backward with a random cotangent in x's dtype; dx, dweight (, dbias, dz)
    against the float64 reference's autograd."""

    t = _inputs(static, dtypes, gen)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    refs = {k: v.double().requires_grad_() for k, v in t.items()}
    extra = {"rowscale": _rowscale(static, gen)}
    with recording() as keys, target(arch):
        got = _outputs(_call(leaves, static, extra=extra))
        douts = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in got.items()}
        torch.autograd.backward(list(got.values()), list(douts.values()))
    ran(keys, OP, "bwd", static, dtypes)
    ref = _outputs(_call(refs, static, kernel=False, extra=extra))
    torch.autograd.backward(list(ref.values()), [douts[k].double() for k in ref])
    for name, g in got.items():
        compare(name, g, ref[name], *tolerance(g.dtype))
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
    CHECKS[direction](dict(static), dict(dtypes), arch, generator(0))
