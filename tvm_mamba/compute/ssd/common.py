"""The SSD math every template shares: the decay step and its clamp, dt' = clamp(softplus(dt + dt_bias)),
the segment decays and sequence masks, the gate g = dy silu(z). Expressions only (no loops): templates
place them, strategies choose the math they lower to (``m``: a ``compute._math.Math``)."""
from __future__ import annotations

from tvm import tirx

F32 = "float32"
I32 = "int32"
NEG = -100.0  # exp(-100) == 0 in _math.exp (inputs below -87 give 0): the masked-out exponent
DA_MIN = -110.0  # the lowest dt'*A step: exp(-110) = 1.7e-48 is 0 in float32 (exp(-104) ~ the last denormal)
Z4 = (1, 1, 1, 1)  # the shape of an absent optional 4-d tensor


def c32(v):
    return tirx.const(v, F32)


def dA_step(dt, A):
    """dt' * A clamped below at DA_MIN (issue #16): A = -inf (or a huge negative A) gives decay exp(DA_MIN) = 0,
    exactly as exp(dt' A) = 0, while every cumsum and segment difference stays finite (-inf - -inf was NaN for
    the whole head). dt' = 0 (past seqlen; no step) gives 0 even for A = -inf (0 * -inf); NaN stays NaN."""
    u = dt * A
    lo = tirx.const(DA_MIN, F32)
    return tirx.Select(u >= lo, u, tirx.Select(u < lo, lo, tirx.Select(dt == c32(0.0), c32(0.0), u)))


def dA_passes(dt, A):
    """Whether dA_step passes its gradient (dt' * A >= DA_MIN): a clamped step has zero gradient w.r.t. dt'
    and A (torch.clamp's rule; the true d exp(dt A) = A exp(dt A) or dt exp(dt A) is 0 in float32 there)."""
    return dt * A >= tirx.const(DA_MIN, F32)


def dt_stages(m, tmp, raw, dt_bias, h, dt_limit, has_dt_bias, dt_softplus, has_dt_limit):
    """The stages of dt' = clamp(softplus(dt + dt_bias)) as (slot, expr) pairs, each stored in a scalar slot
    ``tmp[i]`` (so no exp is nested inside another: inlined, the polynomial trees took LLVM 5 s to compile one
    kernel, and nvcc spilled). Slots: 0 pre-activation, 1 before the clamp, 2 dt', 3 d dt' / d dt (torch
    semantics: the clamp passes the gradient on [lo, hi])."""
    v = raw + dt_bias[h] if has_dt_bias else raw
    gs = m.softplus_grad(tmp[0]) if dt_softplus else c32(1.0)
    if has_dt_limit:
        gs = tirx.Select(tirx.all(tmp[1] >= dt_limit[0], tmp[1] <= dt_limit[1]), gs, c32(0.0))
    return [(0, v), (1, m.softplus(tmp[0]) if dt_softplus else tmp[0]),
            (2, tirx.min(tirx.max(tmp[1], dt_limit[0]), dt_limit[1]) if has_dt_limit else tmp[1]), (3, gs)]


class Row:
    """row[q] -> at(q): a chunk row read where it lies (the helpers below index rows the CPU loop nests stage,
    and sequence ids as ``sids[t]``: seq_idx[b, t] of a batch row, or a 1-d seq_idx itself)."""

    def __init__(self, at):
        self.at = at

    def __getitem__(self, q):
        return self.at(q)


def batch_sids(seq_idx, b):
    """Batch row b's sequence ids by position: sids[t] = seq_idx[b, t]."""
    return Row(lambda t: seq_idx[b, t])


def prev_sid(sids, c, Q):
    """The sequence id of the state entering chunk c: chunk c-1's last position's, 0 for c = 0 (initial_states
    belong to sequence 0)."""
    return tirx.if_then_else(c > 0, sids[tirx.max(c * Q, 1) - 1], tirx.const(0, I32))


def last_sid(sids, c, Q, seqlen):
    """The sequence id of chunk c's last position (the ragged last chunk: of position seqlen - 1)."""
    return sids[tirx.min(c * Q + Q, seqlen) - 1]


def chunk_scale(m, seq_idx, dA_cs, b, h, c, Q, seqlen, has_seq_idx):
    """exp(dA_cs[c, Q-1]), zeroed when chunk c's last sequence id differs from chunk c-1's (0 for c = 0)."""
    a = m.exp(dA_cs[b, h, c, Q - 1])
    if not has_seq_idx:
        return a
    sids = batch_sids(seq_idx, b)
    return tirx.Select(last_sid(sids, c, Q, seqlen) == prev_sid(sids, c, Q), a, c32(0.0))


def ld(buf, idx, seqlen, t):
    """buf[idx] as float32 when position t < seqlen, else 0 (t is clamped into range for the load)."""
    return tirx.if_then_else(t < seqlen, buf[idx].astype(F32), c32(0.0))


