"""``python -m tvm_mamba sim-check``: every kernel configuration ``build-check`` builds, run on the CPU through
the CUDA execution harness (runtime/cudasim.py) against the float64 reference, through the public function
that serves it.

One module per op, ``tvm_mamba.simcheck.<op>``, with::

    def check(direction: str, static: dict, dtypes: dict, arch: str) -> None

which builds small inputs whose model dims are ``static``'s, calls the op's public function (forward and,
for a backward direction, the gradients) inside ``tvm_mamba.simulate_cuda(arch)``, compares every output with
the float64 reference (:func:`compare`), and checks with :func:`ran` that the configuration's own kernel
served the call. It raises :class:`CheckFailed` (or any error the kernel raised) on a failure.

The same cases run natively on a device (scripts/gpu_check.py: the compiled CUDA or CPU kernels, no harness)
inside :func:`on_device`: the modules create their inputs with :func:`generator` (on the device), run their
kernel calls in :func:`target` (the harness, or on the device capturing every launch for replay timing), take
batch / seqlen from :func:`size`, and :func:`compare` logs each comparison's error.
"""
from __future__ import annotations

import contextlib
import dataclasses
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


@dataclasses.dataclass
class Where:
    """Where the cases run: ``device`` None is the CUDA harness (sim-check); else a torch device, with
    ``sizes`` ({"batch": .., "seqlen": ..}) overriding the modules' small defaults, and what the run saw:
    ``errors`` [(name, max |err|, worst |err| / tolerance)] and ``launches`` (torch_ops' Launch records).
    ``dry``: stop each case (:class:`DryStop`) when its first kernel block ends (listing the kernels a case
    hits without its reference's cost)."""

    device: object = None
    sizes: dict = dataclasses.field(default_factory=dict)
    dry: bool = False
    errors: list = dataclasses.field(default_factory=list)
    launches: list = dataclasses.field(default_factory=list)


_where = Where()


class DryStop(Exception):
    """Raised after a case's first kernel block in a ``dry`` :func:`on_device` run."""


@contextlib.contextmanager
def on_device(device, sizes: dict | None = None, dry: bool = False):
    """``with on_device("cuda", {"seqlen": 2048}) as where:`` run cases natively on ``device`` (torch's default
    device inside; None: in the harness, at ``sizes``); ``where`` collects their comparisons and launches."""
    global _where
    prev, _where = _where, Where(torch.device(device) if device is not None else None, dict(sizes or {}), dry)
    try:
        with torch.device(_where.device) if device is not None else contextlib.nullcontext():
            yield _where
    finally:
        _where = prev


def generator(seed: int = 0) -> torch.Generator:
    """A seeded generator on the device the cases run on (the CPU in the harness)."""
    return torch.Generator(device=_where.device or "cpu").manual_seed(seed)


def size(name: str, default: int) -> int:
    """The case's batch / seqlen / rows: ``on_device``'s override, else the module's harness-sized default."""
    return int(_where.sizes.get(name, default))


def target(arch: str, **sim):
    """The context kernel calls run in: ``simulate_cuda(arch, **sim)`` in the harness; on a device, a block that
    records every kernel launch into :func:`on_device`'s ``launches`` (replayed there to time each kernel)."""
    from ..torch_ops._dlpack import capture_launches

    @contextlib.contextmanager
    def block():
        if _where.device is None:
            import tvm_mamba

            with tvm_mamba.simulate_cuda(arch, **sim):
                yield
        else:
            with capture_launches() as launches:
                yield
            _where.launches.extend(launches)
        if _where.dry:
            raise DryStop

    return block()


def ran(keys, op: str, direction: str, static: dict, dtypes: dict) -> None:
    """CheckFailed unless one of ``keys`` is the configuration (op, direction, static dims, dtypes) on a
    simulated CUDA target (on a CUDA device: its CUDA target): the case really ran the kernel that build-check
    builds. On a CPU device nothing is required (the CPU dispatch keys its own kernels)."""
    dev = _where.device
    if dev is not None and dev.type == "cpu":
        return
    want = "cuda-" if dev is not None else "cudasim-"
    for k in keys:
        if (k.op, k.direction) == (op, direction) and k.static == dict(static) and k.dtype == dict(dtypes) \
                and k.target.startswith(want):
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
    bound = atol + rtol * ref.abs()
    bad = ~(err <= bound)
    if _where.device is not None:
        worst = (err / bound.clamp_min(1e-300)).nan_to_num(1e30).max().item() if err.numel() else 0.0
        _where.errors.append((name, err.nan_to_num(1e30).max().item() if err.numel() else 0.0, worst))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckFailed(f"{name}: {int(bad.sum())} of {got.numel()} elements off (first at {idx}: "
                          f"{got[idx].item():.6g} vs {ref[idx].item():.6g}); max |err| {err.nan_to_num(1e30).max().item():.3g}")


def run_config(op: str, direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration through the harness (see the module docstring)."""
    module = importlib.import_module(f"tvm_mamba.simcheck.{op}")
    module.check(direction, dict(static), dict(dtypes), arch)
