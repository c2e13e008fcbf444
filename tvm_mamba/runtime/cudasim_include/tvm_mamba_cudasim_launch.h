// tvm_mamba CUDA-on-CPU harness: the launcher (included by tvm_mamba_cudasim.h).
// A launch runs the grid's blocks one after another; a block runs its threads as fibers under a scheduler that
// resumes every runnable fiber until it blocks (barrier, warp collective, __activemask) or exits, then resolves
// what can complete. Faults (SIGSEGV/SIGBUS in a guard page, SIGILL from -fsanitize=bounds traps, SIGFPE) and
// semantic errors abort the launch with a message naming the kernel, block and thread.
#pragma once
#include <tvm/ffi/c_api.h>

extern "C" char __start_tvm_mamba_sim_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_tvm_mamba_sim_shared[] __attribute__((weak, visibility("hidden")));

namespace tvm_mamba_sim {

template <typename T>
inline T arg_as(const TVMFFIAny& a) {
  if constexpr (std::is_pointer<T>::value) {
    return a.type_index == kTVMFFINone ? nullptr : static_cast<T>(a.v_ptr);
  } else if constexpr (std::is_floating_point<T>::value) {
    return a.type_index == kTVMFFIFloat ? static_cast<T>(a.v_float64) : static_cast<T>(a.v_int64);
  } else {
    return a.type_index == kTVMFFIFloat ? static_cast<T>(a.v_float64) : static_cast<T>(a.v_int64);
  }
}

template <typename... P, size_t... I>
inline std::tuple<P...> convert_args(const TVMFFIAny* args, std::index_sequence<I...>) {
  return std::tuple<P...>(arg_as<P>(args[I])...);
}

inline int report(const char* kernel, const std::string& what) {
  std::string msg = std::string("cudasim: kernel ") + kernel + ": " + what;
  TVMFFIErrorSetRaisedFromCStr("RuntimeError", msg.c_str());
  return -1;
}

// Defined by the runtime part (hidden: each kernel library calls its own).
__attribute__((visibility("hidden"))) int run_launch(const char* name, void (*run)(void*), void* ctx,
                                                     const TVMFFIAny* tag_values, const char* const* tags, int ntags);
__attribute__((visibility("hidden"))) char* dyn_shared(const char* name);

// Run one launch of ``kernel``: the packed arguments are its parameters, then one value per launch tag
// ("blockIdx.x" ... "threadIdx.z", "tirx.use_dyn_shared_memory"), exactly what TVM's host code passes to the
// CUDA module's function of the same name.
template <typename... P>
int launch(const char* name, void (*kernel)(P...), const TVMFFIAny* args, int nargs, const char* const* tags,
           int ntags) {
  constexpr int np = sizeof...(P);
  if (nargs != np + ntags)
    return report(name, "expected " + std::to_string(np + ntags) + " packed arguments, got " + std::to_string(nargs));
  std::tuple<P...> params = convert_args<P...>(args, std::index_sequence_for<P...>{});
  struct Body {
    void (*k)(P...);
    std::tuple<P...>* p;
    static void run(void* ctx) { Body* b = static_cast<Body*>(ctx); std::apply(b->k, *b->p); }
  } body{kernel, &params};
  return run_launch(name, &Body::run, &body, args + np, tags, ntags);
}

}  // namespace tvm_mamba_sim

#define TVM_MAMBA_SIM_DYN_SHARED(T, NAME) T* NAME = reinterpret_cast<T*>(::tvm_mamba_sim::dyn_shared(#NAME))

#ifdef TVM_MAMBA_SIM_RUNTIME
namespace tvm_mamba_sim {

constexpr size_t kStack = 256 << 10;  // per thread; kernels keep small local arrays (ptxas: <= 1 KiB stack)

struct Config { int order = 0; uint64_t seed = 0; };
inline Config& config() { static Config c; return c; }

// The checker's view of a launch (tvm_mamba_cudasim_checks.h): the static __shared__ section (its shadow mapped once
// per library) and this launch's dynamic shared memory.
inline void checks_begin(const Launch* l) {
  g_chk.launch = l;
  if (!g_chk.on) return;
  Region& s = g_chk.regions[kStatic];
  if (s.shadow == nullptr && __start_tvm_mamba_sim_shared != nullptr)
    set_region(s, reinterpret_cast<uintptr_t>(__start_tvm_mamba_sim_shared),
               static_cast<size_t>(__stop_tvm_mamba_sim_shared - __start_tvm_mamba_sim_shared), Mem::kStaticShared, 0, "");
  if (l->dyn_shared_bytes)
    set_region(g_chk.regions[kDyn], reinterpret_cast<uintptr_t>(l->dyn_shared), l->dyn_shared_bytes, Mem::kDynShared, 0,
               g_chk.regions[kDyn].name);
}
inline void checks_end() {
  if (g_chk.regions[kDyn].shadow) set_region(g_chk.regions[kDyn], 0, 0, Mem::kDynShared, 0, "");
  g_chk.launch = nullptr;
}

inline size_t page() { static size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE)); return p; }

