"""The linear kernels' typed static dims (both directions share ``LinearDims``).
Importable without TVMScript or TE, as every op's dims."""
from __future__ import annotations

import dataclasses

from .._common import Dims, check_dtype

WEIGHT_DTYPES = ("float32", "bfloat16", "int8")
X_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LinearDims(Dims):
    """Static dims of one linear layer: in_features (K), out_features (N), a bias flag, x's and the weight's
    dtypes (the scale exists iff the weight is int8)."""

    in_features: int
    out_features: int
    has_bias: bool = False
    x_dtype: str = "float32"
    weight_dtype: str = "float32"

    def __post_init__(self):
        for name in ("in_features", "out_features"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive int, got {v!r}")
        if not isinstance(self.has_bias, bool):
            raise ValueError(f"has_bias: must be a bool, got {self.has_bias!r}")
        check_dtype("x_dtype", self.x_dtype, X_DTYPES)
        check_dtype("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)

    @property
    def has_scale(self) -> bool:
        return self.weight_dtype == "int8"


DIMS = LinearDims
