"""The algorithm's minimum global traffic and arithmetic per kernel, in one place.

Bytes: every input read once and every output written once, at the kernel's dtypes: the sum of its
parameters' sizes at (batch, seqlen), except

* scratch: buffers the schedule chose to keep (checkpoints saved for the backward, per-block partial sums)
  rather than ones the math needs — listed per kernel in ``SCRATCH``;
* partial outputs whose parts the caller adds (``gparts`` partial dB / dC of the SSD backward, ``nparts``
  partial weight gradients; ``PART_AXES`` where the part count is an expression of the shape): counted at one
  part per group (``reduced_dims``), what a fused reduction writes;
* state updated in place (the decode step's ``state``): read and written, so counted twice (``INOUT``).

Arithmetic: the leading terms of the math, per kernel below (matrix products exactly; element-wise work within
a few flops per element). ``mm`` flops are matrix products, the work a tensor core can do; ``flops`` the rest
(fp32 CUDA cores); ``exps`` exp-family evaluations; ``sfu`` other transcendental ones (log1p of softplus).
Notation: B batch, L seqlen, D channels, N dstate, H heads, P headdim, G groups, Q chunk length,
T = B * nchunks * H * Q(Q+1)/2 the causal (t >= s) pairs of the SSD chunks; Mamba-3: N headdim_qk, P headdim_v,
S rotary angles (pairs); a norm's rows = B * L.
"""
from __future__ import annotations

import dataclasses

SCRATCH = {
    ("selective_scan", "fwd"): {"ck"},  # state checkpoints saved for the backward (a schedule choice)
    ("selective_scan", "bwd"): {"ck", "ws"},  # the minimum recomputes the states; ws: the partials
    ("ssd", "chunk_scan_bwd"): set(),
    ("mamba3", "siso_step"): {"qrot"},  # the rotated q, written by the rotate pass for the update pass
    ("mamba3", "mimo_step"): {"qrot"},
    ("mamba3", "siso_preprocess_bwd"): {"gdt", "c0"},  # the angles' DT terms / the init term, between passes
}
INOUT = {("selective_scan", "update"): {"state"}}
# partial outputs whose part count is an expression of the shape, not a dim of its own (the norm backward's
# ceil(rows / PART_ROWS) parts): {parameter: its part axis}, counted at one part like ``reduced_dims``
# (and the Mamba-3 preprocess backward's bias gradients, per (batch, block of PAIR_STEPS steps))
PART_AXES = {("rmsnorm_gated", "bwd"): {"partial": 0}, ("mamba3", "siso_preprocess_bwd"): {"dQb": 1, "dKb": 1}}


def broadcast_axes(op: str, direction: str, static: dict) -> dict[str, tuple[int, ...]]:
    """{parameter: axes it is read at index 0 along} (a view of stride 0 there: one element counted): the
    tied decode step takes mamba_ssm's expanded per-head dt, A, D, dt_bias as they come."""
    if (op, direction) == ("selective_scan", "update") and static.get("tie_hdim"):
        return {"dt": (2,), "A": (1, 2), "Dv": (1,), "dtb": (1,)}
    return {}


def reduced_dims(static: dict) -> dict[str, int]:
    """Symbolic partial-count dims at their minimum: one part per group."""
    return {"gparts": int(static.get("ngroups", 1)), "nparts": 1}


@dataclasses.dataclass(frozen=True)
class Minimum:
    bytes: int
    mm: int  # matrix-product flops (tensor-core eligible)
    flops: int  # other flops (CUDA cores)
    exps: int
    sfu: int = 0


def min_bytes(op: str, direction: str, param_bytes: dict[str, int]) -> int:
    """Each parameter once (twice if updated in place), scratch excluded; ``param_bytes`` at reduced dims."""
    scratch = SCRATCH.get((op, direction), set())
    inout = INOUT.get((op, direction), set())
    return sum(n * (2 if p in inout else 1) for p, n in param_bytes.items() if p not in scratch)


def _conv(d: str, s: dict, B: int, L: int) -> tuple[int, int, int, int]:
    n, W = B * s["dim"] * L, s["width"]
    act = 1 if s.get("activation") in ("silu", "swish") else 0
    if d == "fwd":  # W MACs, bias, silu (x / (1 + exp(-x)): add, div, mul)
        return 0, n * (2 * W + 1 + 3 * act), n * act, 0
    # recompute the pre-activation, silu's derivative (~6), dx and dweight (W MACs each), dbias
    return 0, n * (2 * W + 1 + 6 * act + 4 * W + 1), n * act, 0


def _scan(d: str, s: dict, B: int, L: int) -> tuple[int, int, int, int]:
    n, N = B * s["dim"] * L, s["dstate"]
    if d == "fwd":  # per state: exp(delta A), h = dA h + (delta u) B, y += C h; softplus, D u, silu(z) gate
        return 0, n * (6 * N + 9), n * (N + 2), n
    # recompute h (4 per state), reverse recurrence and the dB, dC, ddelta, dA contributions (~15 per state)
    return 0, n * (19 * N + 15), n * (N + 2), n


def _update(s: dict, B: int) -> tuple[int, int, int, int]:
    H, P, N = s["nheads"], s["headdim"], s["dstate"]
    n = B * H * P
    if s.get("tie_hdim"):  # dA = exp(dt A) once per head; softplus once per head
        return 0, n * (5 * N + 6) + 3 * B * H, n + 2 * B * H, B * H
    return 0, n * (6 * N + 9), n * (N + 2), n