// One mmap'd stack per thread slot, each above a PROT_NONE guard page; kept across launches.
inline char* stack_pool(int n) {
  static char* base = nullptr;
  static int have = 0;
  if (n > have) {
    if (base) munmap(base, static_cast<size_t>(have) * (kStack + page()));
    size_t bytes = static_cast<size_t>(n) * (kStack + page());
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    base = static_cast<char*>(p);
    for (int i = 0; i < n; ++i) mprotect(base + static_cast<size_t>(i) * (kStack + page()), page(), PROT_NONE);
    have = n;
  }
  return base;
}

inline std::string thread_name(const Launch* l, const Fiber* f) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "block (%u,%u,%u), thread (%u,%u,%u)", l->bid.x, l->bid.y, l->bid.z,
                f->tid.x, f->tid.y, f->tid.z);
  return buf;
}

// ---- faults ----------------------------------------------------------------------------------------------------
inline void on_fault(int sig, siginfo_t* info, void*) {
  Launch* l = current();
  if (l == nullptr || !l->in_kernel) {  // not ours: fall back to the default action and re-fault
    signal(sig, SIG_DFL);
    return;
  }
  char buf[200];
  const char* what = sig == SIGILL ? "index out of the bounds of a local or __shared__ array (-fsanitize=bounds)"
                     : sig == SIGFPE ? "arithmetic fault (integer division by zero?)"
                     : info->si_code == SI_KERNEL ? "general protection fault (a misaligned vector access?)"
                                                  : "invalid memory access";
  std::snprintf(buf, sizeof(buf), "%s at address 0x%llx", what,
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(info->si_addr)));
  l->error = buf;
  if (l->cur) l->error += " in " + thread_name(l, l->cur);
  l->in_kernel = 0;
  siglongjmp(l->fault_jmp, 1);
}

struct FaultGuard {
  struct sigaction old[4];
  stack_t old_stack;
  static constexpr int kSigs[4] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
  FaultGuard() {
    static char* alt = static_cast<char*>(std::malloc(1 << 16));
    stack_t st{};
    st.ss_sp = alt;
    st.ss_size = 1 << 16;
    sigaltstack(&st, &old_stack);
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 4; ++i) sigaction(kSigs[i], &sa, &old[i]);
  }
  ~FaultGuard() {
    for (int i = 0; i < 4; ++i) sigaction(kSigs[i], &old[i], nullptr);
    sigaltstack(&old_stack, nullptr);
  }
};

// ---- scheduling ------------------------------------------------------------------------------------------------
inline uint64_t next_rand(uint64_t& s) {
  s ^= s << 13; s ^= s >> 7; s ^= s << 17;
  return s;
}

inline void permute(Launch* l, std::vector<int>& perm) {
  int n = static_cast<int>(perm.size());
  for (int i = 0; i < n; ++i) perm[i] = l->order == 2 ? n - 1 - i : i;
  if (l->order == 0)
    for (int i = n - 1; i > 0; --i) std::swap(perm[i], perm[static_cast<int>(next_rand(l->rng) % (i + 1))]);
}

inline int lanes_in_warp(const Launch* l, int w) { return std::min(32, l->nthreads - 32 * w); }

inline std::string block_name(const Launch* l) {
  return "block (" + std::to_string(l->bid.x) + "," + std::to_string(l->bid.y) + "," + std::to_string(l->bid.z) + ")";
}

