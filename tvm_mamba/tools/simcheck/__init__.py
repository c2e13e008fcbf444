"""``python -m tvm_mamba sim-check``: every kernel configuration ``build-check`` builds, run on the CPU through
the CUDA execution harness (runtime/cudasim.py) against the float64 reference, through the public function
that serves it.

One module per op, ``tvm_mamba.tools.simcheck.<op>`` (found through ``ops.py``'s table: ``run_config``), with::

    def check(direction: str, static: dict, dtypes: dict, arch: str) -> None

which builds small inputs whose model dims are ``static``'s, calls the op's public function (forward and,
for a backward direction, the gradients) inside ``tvm_mamba.simulate_cuda(arch)``, compares every output with
the float64 reference (:func:`compare`), and checks with :func:`ran` that the configuration's own kernel
served the call. It raises :class:`CheckFailed` (or any error the kernel raised) on a failure.

``sim-check --full`` (:func:`full_shapes`) runs the same checks with the sequence (or row) axis that a kernel
tiles at :data:`FULL_TILES` whole production tiles plus a ragged tail (:func:`extent`): SSD and Mamba-3 chunk
256 at seqlen 515, conv's 1024-step tile at 2051, the scan's chunk, the norms' row parts.

The same cases run natively on a device (scripts/gpu_check.py: the compiled CUDA or CPU kernels, no harness)
inside :func:`on_device`: the modules create their inputs with :func:`generator` (on the device), run their
kernel calls in :func:`target` (the harness, or on the device capturing every launch for replay timing), take
batch / seqlen from :func:`size`, and :func:`compare` logs each comparison's error.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch


class CheckFailed(AssertionError):
    """A simulated kernel's result is off its reference, or the configuration's kernel did not run."""


@contextlib.contextmanager
def recording():
    """``with recording() as keys:`` the KernelKeys of every kernel run inside."""
    from ...runtime.dispatch import record_keys

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
    arch: str = ""  # the last arch :func:`target` ran the harness's calls under ("webgpu": on WebGPU)
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


WEBGPU = "webgpu"  # the ``arch`` that runs the checks on WebGPU (wgpu) instead of the CUDA harness


def on_webgpu(dtypes: dict) -> bool:
    """Whether a configuration of these dtypes runs on WebGPU: float32 (WGSL has no bf16, and f16 only with
    shader-f16), with 32-bit, 64-bit (converted) and 8-bit (as words) integer indices / codes."""
    return all(v in ("float32", "int32", "int64", "int8") for v in dtypes.values())


def target(arch: str, **sim):
    """The context kernel calls run in: ``simulate_cuda(arch, **sim)`` in the harness (``arch`` "webgpu":
    ``tvm_mamba.webgpu()``, the harness's options not applying); on a device, a block that records every kernel
    launch into :func:`on_device`'s ``launches`` (replayed there to time each kernel)."""
    from ...torch_ops._dlpack import capture_launches

    @contextlib.contextmanager
    def block():
        if _where.device is None:
            import tvm_mamba

            _where.arch = arch
            with tvm_mamba.webgpu() if arch == WEBGPU else tvm_mamba.simulate_cuda(arch, **sim):
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
    simulated CUDA target (on WebGPU: the webgpu target; on a CUDA device: its CUDA target): the case really
    ran the kernel that build-check builds. On a CPU device nothing is required (the CPU dispatch keys its
    own kernels)."""
    dev = _where.device
    if dev is not None and dev.type == "cpu":
        return
    want = "cuda-" if dev is not None else WEBGPU if _where.arch == WEBGPU else "cudasim-"
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


FULL_TILES, FULL_TAIL = 2, 3  # --full: whole production tiles per sequence, then a ragged tail (not a tile multiple)
_FULL = contextvars.ContextVar("tvm_mamba_simcheck_full", default=False)


@contextlib.contextmanager
def full_shapes(on: bool = True):
    """``with full_shapes():`` the checks inside run at :func:`extent`'s full lengths (``sim-check --full``)."""
    token = _FULL.set(on)
    try:
        yield
    finally:
        _FULL.reset(token)


def full() -> bool:
    return _FULL.get()


def extent(quick: int, tile) -> int:
    """A check's length along the axis a kernel tiles by ``tile`` (time steps per chunk / block tile, or rows
    per block part; or a function giving it, asked only under --full, e.g. a :func:`production_knob` lookup):
    ``quick`` in the default sim-check; under :func:`full_shapes`, FULL_TILES whole tiles and a ragged
    FULL_TAIL, so tile-to-tile carries (chunk states, conv halos, row parts) and a partial last tile both run
    at the production tile size."""
    if not full():
        return quick
    tile = tile() if callable(tile) else tile
    if tile < 1:
        raise ValueError(f"tile: expected a positive tile size, got {tile}")
    return FULL_TILES * tile + FULL_TAIL


def production_knob(op: str, direction: str, static: dict, dtypes: dict, arch: str, name: str):
    """The value of schedule knob ``name`` (e.g. causal_conv1d's ``tile``) that the configuration's production
    plan uses: its tuning record's, else the schedule's hand default (read as the schedule picks it)."""
    from ...runtime import KernelKey, dispatch
    from ...schedules.rule import Decisions

    key = KernelKey.make(op, direction, dtypes, static, "cudasim-" + arch)
    decisions = Decisions(dict(dispatch.plan(key).decisions))
    dispatch.schedule(key, decisions)
    if name not in decisions.used:
        raise KeyError(f"{op}.{direction}: its schedule reads no knob {name!r} (read: {sorted(decisions.used)})")
    return decisions.used[name]
