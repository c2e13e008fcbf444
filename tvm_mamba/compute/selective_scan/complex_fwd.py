"""Mamba-1 selective scan with a complex A (mamba_ssm 2.3.2 ``selective_scan_ref`` semantics, S4D-style), as
ONE loop-nest template per direction, laid out by a one-thread-per-lane ``Layout`` (serial, CPU vectors
over dstate pairs, a CUDA thread per lane).

    dt = softplus?(delta + delta_bias);  h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t   (h, A, B, C complex)
    y_t = 2 Re(C_t . h_t) + D u_t;  out = y * silu(z)

The complex state is kept as real/imaginary pairs; exp(dt A) is the rotation
exp(dt Re A) (cos(dt Im A), sin(dt Im A)), applied by one complex multiply per step and state.
Kernel layouts (the torch op builds them with views of the complex tensors, ``view_as_real``):
- u, delta, z, out: (batch, dim, seqlen); D, delta_bias: (dim,); A: (dim, dstate, 2) (re, im).
- B, C: ``groups == 0``: time-invariant complex (dim, dstate, 2) in ``acc``; else (batch, groups, seqlen,
  dstate, 2) — mamba_ssm's real (batch, groups, dstate, 2 seqlen) with (re, im) interleaved in time,
  transposed so one step reads dstate pairs.
- states (initial, last, checkpoints (batch, dim, nchunk, dstate, 2): the state before each chunk) in ``acc``.
One lane = one (batch, channel) in the forward, one (batch, block of channels) in the backward; dstate is
the vector loop (CPU), time is serial. The backward recomputes one chunk of states from its checkpoint,
then runs the reverse scan (torch's convention for complex gradients, dL/dRe + i dL/dIm):
    g_t = 2 dy_t conj(C_t) + conj(a_{t+1}) g_{t+1},  a_t = exp(dt_t A);  dC_t = 2 dy_t conj(h_t);
    dB_t = dt_t u_t g_t;  p_t = conj(a_t) conj(h_{t-1}) g_t;  dA = sum_t dt_t p_t;
    d dt_t = u_t Re(conj(B_t) g_t) + Re(conj(A) p_t);  du_t = D dy_t + dt_t Re(conj(B_t) g_t);
    dinit = conj(a_0) g_0.
"""
from __future__ import annotations

import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from .dims import ScanDims
from ._layout import Layout
from ._signature import scan_kernel
from ._step import ScanMath