inline std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// A wmma operation (mma.h) is a collective of the whole warp: all 32 lanes at the same call, with one pointer and
// one leading dimension; the pointer 32-byte aligned, ldm a multiple of 16 bytes (CUDA's wmma contract; a GPU
// gives undefined results otherwise). Returns whether lane i's operation completed.
inline bool resolve_wmma(Launch* l, int w, int i) {
  Fiber* lanes = &l->fibers[32 * w];
  const Fiber& a = lanes[i];
  const std::string what = std::string("wmma contract: ") + a.op + " at line " + std::to_string(a.line) +
                           " in warp " + std::to_string(w) + " of " + block_name(l);
  const int nl = lanes_in_warp(l, w);
  if (nl < 32)
    fail_here(what + ": the warp has " + std::to_string(nl) + " threads; a wmma operation needs all 32 lanes");
  for (int j = 0; j < 32; ++j) {
    const Fiber& b = lanes[j];
    if (b.wait == Wait::kDone)
      fail_here(what + ": lane " + std::to_string(j) + " has exited (all 32 lanes must call it together)");
    if (b.wait != Wait::kWarp) return false;  // not there yet
    if (b.coll != Coll::kWmma || b.line != a.line)
      fail_here(what + ": lane " + std::to_string(j) + " waits at another warp operation (line " +
                std::to_string(b.line) + "); the warp must call it converged");
  }
  for (int j = 0; j < 32; ++j) {
    const Fiber& b = lanes[j];
    if (b.value != a.value || b.arg != a.arg)
      fail_here(what + ": lane " + std::to_string(i) + " passes pointer " + hex(a.value) + ", ldm " +
                std::to_string(a.arg) + " but lane " + std::to_string(j) + " passes " + hex(b.value) + ", ldm " +
                std::to_string(b.arg) + " (the warp must pass one pointer and one leading dimension)");
  }
  if (a.value % 32 != 0) {
    const Region* r = region_of(a.value);
    fail_here(what + ": misaligned wmma pointer " + hex(a.value) + " (needs 32-byte alignment; it is " +
              std::to_string(a.value % 32) + " past it)" + (r ? " on " + where(*r, a.value) : std::string()));
  }
  if (a.elem && (static_cast<long long>(a.arg) * a.elem) % 16 != 0)
    fail_here(what + ": ldm " + std::to_string(a.arg) + " is not a multiple of 16 bytes (" +
              std::to_string(16 / a.elem) + " elements of " + std::to_string(a.elem) + " bytes)");
  for (int j = 0; j < 32; ++j) lanes[j].wait = Wait::kReady;
  return true;
}

