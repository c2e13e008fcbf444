"""The real scan's math, written once: the forward step and the adjoint step of one time step.

    forward:  dt = softplus?(delta + delta_bias);  h <- exp(dt A) h + dt B u;  y = C . h;
              out = (y + D u) * silu(z)
    adjoint:  dy = dout silu(z);  dz = dout (y + D u) silu'(z);  g <- g + dy C;  dC += dy h;  dB += g dt u;
              d dt = u sum_n g B + sum_n g h_{t-1} exp(dt A) A;  dA += dt g h_{t-1} exp(dt A);
              du = D dy + dt sum_n g B;  g <- exp(dt A) g   (then d delta = d dt softplus'(.))

``ScanMath`` holds the scalar expressions (reads of B / C per layout, dt, the finish); ``adjoint_state`` is
the per-state part of the adjoint as a macro over a ``Layout``'s indices. Every real template (forward,
chunked forward, backward, decode step) builds its expressions from these, so the operation order — and
with it the fp32 bit patterns — is the same on every layout.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .._math import Math
from .dims import ScanDims


class ScanMath:
    """Scalar pieces of the forward and adjoint steps in the accumulation dtype of ``dims`` (math ``m``)."""

    def __init__(self, dims: ScanDims, m: Math):
        self.d, self.m = dims, m

    def B(self, Bm, b, d, t, n):
        """B_t[n] of channel d: (batch, groups, seqlen, dstate) when varying, else (dim, dstate)."""
        m, s = self.m, self.d
        return m.cast(Bm[b, d // s.b_per_group, t, n]) if s.varying_B else m.cast(Bm[d, n])

    def C(self, Cm, b, d, t, n):
        m, s = self.m, self.d
        return m.cast(Cm[b, d // s.c_per_group, t, n]) if s.varying_C else m.cast(Cm[d, n])

    def pre_dt(self, delta, db, b, d, t):
        """delta + delta_bias (the softplus argument)."""
        return self.m.cast(delta[b, d, t]) + (db[d] if self.d.has_delta_bias else self.m.zero)

    def dt(self, x):
        return self.m.softplus(x) if self.d.delta_softplus else x

    def dt_at(self, delta, db, b, d, t):
        return self.dt(self.pre_dt(delta, db, b, d, t))

    def dt_grad(self, x):
        """d dt / d delta at x = delta + delta_bias."""
        return self.m.softplus_grad(x) if self.d.delta_softplus else self.m.one

    def gate(self, zv):
        """silu(z) (1 without z) of an accumulation-dtype z value."""
        return self.m.silu(zv) if self.d.has_z else self.m.one

    def gate_grad(self, zv):
        return self.m.silu_grad(zv) if self.d.has_z else self.m.one

    def z_at(self, z, b, d, t):
        return self.m.cast(z[b, d, t])

    def skip(self, Dv, u, b, d, t):
        """D u (0 without D)."""
        return Dv[d] * self.m.cast(u[b, d, t]) if self.d.has_D else self.m.zero

    def finish(self, y, u, Dv, z, b, d, t, skip: bool = True):
        """out = (y + D u) * silu(z) in u's dtype (``skip`` False: y already holds D u)."""
        y = y + self.skip(Dv, u, b, d, t) if skip else y
        return (y * self.m.silu(self.z_at(z, b, d, t)) if self.d.has_z else y).astype(self.d.u_dtype)

    @staticmethod
    def h_next(decay, h, dtu, bv):
        """One state's recurrence: exp(dt A) h + dt u B (``decay`` = exp(dt A))."""
        return decay * h + dtu * bv


def adjoint_state(sm: ScanMath, L):
    """The per-state part of one reverse step, a macro over layout ``L``'s indices (state n, register r,
    vector slot ki); s[0] = dt, s[1] = u, s[3] = dy. Accumulates the lane's dC / dB / dA partials (gC, gB,
    gA; varying B / C straight into the block's workspace row, the first channel of a block overwriting),
    the vector partials rv[0] += g B and rv[1] += g h_{t-1} exp(dt A) A of the dstate sums, and advances
    g to exp(dt A) g."""
    m, dims = sm.m, sm.d
    VARB, VARC = dims.varying_B, dims.varying_C

    @T.macro
    def step(A, Bm, Cm, wsB, wsC, hs, g, gA, gB, gC, ex, rv, s, b, blk, ci, d, t, i, n, r, ki, ok):
        gC[r] = gC[r] + s[3] * hs[i + 1, r]
        if VARC:
            if ok:
                wsC[b, blk, t, n] = T.Select(ci == 0, m.zero, wsC[b, blk, t, n]) + s[3] * hs[i + 1, r]
        g[r] = g[r] + s[3] * sm.C(Cm, b, d, t, n)
        gB[r] = gB[r] + g[r] * s[0] * s[1]
        if VARB:
            if ok:
                wsB[b, blk, t, n] = T.Select(ci == 0, m.zero, wsB[b, blk, t, n]) + g[r] * s[0] * s[1]
        rv[0, ki] = rv[0, ki] + g[r] * sm.B(Bm, b, d, t, n)
        ex[0, ki] = m.exp(s[0] * A[d, n])
        ex[1, ki] = g[r] * hs[i, r] * ex[0, ki]  # g h_{t-1} exp(dt A)
        rv[1, ki] = rv[1, ki] + ex[1, ki] * A[d, n]
        gA[r] = gA[r] + s[0] * ex[1, ki]
        g[r] = g[r] * ex[0, ki]

    return step
