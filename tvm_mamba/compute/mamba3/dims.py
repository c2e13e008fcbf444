"""Typed static dims of the Mamba-3 kernels. Here, not in compute/mamba3/, so the torch op can key its kernels
without importing TVMScript (a runtime-only machine serving an AOT pack), as compute/ssd/dims.py."""
from __future__ import annotations

import dataclasses

from .._common import OMIT_DEFAULT, Dims, check_dtype

IO_DTYPES = ("float32", "float16", "bfloat16", "float64")
# the preprocess's pair passes (compute/mamba3/preprocess*.py): time steps per task; the backward's bias
# gradients come in parts per (batch, block of PAIR_STEPS steps), which torch_ops/mamba3.py allocates and sums
PAIR_STEPS = 16


def acc_dtype(v_dtype: str) -> str:
    """Accumulation dtype (ADT, DT, Trap, biases, Angles, D, the angle / ssm states and every output state):
    float64 for float64 inputs (gradcheck-style checks), else float32 (as upstream's kernels)."""
    return "float64" if v_dtype == "float64" else "float32"


def mimo_chunk_steps(chunk_size: int, mimo_rank: int) -> int:
    """The chunk (in time steps) mamba3_mimo's kernels run: chunk_size, at most 256 // mimo_rank (its SSD pieces
    see chunk_size * mimo_rank flattened (step, rank) positions per chunk; 256 is their limit)."""
    return min(chunk_size, 256 // mimo_rank)


@dataclasses.dataclass(frozen=True)
class HeadDims(Dims):
    """The model dims every Mamba-3 SISO kernel is keyed by. nheads / nheads_qk: V heads and Q/K heads (GQA:
    head h reads Q/K head h // (nheads // nheads_qk)); headdim_qk (even: rotary pairs), headdim_v,
    headdim_angles (rotated pairs, 1 .. headdim_qk // 2; upstream's module always has at least one)."""

    nheads: int
    nheads_qk: int
    headdim_qk: int
    headdim_v: int
    headdim_angles: int

    def __post_init__(self):
        if min(self.nheads, self.nheads_qk, self.headdim_qk, self.headdim_v) < 1 or self.nheads % self.nheads_qk:
            raise ValueError(f"nheads_qk: must divide nheads={self.nheads}, got {self.nheads_qk}")
        if self.headdim_qk % 2:
            raise ValueError(f"headdim_qk: must be even (rotary pairs), got {self.headdim_qk}")
        if not 1 <= self.headdim_angles <= self.headdim_qk // 2:
            raise ValueError(f"headdim_angles: must be in [1, headdim_qk // 2 = {self.headdim_qk // 2}], "
                             f"got {self.headdim_angles}")

    def check_dtypes(self, names: tuple, allowed: tuple) -> None:
        """ValueError naming the tensor whose ``<name>_dtype`` field (None: a default) is not in ``allowed``."""
        for name in names:
            dt = getattr(self, f"{name}_dtype")
            if dt is not None:
                check_dtype(name, dt, allowed)

    @property
    def heads_per_qk(self) -> int:
        return self.nheads // self.nheads_qk


@dataclasses.dataclass(frozen=True)
class StepDims(HeadDims):
    """The SISO decode step's dims (mamba_ssm's ``mamba3_siso_step``): HeadDims' model dims;
    has_D / has_z: optional inputs present. Dtypes: ``qk`` of Q and K, ``v`` of V and out; ``z`` (None: v's),
    ``kstate`` of the input K state (None: acc), ``vstate`` of the input V state (None: v's). Everything else
    is in the accumulation dtype (the torch op widens those small tensors).
    """

    has_D: bool = False
    has_z: bool = False
    qk_dtype: str = "float32"
    v_dtype: str = "float32"
    z_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    kstate_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    vstate_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)

    def __post_init__(self):
        super().__post_init__()
        names = ("qk", "v", "z", "kstate", "vstate")
        self.check_dtypes(names, IO_DTYPES)
        wide = [getattr(self, f"{n}_dtype") == "float64" for n in names if getattr(self, f"{n}_dtype") is not None]
        if any(wide) and not all(wide):
            raise ValueError("v: a float64 kernel needs every tensor float64")

    @property
    def acc(self) -> str:
        return acc_dtype(self.v_dtype)

    # the step template's MIMO generalisation (MimoStepDims): SISO is rank 1, interleaved rotary pairs, no
    # MIMO projections; upstream's two-function path's flags at the fused step's values
    mimo = False
    rank = 1
    has_outproj = False
    pairwise = True
    angle_mod = True
    conjugate = False
    trap_logit = True
    raw_a = False
    inplace = False
    rank_major = False
    has_qbias = True
    has_kbias = True
    state_dtype = None


