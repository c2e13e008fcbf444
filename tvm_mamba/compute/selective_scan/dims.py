"""Typed static dims and static-dim choices of the selective-scan kernels, importable without TVM's
compiler (no TVMScript): the torch ops build kernel keys from them, also on a runtime-only machine serving an
AOT pack. compute/selective_scan re-exports them for the builders and the rules.

``key_parts()`` gives exactly the KernelKey maps the keyword builders produced before (field names, the
``<tensor>_dtype`` split, optional fields left out at their defaults), so kernel caches and committed tuning
records keep matching.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import math

from .._common import OMIT_DEFAULT, Dims, check_dtype


# the private (per-invocation) float32 values a WebGPU lane of the scan's backward may hold, its chunk of states
# and its ~7 dstate-sized arrays: Mesa's llvmpipe computed wrong gradients past it (dstate 64 at chunk 17; at
# dstate 256 with any chunk), and a GPU would spill
WEBGPU_PRIVATE_FLOATS = 1024


def chunk_size(dstate: int, private_floats: int | None = None) -> int:
    """Default checkpoint interval (the torch op's choice; a static dim of the kernels): state memory for
    the backward's chunk recompute stays <= 4096 fp32 values per lane; with ``private_floats`` (WebGPU's
    budget) the chunk and the lane's other arrays fit it (dstate 64: 9, 128 and up: 1)."""
    if private_floats is not None:
        return max(1, min(48, private_floats // dstate - 7))
    return max(8, min(48, 4096 // dstate))


# channels a WebGPU backward lane runs (``block_size``'s ``want``): at 16, with z, at dstate 256, llvmpipe computed
# wrong gradients for the last two channels of every block
WEBGPU_BLOCK = 8


def block_size(dim: int, b_groups: int, c_groups: int, want: int = 16) -> int:
    """Channels per backward lane: the largest divisor <= want of every group's channel count (WebGPU:
    ``want`` = WEBGPU_BLOCK)."""
    g = dim
    for groups in (b_groups, c_groups):
        if groups:
            g = math.gcd(g, dim // groups)
    return max(k for k in range(1, min(want, g) + 1) if g % k == 0)


IO_DTYPES = ("float32", "float16", "bfloat16", "float64")
INDEX_DTYPES = ("int32", "int64")


def acc_dtype(u_dtype: str) -> str:
    """Accumulation dtype: float64 for float64 inputs (gradcheck), else float32."""
    return "float64" if u_dtype == "float64" else "float32"


@dataclasses.dataclass(frozen=True)
class ScanDims(Dims):
    """The scan's static dims (forward kernels: fwd, fwd_chunked, fwd_complex).

    dim: channels; dstate: states per channel; b_groups / c_groups: 0 = time-invariant B / C (dim, dstate),
    g > 0 = time-varying (batch, g, seqlen, dstate) shared by dim / g channels; has_*: optional inputs
    present; chunk: checkpoint interval (the backward recomputes one chunk of states at a time).
    """

    dim: int
    dstate: int
    b_groups: int = 0
    c_groups: int = 0
    has_D: bool = False
    has_z: bool = False
    has_delta_bias: bool = False
    delta_softplus: bool = False
    has_init: bool = False
    chunk: int = 64
    u_dtype: str = "float32"
    B_dtype: str = "float32"
    C_dtype: str = "float32"

    def __post_init__(self):
        if self.dim < 1 or self.dstate < 1:
            raise ValueError(f"dim/dstate: must be >= 1, got dim={self.dim}, dstate={self.dstate}")
        for name, g in (("B", self.b_groups), ("C", self.c_groups)):
            if g < 0 or (g and self.dim % g):
                raise ValueError(f"{name}: groups must divide dim={self.dim}, got {g}")
        if self.chunk < 1:
            raise ValueError(f"chunk: must be >= 1, got {self.chunk}")
        for name, dt in (("u", self.u_dtype), ("B", self.B_dtype), ("C", self.C_dtype)):
            check_dtype(name, dt, IO_DTYPES)

    @property
    def acc(self) -> str:
        return acc_dtype(self.u_dtype)

    @property
    def varying_B(self) -> bool:
        return self.b_groups > 0

    @property
    def varying_C(self) -> bool:
        return self.c_groups > 0

    @property
    def b_per_group(self) -> int:
        """Channels per B group (1 for a time-invariant B)."""
        return self.dim // self.b_groups if self.b_groups else 1

    @property
    def c_per_group(self) -> int:
        return self.dim // self.c_groups if self.c_groups else 1


@dataclasses.dataclass(frozen=True)
class ScanBwdDims(ScanDims):
    """The backward's dims: the forward's plus ``block``, the channels one lane runs in turn (the varying-B/C
    workspaces hold one partial per block: (batch, dim // block, seqlen, dstate))."""

    block: int = 1

    def __post_init__(self):
        super().__post_init__()
        b = self.block
        if b < 1 or (self.dim // max(self.b_groups, 1)) % b or (self.dim // max(self.c_groups, 1)) % b:
            raise ValueError(f"block: must divide the channels of every group, got {b}")

    @property
    def nblocks(self) -> int:
        return self.dim // self.block

    def blocks_per_group(self, groups: int) -> int:
        """Channel blocks per B / C group (1 when time-invariant)."""
        return self.dim // groups // self.block if groups else 1


@dataclasses.dataclass(frozen=True)
class UpdateDims(Dims):
    """The decode step's dims (Mamba-2 head layout; Mamba-1 is nheads = dim, headdim = 1).

    Optional dtypes default to None (state: the accumulation dtype; dt, z: x's; idx: no slot indices) and
    ``tie_hdim`` (one A / dt / D / dt_bias per head) and ``mamba1_layout`` to False; at those defaults they
    are not in the kernel key, so records of the fp32-state decode step keep matching. ``mamba1_layout``: the
    kernel takes Mamba-1's own tensors (x, dt, z, out (batch, dim); state (nstate, dim, dstate); A (dim,
    dstate); D, dt_bias (dim,); B, C (batch, dstate)) with nheads = dim, headdim = 1, where the head layout
    would cost each call five views of new activations.
    """

    nheads: int
    headdim: int
    dstate: int
    ngroups: int = 1
    has_D: bool = False
    has_z: bool = False
    has_dt_bias: bool = False
    dt_softplus: bool = False
    x_dtype: str = "float32"
    B_dtype: str = "float32"
    C_dtype: str = "float32"
    state_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    dt_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    z_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    idx_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    tie_hdim: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    mamba1_layout: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)

    def __post_init__(self):
        if min(self.nheads, self.headdim, self.dstate, self.ngroups) < 1 or self.nheads % self.ngroups:
            raise ValueError(f"ngroups: must divide nheads={self.nheads}, got {self.ngroups}")
        if self.mamba1_layout and (self.headdim, self.ngroups, self.tie_hdim) != (1, 1, False):
            raise ValueError(f"mamba1_layout: needs headdim 1, one group and untied parameters, got headdim "
                             f"{self.headdim}, ngroups {self.ngroups}, tie_hdim {self.tie_hdim}")
        for name in ("x", "B", "C", "state", "dt", "z"):
            dt = getattr(self, f"{name}_dtype")
            if dt is not None:
                check_dtype(name, dt, IO_DTYPES)
        if self.idx_dtype is not None:
            check_dtype("state_batch_indices", self.idx_dtype, INDEX_DTYPES)
        if (self.acc == "float64") != ((self.state_dtype or self.acc) == "float64"):
            raise ValueError(f"state: a float64 kernel keeps a float64 state (x {self.x_dtype}, "
                             f"state {self.state_dtype})")

    @property
    def acc(self) -> str:
        return acc_dtype(self.x_dtype)


def bwd_workspace(dims, batch, seqlen, pair: tuple = ()) -> tuple[list[tuple[tuple, object]], object]:
    """The backward's one workspace: ([(shape, element offset) of wsA, wsB, wsC, wsS], its size), in the
    accumulation dtype. wsA: dA partials (batch, dim, dstate); wsB / wsC: dB / dC partials, per channel
    block and step when varying (batch, dim // block, seqlen, dstate), else per channel (batch, dim, dstate);
    wsS: dD and d delta_bias partials (batch, dim, 2); ``pair`` appended to every region but wsS. ``dims``:
    a ``ScanBwdDims``; plain ints give the torch op's size, ``T.int32`` vars the kernel's shapes."""
    N, P = dims.dstate, tuple(pair)

    def bc(varying):
        return (batch, dims.nblocks, seqlen, N, *P) if varying else (batch, dims.dim, N, *P)

    regions, size = [], 0
    for shape in ((batch, dims.dim, N, *P), bc(dims.varying_B), bc(dims.varying_C), (batch, dims.dim, 2)):
        regions.append((shape, size))
        size = size + functools.reduce(operator.mul, shape)
    return regions, size
