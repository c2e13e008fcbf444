// tvm_mamba CUDA-on-CPU harness: the race and alignment checker (included by tvm_mamba_cudasim.h;
// docs/cuda_sim.md, "Races and alignment").
//
// The kernels are compiled with g++ -fsanitize=thread purely as an instrumentation hook: g++ then calls
// __tsan_read4(addr), __tsan_write16(addr), __tsan_read_range(addr, n), ... before every memory access the
// kernel makes. This header defines those functions itself (libtsan is never linked; the definitions are
// hidden, so each kernel library calls its own). For an address in device memory -- the block's __shared__
// arrays, its dynamic shared memory, or a kernel argument's buffer (cudasim.py registers those) -- a hook
//  * checks the alignment: an N-byte access (N = 2, 4, 8, 16: a float2 / float4 / int4 / nv_bfloat162 ...
//    load or store) must start at a multiple of N, as a GPU requires (it faults with "misaligned address");
//  * updates one shadow cell per byte: who wrote it and who read it since the last barrier, and reports a
//    write-write or read-write pair of two different threads of the block with no barrier between them
//    (compute-sanitizer racecheck's hazards; a non-atomic `s[0] += v` by several threads is one).
// Barriers are counted by a clock: every __syncthreads (and the start of each block) opens a new interval
// (`epoch`), so a cell whose stamps are older than the epoch is empty; nothing is cleared. The check does not
// depend on the order the fibers run in: a pair is reported whichever of its two accesses runs first.
// Lanes of one warp are independent threads (sm_70+); a __syncwarp whose mask covers every live lane of the
// warp orders the warp's accesses (`warp_sync`). Shuffles, votes and wmma operations do not order memory
// (CUDA promises that only for __syncwarp). Atomics are not recorded (atomicAdd by many threads is no race).
#pragma once
#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <tvm/ffi/c_api.h>

#define TVM_MAMBA_SIM_NOTSAN __attribute__((no_sanitize_thread))

namespace tvm_mamba_sim {

// One byte of device memory. Stamps are clock values (0: never); a tid is the linear thread index + 1 (0: none).
struct Cell {
  uint32_t w_stamp, r_stamp;  // the last write / the last read in the current interval
  uint32_t rwarps;            // warps that read it since the epoch began (bit w)
  uint32_t rlanes;            // lanes of r_tid's warp that read it since that warp's last __syncwarp
  uint16_t w_tid, r_tid;      // the last writer, the last reader
  uint16_t r2_tid;            // the last reader of a warp other than r_tid's (0: none)
  uint16_t pad;
};

enum class Mem : int { kStaticShared, kDynShared, kArg };

struct Region {
  uintptr_t lo = 0, hi = 0;
  Cell* shadow = nullptr;
  size_t shadow_bytes = 0;
  Mem kind = Mem::kArg;
  int index = 0;           // argument position (kArg)
  const char* name = "";   // the dynamic shared array's name (kDynShared)
};

constexpr int kMaxRegions = 64;
constexpr int kStatic = 0, kDyn = 1;  // regions[0]: the static __shared__ section, [1]: dynamic shared memory

struct Checks {
  int on = 0;
  Fiber* cur = nullptr;        // the running thread (nullptr while the scheduler runs)
  const Launch* launch = nullptr;
  uint32_t clock = 1;          // advanced by every barrier, block start and full-warp __syncwarp
  uint32_t epoch = 1;          // clock at the last __syncthreads / block start
  uint32_t warp_sync[32] = {};  // clock at each warp's last full __syncwarp (>= epoch)
  int nregions = 2;
  Region regions[kMaxRegions];
};
// One per kernel library: defined in the harness runtime (compiled once per flag set into the runtime object that
// every kernel library links), hidden, so each library keeps its own.
extern Checks g_chk __attribute__((visibility("hidden")));

// A wmma fragment element or an atomic: shadow (if `shadow`) and alignment as given, outside the instrumentation.
TVM_MAMBA_SIM_NOTSAN __attribute__((visibility("hidden"))) void note_access(const volatile void* p, size_t n,
                                                                            bool write, size_t align, bool shadow);

}  // namespace tvm_mamba_sim