def _ssd(d: str, s: dict, B: int, L: int) -> tuple[int, int, int, int]:
    Q, N = s["chunk_size"], s["dstate"]
    c = -(-L // Q)
    if d == "bmm_chunk":  # C_l . B_s over dstate, the causal pairs s <= l of each chunk (all its consumers read)
        return 2 * B * c * s["ngroups"] * Q * (Q + 1) // 2 * N, 0, 0, 0
    H, P = s["nheads"], s["headdim"]
    tok, pairs = B * L * H, B * c * H * Q * (Q + 1) // 2
    if d == "chunk_state":  # states = sum_t x_t B_t exp(dA_last - dA_t) dt_t
        return 2 * tok * P * N, 3 * tok, 0, tok
    if d == "chunk_scan":  # C . states, causal (cb * decay * dt) . x, D x, silu(z) gate
        return 2 * tok * P * N + 2 * pairs * P, 3 * pairs + 8 * tok * P, pairs + tok + tok * P, 0
    if d == "chunk_scan_bwd_dstates":  # dstates = sum_t C_t exp(dA_t) dy'_t, z gate backward
        return 2 * tok * P * N, 8 * tok * P + tok, tok * P + tok, 0
    if d == "chunk_scan_bwd":  # dx (states and causal part), dB, dC, d(cb), ddt / ddA
        return 6 * tok * P * N + 4 * pairs * P, 6 * pairs + 6 * tok * P, pairs + 2 * tok, 0
    raise KeyError(d)


def _mamba3(d: str, s: dict, B: int, L: int) -> tuple[int, int, int, int]:
    H, P, N, S = s["nheads"], s["headdim_v"], s["headdim_qk"], s["headdim_angles"]
    rot = 2 * N + 17 * S  # biases on q and k; per angle tanh-rate step and mod 2 pi (5), two rotated pairs (12)
    if d == "siso_step":  # per (b, h): rot, alpha, sigmoid, beta, gamma; per state 5 (the update) + 2 (h' q);
        n = B * H * P  # per row D V, silu(Z) gate, the row's beta v_state and gamma V
        return 0, n * (7 * N + 8) + B * H * (rot + 6), n + 2 * B * H, 3 * S * B * H
    if d == "mimo_step":  # per (b, h): the angles (5 S) once, per rank biases and rotated pairs (2N + 12 S); per
        R, n = s["mimo_rank"], B * H * P  # state alpha h + R rank terms (4 each) + R dots (2 each); per row
        #                                   and rank x_r twice, D x_r, the gate (Z MIMO_Z, silu), MIMO_Out (~8)
        flops = n * ((1 + 6 * R) * N + 8 * R) + B * H * (R * (2 * N + 12 * S) + 5 * S + 6)
        return 0, flops, n * R + 2 * B * H, 3 * S * B * H
    if d == "siso_preprocess":  # per (b, t, h): rot, the diagonal dot (2N), cumsum, sigmoid, scale, skip;
        tok = B * L * H  # input states: init = ssm + DT_0 (1 - lam_0) v k^T (3 per state)
        init = (3 * B * H * P * N + 4 * B * H, B * H) if s.get("has_init") else (0, 0)
        return 0, tok * (rot + 2 * N + 10) + init[0], tok + init[1], 3 * S * tok
    if d == "siso_preprocess_bwd":  # per (b, t, h): rot again, R^T dq and R^T dk (6N), the skip's dX / dY (4N),
        tok = B * L * H  # the bias sums (2N), the diagonal dot (2N); per angle the d theta (8), reverse cumsum,
        #                  dAngles and its DT term (9); dgamma, dnu, dDT, dTrap, dADT (~15); input states: c0,
        #                  dk_state, dv_state (6 per state)
        init = 6 * B * H * P * N if s.get("has_init") else 0
        return 0, tok * (rot + 14 * N + 17 * S + 15) + init, tok, 3 * S * tok
    raise KeyError(d)


def _norm(d: str, s: dict, rows: int) -> tuple[int, int, int, int]:
    n, gate = rows * s["hidden"], 1 if s.get("has_z") else 0
    if d == "fwd":  # silu(z) gate (3), the square and sum (2), scale by rstd and weight (2), bias
        return 0, n * (4 + 3 * gate + (1 if s.get("has_bias") else 0)), n * gate, 0
    # recompute u and xhat (1 + 3 gate), dy * w (1), the dot (2), du (3), ds (gate 1), dz (gate ~6),
    # dweight (2), dbias
    return 0, n * (9 + 10 * gate + (1 if s.get("has_bias") else 0)), n * gate, 0


def minimum(op: str, direction: str, static: dict, batch: int, seqlen: int,
            param_bytes: dict[str, int]) -> Minimum:
    """The minimum of kernel (op, direction) with model dims ``static`` at (batch, seqlen). KeyError for a
    kernel without a model."""
    if op == "causal_conv1d" and direction in ("fwd", "bwd"):
        mm, fl, ex, sf = _conv(direction, static, batch, seqlen)
    elif op == "selective_scan" and direction in ("fwd", "bwd"):
        mm, fl, ex, sf = _scan(direction, static, batch, seqlen)
    elif op == "selective_scan" and direction == "update":
        mm, fl, ex, sf = _update(static, batch)
    elif op == "rmsnorm_gated":
        mm, fl, ex, sf = _norm(direction, static, batch * seqlen)
    elif op == "ssd":
        mm, fl, ex, sf = _ssd(direction, static, batch, seqlen)
    elif op == "mamba3":
        mm, fl, ex, sf = _mamba3(direction, static, batch, seqlen)
    else:
        raise KeyError(f"{op}.{direction}")
    return Minimum(min_bytes(op, direction, param_bytes), mm, fl, ex, sf)
