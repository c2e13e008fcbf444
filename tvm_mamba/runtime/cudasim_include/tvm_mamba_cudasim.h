// tvm_mamba's CUDA execution model for the CPU: lets g++ compile the CUDA C source that TVM generates, unedited,
// and runs each kernel with GPU semantics (docs/cuda_sim.md).
//
//  * every thread of a block is a fiber with its own stack: __syncthreads() is a real barrier, locals are per
//    thread, and a barrier that some threads reach after others exited is reported, not hung on;
//  * __shared__ arrays are one per block (blocks run one after another) and are filled with 0xFF bytes (NaN,
//    -1) when each block starts, so a read that a missing barrier lets run early sees poison, not a stale value;
//  * warp intrinsics (__shfl*_sync, __activemask, __ballot_sync, __any/__all_sync, __syncwarp) rendezvous the
//    lanes their mask names and exchange values; a lane outside the mask, or one that has exited, is an error;
//  * threads and blocks run in a seeded random order (or forward / reversed), so code that relies on an order
//    the GPU does not promise gives different answers;
//  * bfloat16 / half convert with round-to-nearest-even as the GPU does; __dp4a, atomics, __ldg and the
//    fast-math intrinsics are implemented; anything else fails to compile, naming the intrinsic.
// The launcher entry points are generated per kernel by tvm_mamba/runtime/cudasim.py.
//
// Two parts, each compiled with the same flags (cudasim.link): the runtime -- scheduler, warp and wmma resolution,
// the race checker, fault handling and the library's own entry points, everything below guarded by
// TVM_MAMBA_SIM_RUNTIME -- once per flag set into an object that every kernel library links, and the kernels'
// source, which sees only what the kernels call. The runtime's state is hidden in each library, as if the whole
// header were compiled with every kernel (the runtime is thousands of lines that g++ would otherwise optimize
// again for every kernel).
#pragma once
#ifndef TVM_MAMBA_CUDASIM_H_
#define TVM_MAMBA_CUDASIM_H_

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <math.h>
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>

// ---- CUDA keywords --------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static
// One copy per block: a static in a section of its own, whose bounds the launcher knows (to poison it).
#define __shared__ static __attribute__((section("tvm_mamba_sim_shared")))
#ifndef __CUDA_ARCH__
#error "tvm_mamba_cudasim.h: compile with -D__CUDA_ARCH__=<arch*10> (cudasim.py does)"
#endif

namespace tvm_mamba_sim {

struct uint3_ { unsigned int x, y, z; };

enum class Wait : int { kReady, kBarrier, kWarp, kActiveMask, kDone };
enum class Coll : int { kShfl, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncWarp, kWmma };

struct Fiber {
  void* sp = nullptr;          // saved stack pointer while switched out
  char* stack = nullptr;       // mmap'd stack (a guard page below it)
  uint3_ tid{0, 0, 0};
  int linear = 0, lane = 0, warp = 0;
  Wait wait = Wait::kReady;
  int line = 0;                // source line of the barrier / collective it waits at
  // warp collective in flight
  Coll coll = Coll::kShfl;
  unsigned mask = 0;
  int arg = 0, width = 32;
  uint64_t value = 0, result = 0;
  const char* op = "";         // kWmma: the operation (load_matrix_sync, ...); value: its pointer, arg: ldm
  int elem = 0;                // kWmma: the element size in bytes (ldm's unit)
};

struct Launch {
  const char* kernel = "";
  uint3_ grid{1, 1, 1}, block{1, 1, 1}, bid{0, 0, 0};
  std::vector<Fiber> fibers;
  int nthreads = 0, nwarps = 0;
  void (*body)(void*) = nullptr;
  void* body_ctx = nullptr;
  void* sched_sp = nullptr;
  Fiber* cur = nullptr;
  char* dyn_shared = nullptr;
  size_t dyn_shared_bytes = 0;
  uint64_t rng = 0;
  int order = 0;               // 0 seeded random, 1 forward, 2 reversed
  std::string error;
  sigjmp_buf fault_jmp;
  volatile int in_kernel = 0;
};

inline Launch*& current() { static Launch* l = nullptr; return l; }
inline Fiber* cur() { return current()->cur; }

[[noreturn]] inline void fail_here(const std::string& what);

}  // namespace tvm_mamba_sim

#define threadIdx (::tvm_mamba_sim::cur()->tid)
#define blockIdx (::tvm_mamba_sim::current()->bid)
#define blockDim (::tvm_mamba_sim::current()->block)
#define gridDim (::tvm_mamba_sim::current()->grid)
#define warpSize 32

// ---- context switch (x86-64 System V; callee-saved registers, MXCSR and the x87 control word) ----------------
extern "C" __attribute__((visibility("hidden"))) void tvm_mamba_sim_switch(void** save_sp, void* new_sp);
extern "C" __attribute__((visibility("hidden"))) void tvm_mamba_sim_trampoline();
#ifdef TVM_MAMBA_SIM_RUNTIME
__asm__(
    ".text\n"
    ".hidden tvm_mamba_sim_switch\n.globl tvm_mamba_sim_switch\n.type tvm_mamba_sim_switch,@function\n"
    "tvm_mamba_sim_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".hidden tvm_mamba_sim_trampoline\n.globl tvm_mamba_sim_trampoline\n"
    ".type tvm_mamba_sim_trampoline,@function\n"
    "tvm_mamba_sim_trampoline:\n  movq %r12, %rdi\n  call *%r13\n  ud2\n");