#ifdef TVM_MAMBA_SIM_RUNTIME
namespace tvm_mamba_sim {

Checks g_chk;

TVM_MAMBA_SIM_NOTSAN inline Cell* map_shadow(size_t nbytes, size_t* mapped) {
  *mapped = nbytes * sizeof(Cell);
  if (*mapped == 0) return nullptr;
  void* p = mmap(nullptr, *mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Cell*>(p);
}

TVM_MAMBA_SIM_NOTSAN inline void set_region(Region& r, uintptr_t lo, size_t n, Mem kind, int index, const char* name) {
  if (r.shadow) munmap(r.shadow, r.shadow_bytes);
  r.shadow = map_shadow(n, &r.shadow_bytes);
  r.lo = lo;
  r.hi = r.shadow ? lo + n : lo;  // no shadow (empty or mmap failed): never matches
  r.kind = kind;
  r.index = index;
  r.name = name;
}

// ---- reports ---------------------------------------------------------------------------------------------------
// The name of the static __shared__ array at `addr`: its symbol in this library's ELF symbol table (function-local
// statics are not dynamic symbols, so dladdr alone cannot name them). "" if the file cannot be read.
inline std::string shared_symbol(uintptr_t addr, uintptr_t* start) {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(addr), &info) || !info.dli_fname) return "";
  FILE* fp = std::fopen(info.dli_fname, "rb");
  if (!fp) return "";
  std::vector<char> img;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), fp)) > 0;) img.insert(img.end(), buf, buf + n);
  std::fclose(fp);
  if (img.size() < sizeof(Elf64_Ehdr)) return "";
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(img.data());
  if (eh->e_shoff + static_cast<size_t>(eh->e_shnum) * sizeof(Elf64_Shdr) > img.size()) return "";
  const auto* sh = reinterpret_cast<const Elf64_Shdr*>(img.data() + eh->e_shoff);
  const uintptr_t base = reinterpret_cast<uintptr_t>(info.dli_fbase);
  for (int s = 0; s < eh->e_shnum; ++s) {
    if (sh[s].sh_type != SHT_SYMTAB || sh[s].sh_link >= eh->e_shnum) continue;
    const auto* syms = reinterpret_cast<const Elf64_Sym*>(img.data() + sh[s].sh_offset);
    const char* strs = img.data() + sh[sh[s].sh_link].sh_offset;
    for (size_t k = 0; k < sh[s].sh_size / sizeof(Elf64_Sym); ++k) {
      const Elf64_Sym& y = syms[k];
      if (ELF64_ST_TYPE(y.st_info) != STT_OBJECT || addr < base + y.st_value || addr >= base + y.st_value + y.st_size)
        continue;
      int status = 0;
      char* d = abi::__cxa_demangle(strs + y.st_name, nullptr, nullptr, &status);
      std::string name = status == 0 && d ? d : strs + y.st_name;
      std::free(d);
      *start = base + y.st_value;
      size_t cut = name.rfind("::");  // "kernel(float*, float*)::red_buf" -> "red_buf"
      return cut == std::string::npos ? name : name.substr(cut + 2);
    }
  }
  return "";
}

// "__shared__ array red_buf (byte 4)", "dynamic __shared__ array buf_dyn_shmem (byte 4)",
// "argument #1 (4096 bytes; byte 12)"
inline std::string where(const Region& r, uintptr_t a) {
  char buf[300];
  if (r.kind == Mem::kArg) {
    std::snprintf(buf, sizeof(buf), "argument #%d (%zu bytes; byte %zu)", r.index, static_cast<size_t>(r.hi - r.lo),
                  static_cast<size_t>(a - r.lo));
    return buf;
  }
  if (r.kind == Mem::kDynShared) {
    std::snprintf(buf, sizeof(buf), "dynamic __shared__ array %s (byte %zu)", r.name, static_cast<size_t>(a - r.lo));
    return buf;
  }
  uintptr_t start = r.lo;
  std::string name = shared_symbol(a, &start);
  std::snprintf(buf, sizeof(buf), "__shared__ array %s (byte %zu)", name.empty() ? "?" : name.c_str(),
                static_cast<size_t>(a - start));
  return buf;
}

