"""sim-check of Mamba-3: ``siso_step`` through ``mamba3_siso_step`` on the CUDA execution harness against the
float64 reference (tvm_mamba/reference/mamba3.py), two decode steps chained through the returned states."""
from __future__ import annotations

import math

import torch

from . import CheckFailed, compare, ran, recording, tolerance

OP = "mamba3"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def step_inputs(static: dict, dtypes: dict, batch: int, seed: int = 0) -> tuple[dict, list]:
    """(mamba3_siso_step keyword arguments without Input_States, [angle, ssm, k, v] states) of a
    configuration: Q / K in ``qk``, V in ``v``, Z / K state / V state in their key dtypes (defaults: v's,
    the accumulation dtype, v's), the rest in the accumulation dtype; Trap as logits, ADT = A DT < 0."""
    g = torch.Generator().manual_seed(seed)
    H, HQ, N, P, S = (static[k] for k in ("nheads", "nheads_qk", "headdim_qk", "headdim_v", "headdim_angles"))
    qk, v = _DTYPES[dtypes["qk"]], _DTYPES[dtypes["v"]]
    acc = torch.float64 if v == torch.float64 else torch.float32
    z, ks, vs = (_DTYPES[dtypes[k]] if k in dtypes else d for k, d in (("z", v), ("kstate", acc), ("vstate", v)))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dt = torch.nn.functional.softplus(r(batch, H)) * 0.5
    args = dict(Q=r(batch, HQ, N).to(qk), K=r(batch, HQ, N).to(qk), V=r(batch, H, P).to(v),
                ADT=(-(torch.rand(H, generator=g) + 0.1) * dt).to(acc), DT=dt.to(acc), Trap=r(batch, H).to(acc),
                Q_bias=(0.3 * r(H, N)).to(acc), K_bias=(0.3 * r(H, N)).to(acc), Angles=(2 * r(batch, H, S)).to(acc),
                D=r(H).to(acc) if static["has_D"] else None, Z=r(batch, H, P).to(z) if static["has_z"] else None)
    states = [(torch.rand(batch, H, S, generator=g) * 2 * math.pi).to(acc), (0.5 * r(batch, H, P, N)).to(acc),
              r(batch, H, N).to(ks), r(batch, H, P).to(vs)]
    return args, states


def step_results(static: dict, dtypes: dict, arch: str, batch: int = 2, steps: int = 2, **sim) -> tuple[dict, list]:
    """``steps`` decode steps, each fed the previous step's returned states (cast to the configuration's
    state dtypes, as Mamba3's inference cache copies them): {name: (simulated, float64 reference of that step
    on the same inputs)} and the keys run."""
    import tvm_mamba
    from ..reference.mamba3 import mamba3_siso_step_ref

    args, states = step_inputs(static, dtypes, batch)
    res = {}
    with recording() as keys:
        for i in range(steps):
            with tvm_mamba.simulate_cuda(arch, **sim):
                out, new = tvm_mamba.mamba3_siso_step(**args, Input_States=states)
            ref, ref_new = mamba3_siso_step_ref(**args, Input_States=states)
            res[f"out[{i}]"] = (out, ref)
            for name, got, want in zip(("angle_state", "ssm_state", "k_state"), new, ref_new):
                res[f"{name}[{i}]"] = (got, want)
            states = [s.to(old.dtype) for s, old in zip(new, states[:3])] + [new[3].to(states[3].dtype)]
    return res, keys


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of Mamba-3 in the harness (module docstring)."""
    if direction != "siso_step":
        raise CheckFailed(f"{OP}: unknown direction {direction!r} (CUDA runs siso_step)")
    res, keys = step_results(static, dtypes, arch)
    ran(keys, OP, direction, static, dtypes)
    for name, (got, want) in res.items():
        rtol, atol = tolerance(got.dtype)
        compare(f"{OP}.{direction} {arch}: {name}", got, want, rtol, atol * max(1.0, want.abs().max().item()))
