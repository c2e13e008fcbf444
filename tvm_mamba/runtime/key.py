"""The one typed kernel key, and shape buckets.

A :class:`KernelKey` names one compiled kernel: which op and direction, its dtypes, its static (model)
dims and flags, the target, and a shape bucket. Batch and sequence length are symbolic in the TIR, so the
bucket only selects a schedule (tuned per bucket); every length inside a bucket runs the same binary.
Cache paths and tuning lookups derive from the key; nothing is keyed by ad-hoc strings.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping

Static = tuple[tuple[str, Any], ...]


def _freeze(mapping: Mapping[str, Any] | Static) -> Static:
    items = mapping.items() if isinstance(mapping, Mapping) else mapping
    out = []
    for name, value in sorted(items):
        if isinstance(value, list):
            value = tuple(value)
        if not isinstance(value, (bool, int, float, str, tuple, type(None))):
            raise TypeError(f"KernelKey: static value {name}={value!r} is not a plain value")
        out.append((str(name), value))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """op: ``causal_conv1d``; direction: ``fwd`` / ``bwd`` / ``update``; dtypes: tensor name -> dtype;
    static_dims: model dims and flags (dim, width, activation, ...); target: a target key
    (``llvm-rocketlake``, ``cuda-sm_90``); shape_bucket: bucketed dynamic dims (seqlen, batch)."""

    op: str
    direction: str
    dtypes: Static
    static_dims: Static
    target: str
    shape_bucket: Static = ()

    @staticmethod
    def make(op: str, direction: str, dtypes: Mapping[str, str], static_dims: Mapping[str, Any],
             target: str, shape_bucket: Mapping[str, int] | None = None) -> "KernelKey":
        return KernelKey(op, direction, _freeze(dtypes), _freeze(static_dims), target,
                         _freeze(shape_bucket or {}))

    @staticmethod
    def of(op: str, direction: str, dims, target: str,
           shape_bucket: Mapping[str, int] | None = None) -> "KernelKey":
        """The key of a typed ``dims`` (a ``compute._common.Dims``: static dims and dtypes in one object)."""
        static, dtypes = dims.key_parts()
        return KernelKey.make(op, direction, dtypes, static, target, shape_bucket)

    @property
    def static(self) -> dict[str, Any]:
        return dict(self.static_dims)

    @property
    def dtype(self) -> dict[str, str]:
        return dict(self.dtypes)

    def workload(self) -> "KernelKey":
        """The same key without its shape bucket: what the compiled binary depends on."""
        found = self.__dict__.get("_workload")
        if found is None:  # memoized on the instance (not a field: eq/hash/repr ignore it)
            found = self if not self.shape_bucket else dataclasses.replace(self, shape_bucket=())
            object.__setattr__(self, "_workload", found)
        return found

    def to_json(self) -> dict:
        return {"op": self.op, "direction": self.direction, "dtypes": dict(self.dtypes),
                "static_dims": dict(self.static_dims), "target": self.target,
                "shape_bucket": dict(self.shape_bucket)}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "KernelKey":
        return KernelKey.make(obj["op"], obj["direction"], obj["dtypes"], obj["static_dims"],
                              obj["target"], obj.get("shape_bucket") or {})

    def digest(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def slug(self) -> str:
        """Readable file-name stem: ``causal_conv1d-fwd-<digest>``."""
        return f"{self.op}-{self.direction}-{self.digest()}"

    def __str__(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in self.static_dims)
        dts = ",".join(f"{k}:{v}" for k, v in self.dtypes)
        bucket = ",".join(f"{k}<={v}" for k, v in self.shape_bucket)
        return f"{self.op}.{self.direction}[{dts}][{dims}]@{self.target}" + (f"{{{bucket}}}" if bucket else "")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one kernel key is served: the decisions and where they came from (made by ``dispatch.plan``,
    the tuning lookup and the kernel pack; ``dispatch.Plan`` is the same class)."""

    key: KernelKey
    decisions: tuple  # sorted (name, value) pairs
    source: str  # "default" or "tuned: <file> (<seconds> s)"

    def digest(self) -> str:
        return repr(self.decisions)


def bucket_distance(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    """How far apart two shape buckets are: the sum over their dims of |log2 a - log2 b| (a missing dim
    counts as 1). The nearest tuned bucket, or packed kernel, serves a bucket with none of its own."""
    names = set(a) | set(b)
    return sum(abs(math.log2(max(a.get(n, 1), 1)) - math.log2(max(b.get(n, 1), 1))) for n in names)


def pow2_bucket(n: int, lo: int = 1, hi: int = 1 << 20) -> int:
    """Smallest power of two >= n, clamped to [lo, hi]: the bucket a dynamic length falls in."""
    n = max(int(n), lo)
    b = 1
    while b < n:
        b <<= 1
    return min(max(b, lo), hi)


def shape_bucket(**dims: int) -> dict[str, int]:
    """Power-of-two buckets for the dynamic dims of a call (``seqlen=1000`` -> ``{"seqlen": 1024}``)."""
    return {name: pow2_bucket(value) for name, value in dims.items()}