// Resolve one warp's collectives; returns true if any completed.
inline bool resolve_warp(Launch* l, int w) {
  bool progress = false;
  Fiber* lanes = &l->fibers[32 * w];
  int nl = lanes_in_warp(l, w);
  // __activemask(): the lanes that wait at the same call site together are the active (converged) ones.
  for (int i = 0; i < nl; ++i) {
    if (lanes[i].wait != Wait::kActiveMask) continue;
    unsigned m = 0;
    for (int j = i; j < nl; ++j)
      if (lanes[j].wait == Wait::kActiveMask && lanes[j].line == lanes[i].line) m |= 1u << j;
    for (int j = i; j < nl; ++j)
      if (m >> j & 1u) { lanes[j].result = m; lanes[j].wait = Wait::kReady; }
    progress = true;
  }
  for (int i = 0; i < nl; ++i) {
    Fiber& a = lanes[i];
    if (a.wait != Wait::kWarp) continue;
    if (a.coll == Coll::kWmma) {
      progress |= resolve_wmma(l, w, i);
      continue;
    }
    unsigned m = a.mask;
    if (!(m >> i & 1u)) fail_here("warp collective at line " + std::to_string(a.line) + ": lane " +
                                  std::to_string(i) + " is not in its own mask 0x" + std::to_string(m));
    bool ready = true;
    for (int j = 0; j < 32; ++j) {
      if (!(m >> j & 1u)) continue;
      if (j >= nl) fail_here("warp collective at line " + std::to_string(a.line) + " in " + thread_name(l, &a) +
                             ": its mask names lane " + std::to_string(j) + ", which this block does not have");
      Fiber& b = lanes[j];
      if (b.wait == Wait::kDone)
        fail_here("warp collective at line " + std::to_string(a.line) + " in " + thread_name(l, &a) +
                  ": lane " + std::to_string(j) + " named in the mask has exited");
      if (b.wait != Wait::kWarp) { ready = false; continue; }
      // CUDA: every lane the mask names must execute the same intrinsic with the same mask.
      if (b.mask != m || b.coll != a.coll)
        fail_here("warp collective divergence in " + thread_name(l, &a) + ": lane " + std::to_string(i) +
                  " (line " + std::to_string(a.line) + ") and lane " + std::to_string(j) + " (line " +
                  std::to_string(b.line) + ") wait at different warp intrinsics or with different masks");
    }
    if (!ready) continue;
    uint64_t ballot = 0;
    for (int j = 0; j < 32; ++j) if ((m >> j & 1u) && lanes[j].value) ballot |= 1ull << j;
    for (int j = 0; j < 32; ++j) {
      if (!(m >> j & 1u)) continue;
      Fiber& b = lanes[j];
      int width = b.width, base = j & ~(width - 1), src = j;
      switch (b.coll) {
        case Coll::kShfl: src = base + (b.arg & (width - 1)); break;
        case Coll::kShflUp: src = (j - b.arg >= base) ? j - b.arg : j; break;
        case Coll::kShflDown: src = (j + b.arg < base + width) ? j + b.arg : j; break;
        case Coll::kShflXor: src = j ^ b.arg; if (src >= base + width) src = j; break;
        default: break;
      }
      if (b.coll <= Coll::kShflXor) {
        if (width <= 0 || width > 32 || (width & (width - 1)))
          fail_here("warp shuffle width " + std::to_string(width) + " is not a power of two <= 32");
        if (src < 0 || src >= 32 || !(m >> src & 1u))
          fail_here("warp shuffle at line " + std::to_string(b.line) + " in " + thread_name(l, &b) +
                    " reads lane " + std::to_string(src) + ", which is not in the mask (undefined on a GPU)");
        b.result = lanes[src].value;
      } else if (b.coll == Coll::kBallot) {
        b.result = ballot;
      } else if (b.coll == Coll::kAny) {
        b.result = ballot != 0;
      } else if (b.coll == Coll::kAll) {
        b.result = (ballot == (static_cast<uint64_t>(m)));
      }
    }
    if (a.coll == Coll::kSyncWarp) {  // orders the warp's memory accesses if it names every live lane
      unsigned live = 0;
      for (int j = 0; j < nl; ++j) live |= static_cast<unsigned>(lanes[j].wait != Wait::kDone) << j;
      if ((m & live) == live) chk_warp_sync(w);
    }
    for (int j = 0; j < 32; ++j) if (m >> j & 1u) lanes[j].wait = Wait::kReady;
    progress = true;
  }
  return progress;
}

inline std::string describe_waits(const Launch* l) {
  std::string s;
  const char* names[] = {"runnable", "wait at __syncthreads", "wait at a warp collective", "wait at __activemask",
                         "exited"};
  int i = 0, n = l->nthreads;
  while (i < n) {
    int j = i;
    while (j + 1 < n && l->fibers[j + 1].wait == l->fibers[i].wait && l->fibers[j + 1].line == l->fibers[i].line) ++j;
    char buf[160];
    const Fiber& f = l->fibers[i];
    std::snprintf(buf, sizeof(buf), "%sthreads %d-%d %s", s.empty() ? "" : "; ", i, j,
                  names[static_cast<int>(f.wait)]);
    s += buf;
    if (f.wait == Wait::kBarrier || f.wait == Wait::kWarp) s += " (line " + std::to_string(f.line) + ")";
    i = j + 1;
  }
  return s;
}

