"""Vectorizable float32 math for CPU loop nests: exp, sigmoid, tanh, silu, softplus.

Why: TVM lowers ``T.exp`` to LLVM's ``llvm.exp`` intrinsic, which LLVM scalarizes into one libm call per
vector lane (a conv1d + SiLU went from 0.42 ms to 9.5 ms). These versions are plain arithmetic, so a
``T.vectorized`` loop stays in zmm registers.

exp: Cody-Waite range reduction x = n*ln2 + r, |r| <= ln2/2, a degree-6 Taylor polynomial for e^r
(truncation error r^7/7! < 1.2e-7 relative), and 2^n built in the exponent bits. Max relative error
against float64 exp is ~2e-7 on [-87, 88] (tests/compute/test_math.py). Inputs below -87 give ~1e-38
give 0; NaN propagates; +inf saturates at e^88 ~ 1.65e38.
"""
from __future__ import annotations

import functools

from tvm import tirx

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # ln2 split so that n*_LN2_HI is exact for |n| < 2^11
_LN2_LO = 1.428606820309417e-06
_COEFFS = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)  # Horner, highest power first


def _c(v: float):
    return tirx.const(v, "float32")


def exp(x):
    """e^x for a float32 PrimExpr, vectorizable (no libm call)."""
    xc = tirx.min(tirx.max(x, _c(-87.0)), _c(88.0))
    n = tirx.floor(xc * _c(_LOG2E) + _c(0.5))
    r = xc - n * _c(_LN2_HI) - n * _c(_LN2_LO)
    p = _c(_COEFFS[0])
    for coef in _COEFFS[1:]:
        p = p * r + _c(coef)
    scale = tirx.reinterpret("float32", tirx.shift_left(n.astype("int32") + 127, tirx.const(23, "int32")))
    # NaN in, NaN out (the clamp above would drop it); below -87 return 0 instead of ~1e-38.
    res = tirx.Select(x < _c(-87.0), _c(0.0), p * scale)
    return tirx.Select(is_nan(x), x, res)


def is_nan(x, dtype: str = "float32"):
    """Whether x (a float32 or float64 PrimExpr, ``dtype``) is NaN, from its bits: an ``x != x`` test is folded
    away under LLVM's fast-math flags."""
    ib, mag, inf = (("int64", 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000) if dtype == "float64" else
                    ("int32", 0x7FFFFFFF, 0x7F800000))
    return (tirx.reinterpret(ib, x) & tirx.const(mag, ib)) > tirx.const(inf, ib)


def reciprocal(d):
    """1 / d for d >= 1 (the sigmoid denominator), division-free: a bit-trick first guess (rel. error
    <= 12%) and three Newton steps r <- r (2 - d r) (error squares each step: ~1e-7 after three). vdivps on
    zmm costs ~10 cycles of throughput; this is six FMAs (conv1d + SiLU forward at (4, 768, 2048): 1.75 -> 1.67 ms)."""
    d = tirx.min(d, _c(4.0e37))  # keeps the bit-trick guess a normal float (1/4e37 = 2.5e-38)
    guess = tirx.reinterpret("float32", tirx.const(0x7EF311C3, "int32") - tirx.reinterpret("int32", d))
    r = guess
    for _ in range(3):
        r = r * (_c(2.0) - d * r)
    return r


def sigmoid(x):
    """1 / (1 + e^-x)."""
    return reciprocal(_c(1.0) + exp(-x))


# tanh(x) ~ x P(x^2) / Q(x^2) on |x| <= 9 (tanh rounds to +-1 in float32 beyond ~8.7): a (9, 8) rational
# fitted here by iteratively reweighted least squares on the relative error (fit error 2e-8; evaluated in
# float32 the error is <= 3.3e-7 relative, tests/compute/test_math.py).
_TANH_P = (0.9999999795613904, 0.13381029497634064, 0.0034955905176978896, 2.06090405435586e-05,
           1.3354477704104973e-08)
_TANH_Q = (1.0, 0.46714345160432946, 0.025876996961711585, 0.0003285635088399482, 7.776508087962017e-07)


