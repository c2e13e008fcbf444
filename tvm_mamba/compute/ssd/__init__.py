"""Mamba-2 SSD chunked scan (mamba_ssm 2.3.x ``mamba_chunk_scan_combined`` semantics): kernel builders.

Per head h of group g, with dt' = clamp(softplus(dt + dt_bias)), dA_cs = chunk-local cumsum(dt' A):

    h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T,   y_t = h_t C_t + D x_t,   y <- y * silu(z)

computed chunk by chunk (chunk length Q = chunk_size), as upstream's five Triton kernels do:

=====================  ============================================================================
ssd_chunk_cumsum       dt' and dA_cs per chunk; positions past seqlen get dt' = 0 (no decay, no input),
                       which makes a ragged last chunk exact without padding any tensor
ssd_bmm_chunk          CB_c[l, s] = C_l . B_s per (chunk, group): computed once, shared by the group's heads
ssd_chunk_state        S_c[p, n] = sum_l x[l, p] dt'[l] exp(dA_cs[Q-1] - dA_cs[l]) B[l, n]   (P x Q x N)
ssd_state_passing      Sin_{c+1} = exp(dA_cs_c[Q-1]) Sin_c + S_c (sequential over chunks)
ssd_chunk_scan         y[l] = sum_{s<=l} (C_l.B_s) exp(dA_cs[l] - dA_cs[s]) dt'[s] x[s]
                              + exp(dA_cs[l]) C_l Sin_c + D x_l ; optional silu(z) gate
ssd_chunk_scan_bwd_dstates   dSloc_c = sum_l exp(dA_cs[l]) g[l] C_l^T (g = dy * silu(z)), and dz
ssd_state_passing_bwd  reverse scan: dS_c = dH_{c+1}, dH_c = dSloc_c + a_c dH_{c+1}, dinit = dH_0
ssd_chunk_scan_bwd     every per-chunk gradient: dx, dB, dC (per head), d dt', d dA_step (per step), dD
ssd_chunk_cumsum_bwd   d dA_step + the state-passing term -> d dt', d A, through softplus/clamp -> d dt, d dt_bias
ssd_head_sum           dB, dC: the per-head partials summed over the heads of each group (fixed order)
=====================  ============================================================================

Segment decays are always exp of a *difference* of cumulative sums, masked (s <= l, same seq_idx) before
the exponential, so nothing overflows in any dtype (never exp(cumsum) / exp(cumsum)). With seq_idx the
masks are upstream's: a position's state contribution counts only toward its own sequence, the carried
state only where the sequence id matches the previous chunk's last id (id 0 before position 0).

All reductions are owned by one thread (no atomics): per-head dB/dC and per-(batch, chunk) dD partials are
summed over heads/chunks in a fixed order by the torch op. Accumulation and states are float32.
Batch, seqlen and nchunks are symbolic; nheads, ngroups, headdim, dstate, chunk_size are static.

These kernels are TVMScript loop nests, not TE: a symbolic seqlen with vectorized TE schedules loses all
vector code on CPU (see the CPU rule). Layout of the package:

    dims.py      the typed static dims (one frozen dataclass per kernel family; ``DIMS``, what dispatch builds)
    common.py    the shared math (decay step, dt', segment decays and masks, the gate)
    strategy.py  how a template is laid onto the machine (serial here; CPU / CUDA in schedules/<target>/ssd.py)
    dt.py, passing.py          chunk_cumsum(_bwd), state_passing(_bwd), head_sum: one template each
    bmm.py, chunk_state.py, dstates.py, varlen.py   bmm_chunk, chunk_state, chunk_scan_bwd_dstates,
                 chunk_state_varlen: one template each (the chunk matmuls through the strategy's)
    scan.py      chunk_scan: one template (the strategy's causal_matmul)
    scan_bwd.py  chunk_scan_bwd: one template, its math as specs (scan_bwd_spec.py) executed in two forms
                 (scan_bwd_task.py: a task per chunk on staged operands, the CPU's; scan_bwd_launch.py: a
                 launch per piece, a thread per output, CUDA's)
    mm.py        the CPU's register-blocked matmul

A builder takes its dims (``ssd_chunk_scan(ScanDims(...))``, or the fields as keywords) and returns the
PrimFunc the rules reschedule: the template laid out serially (``strategy=``: another layout).
"""
from __future__ import annotations

from .._common import lazy_names

__getattr__ = lazy_names(__name__, __file__)  # dims.py, then kernels.py, each imported on first use
