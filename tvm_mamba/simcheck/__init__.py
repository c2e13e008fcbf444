"""``python -m tvm_mamba sim-check``: every kernel configuration ``build-check`` builds, run on the CPU through
the CUDA execution harness (runtime/cudasim.py) against the float64 reference, through the public function
that serves it.

One module per op, ``tvm_mamba.simcheck.<op>``, with::

    def check(direction: str, static: dict, dtypes: dict, arch: str) -> None

which builds small inputs whose model dims are ``static``'s, calls the op's public function (forward and,
for a backward direction, the gradients) inside ``tvm_mamba.simulate_cuda(arch)``, compares every output with
the float64 reference (:func:`compare`), and checks with :func:`ran` that the configuration's own kernel
served the call. It raises :class:`CheckFailed` (or any error the kernel raised) on a failure.
"""
from __future__ import annotations

import contextlib
import importlib

import torch


class CheckFailed(AssertionError):
    """A simulated kernel's result is off its reference, or the configuration's kernel did not run."""


@contextlib.contextmanager
def recording():
    """``with recording() as keys:`` the KernelKeys of every kernel run inside."""
    from ..runtime.dispatch import record_keys

    with record_keys() as used:
        keys: list = []
        try:
            yield keys
        finally:
            keys.extend(k for k, _ in used)


def ran(keys, op: str, direction: str, static: dict, dtypes: dict) -> None:
    """CheckFailed unless one of ``keys`` is the configuration (op, direction, static dims, dtypes) on a
    simulated CUDA target: the case really ran the kernel that build-check builds."""
    for k in keys:
        if (k.op, k.direction) == (op, direction) and k.static == dict(static) and k.dtype == dict(dtypes) \
                and k.target.startswith("cudasim-"):
            return
    seen = "; ".join(str(k) for k in keys) or "none"
    raise CheckFailed(f"the call did not run {op}.{direction} with {static} {dtypes} (ran: {seen})")


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for outputs of ``dtype`` against a float64 reference computed from the same inputs."""
    name = str(dtype).replace("torch.", "")
    return {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2), "float16": (2e-3, 2e-3)}.get(name, (0.0, 0.0))


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    """CheckFailed naming ``name`` when |got - ref| > atol + rtol * |ref| anywhere (NaN fails)."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise CheckFailed(f"{name}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}")
    err = (got - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckFailed(f"{name}: {int(bad.sum())} of {got.numel()} elements off (first at {idx}: "
                          f"{got[idx].item():.6g} vs {ref[idx].item():.6g}); max |err| {err.nan_to_num(1e30).max().item():.3g}")


def run_config(op: str, direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration through the harness (see the module docstring)."""
    module = importlib.import_module(f"tvm_mamba.simcheck.{op}")
    module.check(direction, dict(static), dict(dtypes), arch)
