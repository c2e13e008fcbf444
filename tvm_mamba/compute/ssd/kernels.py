"""The SSD kernels' table: direction -> typed dims, template, builder (``KERNELS``), and the build-check /
tuning configurations; the package's docstring describes the op."""
from __future__ import annotations

from .bmm import bmm_template, ssd_bmm_chunk
from .chunk_state import chunk_state_template, ssd_chunk_state
from .common import DA_MIN, NEG, dA_passes, dA_step, with_state_dtype  # noqa: F401 (public helpers)
from .dims import DIMS, check_dims  # noqa: F401
from .dstates import dstates_template, ssd_chunk_scan_bwd_dstates
from .dt import cumsum_bwd_template, cumsum_template, ssd_chunk_cumsum, ssd_chunk_cumsum_bwd
from .passing import (head_sum_template, passing_bwd_template, passing_template, ssd_head_sum, ssd_state_passing,
                      ssd_state_passing_bwd)
from .scan import chunk_scan_template, ssd_chunk_scan
from .scan_bwd import chunk_scan_bwd_template, ssd_chunk_scan_bwd
from .varlen import ssd_chunk_state_varlen, varlen_template
from .dims import head_parts

__all__ = ["ssd_chunk_cumsum", "ssd_bmm_chunk", "ssd_chunk_state", "ssd_state_passing", "ssd_chunk_scan",
           "ssd_chunk_scan_bwd_dstates", "ssd_state_passing_bwd", "ssd_chunk_scan_bwd", "ssd_chunk_cumsum_bwd",
           "ssd_head_sum", "ssd_chunk_state_varlen", "DIMS", "KERNELS", "TEMPLATES", "check_dims", "head_parts"]

TEMPLATES = {"chunk_cumsum": cumsum_template, "chunk_cumsum_bwd": cumsum_bwd_template, "bmm_chunk": bmm_template,
             "chunk_state": chunk_state_template, "state_passing": passing_template,
             "state_passing_bwd": passing_bwd_template, "chunk_scan": chunk_scan_template,
             "chunk_scan_bwd_dstates": dstates_template, "chunk_scan_bwd": chunk_scan_bwd_template,
             "head_sum": head_sum_template, "chunk_state_varlen": varlen_template}
"""direction -> template(dims, strategy): every SSD kernel's one definition; the rules (schedules/<target>/ssd.py)
lay it out with their strategy."""


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning (and roofline) workloads: the five kernels with chunk matmuls (the others have no knobs) of each
    Mamba-2 preset (nheads, ngroups, headdim 64, dstate 128, chunk 256) as its block calls them: fp32, D per
    head, z, no seq_idx; then each Mamba-3 preset's (``_mamba3_configs``)."""
    from .._presets import presets

    out = []
    f32 = {"x": "float32", "bc": "float32"}
    for _, d in presets(preset, families=("mamba2",)):
        if "headdim" not in d:
            continue
        dims = dict(nheads=d["nheads"], ngroups=d["ngroups"], headdim=d["headdim"], dstate=d["d_state"],
                    chunk_size=d["chunk_size"])
        out += [("bmm_chunk", dict(ngroups=d["ngroups"], dstate=d["d_state"], chunk_size=d["chunk_size"]),
                 {"bc": "float32"}),
                ("chunk_state", dict(dims, has_seq_idx=False), f32),
                ("chunk_scan", dict(dims, has_D=True, D_has_hdim=False, has_z=True, has_seq_idx=False), f32),
                ("chunk_scan_bwd_dstates", dict(dims, has_z=True, has_seq_idx=False), f32),
                ("chunk_scan_bwd", dict(dims, has_D=True, D_has_hdim=False, has_z=True, has_seq_idx=False), f32)]
    for _, d in presets(preset, families=("mamba3",)):
        out += _mamba3_configs(d)
    return out