def _poly(coeffs, u):
    acc = _c(coeffs[-1])
    for coef in reversed(coeffs[:-1]):
        acc = acc * u + _c(coef)
    return acc


def tanh(x):
    """tanh(x) as one rational function: 2 clamps, 9 FMAs and one division, no exp (cheaper than
    exp + reciprocal; SiLU through it made the conv1d + SiLU forward at (4, 768, 2048) 1.85 -> 1.15 ms)."""
    xc = tirx.min(tirx.max(x, _c(-9.0)), _c(9.0))
    u = xc * xc
    return xc * _poly(_TANH_P, u) / _poly(_TANH_Q, u)


def silu(x):
    """x * sigmoid(x) = h + h tanh(h), h = x / 2. For x < 0 the factor 1 + tanh(h) cancels: absolute error
    <= 2e-7 |x| (about one float32 ulp of x), relative 2e-6 elsewhere."""
    h = _c(0.5) * x
    return h + h * tanh(h)


def silu_grad(x):
    """d silu / dx = s (1 + x (1 - s)) with s = (1 + t) / 2, t = tanh(x / 2): (1 + t) / 2 + x (1 - t^2) / 4."""
    t = tanh(_c(0.5) * x)
    return _c(0.5) + _c(0.5) * t + _c(0.25) * x * (_c(1.0) - t * t)


def log1p_small(y):
    """log(1 + y) for y in [0, 1] (y = e^-|x| in softplus), vectorizable: atanh series on u = y / (2 + y),
    log(1+y) = 2*(u + u^3/3 + u^5/5 + ...), |u| <= 1/3, 8 terms: error < 3^-17/17 ~ 5e-10."""
    u = y / (_c(2.0) + y)
    u2 = u * u
    acc = _c(1.0 / 15)
    for k in (13, 11, 9, 7, 5, 3, 1):
        acc = acc * u2 + _c(1.0 / k)
    return _c(2.0) * u * acc


def softplus(x):
    """log(1 + e^x) = max(x, 0) + log1p(e^-|x|); equals x above 20 as in torch/mamba_ssm."""
    sp = tirx.max(x, _c(0.0)) + log1p_small(exp(-tirx.abs(x)))
    return tirx.Select(x > _c(20.0), x, sp)


def softplus_grad(x):
    """d softplus / dx = sigmoid(x) (1 above the threshold 20)."""
    return tirx.Select(x > _c(20.0), _c(1.0), sigmoid(x))


