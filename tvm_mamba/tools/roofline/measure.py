"""One roofline row per kernel key: counts at small lengths, an exact affine fit, the value at the preset's shape.

Simulating a kernel at a preset's full shape (batch 4 x seqlen 2048) takes minutes on the CPU, but at fixed
model dims every count is affine in the launch's work: ``c0 + c1*batch + c2*batch*seqlen`` for a kernel with
batch and seqlen (per-batch terms: final states, per-sequence setup), ``c0 + c1*batch`` for a decode step,
``c0 + c1*rows`` for a token-row kernel. The counts are taken at three small points (seqlen a multiple of the
kernel's chunk, so no partial tile changes the pattern), the coefficients solved exactly (fractions), and a
fourth point at a new length must agree exactly, else :class:`NonAffineError`. The fit is then evaluated at the preset's
(batch, seqlen).
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import tvm
import tvm_ffi

from .. import tune
from ...runtime import KernelKey, dispatch
from . import count, hardware, minimum


class NonAffineError(ValueError):
    """Counts at the check point differ from the affine fit through the others."""


def features(names: list[str], batch: int, seqlen: int) -> tuple[int, ...]:
    if "seqlen" in names:
        return (1, batch, batch * seqlen)
    if names == ["batch"]:
        return (1, batch)
    return (1, batch * seqlen)  # rows / M: token rows


def fit_affine(points: list[tuple[tuple[int, ...], int]], check: tuple[tuple[int, ...], int]) -> tuple:
    """Exact coefficients c with c . features == value at every point (as many points as features), then
    NonAffineError unless c . check_features == check_value."""
    n = len(points[0][0])
    if len(points) != n:
        raise ValueError(f"fit_affine: {len(points)} points for {n} coefficients")
    rows = [[Fraction(v) for v in f] + [Fraction(y)] for f, y in points]
    for col in range(n):  # Gauss-Jordan elimination
        piv = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if piv is None:
            raise ValueError("fit_affine: the points do not determine the coefficients")
        rows[col], rows[piv] = rows[piv], rows[col]
        rows[col] = [v / rows[col][col] for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                rows[r] = [a - rows[r][col] * b for a, b in zip(rows[r], rows[col])]
    coef = tuple(row[n] for row in rows)
    got = sum(c * f for c, f in zip(coef, check[0]))
    if got != check[1]:
        raise NonAffineError(f"not affine: the fit predicts {float(got):.6g} at {check[0]}, counted {check[1]}")
    return coef


def evaluate(coef, feats) -> int:
    return round(sum(c * f for c, f in zip(coef, feats)))


def _dims(key: KernelKey) -> list[str]:
    names = tune.symbolic_dims(key)
    return [n for n in names if n not in tune._derived(key, {n: 1 for n in names})]


# seqlen steps a kernel's launch works in, beyond its chunk and 128 (the selective scan's CUDA forward:
# time blocks of 32 threads x up to 16 steps)
TIME_BLOCKS = {("selective_scan", "fwd"): 512}


def _unit(key: KernelKey) -> int:
    """The seqlen step of the fit points: a multiple of the kernel's chunk, of 128 (whole tiles) and of its
    time block (``TIME_BLOCKS``)."""
    static = dict(key.static)
    unit = int(static.get("chunk_size") or static.get("chunk") or 1)
    for step in (128, TIME_BLOCKS.get((key.op, key.direction), 1)):
        unit = unit * step // math.gcd(unit, step)
    return unit


def fit_points(names: list[str], unit: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(the points that determine the fit, the check point) as (batch, seqlen)."""
    if "seqlen" in names:
        return [(1, unit), (1, 2 * unit), (2, unit)], (2, 3 * unit)  # a new length: catches seqlen^2 terms
    if names == ["batch"]:
        return [(1, 1), (2, 1)], (3, 1)
    return [(1, unit), (1, 2 * unit)], (1, 3 * unit)


def _bucket(key: KernelKey, names, batch: int, seqlen: int) -> dict:
    return tune.bucket_for(names, batch, seqlen)


@dataclasses.dataclass
class KernelCounts:
    """One device kernel's counts at the preset's shape (fitted), with its launch shape and per global buffer
    {name: (load bytes, store bytes)}."""

    name: str
    counts: count.Counts
    blocks: int | None  # None: the block count is not affine in the work (ceil of a tile division)
    threads: int
    per_buffer: dict


def _fit_at(series, feats) -> int:
    """The fitted value at ``feats`` of [(features, value)...]: all but the last determine, the last checks."""
    return evaluate(fit_affine(series[:-1], series[-1]), feats)


