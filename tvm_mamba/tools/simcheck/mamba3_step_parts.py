"""sim-check of upstream's two-function Mamba-3 decode path on the CUDA execution harness: ``step_rotate`` through
``apply_rotary_qk_inference_fwd`` and ``step_update`` through ``mamba3_step_fn`` (torch_ops/mamba3_step_parts.py),
each against its float64 reference (reference/mamba3_mimo.py ``apply_rotary_qk_inference_ref`` /
``mamba3_step_fn_ref``), at the build-check configuration's dims, dtypes and flags."""
from __future__ import annotations

import math

import torch

from . import CheckFailed, compare, ran, recording, tolerance, generator, size, target

OP = "mamba3"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def rotate_inputs(static: dict, dtypes: dict, batch: int, seed: int = 0) -> dict:
    """apply_rotary_qk_inference_fwd keyword arguments of a ``step_rotate`` configuration: q, k (batch, R,
    nheads, headdim) in ``qk``, one head broadcast (stride 0) when nheads_qk is 1 (upstream's module passes B / C
    so); the angle state past 2 pi (not reduced), proj, dt, biases (R, nheads, headdim) in the acc dtype."""
    g = generator(seed)
    R, H, HQ, N, S = (static[k] for k in ("mimo_rank", "nheads", "nheads_qk", "headdim_qk", "headdim_angles"))
    if HQ not in (1, H):
        raise CheckFailed(f"{OP}.step_rotate: nheads_qk must be 1 (broadcast) or nheads, got {HQ}")
    qk, acc = _DTYPES[dtypes["qk"]], _DTYPES[dtypes.get("v", "float32")]
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k = (r(batch, R, HQ, N).to(qk).expand(batch, R, H, N) for _ in range(2))
    bias = lambda on: (0.3 * r(R, H, N)).to(acc) if on else None  # noqa: E731
    return dict(q=q, k=k, angle_state=(torch.rand(batch, H, S, generator=g) * 6 * math.pi).to(acc),
                angle_proj=(2 * r(batch, H, S)).to(acc), dt=(0.5 * torch.rand(batch, H, generator=g)).to(acc),
                bias_q=bias(static.get("has_qbias", True)), bias_k=bias(static.get("has_kbias", True)),
                conjugate=static.get("conjugate", False), rotate_pairwise=static.get("pairwise", False))


def update_inputs(static: dict, dtypes: dict, batch: int, seed: int = 0) -> dict:
    """mamba3_step_fn keyword arguments of a ``step_update`` configuration (without ``out``): B, C in ``qk``, x in
    ``v``, z / Bstate / Xstate / state in their key dtypes (defaults v's, acc, v's, acc); A < 0, dt, trap in
    (0, 1), D, projections around upstream's init in acc; a state_out unless the configuration is in place."""
    g = generator(seed)
    R, H, N, P = (static[k] for k in ("mimo_rank", "nheads", "headdim_qk", "headdim_v"))
    v = _DTYPES[dtypes["v"]]
    acc = torch.float64 if v == torch.float64 else torch.float32
    qk, z, ks, vs, sd = (_DTYPES[dtypes[k]] if k in dtypes else d for k, d in
                         (("qk", v), ("z", v), ("kstate", acc), ("vstate", v), ("state", acc)))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    proj = lambda on: ((1 + 0.5 * r(R, H, P)) / R).to(acc) if on else None  # noqa: E731
    a = dict(state=(0.5 * r(batch, H, P, N)).to(sd), Bstate=r(batch, R, H, N).to(ks), Xstate=r(batch, H, P).to(vs),
             A=-(torch.rand(batch, H, generator=g) + 0.1).to(acc), B=r(batch, R, H, N).to(qk),
             C=r(batch, R, H, N).to(qk), D=r(H).to(acc), x=r(batch, H, P).to(v),
             dt=(0.5 * torch.rand(batch, H, generator=g)).to(acc), trap=torch.rand(batch, H, generator=g).to(acc),
             xproj=proj(True), outproj=proj(static["has_outproj"]), z=r(batch, H, P).to(z) if static["has_z"] else None,
             zproj=proj(static["has_z"]))
    a["state_out"] = None if static.get("inplace") else torch.empty_like(a["state"])
    return a


def parts_results(direction: str, static: dict, dtypes: dict, arch: str, batch: int = 2) -> tuple[dict, list]:
    """One call of ``direction``'s function in the harness: {name: (simulated, float64 reference)}, keys run."""
    from ...reference.mamba3_mimo import apply_rotary_qk_inference_ref, mamba3_step_fn_ref
    from ...torch_ops.mamba3_step_parts import apply_rotary_qk_inference_fwd, mamba3_step_fn

    if direction == "step_rotate":
        args = rotate_inputs(static, dtypes, batch)
        with recording() as keys, target(arch):
            got = apply_rotary_qk_inference_fwd(**args)
        return dict(zip(("q_out", "k_out", "angle_out"), zip(got, apply_rotary_qk_inference_ref(**args)))), keys
    args = update_inputs(static, dtypes, batch)
    R, H, P = static["mimo_rank"], static["nheads"], static["headdim_v"]
    out = args["x"].new_empty((batch, H, P) if static["has_outproj"] else (batch, R, H, P))
    ref_out, ref_state = mamba3_step_fn_ref(**{k: v for k, v in args.items() if k != "state_out"})
    with recording() as keys, target(arch):
        mamba3_step_fn(**args, out=out)
    new = args["state"] if args["state_out"] is None else args["state_out"]
    return {"out": (out, ref_out), "state": (new, ref_state)}, keys


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one ``step_rotate`` / ``step_update`` build-check configuration in the harness (module docstring)."""
    res, keys = parts_results(direction, static, dtypes, arch, batch=size("batch", 2))
    ran(keys, OP, direction, static, dtypes)
    for name, (got, want) in res.items():
        rtol, atol = tolerance(got.dtype)
        compare(f"{OP}.{direction} {arch}: {name}", got, want, rtol, atol * max(1.0, want.abs().max().item()))
