"""What the SSD torch ops need of the kernels without TVM's compiler (they also run in runtime-only mode,
TVM_USE_RUNTIME_LIB=1, serving an AOT pack): the typed static dims, one frozen dataclass per kernel family
(``compute._common.Dims``), and the head-part count of the backward.

The dims flow from the torch op (torch_ops/ssd.py) to the KernelKey (``KernelKey.of``), and from the key
(``from_key``) to the builder, the template, the strategy and the rule, instead of the keyword lists every
signature repeated. ``key_parts()`` gives back exactly the maps the kernels have always been keyed with
(fields ``<tensor>_dtype`` -> ``dtypes[<tensor>]``), so caches and committed tuning records still match:
``state_dtype`` is left out of the key at its default float32, as before it existed.
compute/ssd/dims.py re-exports them for the builders (the ``compute.ssd`` package imports TVMScript).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .._common import OMIT_DEFAULT, Dims, check_dtype

F32 = "float32"


def check_dims(nheads, ngroups, headdim, dstate, chunk_size):
    """ValueError naming the dim that is out of range."""
    for name, v, hi in (("nheads", nheads, 1 << 16), ("ngroups", ngroups, 1 << 16), ("headdim", headdim, 256),
                        ("dstate", dstate, 256), ("chunk_size", chunk_size, 256)):
        if not (isinstance(v, int) and 1 <= v <= hi):
            raise ValueError(f"{name}: must be an int in 1..{hi}, got {v!r}")
    if nheads % ngroups:
        raise ValueError(f"ngroups: must divide nheads={nheads}, got {ngroups}")


_DTYPE_NAMES = {"x_dtype": "x", "bc_dtype": "B", "state_dtype": "states", "out_dtype": "out"}


@dataclass(frozen=True)
class SSDDims(Dims):
    """Base: checks every ``<tensor>_dtype`` field (ValueError naming the tensor)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name.endswith("_dtype"):
                check_dtype(_DTYPE_NAMES.get(f.name, f.name[:-6]), getattr(self, f.name))


@dataclass(frozen=True)
class DtDims(SSDDims):
    """ssd_chunk_cumsum / ssd_chunk_cumsum_bwd: dt' = clamp(softplus(dt + dt_bias))."""
    nheads: int
    chunk_size: int
    has_dt_bias: bool = False
    dt_softplus: bool = False
    has_dt_limit: bool = False


@dataclass(frozen=True)
class BmmDims(SSDDims):
    """ssd_bmm_chunk: C B^T per (chunk, group)."""
    ngroups: int
    dstate: int
    chunk_size: int
    bc_dtype: str = F32


@dataclass(frozen=True)
class StateDims(SSDDims):
    """ssd_chunk_state (and ssd_chunk_scan_bwd_dstates' model dims)."""
    nheads: int
    ngroups: int
    headdim: int
    dstate: int
    chunk_size: int
    has_seq_idx: bool = False
    x_dtype: str = F32
    bc_dtype: str = F32

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups


@dataclass(frozen=True)
class DstatesDims(StateDims):
    """ssd_chunk_scan_bwd_dstates."""
    has_z: bool = False


@dataclass(frozen=True)
class ScanBwdDims(StateDims):
    """ssd_chunk_scan_bwd: the skip (D) and gate (z) flags. diag_skip (Mamba-3's chunked forward, and its
    backward): the causal sum runs strictly below the diagonal (s < l) and D is a per-position skip coefficient
    in dt_out's layout (batch, nheads, nchunks, chunk_size): the diagonal term (gamma_l q_l . k_l) and D folded
    into one, y_l gets skip_l x_l. Left out of the key at its default (keys of the other kernels unchanged).
    step_group (with diag_skip; Mamba-3 MIMO, torch_ops/mamba3_mimo.py): chunk positions come in groups of
    step_group (a time step's R ranks flattened, position t R + r), and the causal sum runs over the pairs of
    strictly earlier groups, s // step_group < l // step_group (a group's own block is the caller's, as the
    diagonal is with diag_skip); 1: the plain strict sum. Left out of the key at its default."""
    has_D: bool = False
    D_has_hdim: bool = False
    has_z: bool = False
    diag_skip: bool = field(default=False, metadata=OMIT_DEFAULT)
    step_group: int = field(default=1, metadata=OMIT_DEFAULT)

    def __post_init__(self):
        super().__post_init__()
        if self.diag_skip and not (self.has_D and not self.D_has_hdim):
            raise ValueError("diag_skip: needs has_D (D is the (batch, nheads, nchunks, chunk_size) per-position "
                             "skip) and not D_has_hdim")
        g = self.step_group
        if not (isinstance(g, int) and not isinstance(g, bool) and g >= 1 and self.chunk_size % g == 0):
            raise ValueError(f"step_group: must be an int >= 1 dividing chunk_size={self.chunk_size}, got {g!r}")
        if g > 1 and not self.diag_skip:
            raise ValueError("step_group: a grouped causal sum needs diag_skip (the strict form)")


