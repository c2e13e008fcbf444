"""The gated norms' per-element math, written once: for the TE definitions (__init__.py, what the GPU rules
schedule) and for the CPU's loop nests (schedules/cpu/rmsnorm_gated.py, which add up the group statistics in
vector partial sums and then call these per element).

Every value is at (row r, column h) and reads its inputs from a mapping ``B`` of what can be indexed
(``B["x"][r, h]``): TE tensors in the TE definitions, TVMScript buffers in the CPU loop nests; a flag the dims
leave off never reads its buffer. The group's statistics come in as float32 expressions: the mean mu
(LayerNorm; ignored, and may be None, for RMSNorm), the rstd rs, and in the backward the group MEANS
c1 = mean(dxhat * xhat) and c2 = mean(dxhat) (LayerNorm; ignored for RMSNorm). Each side keeps its reductions'
own structure (TE reduce computes, the CPU's per-lane partial sums); only these formulas are shared.

The dropout mask is a counter-based hash of (row seed, column) (:func:`dropout_keep`): plain integer
arithmetic, the same expression on the CPU (vectorized) and CUDA, and forward and backward recompute the same
mask from the row's seed.
"""
from __future__ import annotations

from tvm import tirx

from .._common import f32
from .._math import Math
from .dims import NormDims

F32 = "float32"


def _u32(v: int) -> tirx.PrimExpr:
    return tirx.const(v, "uint32")


def _mix32(v):
    """A 32-bit integer hash with full avalanche (the "lowbias32" finalizer: xor-shift, multiply, twice)."""
    v = v ^ (v >> _u32(16))
    v = v * _u32(0x21F0AAAD)
    v = v ^ (v >> _u32(15))
    v = v * _u32(0x735A2D97)
    return v ^ (v >> _u32(15))


def dropout_keep(seed, h, p: float):
    """Whether element ``h`` of the row with int32 ``seed`` is kept by dropout with probability ``p``: a
    counter-based uniform u = hash(seed, h) / 2^32 in [0, 1) (24 bits), kept when u >= p, so forward and
    backward recompute the same mask from the row's seed (upstream keeps per-row seeds too). Plain integer
    arithmetic: the same expression on the CPU (vectorized) and CUDA."""
    hv = _mix32(h.astype("uint32") * _u32(0x9E3779B9) + _u32(0x7F4A7C15))
    u = (_mix32(hv ^ seed.astype("uint32")) >> _u32(8)).astype(F32) * tirx.const(2.0 ** -24, F32)
    return u >= tirx.const(p, F32)


class NormMath:
    """What both directions share, for norm dims ``d`` under ``m`` (the target's exp: CUDA's expf for the TE
    definitions, the vectorizable polynomials on the CPU); ``out_dtype`` is the dtype of the kernel's
    outputs (the forward's out / out1: x's; the backward's dx / dz / dx1: dout's)."""

    def __init__(self, d: NormDims, m: Math, out_dtype: str, wide: str = "float64"):
        self.d, self.m, self.out_dtype, self.wide = d, m, out_dtype, wide

    def dropout(self, v, seeds, r, h):
        """upstream's dropout of one float32 element: kept ones scaled by 1 / (1 - p), the mask from the row's
        seed ``seeds[r]``; v itself without dropout."""
        p = self.d.dropout_p
        if p <= 0:
            return v
        return tirx.Select(dropout_keep(seeds[r], h, p), v / tirx.const(1.0 - p, F32), tirx.const(0.0, F32))

    def keep_mask(self, seeds, r, h, dtype: str = "uint8"):
        """The stored dropout mask (uint8: 1 where kept; ``dtype`` int32 for a mask held as words)."""
        return dropout_keep(seeds[r], h, self.d.dropout_p).astype(dtype)

    def zf(self, B, r, h):
        return f32(B["z"][r, h])

    def gated_in(self, B, v, r, h):
        """v * silu(z) when gating before the norm (norm_before_gate=False), else v."""
        return v * self.m.silu(self.zf(B, r, h)) if self.d.gate_in else v

    def normalized(self, v, mu, rs):
        """(v - mu) * rs (v * rs for RMSNorm)."""
        return (v if self.d.is_rms_norm else v - mu) * rs


