// What nvcc's --use_fast_math does to a kernel's float math, for the CPU harness (docs/cuda_sim.md, "Fast math").
//
// runtime/nvcc.py's one flag set decides; cudasim.py passes -D__USE_FAST_MATH__ exactly when that set holds
// --use_fast_math (nvcc defines the same macro). With it, nvcc 13 for sm_90 compiles (read from its PTX):
//
//   expf(x), __expf(x)   mul.ftz.f32 t = x * 0x3FB8AA3B (log2 e, rounded to fp32); ex2.approx.ftz.f32 t
//   exp2f(x)             ex2.approx.ftz.f32 x;   exp10f(x): x * 0x40549A78 (log2 10), then ex2.approx
//   logf(x), __logf(x)   lg2.approx.ftz.f32 x; mul.ftz.f32 by 0x3F317218 (ln 2);   log2f: lg2.approx;
//                        log10f: lg2.approx times 0x3E9A209B (log10 2)
//   powf(x, y)           ex2.approx(y * lg2.approx(x))
//   sinf, cosf, tanf     sin.approx / cos.approx (tanf: their approximate quotient)
//   tanhf(x)             tanh.approx.f32 x
//   sqrtf, rsqrtf        sqrt.approx.ftz, rsqrt.approx.ftz;   __fdividef(x, y): div.approx.ftz
//   every fp32 op        -ftz=true: subnormal inputs and results are flushed to (signed) zero
//
// How each is modelled (error bounds: CUDA Math API, "Single Precision Intrinsics"; PTX ISA):
//  * ex2.approx: 2^t of the fp32 argument, rounded to fp32. The instruction's own error (2 ulp) is not modelled;
//    the error that matters is modelled exactly: __expf's argument t = fl(x * log2e) is off by up to
//    |t| 2^-24 (plus log2e's own rounding), and 2^t then by a relative |t| 2^-24 ln 2 = |x| 2^-24, i.e. up to
//    |x| ulp: why the documented bound, 2 + floor(1.173 |x|) ulp, grows with |x|
//    (tests/runtime/test_cudasim_fastmath.py measures both).
//  * lg2.approx: a fixed-point mantissa logarithm. log2(m) for the mantissa m in [1, 2) is rounded to a multiple
//    of 2^-22 (absolute error <= 2^-23; documented for __log2f: 2^-22 absolute on [0.5, 2], 2 ulp elsewhere), so
//    logf(1 + e) loses its relative accuracy near 1 as on the GPU (documented __logf: 2^-21.41 absolute).
//  * sin.approx / cos.approx: the argument reduced as fl(x * fl(1 / 2pi)) (its rounding grows with |x|, the
//    "larger otherwise" of the documented 2^-21.41 absolute error on [-pi, pi]), the result rounded to a
//    multiple of 2^-22.
//  * tanh.approx: tanh rounded to 16 significant bits (relative error <= 2^-16). The PTX ISA promises only 2^-11
//    relative; MUFU.TANH measures 1.11e-5 (2^-16.5) at worst (N. Juffa, NVIDIA developer forums, 2021), which
//    this reproduces; a kernel that needs tanh better than that fails here as it would there.
//  * sqrt.approx, rsqrt.approx (documented 1 and 2 ulp) and div.approx (2 ulp for |y| in [2^-126, 2^126])
//    are correctly rounded here; __fdividef's documented range cut (x / y = 0 for 2^126 < |y| < 2^128) is
//    modelled. `x / y` on floats also becomes div.approx under --use_fast_math; the harness cannot rewrite the
//    operator and keeps IEEE division (an error of at most 2 ulp missed, far below every test tolerance).
//  * ftz: the x86 MXCSR flush-to-zero and denormals-are-zero bits are set while a kernel runs (FpMode, held by
//    each generated entry point; fibers inherit the launcher's MXCSR), so every SSE float op flushes as the
//    GPU's .ftz ops do. (x86 also flushes doubles there; kernels compute in float.)
#pragma once
#ifndef TVM_MAMBA_CUDASIM_FASTMATH_H_
#define TVM_MAMBA_CUDASIM_FASTMATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <xmmintrin.h>

