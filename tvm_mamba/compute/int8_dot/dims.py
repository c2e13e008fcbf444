"""The int8 kernels' typed static dims (one per kernel; pack and unpack share one).
Importable without TVMScript or TE, as every op's dims."""
from __future__ import annotations

import dataclasses

from .._common import Dims

def _check_pos(name: str, v: int) -> None:
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: must be a positive int, got {v!r}")


class _Positive(Dims):
    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_pos(f.name, getattr(self, f.name))


@dataclasses.dataclass(frozen=True)
class Int8DotMatmul(_Positive):
    """b: (N, K) int8 codes; a's rows M are symbolic."""

    N: int
    K: int


@dataclasses.dataclass(frozen=True)
class Int8DotPacking(_Positive):
    """codes: (rows, K) int8 <-> packed: (rows, ceil(K/4)) int32 (pack and unpack)."""

    K: int


@dataclasses.dataclass(frozen=True)
class Int8DotDgrad(_Positive):
    """g: (heads, M, K), codes: (heads, K, N)."""

    heads: int
    N: int
    K: int


@dataclasses.dataclass(frozen=True)
class Int8DotWgrad(_Positive):
    """codes: (code_heads, M, N), code_heads 1 (shared) or heads; g: (heads, M, K)."""

    heads: int
    code_heads: int
    N: int
    K: int

    def __post_init__(self):
        super().__post_init__()
        if self.code_heads not in (1, self.heads):
            raise ValueError(f"code_heads: must be 1 or heads={self.heads}, got {self.code_heads}")


DIMS = {"matmul": Int8DotMatmul, "pack": Int8DotPacking, "unpack": Int8DotPacking, "dgrad": Int8DotDgrad,
        "wgrad": Int8DotWgrad}