class FwdMath(NormMath):
    """The forward: s = dropout(x (* rowscale)) (+ dropout(x1)) (+ residual); u = s (* silu(z) when gating
    before the norm); xhat = (u - mu) * rs; out = xhat * weight (+ bias) (* silu(z) when norm_before_gate);
    out1 = xhat * weight1 (+ bias1)."""

    def s(self, B, r, h):
        d = self.d
        x = f32(B["x"][r, h])
        v = self.dropout(x * B["rowscale"][r] if d.has_rowscale else x, B["seeds"], r, h)
        if d.has_x1:
            v = v + self.dropout(f32(B["x1"][r, h]), B["seeds1"], r, h)
        return v + f32(B["residual"][r, h]) if d.has_residual else v

    def u(self, B, r, h):
        return self.gated_in(B, self.s(B, r, h), r, h)

    def u64(self, B, r, h, mu=None):
        """u widened to ``wide`` (the reductions over x: float64, or float32 on a target without float64),
        less the group mean ``mu`` (in ``wide``) when given (LayerNorm's centred value; RMSNorm never
        centres)."""
        v = self.u(B, r, h).astype(self.wide)
        return v if self.d.is_rms_norm or mu is None else v - mu

    def xhat(self, B, mu, rs, r, h):
        return self.normalized(self.u(B, r, h), mu, rs)

    def y(self, B, mu, rs, r, h):
        """out (out_dtype)."""
        v = self.xhat(B, mu, rs, r, h) * f32(B["weight"][h])
        if self.d.has_bias:
            v = v + f32(B["bias"][h])
        if self.d.gate_out:
            v = v * self.m.silu(self.zf(B, r, h))
        return v.astype(self.out_dtype)

    def y1(self, B, mu, rs, r, h):
        """out1 (out_dtype), upstream's parallel norm."""
        v = self.xhat(B, mu, rs, r, h) * f32(B["weight1"][h])
        return (v + f32(B["bias1"][h]) if self.d.has_bias1 else v).astype(self.out_dtype)


class BwdMath(NormMath):
    """The backward (see compute/rmsnorm_gated/ for the formulas): B["x"] is the forward's s, so
    u = x (* silu(z)); xhat, dy, dy1, dxhat, du, ds, and the outputs dx, dz, dx1 in out_dtype."""

    def xhat(self, B, mu, rs, r, h):
        return self.normalized(self.gated_in(B, f32(B["x"][r, h]), r, h), mu, rs)

    def dy(self, B, r, h):
        v = f32(B["dout"][r, h])
        return v * self.m.silu(self.zf(B, r, h)) if self.d.gate_out else v

    def dy1(self, B, r, h):
        return f32(B["dout1"][r, h])

    def dxhat(self, B, r, h):
        v = self.dy(B, r, h) * f32(B["weight"][h])
        return v + self.dy1(B, r, h) * f32(B["weight1"][h]) if self.d.has_weight1 else v

    def du(self, B, mu, rs, c1, c2, r, h):
        v = self.dxhat(B, r, h) - self.xhat(B, mu, rs, r, h) * c1
        return rs * (v if self.d.is_rms_norm else v - c2)

    def ds(self, B, mu, rs, c1, c2, r, h):
        """d s (float32): the gradient of the forward's s, dresidual added (dresidual_in is this, cast)."""
        v = self.gated_in(B, self.du(B, mu, rs, c1, c2, r, h), r, h)
        return v + f32(B["dresidual"][r, h]) if self.d.has_dresidual else v

    def dx(self, B, mu, rs, c1, c2, r, h):
        v = self.dropout(self.ds(B, mu, rs, c1, c2, r, h), B["seeds"], r, h)
        return (v * B["rowscale"][r] if self.d.has_rowscale else v).astype(self.out_dtype)

    def dx1(self, B, mu, rs, c1, c2, r, h):
        return self.dropout(self.ds(B, mu, rs, c1, c2, r, h), B["seeds1"], r, h).astype(self.out_dtype)

    def dz(self, B, mu, rs, c1, c2, r, h):
        """dout * y * silu'(z) (norm_before_gate) or du * s * silu'(z)."""
        d, m = self.d, self.m
        if d.norm_before_gate:
            bias = f32(B["bias"][h]) if d.has_bias else tirx.const(0.0, F32)  # the CPU's + 0 kept
            yv = self.xhat(B, mu, rs, r, h) * f32(B["weight"][h]) + bias
            v = f32(B["dout"][r, h]) * yv * m.silu_grad(self.zf(B, r, h))
        else:
            v = self.du(B, mu, rs, c1, c2, r, h) * f32(B["x"][r, h]) * m.silu_grad(self.zf(B, r, h))
        return v.astype(self.out_dtype)