#ifdef __USE_FAST_MATH__
namespace tvm_mamba_sim {

// MXCSR bit 15 flush-to-zero (results), bit 6 denormals-are-zero (inputs): nvcc's -ftz=true for a kernel's span.
struct FpMode {
  unsigned saved;
  FpMode() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FpMode() { _mm_setcsr(saved); }
  FpMode(const FpMode&) = delete;
  FpMode& operator=(const FpMode&) = delete;
};

namespace fastmath {

inline float f32(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
// a product rounded to fp32 and flushed, as mul.ftz.f32 (the volatile keeps g++ from folding it into double)
inline float mul(float a, float b) { volatile float p = ftz(a) * ftz(b); return ftz(p); }
// v rounded to a multiple of 2^-k (a fixed-point result)
inline double fixed(double v, int k) { return std::nearbyint(std::ldexp(v, k)) * std::ldexp(1.0, -k); }

inline float ex2(float t) { return ftz(static_cast<float>(std::exp2(static_cast<double>(ftz(t))))); }

inline float lg2(float x) {
  x = ftz(x);
  if (std::isnan(x) || x < 0.0f) return std::nanf("");
  if (x == 0.0f) return -INFINITY;
  if (std::isinf(x)) return INFINITY;
  int e;
  const double m = 2.0 * std::frexp(static_cast<double>(x), &e);  // x = m 2^(e-1), m in [1, 2)
  return static_cast<float>((e - 1) + fixed(std::log2(m), 22));
}

inline float sin_(float x) {
  if (!std::isfinite(x)) return std::nanf("");
  const double turns = mul(x, 0.159154937f);  // fl(x / 2pi)
  return ftz(static_cast<float>(fixed(std::sin(6.283185307179586 * turns), 22)));
}
inline float cos_(float x) {
  if (!std::isfinite(x)) return std::nanf("");
  const double turns = mul(x, 0.159154937f);
  return ftz(static_cast<float>(fixed(std::cos(6.283185307179586 * turns), 22)));
}

inline float tanh_(float x) {
  if (std::isnan(x)) return x;
  const double t = std::tanh(static_cast<double>(x));
  if (t == 0.0) return static_cast<float>(t);
  int e;
  std::frexp(t, &e);  // |t| in [2^(e-1), 2^e): 16 significant bits = a multiple of 2^(e-16)
  return static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(t, 16 - e)), e - 16));
}

inline float div_(float x, float y) {
  x = ftz(x);
  y = ftz(y);
  const float ay = std::fabs(y);
  if (ay > 0x1p126f && ay < INFINITY) return std::isinf(x) ? std::nanf("") : std::copysign(0.0f, x) * std::copysign(1.0f, y);
  return ftz(x / y);
}

inline float exp_(float x) { return ex2(mul(x, f32(0x3FB8AA3Bu))); }
inline float exp10_(float x) { return ex2(mul(x, f32(0x40549A78u))); }
inline float log_(float x) { return mul(lg2(x), f32(0x3F317218u)); }
inline float log10_(float x) { return mul(lg2(x), f32(0x3E9A209Bu)); }
inline float pow_(float x, float y) { return ex2(mul(y, lg2(x))); }
inline float tan_(float x) { return div_(sin_(x), cos_(x)); }
inline float sqrt_(float x) { return ftz(std::sqrt(ftz(x))); }
inline float rsqrt_(float x) { return ftz(static_cast<float>(1.0 / std::sqrt(static_cast<double>(ftz(x))))); }
inline void sincos_(float x, float* s, float* c) { *s = sin_(x); *c = cos_(x); }

}  // namespace fastmath
}  // namespace tvm_mamba_sim

// The kernel source (included after this header) calls the C names; nvcc maps them as listed above.
#define expf(x) ::tvm_mamba_sim::fastmath::exp_(x)
#define __expf(x) ::tvm_mamba_sim::fastmath::exp_(x)
#define exp2f(x) ::tvm_mamba_sim::fastmath::ex2(x)
#define exp10f(x) ::tvm_mamba_sim::fastmath::exp10_(x)
#define __exp10f(x) ::tvm_mamba_sim::fastmath::exp10_(x)
#define logf(x) ::tvm_mamba_sim::fastmath::log_(x)
#define __logf(x) ::tvm_mamba_sim::fastmath::log_(x)
#define log2f(x) ::tvm_mamba_sim::fastmath::lg2(x)
#define __log2f(x) ::tvm_mamba_sim::fastmath::lg2(x)
#define log10f(x) ::tvm_mamba_sim::fastmath::log10_(x)
#define __log10f(x) ::tvm_mamba_sim::fastmath::log10_(x)
#define powf(x, y) ::tvm_mamba_sim::fastmath::pow_(x, y)
#define __powf(x, y) ::tvm_mamba_sim::fastmath::pow_(x, y)
#define sinf(x) ::tvm_mamba_sim::fastmath::sin_(x)
#define __sinf(x) ::tvm_mamba_sim::fastmath::sin_(x)
#define cosf(x) ::tvm_mamba_sim::fastmath::cos_(x)
#define __cosf(x) ::tvm_mamba_sim::fastmath::cos_(x)
#define tanf(x) ::tvm_mamba_sim::fastmath::tan_(x)
#define __tanf(x) ::tvm_mamba_sim::fastmath::tan_(x)
#define sincosf(x, s, c) ::tvm_mamba_sim::fastmath::sincos_(x, s, c)
#define __sincosf(x, s, c) ::tvm_mamba_sim::fastmath::sincos_(x, s, c)
#define tanhf(x) ::tvm_mamba_sim::fastmath::tanh_(x)
#define sqrtf(x) ::tvm_mamba_sim::fastmath::sqrt_(x)
#define rsqrtf(x) ::tvm_mamba_sim::fastmath::rsqrt_(x)
#define __fdividef(x, y) ::tvm_mamba_sim::fastmath::div_(x, y)
#define fdividef(x, y) ::tvm_mamba_sim::fastmath::div_(x, y)

#else   // precise math: IEEE division and square root, libm functions, subnormals kept (-ftz=false)
namespace tvm_mamba_sim {
struct FpMode {};
}  // namespace tvm_mamba_sim
#endif  // __USE_FAST_MATH__

#endif  // TVM_MAMBA_CUDASIM_FASTMATH_H_
