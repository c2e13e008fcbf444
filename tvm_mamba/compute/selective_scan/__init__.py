"""Mamba-1 selective scan (mamba_ssm 2.3.x semantics): forward, backward, decode step, chunked forward and
the complex-A scan, each ONE loop-nest template laid out per target by a ``Layout``.

    dt = softplus?(delta + delta_bias);  h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t;
    y_t = C_t . h_t + D u_t;  out = y * silu(z)

A recurrence cannot be TE (``te.scan`` is rejected by ``create_prim_func``), so every kernel here is a
loop-nest *template*: a pure function of typed static dims (``_dims``) and a ``Layout`` (``_layout``: how
lanes, dstate and dstate sums land on the machine; the math of one step is ``_step``) that returns a
PrimFunc. ``selective_scan_<direction>(dims)`` builds it with the serial layout (the definition tests and
tools read); the rules in schedules/cpu and schedules/cuda build it with their layouts. ``VARIANTS`` holds alternative
templates of the same kernels (same signature, the layout's choice of algorithm): the parallel-in-time forward
and backward (timescan.py, timescan_bwd.py) that CUDA builds.

Kernel layouts (the torch op builds them with views/transposes):
- u, delta, z, out: (batch, dim, seqlen); A: (dim, dstate); D, delta_bias: (dim,); states (batch, dim, dstate).
- B, C: ``groups == 0``: time-invariant (dim, dstate); else (batch, groups, seqlen, dstate) — mamba_ssm's
  (batch, groups, dstate, seqlen) transposed so one step reads dstate contiguous values.
- checkpoints: (batch, dim, nchunk, dstate), nchunk = ceil(seqlen / chunk): the state *before* each chunk.
  The backward recomputes the states of one chunk at a time from them (memory O(seqlen / chunk)).
- ``acc``: accumulation dtype, float32 (float32/16/bf16 inputs) or float64 (float64 inputs, for gradcheck).
  A, D, delta_bias and all states are in ``acc``.
Absent optional inputs are (1,)*ndim placeholders flagged by ``has_*`` static dims.
No cumulative products or divisions by running decays: only the step recurrence (stable at any length).
"""
from __future__ import annotations

from .._common import lazy_names

__getattr__ = lazy_names(__name__, __file__)  # dims.py, then kernels.py, each imported on first use
