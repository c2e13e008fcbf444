// tvm_mamba CUDA-on-CPU harness: CUDA's value types and device functions (included by tvm_mamba_cudasim.h).
// bfloat16 / half follow cuda_bf16.hpp / cuda_fp16.hpp: storage is the 16-bit pattern, float -> 16-bit rounds to
// nearest even (NaN stays NaN), arithmetic is done in float and rounded once, as sm_80+ does.
#pragma once

namespace tvm_mamba_sim {
inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t float_to_bf16_rn(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN, as __float2bfloat16 returns it
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t b) { return u2f(static_cast<uint32_t>(b) << 16); }
inline uint16_t float_to_half_rn(float f) {
  _Float16 h = static_cast<_Float16>(f);  // IEEE round-to-nearest-even
  uint16_t b; std::memcpy(&b, &h, 2); return b;
}
inline float half_to_float(uint16_t b) { _Float16 h; std::memcpy(&h, &b, 2); return static_cast<float>(h); }
}  // namespace tvm_mamba_sim

#define TVM_MAMBA_SIM_HALF_TYPE(NAME, TO, FROM)                                                             \
  struct __align__(2) NAME {                                                                                \
    uint16_t __x;                                                                                           \
    NAME() = default;                                                                                       \
    NAME(float f) : __x(::tvm_mamba_sim::TO(f)) {}                                                          \
    NAME(double f) : __x(::tvm_mamba_sim::TO(static_cast<float>(f))) {}                                     \
    NAME(int v) : __x(::tvm_mamba_sim::TO(static_cast<float>(v))) {}                                        \
    NAME(unsigned int v) : __x(::tvm_mamba_sim::TO(static_cast<float>(v))) {}                               \
    NAME(long long v) : __x(::tvm_mamba_sim::TO(static_cast<float>(v))) {}                                  \
    NAME(long v) : __x(::tvm_mamba_sim::TO(static_cast<float>(v))) {}                                       \
    NAME(short v) : __x(::tvm_mamba_sim::TO(static_cast<float>(v))) {}                                      \
    NAME(signed char v) : __x(::tvm_mamba_sim::TO(static_cast<float>(v))) {}                                \
    NAME(unsigned char v) : __x(::tvm_mamba_sim::TO(static_cast<float>(v))) {}                              \
    operator float() const { return ::tvm_mamba_sim::FROM(__x); }                                           \
    NAME& operator+=(const NAME& o) { return *this = NAME(float(*this) + float(o)); }                       \
    NAME& operator-=(const NAME& o) { return *this = NAME(float(*this) - float(o)); }                       \
    NAME& operator*=(const NAME& o) { return *this = NAME(float(*this) * float(o)); }                       \
    NAME& operator/=(const NAME& o) { return *this = NAME(float(*this) / float(o)); }                       \
  };                                                                                                        \
  inline NAME operator+(const NAME& a, const NAME& b) { return NAME(float(a) + float(b)); }                 \
  inline NAME operator-(const NAME& a, const NAME& b) { return NAME(float(a) - float(b)); }                 \
  inline NAME operator*(const NAME& a, const NAME& b) { return NAME(float(a) * float(b)); }                 \
  inline NAME operator/(const NAME& a, const NAME& b) { return NAME(float(a) / float(b)); }                 \
  inline NAME operator-(const NAME& a) { NAME r; r.__x = a.__x ^ 0x8000u; return r; }                      \
  inline bool operator==(const NAME& a, const NAME& b) { return float(a) == float(b); }                     \
  inline bool operator!=(const NAME& a, const NAME& b) { return float(a) != float(b); }                     \
  inline bool operator<(const NAME& a, const NAME& b) { return float(a) < float(b); }                       \
  inline bool operator<=(const NAME& a, const NAME& b) { return float(a) <= float(b); }                     \
  inline bool operator>(const NAME& a, const NAME& b) { return float(a) > float(b); }                       \
  inline bool operator>=(const NAME& a, const NAME& b) { return float(a) >= float(b); }                     \
  struct __align__(4) NAME##2 {                                                                             \
    NAME x, y;                                                                                              \
    NAME##2() = default;                                                                                    \
    NAME##2(NAME a, NAME b) : x(a), y(b) {}                                                                 \
  };

TVM_MAMBA_SIM_HALF_TYPE(__nv_bfloat16, float_to_bf16_rn, bf16_to_float)
TVM_MAMBA_SIM_HALF_TYPE(__half, float_to_half_rn, half_to_float)
#undef TVM_MAMBA_SIM_HALF_TYPE
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
typedef __half half;
typedef __half2 half2;

