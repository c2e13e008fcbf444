"""Typed static dims of the causal conv1d kernels: one frozen dataclass per direction, made by the torch op
(torch_ops/causal_conv1d.py), turned into the KernelKey (``KernelKey.of``), rebuilt from the key
(``from_key``) and handed to the compute builder or the target's rule. Importable without TVM's compiler (no
TVMScript): the torch op builds keys with it on a runtime-only machine serving an AOT pack.

Field order is the builders' positional order, and every field is in the key (none was added after the
committed tuning records) but the decode step's ``x_2d`` (left out of the key at its default), so
``key_parts()`` gives the maps the keys have always had.
"""
from __future__ import annotations

import dataclasses

from .._common import FLOAT_DTYPES, OMIT_DEFAULT, Dims, check_dtype

ACTIVATIONS = ("none", "silu")
WIDTHS = range(2, 9)


def _check(dim: int, width: int, activation: str) -> None:
    if width not in WIDTHS:
        raise ValueError(f"width: must be in 2..8, got {width}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: must be one of {ACTIVATIONS}, got {activation!r}")
    if dim < 1:
        raise ValueError(f"dim: must be >= 1, got {dim}")


@dataclasses.dataclass(frozen=True)
class _Conv(Dims):
    """What the forward and the backward share: x: (batch, dim, seqlen), weight: (dim, width); has_bias /
    has_seq_idx / has_init: the optional inputs are present. (Each subclass ends with its flag, then the
    x / weight dtypes: the builders' positional order.)"""

    dim: int
    width: int
    activation: str = "none"
    has_bias: bool = False
    has_seq_idx: bool = False
    has_init: bool = False

    def __post_init__(self):
        _check(self.dim, self.width, self.activation)
        check_dtype("x", self.x_dtype)
        check_dtype("weight", self.weight_dtype)


@dataclasses.dataclass(frozen=True)
class CausalConv1dFwd(_Conv):
    """return_final: write final_states (batch, dim, width-1)."""

    return_final: bool = False
    x_dtype: str = "float32"
    weight_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class CausalConv1dBwd(_Conv):
    """has_dfinal: a gradient of final_states (batch, dim, width-1) flows in."""

    has_dfinal: bool = False
    x_dtype: str = "float32"
    weight_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class CausalConv1dUpdate(Dims):
    """Decode step: conv_state (pool, dim, state_len), state_len >= width-1; has_indices: a
    conv_state_indices (batch,) maps rows to pool slots; has_cache_seqlens: a circular state buffer;
    x_2d: x and out are (batch, dim), one token without its seqlen axis (the form a server's decode step
    passes: the kernel takes it as it comes, where a (batch, dim, 1) view would cost each call a tensor);
    in_place (with x_2d): the result is written over x (vLLM's convention), each row's token read before it
    is overwritten; the out argument is then a (1, 1) placeholder."""

    dim: int
    width: int
    state_len: int
    activation: str = "none"
    has_bias: bool = False
    has_indices: bool = False
    has_cache_seqlens: bool = False
    x_dtype: str = "float32"
    weight_dtype: str = "float32"
    state_dtype: str = "float32"
    x_2d: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    in_place: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)

    def __post_init__(self):
        _check(self.dim, self.width, self.activation)
        if self.in_place and not self.x_2d:
            raise ValueError("in_place: the result is written over x only for one token a row (x_2d)")
        if self.state_len < self.width - 1:
            raise ValueError(f"conv_state: state length must be >= width-1 = {self.width - 1}, got {self.state_len}")
        for name, dt in (("x", self.x_dtype), ("weight", self.weight_dtype), ("conv_state", self.state_dtype)):
            check_dtype(name, dt)


@dataclasses.dataclass(frozen=True)
class CausalConv1dVarlenStates(Dims):
    """x: (total_tokens, dim) packed sequences -> the last state_len tokens of each."""

    dim: int
    state_len: int
    x_dtype: str = "float32"

    def __post_init__(self):
        if self.dim < 1 or self.state_len < 1:
            raise ValueError(f"dim, state_len: must be >= 1, got {self.dim}, {self.state_len}")
        check_dtype("x", self.x_dtype, FLOAT_DTYPES)


DIMS = {"fwd": CausalConv1dFwd, "bwd": CausalConv1dBwd, "update": CausalConv1dUpdate,
        "varlen_states": CausalConv1dVarlenStates}
