"""The selective-scan kernels' table: direction -> typed dims, template, builder (``KERNELS``), and the
build-check / tuning configurations; the package's docstring describes the op."""
from __future__ import annotations

from tvm import tirx

from .._common import stamp
from .._math import Math
from .dims import block_size, chunk_size
from ._configs import build_check_configs, tuning_configs
from .dims import IO_DTYPES, ScanBwdDims, ScanDims, UpdateDims, acc_dtype
from ._layout import Layout
from .bwd import bwd_template
from .chunked import fwd_chunked_template
from .complex_bwd import bwd_complex_template
from .complex_fwd import fwd_complex_template
from .fwd import fwd_template
from .timescan import fwd_timescan_template
from .timescan_bwd import bwd_timescan_template
from .update import update_template

__all__ = ["DIMS", "KERNELS", "TEMPLATES", "VARIANTS", "IO_DTYPES", "ScanDims", "ScanBwdDims", "UpdateDims", "Layout", "acc_dtype",
           "block_size", "chunk_size", "vector_width", "build_check_configs", "tuning_configs", "build",
           "selective_scan_fwd", "selective_scan_bwd", "selective_scan_update", "selective_scan_fwd_chunked",
           "selective_scan_fwd_complex", "selective_scan_bwd_complex"]

# direction -> typed static dims (dispatch builds ``selective_scan_<direction>(DIMS[direction].from_key(...))``)
DIMS = {"fwd": ScanDims, "bwd": ScanBwdDims, "update": UpdateDims, "fwd_chunked": ScanDims,
        "fwd_complex": ScanDims, "bwd_complex": ScanBwdDims}
# direction -> template(dims, layout)
TEMPLATES = {"fwd": fwd_template, "bwd": bwd_template, "update": update_template,
             "fwd_chunked": fwd_chunked_template, "fwd_complex": fwd_complex_template,
             "bwd_complex": bwd_complex_template}
# direction -> alternative templates of the same kernel (a layout's choice of algorithm; same signature)
VARIANTS = {"fwd": {"timescan": fwd_timescan_template}, "bwd": {"timescan": bwd_timescan_template}}


def vector_width(dstate: int, want: int = 16) -> int:
    """Largest power of two <= want dividing dstate (the dstate vector of one step)."""
    v = 1
    while v * 2 <= want and dstate % (v * 2) == 0:
        v *= 2
    return v


def build(direction: str, dims, layout: Layout, variant: str | None = None) -> tirx.PrimFunc:
    """``direction``'s template (or its ``variant``, ``VARIANTS``) laid out by ``layout``, named after its
    kernel."""
    template = VARIANTS[direction][variant] if variant else TEMPLATES[direction]
    return stamp(template(dims, layout), f"selective_scan_{direction}")


def _dims(direction: str, dims, kwargs: dict, **defaults):
    if dims is None:
        return DIMS[direction](**{**defaults, **kwargs})
    if kwargs:
        raise TypeError(f"selective_scan_{direction}: pass dims or keyword dims, not both ({sorted(kwargs)})")
    return dims