@dataclasses.dataclass(frozen=True)
class MimoStepDims(StepDims):
    """The MIMO decode step's dims (mamba_ssm's MIMO ``Mamba3.step``: ``apply_rotary_qk_inference_fwd`` then
    CuTe ``mamba3_step_fn``): StepDims' fields plus mimo_rank R (the Q / K / K-state rank axis, R outputs
    per head) and has_outproj (MIMO_Out given: the R outputs summed into one; else out is (batch, R, nheads,
    headdim_v)). Rotary pairs are the halved (i, i + headdim_qk / 2) of upstream's MIMO layout; MIMO_V,
    MIMO_Z, MIMO_Out are in the accumulation dtype. The same template as SISO (compute/mamba3/step.py).

    The flags after has_outproj serve upstream's two-function path, the step's two passes as kernels of their
    own (directions ``step_rotate``: ``apply_rotary_qk_inference_fwd``; ``step_update``: ``mamba3_step_fn``):
    interleaved pairs at a rank axis, an angle not reduced mod 2 pi, conjugate rotation, Trap given as a
    probability, A given instead of A DT, the ssm state (in ``state`` dtype) rewritten in place, biases and
    MIMO_* laid out rank-major (R, nheads, .) as upstream's function takes them, absent biases."""

    mimo_rank: int = 4  # upstream Mamba3's default
    has_outproj: bool = True
    # upstream's two-function path (``step_rotate`` / ``step_update``, docs/mamba3.md); each at its default
    # is the fused mimo_step's behaviour and stays out of the key
    pairwise: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)  # (2i, 2i+1) pairs, not halved
    angle_mod: bool = dataclasses.field(default=True, metadata=OMIT_DEFAULT)  # the new angle reduced mod 2 pi
    conjugate: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)  # rotate by -theta
    trap_logit: bool = dataclasses.field(default=True, metadata=OMIT_DEFAULT)  # False: Trap is sigmoid(Trap)
    raw_a: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)  # ADT holds A: alpha = exp(A DT)
    inplace: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)  # the ssm state rewritten in place
    rank_major: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)  # biases, MIMO_* (R, nheads, .)
    has_qbias: bool = dataclasses.field(default=True, metadata=OMIT_DEFAULT)
    has_kbias: bool = dataclasses.field(default=True, metadata=OMIT_DEFAULT)
    state_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)  # ssm state (None: acc)

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.mimo_rank, int) and 1 <= self.mimo_rank <= 16):
            raise ValueError(f"mimo_rank: must be an int in 1..16, got {self.mimo_rank!r}")
        self.check_dtypes(("state",), IO_DTYPES)
        if self.state_dtype is not None and (self.state_dtype == "float64") != (self.v_dtype == "float64"):
            raise ValueError("state: a float64 kernel needs every tensor float64")

    mimo = True

    @property
    def rank(self) -> int:
        return self.mimo_rank


@dataclasses.dataclass(frozen=True)
class PreDims(HeadDims):
    """The SISO chunked forward's preprocess (the kernel before the SSD pieces, docs/mamba3.md): HeadDims'
    model dims; chunk_size: the SSD pieces' chunk length (1 .. 256); has_D: D given (folded into the
    per-position skip); has_init: input states given (the angle cumsum starts from the angle state, the
    initial ssm state gets the K / V states' trapezoid term); has_seq_idx: packed sequences (batch 1, a seq_idx
    (batch, seqlen) int32 input: the angle cumsum restarts at each sequence, the trapezoid's left term does not
    cross a boundary, the final angles are per sequence (nseq rows); not with has_init). Dtypes: ``qk`` of Q and K, ``vstate`` of the
    input V state, ``kstate`` of the input K state (None: float32). The SSD pieces accumulate in float32, so
    there is no float64 form.
    """

    chunk_size: int
    has_D: bool = False
    has_init: bool = False
    qk_dtype: str = "float32"
    vstate_dtype: str = "float32"
    kstate_dtype: str | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    has_seq_idx: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)

    def __post_init__(self):
        super().__post_init__()
        if self.has_seq_idx and self.has_init:
            raise ValueError("has_seq_idx: packed sequences start from zero states, not with has_init")
        if not (isinstance(self.chunk_size, int) and 1 <= self.chunk_size <= 256):
            raise ValueError(f"chunk_size: must be an int in 1..256, got {self.chunk_size!r}")
        self.check_dtypes(("qk", "vstate", "kstate"), IO_DTYPES[:3])
