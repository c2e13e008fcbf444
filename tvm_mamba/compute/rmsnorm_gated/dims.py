"""The gated norms' typed static dims: ``NormDims`` (the math's flags, both directions) and the two
kernels' key dims, ``RMSNormGatedFwd`` / ``RMSNormGatedBwd`` (NormDims' flags of the direction plus dtypes).
Importable without TVMScript or TE, as every op's dims."""
from __future__ import annotations

import dataclasses

from .._common import OMIT_DEFAULT, Dims, check_dtype

@dataclasses.dataclass(frozen=True)
class NormDims:
    """The static parameters of one norm kernel (both directions; the direction-only flags are False in the
    other). Keys with default values are left out of a KernelKey (:meth:`static`), so the plain gated
    RMSNorm's keys (and tuning records) are the same as before the LayerNorm / residual flags existed."""

    hidden: int
    group_size: int
    eps: float = 1e-6
    has_bias: bool = False
    has_z: bool = False
    norm_before_gate: bool = True
    is_rms_norm: bool = True
    has_residual: bool = False  # fwd: s = x + residual
    store_residual: bool = False  # fwd: write residual_out = s (residual_out dtype)
    has_dresidual: bool = False  # bwd: the gradient of residual_out is added to ds
    store_dresidual: bool = False  # bwd: also write ds in x's (the saved residual_out's) dtype
    has_rowscale: bool = False  # fwd: s = x * rowscale[row] (+ residual); bwd: dx = ds * rowscale[row]
    dropout_p: float = 0.0  # > 0: x (after rowscale) is dropped with this probability, kept ones / (1 - p)
    store_dropout_mask: bool = False  # fwd: write the keep mask (uint8)
    has_x1: bool = False  # s += dropout(x1) (upstream's parallel norm input); bwd: dx1
    has_weight1: bool = False  # out1 = xhat * weight1 (+ bias1); bwd: dout1 joins dxhat, dweight1
    has_bias1: bool = False

    def __post_init__(self):
        if self.hidden < 1:
            raise ValueError(f"hidden: must be >= 1, got {self.hidden}")
        if self.group_size < 1 or self.hidden % self.group_size:
            raise ValueError(f"group_size: must divide hidden={self.hidden}, got {self.group_size}")

    @property
    def ngroups(self) -> int:
        return self.hidden // self.group_size

    @property
    def gate_in(self) -> bool:
        return self.has_z and not self.norm_before_gate

    @property
    def gate_out(self) -> bool:
        return self.has_z and self.norm_before_gate

    def static(self) -> dict:
        """The KernelKey static dims: hidden, group_size, eps, has_bias, has_z, norm_before_gate always, the
        newer flags only where they differ from their defaults."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("hidden", "group_size", "eps", "has_bias", "has_z", "norm_before_gate") or v != f.default:
                out[f.name] = v
        return out


def _flag(default=False):
    """A field the key leaves out at its default (added after the first tuning records; NormDims.static)."""
    return dataclasses.field(default=default, metadata=OMIT_DEFAULT)


@dataclasses.dataclass(frozen=True)
class _Norm(Dims):
    """What both directions' dims share: the first fields (the builders' positional order; each subclass
    adds its own flags and dtypes), validation, and the direction-independent NormDims the math uses."""

    hidden: int
    group_size: int
    eps: float = 1e-6
    has_bias: bool = False
    has_z: bool = False
    norm_before_gate: bool = True
    is_rms_norm: bool = _flag(True)

    def __post_init__(self):
        self.norm()  # hidden / group_size checks
        for f in dataclasses.fields(self):
            if f.name.endswith("_dtype") and getattr(self, f.name) is not None:
                check_dtype(f.name[:-len("_dtype")], getattr(self, f.name))

    def norm(self) -> NormDims:
        return NormDims(**{f.name: getattr(self, f.name) for f in dataclasses.fields(NormDims) if hasattr(self, f.name)})


@dataclasses.dataclass(frozen=True)
class RMSNormGatedFwd(_Norm):
    """The forward's static dims (NormDims' flags of the forward, in the builder's positional order) and
    dtypes; residual / residual_out dtypes are None (and out of the key) when they are x's."""

    has_residual: bool = _flag()
    store_residual: bool = _flag()
    has_rowscale: bool = _flag()
    dropout_p: float = _flag(0.0)
    store_dropout_mask: bool = _flag()
    has_x1: bool = _flag()
    has_weight1: bool = _flag()
    has_bias1: bool = _flag()
    x_dtype: str = "float32"
    weight_dtype: str = "float32"
    residual_dtype: str | None = _flag(None)
    residual_out_dtype: str | None = _flag(None)


@dataclasses.dataclass(frozen=True)
class RMSNormGatedBwd(_Norm):
    """The backward's static dims and dtypes; dout_dtype is None (and out of the key) when it is x's."""

    has_dresidual: bool = _flag()
    store_dresidual: bool = _flag()
    has_rowscale: bool = _flag()
    dropout_p: float = _flag(0.0)
    has_x1: bool = _flag()
    has_weight1: bool = _flag()
    has_bias1: bool = _flag()
    x_dtype: str = "float32"
    weight_dtype: str = "float32"
    dout_dtype: str | None = _flag(None)


DIMS = {"fwd": RMSNormGatedFwd, "bwd": RMSNormGatedBwd}