def _fit_kernel(kname: str, results, names, at) -> KernelCounts:
    launches = [((b, L), r[kname]) for (b, L), r in results]
    feats = [features(names, b, L) for (b, L), _ in launches]
    vals = [_fit_at(list(zip(feats, [l.counts.as_tuple()[k] for _, l in launches])), at)
            for k in range(len(count.KINDS))]
    try:
        blocks = _fit_at(list(zip(feats, [l.blocks for _, l in launches])), at)
    except NonAffineError:
        blocks = None
    bufs = sorted({n for _, l in launches for n in l.per_buffer})
    per_buffer = {n: tuple(_fit_at(list(zip(feats, [l.per_buffer.get(n, (0, 0))[k] for _, l in launches])), at)
                           for k in (0, 1)) for n in bufs}
    return KernelCounts(kname, count.Counts(*vals), blocks, max(l.threads for _, l in launches), per_buffer)


PART_DIMS = ("gparts", "nparts")


def part_dims(serve: KernelKey) -> dict[str, int]:
    """The partial-sum counts (``gparts``: ssd_chunk_scan_bwd's dB / dC parts, compute.ssd.head_parts) the op
    derives for the preset's shape ``serve``. They grow as batch x nchunks shrinks (to keep the GPU busy), so
    the small fit points would count a different partition; they run with the preset's instead."""
    bucket = dict(serve.shape_bucket)
    return {k: v for k, v in tune._derived(serve, bucket).items() if k in PART_DIMS}


def counted(key: KernelKey, batch: int, seqlen: int) -> tuple[list[KernelCounts], bool]:
    """([per device kernel counts at (batch, seqlen)], tensor cores used) for the cudasim ``key``."""
    names = _dims(key)
    serve = KernelKey.make(key.op, key.direction, key.dtype, key.static, key.target,
                           _bucket(key, names, batch, seqlen))  # the kernel that serves the preset's shape
    built = count.build(dispatch.schedule(serve), dispatch.target_from_key(key.target), str(serve))
    pts, check = fit_points(names, _unit(key))
    fixed = part_dims(serve)
    results = []
    for b, L in pts + [check]:
        at = KernelKey.make(key.op, key.direction, key.dtype, key.static, key.target, _bucket(key, names, b, L))
        args = tune.make_args(at, tvm.cpu(0), fixed=fixed)
        results.append(((b, L), count.run(built, f"{key.op}_{key.direction}", args)))
    at = features(names, batch, seqlen)
    return [_fit_kernel(k, results, names, at) for k in built.names], built.tensor_cores


def footprint(kernels: list[KernelCounts], sizes: dict[str, int]) -> int:
    """Bytes with a perfect cache: each buffer's loads and stores capped at its size (a buffer read twice by
    one kernel costs its size once); a buffer whose size is unknown (a device-side name that is no
    parameter's) at its requested bytes. Summed over the key's kernels."""
    total = 0
    for k in kernels:
        for name, (ld, st) in k.per_buffer.items():
            size = sizes.get(name)
            total += (min(ld, size) + min(st, size)) if size is not None else ld + st
    return total


def param_bytes(key: KernelKey, batch: int, seqlen: int, reduced: bool = True) -> dict[str, int]:
    """{parameter: bytes} at (batch, seqlen); ``reduced``: partial-count dims at their minimum
    (minimum.reduced_dims, minimum.PART_AXES)."""
    func = dispatch.build_func(key)
    names = _dims(key)
    bucket = _bucket(key, names, batch, seqlen)
    bucket.update(tune._derived(key, bucket))
    if reduced:
        bucket.update({k: v for k, v in minimum.reduced_dims(dict(key.static)).items() if k in bucket})
    analyzer = tune.bucket_analyzer(func, bucket)
    parts = minimum.PART_AXES.get((key.op, key.direction), {}) if reduced else {}
    broadcast = minimum.broadcast_axes(key.op, key.direction, dict(key.static))
    out = {}
    for p in func.params:
        shape = list(tune._shape(p, bucket, analyzer))
        if p.name in parts:
            shape[parts[p.name]] = 1
        for axis in broadcast.get(p.name, ()):
            shape[axis] = 1
        out[p.name] = math.prod(shape) * tvm_ffi.dtype(str(p.dtype)).bits // 8
    return out


def ptxas(key: KernelKey, arch: str) -> dict[str, dict]:
    """{kernel name: ptxas stats} of the build-check source of ``key`` on its CUDA target."""
    from ...runtime.cache import compile_module
    from ...runtime.nvcc import ptxas_stats

    cuda = dataclasses.replace(key, target="cuda-" + arch)
    src = compile_module(cuda, dispatch.schedule(cuda)).mod.imports[0].inspect_source("cuda")
    stats = ptxas_stats(src, arch)
    if not stats["ok"]:
        raise RuntimeError(f"nvcc: {stats['error'][:300]}")
    return {k["name"]: k for k in stats["kernels"]}


def occupancy_of(stats: dict | None, threads: int) -> float | None:
    if not stats:
        return None
    return hardware.occupancy(stats["registers"], stats["smem"], threads)