inline std::string thread_of(const Launch* l, int linear) {
  const Fiber& f = l->fibers[linear];
  char buf[64];
  std::snprintf(buf, sizeof(buf), "thread (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z);
  return buf;
}

[[noreturn]] inline void report_race(const Region& r, uintptr_t a, int other, bool other_wrote, bool write) {
  const Launch* l = g_chk.launch;
  const Fiber* f = g_chk.cur;
  const char* kind = other_wrote && write ? "write-write" : "read-write";
  char blk[64];
  std::snprintf(blk, sizeof(blk), "block (%u,%u,%u)", l->bid.x, l->bid.y, l->bid.z);
  bool same_warp = other / 32 == f->warp;
  fail_here(std::string("race (") + kind + " hazard) on " + where(r, a) + " in " + blk + ": " +
            thread_of(l, other) + (other_wrote ? " wrote it and " : " read it and ") + thread_of(l, f->linear) +
            (write ? " writes it" : " reads it") + " with no " +
            (same_warp ? "__syncwarp or __syncthreads" : "__syncthreads") + " between them" +
            (same_warp ? " (lanes of one warp are independent threads on sm_70+)" : ""));
}

[[noreturn]] inline void report_misaligned(const Region& r, uintptr_t a, size_t n, size_t align, bool write) {
  const Launch* l = g_chk.launch;
  char buf[200];
  std::snprintf(buf, sizeof(buf), "misaligned %zu-byte %s at 0x%llx (needs %zu-byte alignment; it is %zu past it) "
                "in block (%u,%u,%u), ", n, write ? "store" : "load", static_cast<unsigned long long>(a), align,
                static_cast<size_t>(a % align), l->bid.x, l->bid.y, l->bid.z);
  fail_here(buf + thread_of(l, g_chk.cur->linear) + ", on " + where(r, a));
}

// ---- the shadow ------------------------------------------------------------------------------------------------
TVM_MAMBA_SIM_NOTSAN inline Region* region_of(uintptr_t a) {
  for (int i = 0; i < g_chk.nregions; ++i) {
    Region& r = g_chk.regions[i];
    if (a - r.lo < r.hi - r.lo) return &r;
  }
  return nullptr;
}

// Whether an access stamped `stamp` by thread `other` is ordered before the current thread's access.
TVM_MAMBA_SIM_NOTSAN inline bool unordered(int other, uint32_t stamp, const Fiber* f) {
  return other / 32 != f->warp || stamp >= g_chk.warp_sync[f->warp];
}

TVM_MAMBA_SIM_NOTSAN inline void record(Region& r, uintptr_t a, size_t n, bool write, size_t align) {
  const Fiber* f = g_chk.cur;
  if (align > 1 && (a & (align - 1))) report_misaligned(r, a, n, align, write);
  const uint32_t epoch = g_chk.epoch, now = g_chk.clock, wbit = 1u << f->warp;
  const uint16_t me = static_cast<uint16_t>(f->linear + 1);
  const uintptr_t end = a + n < r.hi ? a + n : r.hi;
  for (uintptr_t b = a; b < end; ++b) {
    Cell& c = r.shadow[b - r.lo];
    if (c.w_stamp >= epoch && c.w_tid != me && c.w_tid != 0 && unordered(c.w_tid - 1, c.w_stamp, f))
      report_race(r, b, c.w_tid - 1, true, write);
    const bool reads = c.r_stamp >= epoch && c.r_tid != 0;
    const int rwarp = reads ? (c.r_tid - 1) / 32 : -1;
    if (write) {
      if (reads && (c.rwarps & ~wbit)) report_race(r, b, rwarp != f->warp ? c.r_tid - 1 : c.r2_tid - 1, false, true);
      if (reads && c.r_stamp >= g_chk.warp_sync[f->warp]) {  // readers of this warp since its last __syncwarp
        uint32_t others = c.rlanes & ~(1u << f->lane);
        if (others) report_race(r, b, 32 * f->warp + __builtin_ctz(others), false, true);
      }
      c.w_stamp = now;
      c.w_tid = me;
      c.r_stamp = 0;  // every earlier read is this thread's or ordered before this write
      continue;
    }
    if (!reads) {
      c.rwarps = c.rlanes = 0;
      c.r2_tid = 0;
    } else if (rwarp != f->warp) {
      c.r2_tid = c.r_tid;  // a reader of another warp: enough to report any later writer of this warp
      c.rlanes = 0;
    } else if (c.r_stamp < g_chk.warp_sync[f->warp]) {
      c.rlanes = 0;  // this warp's earlier readers are ordered by a __syncwarp since
    }
    c.rlanes |= 1u << f->lane;
    c.rwarps |= wbit;
    c.r_tid = me;
    c.r_stamp = now;
  }
}

TVM_MAMBA_SIM_NOTSAN inline size_t range_align(size_t n) { const size_t low = n & (~n + 1);
  return low < 16 ? low : 16;
}

TVM_MAMBA_SIM_NOTSAN inline void on_access(const volatile void* p, size_t n, bool write, size_t align) {
  if (g_chk.cur == nullptr || !g_chk.on) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (Region* r = region_of(a)) record(*r, a, n, write, align);
}

TVM_MAMBA_SIM_NOTSAN void note_access(const volatile void* p, size_t n, bool write, size_t align, bool shadow) {
  if (g_chk.cur == nullptr || !g_chk.on) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  Region* r = region_of(a);
  if (r == nullptr) return;
  if (shadow) {
    record(*r, a, n, write, align);
  } else if (align > 1 && (a & (align - 1))) {
    report_misaligned(*r, a, n, align, write);
  }
}

// ---- clock events (called by the scheduler) --------------------------------------------------------------------
TVM_MAMBA_SIM_NOTSAN inline void chk_barrier() {  // __syncthreads completed, or a block starts
  g_chk.epoch = ++g_chk.clock;
  for (uint32_t& s : g_chk.warp_sync) s = g_chk.epoch;
}
TVM_MAMBA_SIM_NOTSAN inline void chk_warp_sync(int warp) { g_chk.warp_sync[warp] = ++g_chk.clock; }

// tvm_mamba_sim_checks(on, [index, address, bytes] per tensor argument): the buffers the next launches may
// touch; (0) turns the checks off and frees the shadows.
inline int set_checks(const TVMFFIAny* args, int nargs) {
  Checks& c = g_chk;
  for (int i = 2; i < c.nregions; ++i) set_region(c.regions[i], 0, 0, Mem::kArg, 0, "");
  c.nregions = 2;
  c.on = nargs > 0 && args[0].v_int64 != 0;
  if (!c.on) return 0;
#ifndef __SANITIZE_THREAD__
  c.on = false;  // compiled without the instrumentation (cudasim.CHECK_FLAGS): nothing would be recorded
  return -2;
#endif
  if ((nargs - 1) % 3 != 0 || (nargs - 1) / 3 > kMaxRegions - 2) return -1;
  if (c.clock > (1u << 30)) {  // start the clock again; the static shared shadow is the only one kept
    c.clock = c.epoch = 1;
    if (c.regions[kStatic].shadow) std::memset(c.regions[kStatic].shadow, 0, c.regions[kStatic].shadow_bytes);
  }
  for (int i = 1; i + 2 < nargs; i += 3)
    set_region(c.regions[c.nregions++], reinterpret_cast<uintptr_t>(args[i + 1].v_ptr),
               static_cast<size_t>(args[i + 2].v_int64), Mem::kArg, static_cast<int>(args[i].v_int64), "");
  return 0;
}

}  // namespace tvm_mamba_sim