// Nothing runnable: complete the barrier if every live thread is at it, else report why the block is stuck.
inline void resolve_block(Launch* l) {
  bool progress = false;
  for (int w = 0; w < l->nwarps; ++w) progress |= resolve_warp(l, w);
  if (progress) return;
  int at_barrier = 0, done = 0, line = -1;
  bool same_line = true;
  for (Fiber& f : l->fibers) {
    if (f.wait == Wait::kDone) { ++done; continue; }
    if (f.wait != Wait::kBarrier) continue;
    ++at_barrier;
    if (line < 0) line = f.line; else same_line &= (f.line == line);
  }
  if (at_barrier + done == l->nthreads && at_barrier > 0 && done == 0 && same_line) {
    for (Fiber& f : l->fibers) f.wait = Wait::kReady;
    chk_barrier();
    return;
  }
  for (const Fiber& f : l->fibers)  // a wmma operation some lanes of its warp never reach
    if (f.wait == Wait::kWarp && f.coll == Coll::kWmma)
      fail_here(std::string("wmma contract: ") + f.op + " at line " + std::to_string(f.line) + " in warp " +
                std::to_string(f.warp) + " of " + block_name(l) + " is not reached by all 32 lanes of the warp: " +
                describe_waits(l));
  std::string why = at_barrier + done == l->nthreads && done > 0
                        ? "barrier divergence: some threads exited while others wait at __syncthreads"
                    : at_barrier + done == l->nthreads ? "barrier divergence: threads wait at different __syncthreads"
                                                       : "deadlock";
  fail_here(why + " in block (" + std::to_string(l->bid.x) + "," + std::to_string(l->bid.y) + "," +
            std::to_string(l->bid.z) + "): " + describe_waits(l));
}

inline void init_fiber(Launch* l, Fiber& f, char* stack) {
  f.stack = stack;
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + kStack) & ~static_cast<uintptr_t>(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 8);  // 8 mod 16: where a call would leave a return address
  *sp = reinterpret_cast<uint64_t>(&tvm_mamba_sim_trampoline);
  uint64_t frame[7] = {0, 0, 0, 0, 0, 0, 0};  // mxcsr|fcw, r15, r14, r13, r12, rbx, rbp
  uint32_t mxcsr;
  uint16_t fcw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fcw));
  frame[0] = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fcw) << 32);
  frame[3] = reinterpret_cast<uint64_t>(&fiber_main);  // r13: entry
  frame[4] = 0;                                        // r12: its argument
  sp -= 7;
  std::memcpy(sp, frame, sizeof(frame));
  f.sp = sp;
  f.wait = Wait::kReady;
  (void)l;
}

inline void run_block(Launch* l, char* stacks) {
  if (__start_tvm_mamba_sim_shared != nullptr)
    std::memset(__start_tvm_mamba_sim_shared, 0xff, __stop_tvm_mamba_sim_shared - __start_tvm_mamba_sim_shared);
  if (l->dyn_shared_bytes) std::memset(l->dyn_shared, 0xff, l->dyn_shared_bytes);
  for (int i = 0; i < l->nthreads; ++i)
    init_fiber(l, l->fibers[i], stacks + static_cast<size_t>(i) * (kStack + page()) + page());
  chk_barrier();  // a new block: nothing of the previous one can race with it
  std::vector<int> perm(l->nthreads);
  int live = l->nthreads;
  while (live > 0) {
    permute(l, perm);
    for (int k : perm) {
      Fiber& f = l->fibers[k];
      if (f.wait != Wait::kReady) continue;
      l->cur = g_chk.cur = &f;
      tvm_mamba_sim_switch(&l->sched_sp, f.sp);
      l->cur = g_chk.cur = nullptr;
    }
    live = 0;
    for (Fiber& f : l->fibers) live += f.wait != Wait::kDone;
    if (live > 0) resolve_block(l);
  }
}