class ComplexMath(ScanMath):
    """The complex scan's step pieces: B / C pair reads (k = 0 re, 1 im; a time-invariant B / C is complex in
    the accumulation dtype) and the rotation; dt, softplus and SiLU are the real scan's (``ScanMath``)."""

    def B(self, Bm, b, d, t, n, k):
        s = self.d
        return self.m.cast(Bm[b, d // s.b_per_group, t, n, k]) if s.varying_B else Bm[d, n, k]

    def C(self, Cm, b, d, t, n, k):
        s = self.d
        return self.m.cast(Cm[b, d // s.c_per_group, t, n, k]) if s.varying_C else Cm[d, n, k]

    def rotation(self):
        """The macro ``rot(ex, i, A, d, n, dt)``: ex[0, i], ex[1, i] = Re, Im of exp(dt A[d, n]) =
        exp(dt Re A) (cos, sin)(dt Im A).

        Without the target's ``sincospi``: ``cos`` / ``sin`` (the CPU). With it (CUDA; ex[2, i] is scratch):
        sin, cos(pi x) at x = fl(dt Im A / pi) (``Math.sincospi``: no slow path, no spills), rotated on by
        pi e, e = dt Im A / pi - x (exact through an fma and 1/pi split in two), to first order: the angle
        is dt Im A to within (pi e)^2 / 2 <= 2e-15 (dt Im A)^2, as accurate as cosf / sinf. Without that
        step the angle was off by up to ~2 ulp of dt Im A, and the state's error at angles ~3e5 up to 5x
        that of cos / sin (tests/cudasim/test_selective_scan.py::test_complex_A_large_rotations)."""
        m = self.m
        if not m.has_sincospi:

            @T.macro
            def rot(ex, i, A, d, n, dt):
                ex[0, i] = m.exp(dt * A[d, n, 0]) * tirx.cos(dt * A[d, n, 1])
                ex[1, i] = m.exp(dt * A[d, n, 0]) * tirx.sin(dt * A[d, n, 1])

            return rot
        hi = float(np.float32(1.0 / math.pi)) if m.acc == "float32" else 1.0 / math.pi
        inv_pi_hi, inv_pi_lo = m.const(hi), m.const(1.0 / math.pi - hi)
        fma = "fmaf" if m.acc == "float32" else "fma"

        def pi_e(theta):  # pi (theta / pi - x), x = fl(theta * inv_pi_hi): the angle x's rounding dropped
            x = theta * inv_pi_hi
            return m.const(math.pi) * (tirx.call_pure_extern(m.acc, fma, theta, inv_pi_hi, -x) + theta * inv_pi_lo)

        @T.macro
        def rot_pi(ex, i, A, d, n, dt):
            T.evaluate(m.sincospi(dt * A[d, n, 1] * inv_pi_hi, ex[1, i], ex[0, i]))
            ex[2, i] = ex[0, i] - pi_e(dt * A[d, n, 1]) * ex[1, i]
            ex[1, i] = m.exp(dt * A[d, n, 0]) * (ex[1, i] + pi_e(dt * A[d, n, 1]) * ex[0, i])
            ex[0, i] = m.exp(dt * A[d, n, 0]) * ex[2, i]

        return rot_pi


def _step_fns(dims: ScanDims, m):
    cm = ComplexMath(dims, m)
    return cm.B, cm.C, cm.pre_dt, cm.dt, cm.rotation()


def fwd_complex_template(dims: ScanDims, L: Layout) -> tirx.PrimFunc:
    """The forward loop nest (module docstring) laid out by ``L`` (one thread per lane)."""
    (dim, dstate, b_groups, c_groups, has_D, has_z, has_delta_bias, delta_softplus, has_init, chunk, u_dtype,
     B_dtype, C_dtype) = dims.static().values()
    N, V = dstate, L.V
    NV = N // V
    ACC = dims.acc
    m = L.math
    OUTER, INNER, TPB, SCOPE = L.block_loop, L.thread_loop, L.threads, L.scope
    VEC = L.vloop
    bval, cval, pre_dt, dt_of, rot = _step_fns(dims, m)
    two = tirx.const(2.0, ACC)

    @T.macro
    def body(u, delta, A, Bm, Cm, Dv, z, db, init, out, last, ck, batch, seqlen, nchunk):
        for lane_o in OUTER((batch * dim + TPB - 1) // TPB):
            for lane_i in INNER(TPB):
                if lane_o * TPB + lane_i < batch * dim:
                    lane = T.meta_var(lane_o * TPB + lane_i)
                    h = T.alloc_buffer((2, N), ACC, scope=SCOPE)  # (re, im) of the state
                    ex = T.alloc_buffer((3, V), ACC, scope=SCOPE)  # exp(dt A) (re, im), the new Re h
                    yv = T.alloc_buffer((V,), ACC, scope=SCOPE)
                    s = T.alloc_buffer((3,), ACC, scope=SCOPE)  # dt, dt*u, y
                    b = T.meta_var(lane // dim)
                    d = T.meta_var(lane % dim)
                    for k in range(2):
                        for no in range(NV):
                            for ni in VEC(V):
                                h[k, no * V + ni] = init[b, d, no * V + ni, k] if has_init else m.zero
                    for c in range(nchunk):
                        for no in range(NV):
                            for ni in VEC(V):
                                ck[b, d, c, no * V + ni, 0] = h[0, no * V + ni]
                                ck[b, d, c, no * V + ni, 1] = h[1, no * V + ni]
                        for t in range(c * chunk, T.min(seqlen, c * chunk + chunk)):
                            s[0] = dt_of(pre_dt(delta, db, b, d, t))
                            s[1] = s[0] * m.cast(u[b, d, t])
                            for ni in VEC(V):
                                yv[ni] = m.zero
                            for no in range(NV):
                                for ni in VEC(V):
                                    rot(ex, ni, A, d, no * V + ni, s[0])
                                    ex[2, ni] = (ex[0, ni] * h[0, no * V + ni] - ex[1, ni] * h[1, no * V + ni]
                                                 + s[1] * bval(Bm, b, d, t, no * V + ni, 0))
                                    h[1, no * V + ni] = (ex[0, ni] * h[1, no * V + ni] + ex[1, ni] * h[0, no * V + ni]
                                                         + s[1] * bval(Bm, b, d, t, no * V + ni, 1))
                                    h[0, no * V + ni] = ex[2, ni]
                                    yv[ni] = yv[ni] + (cval(Cm, b, d, t, no * V + ni, 0) * h[0, no * V + ni]
                                                       - cval(Cm, b, d, t, no * V + ni, 1) * h[1, no * V + ni])
                            s[2] = (Dv[d] * m.cast(u[b, d, t])) if has_D else m.zero
                            for ni in range(V):
                                s[2] = s[2] + two * yv[ni]
                            if has_z:
                                out[b, d, t] = (s[2] * m.silu(m.cast(z[b, d, t]))).astype(u_dtype)
                            else:
                                out[b, d, t] = s[2].astype(u_dtype)
                    for no in range(NV):
                        for ni in VEC(V):
                            last[b, d, no * V + ni, 0] = h[0, no * V + ni]
                            last[b, d, no * V + ni, 1] = h[1, no * V + ni]

    return scan_kernel(dims, L, body, pair=(2,))