// ---- the instrumentation's entry points (g++ -fsanitize=thread emits calls to these) --------------------------
#define TVM_MAMBA_SIM_HOOK extern "C" __attribute__((visibility("hidden"), no_sanitize_thread))
#define TVM_MAMBA_SIM_HOOKS(N)                                                                                \
  TVM_MAMBA_SIM_HOOK void __tsan_read##N(void* p) { ::tvm_mamba_sim::on_access(p, N, false, N); }            \
  TVM_MAMBA_SIM_HOOK void __tsan_write##N(void* p) { ::tvm_mamba_sim::on_access(p, N, true, N); }            \
  TVM_MAMBA_SIM_HOOK void __tsan_unaligned_read##N(void* p) { ::tvm_mamba_sim::on_access(p, N, false, 1); }  \
  TVM_MAMBA_SIM_HOOK void __tsan_unaligned_write##N(void* p) { ::tvm_mamba_sim::on_access(p, N, true, 1); }  \
  TVM_MAMBA_SIM_HOOK void __tsan_volatile_read##N(void* p) { ::tvm_mamba_sim::on_access(p, N, false, N); }   \
  TVM_MAMBA_SIM_HOOK void __tsan_volatile_write##N(void* p) { ::tvm_mamba_sim::on_access(p, N, true, N); }
