"""The conv's math at one (batch b, channel c, position): written once, for the TE definitions (__init__.py,
what the GPU rules schedule) and for the CPU's loop nests (schedules/cpu/causal_conv1d.py, which run it in a
scalar head, full vectors and a scalar tail).

Positions: ``xx`` is x extended to the left by the initial states (or zeros); a tap of output t reads
xx[t - (W-1) + k]. With seq_idx, a tap contributes only inside t's sequence, initial states belong to the
row's first sequence, and a padding output (seq_idx < 0) is 0. ``inside=True``: the caller's loop already
keeps the position inside the row (a CPU main loop: s >= 0, and for a gradient src < L), so the value is read
without clamps or bounds selects, only the seq_idx mask (what lets LLVM vectorize it).
"""
from __future__ import annotations

from tvm import tirx

from .._common import f32
from .._math import Math
from .dims import CausalConv1dBwd, CausalConv1dFwd

F32 = "float32"


class ConvMath:
    """The tap reads, the gradient reads and the activation of kernel dims ``d`` under ``m`` (the target's
    exp: CUDA's expf for the TE definitions, the vectorizable polynomials on the CPU)."""

    def __init__(self, d: CausalConv1dFwd | CausalConv1dBwd, m: Math):
        self.d, self.m, self.W, self.zero = d, m, d.width, tirx.const(0.0, F32)

    def _same(self, seq_idx, b, s, t):  # positions s and t (both inside the row) in one sequence
        return seq_idx[b, s] == seq_idx[b, t]

    def xx(self, x, init, seq_idx, b, c, s, t, inside: bool = False):
        """xx[b, c, s] as seen from output position t (float32): x, an initial state, or 0 across a seq_idx
        change (an initial state, at s < 0, belongs to the sequence of position 0, as dinit assumes)."""
        d = self.d
        if inside:
            v = f32(x[b, c, s])
            return tirx.Select(self._same(seq_idx, b, s, t), v, self.zero) if d.has_seq_idx else v
        value = f32(x[b, c, tirx.max(s, 0)])
        if d.has_seq_idx:
            value = tirx.Select(seq_idx[b, tirx.max(s, 0)] == seq_idx[b, t], value, self.zero)
        before = f32(init[b, c, tirx.max(s + (self.W - 1), 0)]) if d.has_init else self.zero
        if d.has_init and d.has_seq_idx:  # initial states continue the row's first sequence only
            before = tirx.Select(seq_idx[b, 0] == seq_idx[b, t], before, self.zero)
        return tirx.if_then_else(s >= 0, value, before)

    def final_state(self, x, init, b, c, L, j):
        """final_states[b, c, j] = xx[L - (W-1) + j] (float32; the row's last W-1 window values, seq_idx
        ignored: they are the state the next chunk continues from)."""
        s, d = L - (self.W - 1) + j, self.d
        before = f32(init[b, c, tirx.max(s + (self.W - 1), 0)]) if d.has_init else self.zero
        return tirx.if_then_else(s >= 0, f32(x[b, c, tirx.max(s, 0)]), before)

    def act(self, v):
        return self.m.silu(v) if self.d.activation == "silu" else v

    def out(self, seq_idx, b, t, pre):
        """The output at (b, t) of the pre-activation ``pre`` (float32): act(pre), 0 at a padding position."""
        return self._padded(self.act(pre), seq_idx, b, t)

    def grad(self, dout, seq_idx, b, c, t, pre):
        """g = dout * act'(pre) (float32): no gradient flows from a padding output (a constant 0)."""
        dv = self._padded(f32(dout[b, c, t]), seq_idx, b, t)
        return dv * self.m.silu_grad(pre) if self.d.activation == "silu" else dv

    def _padded(self, value, seq_idx, b, t):
        if not self.d.has_seq_idx:
            return value
        return tirx.Select(seq_idx[b, t] < 0, self.zero, value)

    def later_grad(self, g, seq_idx, L, b, c, src, s, inside: bool = False):
        """g[b, c, src] if src is a later position (< L) of s's sequence, else 0: what flows back to xx[s]
        through the tap of output src."""
        if inside:  # 0 <= s <= src < L
            val = g[b, c, src]
            return tirx.Select(self._same(seq_idx, b, src, s), val, self.zero) if self.d.has_seq_idx else val
        at = tirx.min(tirx.max(src, 0), L - 1)
        val = g[b, c, at]
        if self.d.has_seq_idx:
            val = tirx.Select(seq_idx[b, at] == seq_idx[b, tirx.max(s, 0)], val, self.zero)
        return tirx.if_then_else(tirx.all(src >= 0, src < L), val, self.zero)

    def final_grad(self, dfinal, L, b, c, s):
        """dfinal flows to position s when s is among the last W-1 positions of xx."""
        if not self.d.has_dfinal:
            return self.zero
        j = s - (L - (self.W - 1))
        return tirx.if_then_else(tirx.all(j >= 0, j < self.W - 1),
                                 f32(dfinal[b, c, tirx.min(tirx.max(j, 0), self.W - 2)]), self.zero)