#endif

namespace tvm_mamba_sim {

inline void yield_to_scheduler() {
  Launch* l = current();
  Fiber* f = l->cur;
  tvm_mamba_sim_switch(&f->sp, l->sched_sp);
}

inline void fiber_main(void*) {
  Launch* l = current();
  l->body(l->body_ctx);
  l->cur->wait = Wait::kDone;
  yield_to_scheduler();
  __builtin_trap();  // never resumed
}

[[noreturn]] inline void fail_here(const std::string& what) {
  Launch* l = current();
  l->error = what;
  siglongjmp(l->fault_jmp, 2);
}

// ---- block barrier and warp collectives ------------------------------------------------------------------------
inline void syncthreads_at(int line) {
  Fiber* f = cur();
  f->wait = Wait::kBarrier;
  f->line = line;
  yield_to_scheduler();
}

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp shuffle of a value wider than 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

inline uint64_t warp_collective(Coll c, unsigned mask, uint64_t value, int arg, int width, int line) {
  Fiber* f = cur();
  f->wait = Wait::kWarp;
  f->coll = c;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
  f->line = line;
  yield_to_scheduler();
  return f->result;
}

inline unsigned activemask_at(int line) {
  Fiber* f = cur();
  f->wait = Wait::kActiveMask;
  f->line = line;
  yield_to_scheduler();
  return static_cast<unsigned>(f->result);
}

}  // namespace tvm_mamba_sim

#define __syncthreads() ::tvm_mamba_sim::syncthreads_at(__LINE__)
#define __activemask() ::tvm_mamba_sim::activemask_at(__LINE__)
// __syncwarp() and __syncwarp(mask): a functor carrying the line (`, ##__VA_ARGS__` does not drop the comma of an
// empty argument in -std=c++17)
#define __syncwarp(...) ::tvm_mamba_sim::SyncWarp{__LINE__}(__VA_ARGS__)

namespace tvm_mamba_sim {
struct SyncWarp {
  int line;
  void operator()(unsigned mask = 0xffffffffu) const { warp_collective(Coll::kSyncWarp, mask, 0, 0, 32, line); }
};
template <typename T>
inline T shfl(Coll c, unsigned mask, T var, int arg, int width, int line) {
  return from_bits<T>(warp_collective(c, mask, to_bits(var), arg, width, line));
}
}  // namespace tvm_mamba_sim

#define __shfl_sync(mask, var, ...) ::tvm_mamba_sim::shfl_call(::tvm_mamba_sim::Coll::kShfl, __LINE__, mask, var, __VA_ARGS__)
#define __shfl_up_sync(mask, var, ...) ::tvm_mamba_sim::shfl_call(::tvm_mamba_sim::Coll::kShflUp, __LINE__, mask, var, __VA_ARGS__)
#define __shfl_down_sync(mask, var, ...) ::tvm_mamba_sim::shfl_call(::tvm_mamba_sim::Coll::kShflDown, __LINE__, mask, var, __VA_ARGS__)
#define __shfl_xor_sync(mask, var, ...) ::tvm_mamba_sim::shfl_call(::tvm_mamba_sim::Coll::kShflXor, __LINE__, mask, var, __VA_ARGS__)
#define __ballot_sync(mask, pred) static_cast<unsigned>(::tvm_mamba_sim::warp_collective(::tvm_mamba_sim::Coll::kBallot, mask, (pred) ? 1 : 0, 0, 32, __LINE__))
#define __any_sync(mask, pred) static_cast<int>(::tvm_mamba_sim::warp_collective(::tvm_mamba_sim::Coll::kAny, mask, (pred) ? 1 : 0, 0, 32, __LINE__))
#define __all_sync(mask, pred) static_cast<int>(::tvm_mamba_sim::warp_collective(::tvm_mamba_sim::Coll::kAll, mask, (pred) ? 1 : 0, 0, 32, __LINE__))

namespace tvm_mamba_sim {
template <typename T>
inline T shfl_call(Coll c, int line, unsigned mask, T var, int arg, int width = 32) {
  return shfl<T>(c, mask, var, arg, width, line);
}
}  // namespace tvm_mamba_sim

#include "tvm_mamba_cudasim_checks.h"
#include "tvm_mamba_cudasim_types.h"
#include "tvm_mamba_cudasim_launch.h"
#include "tvm_mamba_cudasim_fastmath.h"

// nvcc accepts `__shared__ alignas(64) float buf[8];`; g++ rejects a standard attribute after the `static` that
// __shared__ becomes, so the generated source's alignas is spelled as the GNU attribute (every standard header
// is already included above).
#define alignas(n) __attribute__((aligned(n)))

#endif  // TVM_MAMBA_CUDASIM_H_