def _mamba3_configs(d: dict) -> list[tuple[str, dict, dict]]:
    """A Mamba-3 preset's SSD kernels with chunk matmuls as its chunked forward and backward call them
    (torch_ops/mamba3.py, mamba3_mimo.py): a group per head (B = k, C = q), fp32 x = V and B / C, no seq_idx
    or input states, the strict causal sums with the per-position skip (diag_skip); SISO with z; MIMO (a
    ``mimo_rank`` R) over the flattened (step, rank) positions, mimo_chunk_steps(chunk, R) R per chunk,
    step_group R, no z (its gate is per rank, after the scan)."""
    from ..mamba3.dims import mimo_chunk_steps
    from .dims import BmmDims, DstatesDims, ScanBwdDims, ScanDims, StateDims

    R = d.get("mimo_rank") or 1
    Q, H, N = mimo_chunk_steps(d["chunk_size"], R) * R, d["nheads"], d["d_state"]
    chunk = dict(nheads=H, ngroups=H, headdim=d["headdim"], dstate=N, chunk_size=Q)
    scan = dict(chunk, has_D=True, has_z=R == 1, diag_skip=True, **({"step_group": R} if R > 1 else {}))
    return [("bmm_chunk", *BmmDims(H, N, Q).key_parts()), ("chunk_state", *StateDims(**chunk).key_parts()),
            ("chunk_scan", *ScanDims(**scan).key_parts()),
            ("chunk_scan_bwd_dstates", *DstatesDims(**chunk, has_z=R == 1).key_parts()),
            ("chunk_scan_bwd", *ScanBwdDims(**scan).key_parts())]