def selective_scan_fwd(dims: ScanDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (dim, dstate) if groups == 0 else
    (batch, groups, seqlen, dstate); D, delta_bias: (dim,); initial_state: (batch, dim, dstate)
    -> out: (batch, dim, seqlen), last_state: (batch, dim, dstate), checkpoints: (batch, dim, nchunk, dstate).

    h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t; out_t = (C_t . h_t + D u_t) * silu(z_t); checkpoints[c] = h
    before step c*chunk. ``dims``: a ScanDims, or its fields as keywords.
    """
    d = _dims("fwd", dims, kwargs)
    return build("fwd", d, Layout(Math(d.acc)))


def selective_scan_bwd(dims: ScanBwdDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """Backward of :func:`selective_scan_fwd`.

    Inputs: the forward's inputs, checkpoints: (batch, dim, nchunk, dstate), dout: (batch, dim, seqlen),
    dlast: (batch, dim, dstate) (gradient flowing in through last_state; zeros when unused).
    Outputs: du, ddelta, dz: (batch, dim, seqlen); dA: (dim, dstate); dB, dC: B's/C's kernel layout;
    dD, ddelta_bias: (dim,); dinit: (batch, dim, dstate); one float32 workspace ws (flat, ``bwd_workspace``'s
    size) holding the regions wsA: (batch, dim, dstate), wsB/wsC: (batch, dim // block, seqlen, dstate) for
    varying B/C else (batch, dim, dstate), wsS: (batch, dim, 2).

    g_t = dy_t C_t + exp(dt_{t+1} A) g_{t+1} (g_{L-1} also gets dlast); dB_t = g_t dt_t u_t; dC_t = dy_t h_t;
    d dt_t = sum_n g_t (B_t u_t + A exp(dt_t A) h_{t-1}); dA = sum_t g_t dt_t exp(dt_t A) h_{t-1};
    du_t = D dy_t + dt_t sum_n g_t B_t; dinit = exp(dt_0 A) g_0.
    """
    d = _dims("bwd", dims, kwargs)
    return build("bwd", d, Layout(Math(d.acc)))


def selective_scan_fwd_chunked(dims: ScanDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """Shapes and outputs exactly as :func:`selective_scan_fwd` (out, last_state, checkpoints); computed by
    local scans per chunk, a carry pass over chunk boundaries and a fix-up pass (chunked.py)."""
    d = _dims("fwd_chunked", dims, kwargs)
    return build("fwd_chunked", d, Layout(Math(d.acc)))


def selective_scan_update(dims: UpdateDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """Decode step (Mamba-2 head layout; Mamba-1 is nheads=dim, headdim=1).
    state: (nstate, nheads, headdim, dstate) in ``state_dtype`` (default: the accumulation dtype), updated in
    place; x, out: (batch, nheads, headdim); dt, z: the same shape in ``dt_dtype`` / ``z_dtype`` (default x's);
    A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads, headdim);
    state_batch_indices: (batch,) ``idx_dtype`` (int32/int64; absent when None: nstate = batch, row b -> slot b).
    tie_hdim: one A / dt / D / dt_bias per head (mamba_ssm's TIE_HDIM): A: (nheads,), dt: (batch, nheads),
    D, dt_bias: (nheads,).

    dt' = softplus?(dt + dt_bias); s = slot of the row; state[s] = exp(dt' A) state[s] + dt' B x;
    out = (C . state[s] + D x) * silu(z); a row with a negative slot only writes out = 0.
    """
    d = _dims("update", dims, kwargs)
    return build("update", d, Layout(Math(d.acc)))


def selective_scan_fwd_complex(dims: ScanDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """u, delta, z: (batch, dim, seqlen); A: (dim, dstate, 2); B, C: (dim, dstate, 2) if groups == 0 else
    (batch, groups, seqlen, dstate, 2); D, delta_bias: (dim,); initial_state: (batch, dim, dstate, 2)
    -> out: (batch, dim, seqlen), last_state: (batch, dim, dstate, 2),
    checkpoints: (batch, dim, nchunk, dstate, 2). ``_dtype`` of a time-invariant B/C is ignored (acc).

    h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t (complex); out_t = (2 Re(C_t . h_t) + D u_t) * silu(z_t).
    """
    d = _dims("fwd_complex", dims, kwargs, chunk=32)
    return build("fwd_complex", d, Layout(Math(d.acc)))


def selective_scan_bwd_complex(dims: ScanBwdDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """Backward of :func:`selective_scan_fwd_complex` (layouts there; every complex tensor as (..., 2)).

    Inputs: the forward's inputs, checkpoints, dout: (batch, dim, seqlen), dlast: (batch, dim, dstate, 2).
    Outputs: du, ddelta, dz: (batch, dim, seqlen); dA: (dim, dstate, 2); dB, dC: B's/C's kernel layout;
    dD, ddelta_bias: (dim,); dinit: (batch, dim, dstate, 2); one workspace ws (flat, ``bwd_workspace``'s size)
    holding wsA: (batch, dim, dstate, 2), wsB/wsC: (batch, dim // block, seqlen, dstate, 2) varying else
    (batch, dim, dstate, 2), wsS: (batch, dim, 2).
    Gradients of complex tensors are dL/dRe + i dL/dIm (torch's convention).
    """
    d = _dims("bwd_complex", dims, kwargs, chunk=32)
    return build("bwd_complex", d, Layout(Math(d.acc)))


# direction -> builder(dims) -> PrimFunc: this op's kernels (runtime/registry.py reads this table)
KERNELS = {"fwd": selective_scan_fwd, "bwd": selective_scan_bwd, "update": selective_scan_update,
           "fwd_chunked": selective_scan_fwd_chunked, "fwd_complex": selective_scan_fwd_complex,
           "bwd_complex": selective_scan_bwd_complex}