@dataclass(frozen=True)
class ScanDims(ScanBwdDims):
    """ssd_chunk_scan: ScanBwdDims' fields (diag_skip among them), state_dtype (the stored chunk states' dtype;
    the backward reads float32 ones) and has_init: whether initial states were given. Without them the state
    entering chunk 0 is zero and its C . Sin product is skipped (half of the kernel's work when the sequence is
    one chunk)."""
    state_dtype: str = field(default=F32, metadata=OMIT_DEFAULT)
    has_init: bool = field(default=False, metadata=OMIT_DEFAULT)


@dataclass(frozen=True)
class VarlenDims(StateDims):
    """ssd_chunk_state_varlen."""
    state_dtype: str = field(default=F32, metadata=OMIT_DEFAULT)
    out_dtype: str = F32


@dataclass(frozen=True)
class ChunkStatesDims(SSDDims):
    """What the scans over chunk states share: nheads states of (headdim, dstate) per chunk."""
    nheads: int
    headdim: int
    dstate: int
    chunk_size: int
    has_init: bool = False
    has_seq_idx: bool = False


@dataclass(frozen=True)
class PassingDims(ChunkStatesDims):
    """ssd_state_passing."""
    state_dtype: str = field(default=F32, metadata=OMIT_DEFAULT)


@dataclass(frozen=True)
class PassingBwdDims(ChunkStatesDims):
    """ssd_state_passing_bwd."""
    has_dfinal: bool = False


@dataclass(frozen=True)
class HeadSumDims(SSDDims):
    """ssd_head_sum: per-head dB / dC partials summed over each group's heads."""
    nheads: int
    ngroups: int
    dstate: int
    out_dtype: str = F32


DIMS = {"chunk_cumsum": DtDims, "chunk_cumsum_bwd": DtDims, "bmm_chunk": BmmDims, "chunk_state": StateDims,
        "state_passing": PassingDims, "chunk_scan": ScanDims, "chunk_scan_bwd_dstates": DstatesDims,
        "state_passing_bwd": PassingBwdDims, "chunk_scan_bwd": ScanBwdDims, "head_sum": HeadSumDims,
        "chunk_state_varlen": VarlenDims}


def dims_of(cls, dims, kw: dict):
    """The builder's dims: a ``cls`` instance as given, or built from keyword arguments (the older call form,
    ``ssd_chunk_state(nheads=..., ...)``)."""
    if dims is None:
        return cls(**kw)
    if kw:
        raise TypeError(f"pass either a {cls.__name__} or keyword dims, not both (got {sorted(kw)})")
    if type(dims) is not cls:
        raise TypeError(f"dims: expected {cls.__name__}, got {type(dims).__name__}")
    return dims


HEAD_PART_TASKS = 64  # parallel (batch, chunk, group, part) tasks ssd_chunk_scan_bwd aims for


def head_parts(batch: int, nchunks: int, nheads: int, ngroups: int) -> int:
    """Parts the heads of a group are split into by ssd_chunk_scan_bwd (one dB / dC partial per part, summed
    by ssd_head_sum): the fewest (a divisor of nheads / ngroups) that still make HEAD_PART_TASKS parallel
    (batch, chunk, group, part) tasks, else one part per head. A function of the shapes only, like the
    int8 wgrad parts: the same sums in the same order on every machine and thread count. Each part sums its
    heads' rows in head order and its heads share the staged B / C rows; fewer parts, fewer partials to
    write and sum (per head, a Mamba-2 130M layer's two partials are 50 MB at 2048 tokens)."""
    R = nheads // ngroups
    for p in range(1, R + 1):
        if R % p == 0 and batch * nchunks * ngroups * p >= HEAD_PART_TASKS:
            return p
    return R