def derived_dims(direction: str, dims: dict, static: dict) -> dict:
    """Dynamic dims that follow from the others (for tuning-time inputs): nchunks = ceil(seqlen / chunk);
    chunk_scan_bwd's gparts = ngroups * head_parts(...), as torch_ops/ssd.py allocates its partials."""
    if "seqlen" not in dims or "chunk_size" not in static:
        return {}
    out = {"nchunks": -(-dims["seqlen"] // static["chunk_size"])}
    if direction == "chunk_scan_bwd":
        G = static["ngroups"]
        out["gparts"] = G * head_parts(dims.get("batch", 1), out["nchunks"], static["nheads"], G)
    return out


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static dims, dtypes) built by ``python -m tvm_mamba build-check`` for CUDA: the Mamba-2
    2.7B shape (nheads 80, ngroups 1, headdim 64, dstate 128, chunk 256) and the same with dstate 256, bf16
    activations, with every optional input on (D per head, z, dt_bias, softplus, dt_limit, initial and
    final states, seq_idx) and, for the 2.7B shape, the plain variant too; then the varlen-states kernel
    (with seq_idx; without, from bf16 chunk states), the kernels that store / read bf16 chunk states, and
    Mamba-3's chunk scan (``diag_skip``; sim-check runs it through mamba3_siso_combined) and its backward
    (sim-check calls the kernel directly, simcheck/ssd.py ``check_scan_bwd``), and Mamba-3 MIMO's grouped ones
    (``step_group``; both called directly, ``check_scan_fwd`` / ``check_scan_bwd``)."""
    out = []
    dts = {"x": "bfloat16", "bc": "bfloat16"}
    for dstate, flag_sets in ((128, (False, True)), (256, (True,))):
        dims = dict(nheads=80, ngroups=1, headdim=64, dstate=dstate, chunk_size=256)
        sdims = dict(nheads=80, headdim=64, dstate=dstate, chunk_size=256)
        for on in flag_sets:
            dtf = dict(nheads=80, chunk_size=256, has_dt_bias=on, dt_softplus=on, has_dt_limit=on)
            out += [("chunk_cumsum", dtf, {}), ("chunk_cumsum_bwd", dtf, {}),
                    ("chunk_state", dict(dims, has_seq_idx=on), dts),
                    ("state_passing", dict(sdims, has_init=on, has_seq_idx=on), {}),
                    ("state_passing_bwd", dict(sdims, has_init=on, has_dfinal=on, has_seq_idx=on), {}),
                    ("chunk_scan", dict(dims, has_D=True, D_has_hdim=False, has_z=on, has_seq_idx=on,
                                        **({"has_init": True} if on else {})), dts),  # has_init: omitted when off
                    ("chunk_scan_bwd_dstates", dict(dims, has_z=on, has_seq_idx=on), dts),
                    ("chunk_scan_bwd", dict(dims, has_D=True, D_has_hdim=False, has_z=on, has_seq_idx=on), dts)]
        out.append(("head_sum", dict(nheads=80, ngroups=1, dstate=dstate), {"out": "bfloat16"}))
        out.append(("bmm_chunk", dict(ngroups=1, dstate=dstate, chunk_size=256), {"bc": "bfloat16"}))
    # varlen states (batch 1, cu_seqlens) and chunk states stored in bf16 (state_dtype), at the 2.7B shape
    dims = dict(nheads=80, ngroups=1, headdim=64, dstate=128, chunk_size=256)
    sdims = dict(nheads=80, headdim=64, dstate=128, chunk_size=256)
    out += [("chunk_state_varlen", dict(dims, has_seq_idx=True), dict(dts, out="bfloat16")),
            ("chunk_state_varlen", dict(dims, has_seq_idx=False), dict(dts, state="bfloat16", out="bfloat16")),
            ("state_passing", dict(sdims, has_init=True, has_seq_idx=True), {"state": "bfloat16"}),
            ("chunk_scan", dict(dims, has_D=True, D_has_hdim=False, has_z=True, has_seq_idx=True, has_init=True),
             dict(dts, state="bfloat16"))]
    # Mamba-3's chunked forward (torch_ops/mamba3.py) at upstream's tuned SISO shape (32 heads, headdim_v 64,
    # headdim_qk 128 as dstate, chunk 64): the chunk scan with the strict causal sum and per-position skip
    m3 = dict(nheads=32, ngroups=32, headdim=64, dstate=128, chunk_size=64, has_D=True, D_has_hdim=False,
              has_z=True, has_seq_idx=False, diag_skip=True)
    out.append(("chunk_scan", dict(m3, has_init=True), {"x": "bfloat16", "bc": "float32"}))
    # and its backward (the strict causal sums, per-position dD): bf16 V with z, fp32 without
    out += [("chunk_scan_bwd", m3, {"x": "bfloat16", "bc": "float32"}),
            ("chunk_scan_bwd", dict(m3, has_z=False), {"x": "float32", "bc": "float32"})]
    # Mamba-3 MIMO (torch_ops/mamba3_mimo.py) at upstream's MIMO shape (rank 4, 16 steps per chunk: 64 flattened
    # (step, rank) positions): the grouped causal sums (step_group 4), float32 x = V * MIMO_V, no z (the gate
    # is per rank, applied after the scan); sim-check calls the kernels directly (simcheck/ssd.py)
    mimo = dict(m3, has_z=False, step_group=4)
    f32 = {"x": "float32", "bc": "float32"}
    out += [("chunk_scan", mimo, f32), ("chunk_scan", dict(mimo, has_init=True), f32), ("chunk_scan_bwd", mimo, f32)]
    return out


# direction -> builder(dims) -> PrimFunc: this op's kernels (runtime/registry.py reads this table)
KERNELS = {"chunk_cumsum": ssd_chunk_cumsum, "bmm_chunk": ssd_bmm_chunk, "chunk_state": ssd_chunk_state,
           "state_passing": ssd_state_passing, "chunk_scan": ssd_chunk_scan,
           "chunk_scan_bwd_dstates": ssd_chunk_scan_bwd_dstates, "state_passing_bwd": ssd_state_passing_bwd,
           "chunk_scan_bwd": ssd_chunk_scan_bwd, "chunk_cumsum_bwd": ssd_chunk_cumsum_bwd, "head_sum": ssd_head_sum,
           "chunk_state_varlen": ssd_chunk_state_varlen}