// One launch of the kernel whose parameters `run(ctx)` applies, given its launch tags' values (the template
// `launch` above converts the packed arguments; everything else is here, compiled once).
int run_launch(const char* name, void (*run)(void*), void* ctx, const TVMFFIAny* tag_values,
               const char* const* tags, int ntags) {
  Launch l;
  l.kernel = name;
  unsigned* dims[6] = {&l.grid.x, &l.grid.y, &l.grid.z, &l.block.x, &l.block.y, &l.block.z};
  const char* dim_tags[6] = {"blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z"};
  for (int t = 0; t < ntags; ++t) {
    int64_t v = tag_values[t].v_int64;
    bool found = false;
    for (int d = 0; d < 6; ++d) {
      if (std::strcmp(tags[t], dim_tags[d]) == 0) {
        if (v <= 0 || v > (d == 0 ? 2147483647LL : d < 3 ? 65535LL : 1024LL))
          return report(name, std::string("invalid launch extent ") + dim_tags[d] + " = " + std::to_string(v));
        *dims[d] = static_cast<unsigned>(v);
        found = true;
      }
    }
    if (!found && std::strcmp(tags[t], "tirx.use_dyn_shared_memory") == 0) {
      l.dyn_shared_bytes = static_cast<size_t>(v);
      found = true;
    }
    if (!found) return report(name, std::string("unknown launch parameter ") + tags[t]);
  }
  long long nthreads = 1LL * l.block.x * l.block.y * l.block.z;
  if (nthreads > 1024) return report(name, "block of " + std::to_string(nthreads) + " threads (> 1024)");
  l.nthreads = static_cast<int>(nthreads);
  l.nwarps = (l.nthreads + 31) / 32;
  l.fibers.resize(l.nthreads);
  for (int i = 0; i < l.nthreads; ++i) {
    Fiber& f = l.fibers[i];
    f.linear = i;
    f.lane = i % 32;
    f.warp = i / 32;
    f.tid = {static_cast<unsigned>(i % l.block.x), static_cast<unsigned>(i / l.block.x % l.block.y),
             static_cast<unsigned>(i / (l.block.x * l.block.y))};
  }
  l.body = run;
  l.body_ctx = ctx;
  l.order = config().order;
  char* stacks = stack_pool(l.nthreads);
  if (stacks == nullptr) return report(name, "could not map the thread stacks");
  std::vector<char> dyn(l.dyn_shared_bytes + 1);
  l.dyn_shared = dyn.data();
  checks_begin(&l);
  long long nblocks = 1LL * l.grid.x * l.grid.y * l.grid.z;
  std::vector<long long> border(nblocks);
  for (long long i = 0; i < nblocks; ++i) border[i] = l.order == 2 ? nblocks - 1 - i : i;
  l.rng = config().seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  if (l.order == 0)
    for (long long i = nblocks - 1; i > 0; --i) std::swap(border[i], border[next_rand(l.rng) % (i + 1)]);
  Launch* prev = current();
  current() = &l;
  int rc = 0;
  {
    FaultGuard guard;
    if (sigsetjmp(l.fault_jmp, 1) == 0) {
      l.in_kernel = 1;
      for (long long b : border) {
        l.bid = {static_cast<unsigned>(b % l.grid.x), static_cast<unsigned>(b / l.grid.x % l.grid.y),
                 static_cast<unsigned>(b / (1LL * l.grid.x * l.grid.y))};
        run_block(&l, stacks);
      }
      l.in_kernel = 0;
    } else {
      l.in_kernel = 0;
      rc = -1;
    }
  }
  current() = prev;
  checks_end();
  if (rc != 0) return report(name, l.error);
  return 0;
}


char* dyn_shared(const char* name) {
  g_chk.regions[kDyn].name = name;
  return current()->dyn_shared;
}

}  // namespace tvm_mamba_sim

// __tvm_set_device: TVM's host code selects the device before launching; there is one simulated device.
extern "C" __attribute__((visibility("default"))) int __tvm_ffi___tvm_set_device(void*, const TVMFFIAny*, int32_t,
                                                                                 TVMFFIAny*) {
  return 0;
}
// tvm_mamba_sim_config(order, seed): 0 seeded random, 1 forward, 2 reversed thread and block order.
extern "C" __attribute__((visibility("default"))) int __tvm_ffi_tvm_mamba_sim_config(void*, const TVMFFIAny* args,
                                                                                     int32_t nargs, TVMFFIAny*) {
  if (nargs != 2) return tvm_mamba_sim::report("tvm_mamba_sim_config", "expected (order, seed)");
  tvm_mamba_sim::config().order = static_cast<int>(args[0].v_int64);
  tvm_mamba_sim::config().seed = static_cast<uint64_t>(args[1].v_int64);
  return 0;
}
// tvm_mamba_sim_checks(on, [argument index, address, bytes]...): turn the race / alignment checks on for the
// given buffers (cudasim.py calls it before each run), or off (0).
extern "C" __attribute__((visibility("default"))) int __tvm_ffi_tvm_mamba_sim_checks(void*, const TVMFFIAny* args,
                                                                                     int32_t nargs, TVMFFIAny*) {
  int rc = tvm_mamba_sim::set_checks(args, nargs);
  if (rc == -2)
    return tvm_mamba_sim::report("tvm_mamba_sim_checks", "this kernel library was built without the checker's "
                                 "instrumentation (checks off); build it with checks on");
  if (rc != 0)
    return tvm_mamba_sim::report("tvm_mamba_sim_checks", "expected (on, [index, address, bytes]...)");
  return 0;
}
#endif  // TVM_MAMBA_SIM_RUNTIME