class Math:
    """exp / softplus / sigmoid / silu and their derivatives in an accumulation dtype: the one place where
    a target's math is chosen. Templates call ``m.exp(x)`` etc.; the strategy decides what it lowers to.

    ``native=False`` (CPU loop nests, float32): the vectorizable polynomials above — ``T.exp`` on a vector
    is one libm call per lane. SiLU goes through tanh, exact at huge |x| (x * sigmoid(x) with the
    polynomial exp + Newton reciprocal gave silu'(1e20) = 7e12 and silu(-1e36) = -0.025).
    ``native=True`` (CUDA, or any float64 build): the target's own exp / log1p (CUDA expf / log1pf); the
    polynomials cost 20-100 extra registers per kernel there and spilled.
    ``sincospi=True`` (CUDA): the target has ``sincospi[f]`` (see ``sincospi``), and a rotation by an angle
    is computed through it instead of ``cos`` / ``sin``.
    ``libm=False`` (WebGPU): the target's functions are WGSL's (exp, log, tanh, sin, cos): no log1p / expm1,
    which native math then forms from exp and log with their rounding error corrected (:meth:`log1p`,
    :meth:`expm1`).
    """

    def __init__(self, acc: str = "float32", native: bool = False, sincospi: bool = False, libm: bool = True):
        self.acc, self.native, self.has_sincospi, self.libm = acc, native, sincospi, libm
        self.zero, self.one = tirx.const(0.0, acc), tirx.const(1.0, acc)
        self.poly = acc == "float32" and not native

    def const(self, v: float):
        return tirx.const(v, self.acc)

    def keep_nan(self, x, y):
        """y, or x where x is NaN: around a clamp, which maps NaN to a bound (max / min on a CPU and fmaxf /
        fminf on CUDA return the other operand), and the polynomial sigmoid / tanh, which clamp their input."""
        return tirx.Select(is_nan(x, self.acc), x, y)

    def cast(self, x):
        dtype = getattr(x, "dtype", None)  # a TVMScript buffer load (TensorLoad) has no .dtype here
        return x if dtype == self.acc else x.astype(self.acc)

    def exp(self, x):
        return exp(x) if self.poly else tirx.exp(x)

    def sigmoid(self, x):
        return sigmoid(x) if self.poly else self.one / (self.one + tirx.exp(-x))

    def softplus(self, x):
        if self.poly:
            return softplus(x)
        return tirx.Select(x > self.const(20.0), x, self.log1p(tirx.exp(x)))

    def log1p(self, y):
        """log(1 + y): the target's log1p, or without libm log(u) * y / (u - 1) with u = fl(1 + y) (the
        rounding of 1 + y cancels: accurate to a few ulp; y itself where u rounds to 1)."""
        if self.libm:
            return tirx.log1p(y)
        u = self.one + y
        return tirx.Select(u == self.one, y, tirx.log(u) * (y / (u - self.one)))

    def expm1(self, x):
        """e^x - 1: CUDA's expm1f (float32), or without libm (u - 1) * x / log(u) with u = exp(x) (Kahan's
        correction of the cancellation near 0; x itself where u rounds to 1, -1 where u - 1 does)."""
        if self.libm:
            return tirx.call_pure_extern("float32", "expm1f", x) if self.acc == "float32" else tirx.exp(x) - self.one
        u = tirx.exp(x)
        return tirx.Select(u == self.one, x,
                           tirx.Select(u - self.one == -self.one, -self.one, (u - self.one) * x / tirx.log(u)))

    def softplus_grad(self, x):
        return tirx.Select(x > self.const(20.0), self.one, self.sigmoid(x))

    def silu(self, x):
        return silu(x) if self.poly else x * self.sigmoid(x)

    def sincospi(self, x, sin_dst, cos_dst):
        """The statement ``sincospi[f](x, &sin_dst, &cos_dst)``: sin(pi x) and cos(pi x) (CUDA, <= 1 ulp)
        written to two buffer elements. Why not cosf / sinf: for |x| > 105615 their argument reduction takes
        a Payne-Hanek slow path with a 28-byte local array, and ptxas spilled 36-96 bytes around it in the
        complex-A scan kernels (sincosf too). sin(pi x)'s reduction is exact (x - rint(2x) / 2): no slow
        path. Only for targets with ``has_sincospi``."""
        name = "sincospif" if self.acc == "float32" else "sincospi"
        return tirx.call_extern("void", name, x, tirx.address_of(sin_dst), tirx.address_of(cos_dst))

    def tanh(self, x):
        """tanh(x), NaN kept. Native float32 goes through expm1f: CUDA's tanhf compiles to tanh.approx.f32
        under --use_fast_math (documented relative error 2^-11, about 1e-5 measured), and the rotary angle
        rate that takes tanh is summed over the whole sequence; expm1f (1 ulp, no fast-math form) keeps
        tanh(x) = e / (e + 2), e = expm1(2x), accurate near 0, and |x| > 9 rounds to +-1 in float32."""
        if self.poly:
            return tanh(x)
        if self.acc != "float32":
            return tirx.tanh(x)
        e = self.expm1(x + x)
        one = tirx.Select(x > self.zero, self.one, -self.one)
        return tirx.Select(tirx.abs(x) > self.const(9.0), one, e / (e + self.const(2.0)))

    def silu_grad(self, x):
        if self.poly:
            return silu_grad(x)
        s = self.sigmoid(x)
        return s * (self.one + x * (self.one - s))


@functools.lru_cache(maxsize=None)
def math_for(acc: str = "float32", native: bool = False, sincospi: bool = False, libm: bool = True) -> Math:
    """One shared :class:`Math` per choice, made on first use: its constants are TVM expressions, which a
    runtime-only TVM (no compiler) cannot make, so no module makes one at import."""
    return Math(acc, native, sincospi, libm)