inline float __bfloat162float(__nv_bfloat16 a) { return float(a); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(static_cast<float>(d)); }
inline float __half2float(__half a) { return float(a); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
#define TVM_MAMBA_SIM_HALF_OPS(T)                                                                           \
  inline bool __hgt(T a, T b) { return float(a) > float(b); }                                               \
  inline bool __hlt(T a, T b) { return float(a) < float(b); }                                               \
  inline bool __hge(T a, T b) { return float(a) >= float(b); }                                              \
  inline bool __hle(T a, T b) { return float(a) <= float(b); }                                              \
  inline bool __heq(T a, T b) { return float(a) == float(b); }                                              \
  inline T __hadd(T a, T b) { return a + b; }                                                               \
  inline T __hsub(T a, T b) { return a - b; }                                                               \
  inline T __hmul(T a, T b) { return a * b; }                                                               \
  inline T __hdiv(T a, T b) { return a / b; }                                                               \
  inline T __hfma(T a, T b, T c) { return T(std::fmaf(float(a), float(b), float(c))); }                     \
  inline T __hneg(T a) { return -a; }                                                                       \
  inline T __habs(T a) { T r = a; r.__x &= 0x7fffu; return r; }                                             \
  inline T hexp(T a) { return T(expf(float(a))); }                                                          \
  inline T hlog(T a) { return T(logf(float(a))); }                                                          \
  inline T hsqrt(T a) { return T(sqrtf(float(a))); }                                                        \
  inline T hrsqrt(T a) { return T(1.0f / sqrtf(float(a))); }                                                \
  inline T htanh(T a) { return T(tanhf(float(a))); }                                                        \
  inline T hfloor(T a) { return T(floorf(float(a))); }                                                      \
  inline T hceil(T a) { return T(ceilf(float(a))); }                                                        \
  inline T __hmax(T a, T b) { return float(a) > float(b) ? a : b; }                                         \
  inline T __hmin(T a, T b) { return float(a) < float(b) ? a : b; }
TVM_MAMBA_SIM_HALF_OPS(__nv_bfloat16)
TVM_MAMBA_SIM_HALF_OPS(__half)
#undef TVM_MAMBA_SIM_HALF_OPS

// ---- vector types ----------------------------------------------------------------------------------------------
#define TVM_MAMBA_SIM_VEC(T, NAME, A1, A2, A3, A4)                                                          \
  struct __align__(A1) NAME##1 { T x; };                                                                    \
  struct __align__(A2) NAME##2 { T x, y; };                                                                 \
  struct NAME##3 { T x, y, z; };                                                                            \
  struct __align__(A4) NAME##4 { T x, y, z, w; };                                                           \
  inline NAME##1 make_##NAME##1(T x) { return NAME##1{x}; }                                                 \
  inline NAME##2 make_##NAME##2(T x, T y) { return NAME##2{x, y}; }                                         \
  inline NAME##3 make_##NAME##3(T x, T y, T z) { return NAME##3{x, y, z}; }                                 \
  inline NAME##4 make_##NAME##4(T x, T y, T z, T w) { return NAME##4{x, y, z, w}; }
TVM_MAMBA_SIM_VEC(float, float, 4, 8, 4, 16)
TVM_MAMBA_SIM_VEC(double, double, 8, 16, 8, 16)
TVM_MAMBA_SIM_VEC(int, int, 4, 8, 4, 16)
TVM_MAMBA_SIM_VEC(unsigned int, uint, 4, 8, 4, 16)
TVM_MAMBA_SIM_VEC(signed char, char, 1, 2, 1, 4)
TVM_MAMBA_SIM_VEC(unsigned char, uchar, 1, 2, 1, 4)
TVM_MAMBA_SIM_VEC(short, short, 2, 4, 2, 8)
TVM_MAMBA_SIM_VEC(unsigned short, ushort, 2, 4, 2, 8)
TVM_MAMBA_SIM_VEC(long long, longlong, 8, 16, 8, 16)
TVM_MAMBA_SIM_VEC(unsigned long long, ulonglong, 8, 16, 8, 16)  // ulonglong4: TVM's 32-byte float32x8 (a bf16x8 load widened)
#undef TVM_MAMBA_SIM_VEC
typedef ::tvm_mamba_sim::uint3_ dim3_;

// ---- arithmetic device functions -------------------------------------------------------------------------------
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> max(A a, B b) { using C = std::common_type_t<A, B>; return C(a) > C(b) ? C(a) : C(b); }
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> min(A a, B b) { using C = std::common_type_t<A, B>; return C(a) < C(b) ? C(a) : C(b); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __saturatef(float a) { return a < 0.f ? 0.f : (a > 1.f ? 1.f : a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline double rsqrt(double a) { return 1.0 / std::sqrt(a); }
// sincospi[f](x, &s, &c) = sin(pi x), cos(pi x): quadrant q = rint(2x) and r = x - q/2 in [-1/4, 1/4] are exact, as
// on the GPU (sinpi of an integer is exactly +-0, of -0 is -0); sin / cos of pi r in long double; inf/NaN give NaN.
namespace tvm_mamba_sim {
inline void sincospi_l(long double x, long double* s, long double* c) {
  if (!std::isfinite(x)) { *s = *c = x - x; return; }
  const long double q = std::nearbyint(2.0L * x), r = q == 0.0L ? x : x - 0.5L * q, a = 3.14159265358979323846264338327950288L * r;
  const long double sr = std::sin(a), cr = std::cos(a);
  switch (static_cast<int>(std::fmod(std::fabs(q), 4.0L)) * (q < 0 ? -1 : 1) & 3) {
    case 0: *s = sr; *c = cr; break;
    case 1: *s = cr; *c = -sr; break;
    case 2: *s = -sr; *c = -cr; break;
    default: *s = -cr; *c = sr; break;
  }
}
}  // namespace tvm_mamba_sim
inline void sincospif(float x, float* s, float* c) {
  long double sl, cl; tvm_mamba_sim::sincospi_l(x, &sl, &cl); *s = static_cast<float>(sl); *c = static_cast<float>(cl);
}
inline void sincospi(double x, double* s, double* c) {
  long double sl, cl; tvm_mamba_sim::sincospi_l(x, &sl, &cl); *s = static_cast<double>(sl); *c = static_cast<double>(cl);
}
inline int __float2int_rn(float a) { return static_cast<int>(nearbyintf(a)); }
inline int __float2int_rz(float a) { return static_cast<int>(a); }
inline int __popc(unsigned int v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline unsigned int __brev(unsigned int v) {
  unsigned int r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
inline int __mul24(int a, int b) { return a * b; }
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }

// __dp4a: four signed (or unsigned) byte products accumulated into c, as sm_61+ does.
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i)
    c += static_cast<int>(static_cast<int8_t>(a >> (8 * i))) * static_cast<int>(static_cast<int8_t>(b >> (8 * i)));
  return c;
}
inline unsigned int __dp4a(unsigned int a, unsigned int b, unsigned int c) {
  for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
  return c;
}
inline int __dp4a(char4 a, char4 b, int c) {
  return c + a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

template <typename T>
inline T __ldg(const T* p) { return *p; }
inline void __threadfence() {}
inline void __threadfence_block() {}

// Atomics: the threads of a block are fibers of one OS thread and blocks run one after another, so a plain
// read-modify-write is atomic here. Not instrumented (an atomic is no race): only the alignment is checked.
#define TVM_MAMBA_SIM_ATOMIC(NAME, NEW)                                                                      \
  template <typename T>                                                                                     \
  TVM_MAMBA_SIM_NOTSAN inline T NAME(T* p, T v) {                                                           \
    ::tvm_mamba_sim::note_access(p, sizeof(T), true, sizeof(T), false);                                     \
    T old = *p;                                                                                             \
    *p = NEW;                                                                                               \
    return old;                                                                                             \
  }
TVM_MAMBA_SIM_ATOMIC(atomicAdd, old + v)
TVM_MAMBA_SIM_ATOMIC(atomicSub, old - v)
TVM_MAMBA_SIM_ATOMIC(atomicExch, v)
TVM_MAMBA_SIM_ATOMIC(atomicMax, old > v ? old : v)
TVM_MAMBA_SIM_ATOMIC(atomicMin, old < v ? old : v)
TVM_MAMBA_SIM_ATOMIC(atomicAnd, old & v)
TVM_MAMBA_SIM_ATOMIC(atomicOr, old | v)
#undef TVM_MAMBA_SIM_ATOMIC
template <typename T>
TVM_MAMBA_SIM_NOTSAN inline T atomicCAS(T* p, T cmp, T v) {
  ::tvm_mamba_sim::note_access(p, sizeof(T), true, sizeof(T), false);
  T old = *p;
  if (old == cmp) *p = v;
  return old;
}
