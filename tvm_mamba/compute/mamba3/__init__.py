"""Mamba-3 (mamba_ssm 2.3.2.post1, docs/mamba3.md): the SISO and MIMO decode steps, one loop-nest template
(step.py) laid out per target by the selective scan's ``Layout`` strategy objects (serial here; CPU / CUDA
layouts in the rules), and
the SISO chunked forward's preprocess (preprocess.py), laid out by the SSD strategies: the chunked forward is
that preprocess, then the SSD pieces of compute/ssd/ (bmm_chunk, chunk_state, state_passing, chunk_scan with
``diag_skip``), chained by torch_ops/mamba3.py; and that preprocess's backward (preprocess_bwd.py), on the same
strategies.

    h' = exp(ADT) h + exp(ADT) DT (1 - sigmoid(Trap)) v_state k_state^T + DT sigmoid(Trap) V k^T;
    out = (h' q + D V) * silu(Z),   q, k = rotary(theta') (Q + Q_bias), rotary(theta') (K + K_bias)

Kernel layouts (the public function's, upstream's): Q, K (batch, nheads_qk, headdim_qk); V, Z, out
(batch, nheads, headdim_v); ADT, DT, Trap (batch, nheads); Q_bias, K_bias (nheads, headdim_qk); Angles and
the angle states (batch, nheads, headdim_angles); D (nheads,); ssm states (batch, nheads, headdim_v,
headdim_qk); K states (batch, nheads, headdim_qk); V state (batch, nheads, headdim_v). Absent D / Z are
(1,)*ndim placeholders flagged by ``has_D`` / ``has_z``. The MIMO step (``mimo_step``, MimoStepDims) adds a
rank axis R: Q, K, the K states (batch, R, nheads(_qk), headdim_qk), Q_bias, K_bias (nheads, R, headdim_qk),
MIMO_V / MIMO_Z / MIMO_Out (nheads, R, headdim_v), out (batch, R, nheads, headdim_v) without MIMO_Out.
Upstream's two-function decode path runs the step's two passes as kernels of their own from the same template
(``step_rotate``, ``step_update``; MimoStepDims' flags for upstream's layouts and conventions).
"""
from __future__ import annotations

from .._common import lazy_names

__getattr__ = lazy_names(__name__, __file__)  # dims.py, then kernels.py, each imported on first use
