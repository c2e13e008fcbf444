// tvm_mamba CUDA-on-CPU harness: stands in for the CUDA header of this name (see docs/cuda_sim.md).
//
// nvcuda::wmma, the warp matrix operations TVM emits for tensor cores (tvm_load_matrix_sync, tvm_mma_sync, ...).
// On a GPU a fragment is spread over the warp's 32 threads in an unspecified layout; here every thread holds
// the whole tile (a fragment is only ever read through these functions, so no code can tell) and runs each
// operation on it itself: a load reads the whole tile, mma_sync computes the whole product (float products of
// the 16-bit inputs, exact; summed over k in ascending order into the accumulator, in float), a store writes
// the lane's share of the tile (elements lane, lane + 32, ...), so a tile is whole only if the warp agreed.
// 8-bit operands and int accumulators (the s8 / u8 wmma, int32 accumulate) are held as integers: products and
// sums exact, the int32 sum wrapping as the GPU's does. load / store / mma_sync are warp collectives: the 32
// lanes meet at the call and the contract is checked (all lanes converged, one pointer and ldm, a 32-byte
// aligned pointer, ldm a multiple of 16 bytes). Not modelled: the GPU's own summation order inside one mma
// (results differ in the last bits).
#pragma once
#include <type_traits>

#include "tvm_mamba_cudasim.h"

namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K>
struct shape_of;
template <int M, int N, int K>
struct shape_of<matrix_a, M, N, K> { static constexpr int rows = M, cols = K; };
template <int M, int N, int K>
struct shape_of<matrix_b, M, N, K> { static constexpr int rows = K, cols = N; };
template <int M, int N, int K>
struct shape_of<accumulator, M, N, K> { static constexpr int rows = M, cols = N; };

// a fragment's element type here: int for the integer wmma (signed / unsigned char operands, int
// accumulators), float for every other
template <typename T>
using held_t = typename std::conditional<std::is_integral<T>::value, int, float>::type;

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = shape_of<Use, M, N, K>::rows, cols = shape_of<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  held_t<T> v[rows * cols];  // the whole tile, row-major
};

template <typename Use, int M, int N, int K, typename T, typename L>
inline bool col_layout(const fragment<Use, M, N, K, T, L>&) { return std::is_same<L, col_major>::value; }

// The warp contract, checked by the scheduler (tvm_mamba_cudasim_launch.h, resolve_wmma): the warp's 32 lanes meet
// here, at the same call, with one pointer and ldm; the pointer 32-byte aligned, ldm a multiple of 16 bytes.
inline void converge(const char* op, int line, const void* p, unsigned ldm, int elem) {
  ::tvm_mamba_sim::Fiber* f = ::tvm_mamba_sim::cur();
  f->op = op;
  f->elem = elem;
  ::tvm_mamba_sim::warp_collective(::tvm_mamba_sim::Coll::kWmma, 0xffffffffu, reinterpret_cast<uintptr_t>(p),
                                   static_cast<int>(ldm), 32, line);
}

// Every lane copies the whole tile, unobserved by the race checker, then records the reads of its share (elements
// lane, lane + 32, ...: on a GPU each lane loads part of the tile, in a layout CUDA leaves unspecified).
struct Unobserved {
  ::tvm_mamba_sim::Fiber* f = ::tvm_mamba_sim::g_chk.cur;
  Unobserved() { ::tvm_mamba_sim::g_chk.cur = nullptr; }
  ~Unobserved() { ::tvm_mamba_sim::g_chk.cur = f; }
};

template <typename P>
inline void note_share(const P* p, int rows, int cols, unsigned ldm, bool col, bool write) {
  for (int e = ::tvm_mamba_sim::cur()->lane; e < rows * cols; e += 32) {
    const int r = e / cols, c = e % cols;
    ::tvm_mamba_sim::note_access(col ? &p[c * ldm + r] : &p[r * ldm + c], sizeof(P), write, 1, true);
  }
}

template <typename Use, int M, int N, int K, typename T, typename L, typename P>
inline void load_matrix_sync_at(int line, fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, L>;
  converge("load_matrix_sync", line, p, ldm, sizeof(P));
  {
    Unobserved quiet;
    for (int r = 0; r < F::rows; ++r)
      for (int c = 0; c < F::cols; ++c)
        f.v[r * F::cols + c] = static_cast<held_t<T>>(col_layout(f) ? p[c * ldm + r] : p[r * ldm + c]);
  }
  note_share(p, F::rows, F::cols, ldm, col_layout(f), false);
}

template <int M, int N, int K, typename T>
inline void load_matrix_sync_at(int line, fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm,
                                layout_t layout) {
  converge("load_matrix_sync", line, p, ldm, sizeof(T));
  {
    Unobserved quiet;
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < N; ++c)
        f.v[r * N + c] = static_cast<held_t<T>>(layout == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]);
  }
  note_share(p, M, N, ldm, layout == mem_col_major, false);
}

// Each lane stores its share of the tile (elements lane, lane + 32, ...), as the GPU's lanes each store theirs.
template <int M, int N, int K, typename T>
inline void store_matrix_sync_at(int line, T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                                 layout_t layout) {
  converge("store_matrix_sync", line, p, ldm, sizeof(T));
  for (int e = ::tvm_mamba_sim::cur()->lane; e < M * N; e += 32) {
    const int r = e / N, c = e % N;
    (layout == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]) = static_cast<T>(f.v[e]);
  }
}

template <typename Use, int M, int N, int K, typename T, typename L, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, V value) {
  for (int e = 0; e < fragment<Use, M, N, K, T, L>::num_elements; ++e) f.v[e] = static_cast<held_t<T>>(value);
}

template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB, typename TC>
inline void mma_sync_at(int line, fragment<accumulator, M, N, K, TC>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                        const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, TC>& c) {
  converge("mma_sync", line, nullptr, 0, 0);
  held_t<TC> out[M * N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      held_t<TC> acc = c.v[m * N + n];
      for (int k = 0; k < K; ++k) {
        if constexpr (std::is_integral<TC>::value)  // int32 wraps on the GPU: unsigned arithmetic, no UB
          acc = static_cast<int>(static_cast<unsigned>(acc) + static_cast<unsigned>(a.v[m * K + k] * b.v[k * N + n]));
        else
          acc += a.v[m * K + k] * b.v[k * N + n];
      }
      out[m * N + n] = acc;
    }
  for (int e = 0; e < M * N; ++e) d.v[e] = out[e];
}

}  // namespace wmma
}  // namespace nvcuda

// The source line of each call, for the contract's messages (nvcuda::wmma::load_matrix_sync(...) becomes
// nvcuda::wmma::load_matrix_sync_at(__LINE__, ...)).
#define load_matrix_sync(...) load_matrix_sync_at(__LINE__, __VA_ARGS__)
#define store_matrix_sync(...) store_matrix_sync_at(__LINE__, __VA_ARGS__)
#define mma_sync(...) mma_sync_at(__LINE__, __VA_ARGS__)