def seg_exp(m, acs, sid, l, s, has_seq_idx):
    """exp(acs[l] - acs[s]) for s <= l in the same sequence, else 0 (masked before the exp)."""
    return seg_exp_of(m, acs[l], acs[s], (sid[l], sid[s]) if has_seq_idx else None, l, s)


def seg_exp_of(m, a_l, a_s, sids, l, s):
    """``seg_exp`` from the values at l and s: dA_cs (a_l, a_s) and, with seq_idx, the pair of sequence ids."""
    ok = s <= l
    if sids is not None:
        ok = tirx.all(ok, sids[0] == sids[1])
    return m.exp(tirx.Select(ok, a_l - a_s, c32(NEG)))


def gate(m, dy, z, idx, seqlen, t, has_z):
    """g = dy * silu(z) (the gradient reaching the pre-gate output), 0 past seqlen."""
    g = ld(dy, idx, seqlen, t)
    if has_z:
        g = g * m.silu(ld(z, idx, seqlen, t))
    return g


def with_state_dtype(static: dict, state_dtype: str) -> dict:
    """static plus state_dtype when it is not the default float32 (default stamps stay as before)."""
    return dict(static, state_dtype=state_dtype) if state_dtype != F32 else static


def carried_decay(m, a_l, sid_l, sids, c, Q, has_seq_idx):
    """e[l] = exp(dA_cs[l]) (a_l), the decay of the state carried into chunk c up to position l; 0 where l's
    sequence id (sid_l) is not that state's (``prev_sid``): the carried state is another sequence's."""
    v = m.exp(a_l)
    if not has_seq_idx:
        return v
    return tirx.Select(sid_l == prev_sid(sids, c, Q), v, c32(0.0))


def state_decay(m, a_last, a_l, sid_l, sids, c, Q, seqlen, has_seq_idx):
    """exp(dA_cs[Q-1] - dA_cs[l]) (a_last - a_l), the decay from position l to the chunk's end; 0 where l's
    sequence id (sid_l) is not that of the chunk's last position (l's state counts toward its sequence only)."""
    v = m.exp(a_last - a_l)
    if not has_seq_idx:
        return v
    return tirx.Select(sid_l == last_sid(sids, c, Q, seqlen), v, c32(0.0))


def skip(Dm, h, p, v, has_D, D_has_hdim):
    """D[h] v (D[h, p] v with D per channel): the skip connection's term; 0 without D."""
    if not has_D:
        return c32(0.0)
    return (Dm[h, p] if D_has_hdim else Dm[h]) * v


def d_shape(d, batch, nchunks):
    """D's buffer shape (chunk_scan and its backward): (nheads,) per head, (nheads, headdim) per channel,
    (batch, nheads, nchunks, chunk_size) per position with ``diag_skip`` (dt_out's layout), or a (1,)
    placeholder without D."""
    if d.diag_skip:
        return (batch, d.nheads, nchunks, d.chunk_size)
    return ((d.nheads, d.headdim) if d.D_has_hdim else (d.nheads,)) if d.has_D else (1,)


def d_per_row(d) -> bool:
    """Whether D is one value per chunk position (per head, or per position with ``diag_skip``), not per
    channel: a value a layout may stage with a tile row's per-position values (chunk_scan), or put on the
    diagonal of a causal product (chunk_scan_bwd's dx)."""
    return d.has_D and (d.diag_skip or not d.D_has_hdim)


def skip_at(d, Dm, b, h, c, l, p, v):
    """The skip term of value v at chunk position l (batch b, head h, chunk c, channel p): D[b, h, c, l] v with
    ``diag_skip`` (per position), else ``skip`` (per head or channel; 0 without D)."""
    if d.diag_skip:
        return Dm[b, h, c, l] * v
    return skip(Dm, h, p, v, d.has_D, d.D_has_hdim)


def causal(d, l, s):
    """Whether pair (l, s) of a chunk is in the intra-chunk causal sum: s <= l, s < l with ``diag_skip`` (the
    diagonal term is the per-position skip), s // G < l // G with ``step_group`` G > 1 (a group's own block is
    the caller's)."""
    G = d.step_group
    if G > 1:
        return s // G < l // G
    return s < l if d.diag_skip else s <= l


def causal_end(d, l):
    """The end of row l's causal range (pairs (l, s) for s < causal_end): l + 1, l with ``diag_skip``, the start
    of l's step group with ``step_group`` > 1."""
    G = d.step_group
    if G > 1:
        return l // G * G
    return l + 1 - (1 if d.diag_skip else 0)  # (written as the launch form always has: the same IR)


def causal_start(d, s):
    """The start of column s's causal range (pairs (l, s) for l >= causal_start): s, s + 1 with ``diag_skip``,
    the start of the next step group with ``step_group`` > 1."""
    G = d.step_group
    if G > 1:
        return (s // G + 1) * G
    return s + (1 if d.diag_skip else 0)