TVM_MAMBA_SIM_HOOKS(1)
TVM_MAMBA_SIM_HOOKS(2)
TVM_MAMBA_SIM_HOOKS(4)
TVM_MAMBA_SIM_HOOKS(8)
TVM_MAMBA_SIM_HOOKS(16)
#undef TVM_MAMBA_SIM_HOOKS
// An access whose size is not 1-16 bytes (a 32-byte ulonglong4, a 12-byte float3): aligned as the largest power of
// two dividing its size, at most 16 (a GPU splits a wider access into 16-byte ones).
TVM_MAMBA_SIM_HOOK void __tsan_read_range(void* p, unsigned long n) {
  ::tvm_mamba_sim::on_access(p, n, false, ::tvm_mamba_sim::range_align(n));
}
TVM_MAMBA_SIM_HOOK void __tsan_write_range(void* p, unsigned long n) {
  ::tvm_mamba_sim::on_access(p, n, true, ::tvm_mamba_sim::range_align(n));
}
// C++ atomics in the harness itself (the guard of a function-local static): performed, not recorded.
#define TVM_MAMBA_SIM_ATOMIC_HOOKS(B, T)                                                                      \
  TVM_MAMBA_SIM_HOOK T __tsan_atomic##B##_load(const volatile T* p, int mo) { return __atomic_load_n(p, mo); } \
  TVM_MAMBA_SIM_HOOK void __tsan_atomic##B##_store(volatile T* p, T v, int mo) { __atomic_store_n(p, v, mo); }
TVM_MAMBA_SIM_ATOMIC_HOOKS(8, uint8_t)
TVM_MAMBA_SIM_ATOMIC_HOOKS(16, uint16_t)
TVM_MAMBA_SIM_ATOMIC_HOOKS(32, uint32_t)
TVM_MAMBA_SIM_ATOMIC_HOOKS(64, uint64_t)
#undef TVM_MAMBA_SIM_ATOMIC_HOOKS
TVM_MAMBA_SIM_HOOK void __tsan_init() {}
TVM_MAMBA_SIM_HOOK void __tsan_func_entry(void*) {}
TVM_MAMBA_SIM_HOOK void __tsan_func_exit() {}
#undef TVM_MAMBA_SIM_HOOK
#endif  // TVM_MAMBA_SIM_RUNTIME
