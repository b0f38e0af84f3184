// scheduler.cpp: the fiber scheduler of the CPU harness (see scheduler.h).
//
// Every thread of the running threadgroup is a fiber with its own stack. A scheduling pass resumes each
// ready fiber once, in the pass's order; it runs until it blocks (barrier, collective) or returns. When no fiber is
// ready, complete collectives are released (every live lane of a simdgroup waits at the same one; the values are
// snapshot in lane order), then a barrier is released when all threads of the group wait at the same one.
// Anything else is a divergence and is reported with each thread's source line.
//
// Fibers switch with a few lines of assembly (x86-64 and AArch64, System V): ucontext's swapcontext makes two
// system calls per switch (0.9 us a round trip), which dominated the run time of the GEMM kernels.
#include "scheduler.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define METAL_EMU_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#endif

// metal_emu_switch(&from_sp, to_sp): saves the callee-saved registers on the current stack, stores the stack
// pointer in from_sp, and resumes the fiber whose stack pointer is to_sp (the frame layout of new_fiber_stack).
extern "C" void metal_emu_switch(void** from_sp, void* to_sp);
#if defined(__x86_64__)
asm(R"(.text
.globl metal_emu_switch
.type metal_emu_switch,@function
metal_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size metal_emu_switch,.-metal_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#elif defined(__aarch64__)
asm(R"(.text
.globl metal_emu_switch
.type metal_emu_switch,%function
metal_emu_switch:
  sub sp, sp, #160
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mov x2, sp
  str x2, [x0]
  mov sp, x1
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #160
  ret
.size metal_emu_switch,.-metal_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#else
#error "the Metal CPU harness switches fibers on x86-64 and AArch64 only"
#endif

namespace metal_emu {
namespace {

constexpr size_t kMaxThreadgroupMemory = 32768;  // Apple GPUs: 32 KB per threadgroup
constexpr uint32_t kMaxThreads = 1024;
#ifdef METAL_EMU_ASAN
constexpr size_t kStackBytes = size_t(1) << 20;
#else
constexpr size_t kStackBytes = size_t(256) << 10;
#endif
constexpr unsigned char kPoison = 0xff;  // NaN as float and as bf16, 0xffffffff as uint

enum class State { ready, barrier, simd, done };

struct Fiber {
  void* sp;  // saved stack pointer while switched out
  char* stack;
  State state;
  const char* what;
  Loc loc;
  Pos pos;
  uint32_t matrix_ops;  // simdgroup matrix operations since the simdgroup's last scheduling point
  MatrixLane matrix;    // what matrix_op sees while this fiber runs
  void* fake_stack;     // ASan's record of this fiber's stack while it is switched out
};

// Fiber stacks, reused by every dispatch of this OS thread (mapped lazily, a guard page below each).
struct StackPool {
  std::vector<char*> stacks;
  ~StackPool() {
    for (char* s : stacks) munmap(s - 4096, kStackBytes + 4096);
  }
  char* get(size_t i) {
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, kStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      mprotect(p, 4096, PROT_NONE);
      stacks.push_back(static_cast<char*>(p) + 4096);
    }
    return stacks[i];
  }
};

struct Group {
  const Kernel* k;
  const Bindings* b;
  U3 id;
  uint32_t n;
  std::vector<Fiber> fibers;
  std::vector<Exchange> exchange;                      // per simdgroup: the last completed collective
  std::vector<unsigned char> arrivals;                 // per thread: its value at the pending collective
  std::vector<MatrixOp*> matrix_log;                   // per simdgroup: matrix operations since the last sync
  std::vector<uint32_t> matrix_log_size;
  std::vector<std::unique_ptr<unsigned char[]>> mem;   // this group's threadgroup memory blocks
  void* dynamic[kMaxBindings];
  std::map<const void*, void*> statics;
  size_t tg_total;
  Fiber* cur;
  void* sched_sp;
  const void* sched_bottom;
  size_t sched_size;
  std::exception_ptr error;
};

// initial-exec: the module is loaded with dlopen, where the default TLS model calls __tls_get_addr on every access
// (8 % of the run time of the GEMM kernels, which reach the scheduler once per lane and matrix operation).
__attribute__((tls_model("initial-exec"))) thread_local Group* g_group = nullptr;
thread_local StackPool g_stacks;
thread_local std::vector<std::unique_ptr<MatrixOp[]>> g_logs;  // matrix logs, reused like the stacks

struct Registered {
  Kernel k;
  std::atomic<uint64_t> dispatches{0};
  explicit Registered(const Kernel& k) : k(k) {}
};

std::map<std::string, Registered>& registry() {
  static std::map<std::string, Registered> r;
  return r;
}

std::string str(U3 v) { return "(" + std::to_string(v.x) + "," + std::to_string(v.y) + "," + std::to_string(v.z) + ")"; }
std::string where(Loc l) { return std::string(l.file) + ":" + std::to_string(l.line); }
std::string kernel_text(const Group& g) { return "kernel '" + std::string(g.k->name) + "' threadgroup " + str(g.id); }

void* tg_alloc(Group& g, size_t bytes, const std::string& what) {
  g.tg_total += bytes;
  if (g.tg_total > kMaxThreadgroupMemory)
    throw KernelError(what + " brings the threadgroup memory of " + kernel_text(g) + " to " +
                      std::to_string(g.tg_total) + " bytes, over Apple's limit of 32768");
  g.mem.emplace_back(new unsigned char[bytes]);
  std::memset(g.mem.back().get(), kPoison, bytes);
  return g.mem.back().get();
}

void switch_to_fiber(Group& g, Fiber& f) {
  g.cur = &f;
  g_matrix = &f.matrix;
#ifdef METAL_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
  metal_emu_switch(&g.sched_sp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  metal_emu_switch(&g.sched_sp, f.sp);
#endif
  g_matrix = nullptr;
}

void switch_to_scheduler(Group& g, Fiber& f, bool exiting) {
#ifdef METAL_EMU_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, g.sched_bottom, g.sched_size);
  metal_emu_switch(&f.sp, g.sched_sp);
  __sanitizer_finish_switch_fiber(f.fake_stack, &g.sched_bottom, &g.sched_size);
#else
  (void)exiting;
  metal_emu_switch(&f.sp, g.sched_sp);
#endif
}

extern "C" void fiber_main() {
  Group& g = *g_group;
  Fiber& f = *g.cur;
#ifdef METAL_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g.sched_bottom, &g.sched_size);
#endif
  try {
    g.k->entry(*g.b, f.pos);
  } catch (...) {
    if (!g.error) g.error = std::current_exception();
  }
  f.state = State::done;
  switch_to_scheduler(g, f, true);
  __builtin_unreachable();  // a finished fiber is never resumed
}

// A stack whose first switch "returns" into fiber_main, with the frame layout metal_emu_switch restores.
void* new_fiber_stack(char* stack) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + kStackBytes) & ~uintptr_t(15);
#if defined(__x86_64__)
  auto* sp = reinterpret_cast<uint64_t*>(top - 16);  // after `ret`, rsp = top - 8: a function's entry alignment
  sp[0] = reinterpret_cast<uint64_t>(&fiber_main);
  sp -= 7;  // mxcsr and x87 control word, r15, r14, r13, r12, rbx, rbp
  std::memset(sp, 0, 7 * sizeof(uint64_t));
  sp[0] = 0x1f80 | (uint64_t(0x037f) << 32);
#else
  auto* sp = reinterpret_cast<uint64_t*>(top - 160);
  std::memset(sp, 0, 160);
  sp[11] = reinterpret_cast<uint64_t>(&fiber_main);  // x30, the return address
#endif
  return sp;
}

Fiber& current(const char* what) {
  if (!g_group) throw KernelError(std::string(what) + " called outside a kernel dispatch");
  return *g_group->cur;
}

void block(State s, const char* what, Loc loc) {
  Group& g = *g_group;
  Fiber& f = *g.cur;
  f.state = s, f.what = what, f.loc = loc;
  switch_to_scheduler(g, f, false);
}

// "0-31 wait at simd_sum (a.metal:10); 32-63 returned": what each thread of the group is doing.
std::string states(const Group& g) {
  std::vector<std::pair<std::string, std::vector<uint32_t>>> sites;
  for (uint32_t i = 0; i < g.n; ++i) {
    const Fiber& f = g.fibers[i];
    std::string s = f.state == State::done ? "returned" : "wait at " + std::string(f.what) + " (" + where(f.loc) + ")";
    auto it = std::find_if(sites.begin(), sites.end(), [&](auto& p) { return p.first == s; });
    if (it == sites.end()) sites.push_back({s, {}}), it = sites.end() - 1;
    it->second.push_back(i);
  }
  std::string out;
  for (auto& [s, ids] : sites) {
    std::string r;
    for (size_t a = 0; a < ids.size();) {
      size_t e = a;
      while (e + 1 < ids.size() && ids[e + 1] == ids[e] + 1) ++e;
      r += (r.empty() ? "" : ",") + std::to_string(ids[a]) + (e > a ? "-" + std::to_string(ids[e]) : "");
      a = e + 1;
    }
    out += (out.empty() ? "" : "; ") + std::string("threads ") + r + " " + s;
  }
  return out;
}

// Every lane of simdgroup s must have run the logged matrix operations since the last sync; clears the log.
void check_matrix_ops(Group& g, uint32_t s) {
  uint32_t& size = g.matrix_log_size[s];
  const uint32_t first = s * kSimd, last = std::min(g.n, first + kSimd);
  if (size) {
    for (uint32_t i = first; i < first + kSimd; ++i) {
      const uint32_t ran = i < last ? g.fibers[i].matrix_ops : 0;
      if (ran != size) {
        const MatrixOp& op = g.matrix_log[s][ran < size ? ran : 0];
        throw KernelError(where(op.loc) + ": " + op.what + ": " + kernel_text(g) + ": lane " +
                          std::to_string(i - first) + " of simdgroup " + std::to_string(s) + " ran " +
                          std::to_string(ran) + " of the " + std::to_string(size) +
                          " simdgroup matrix operations since the last barrier or collective; they need all 32 lanes "
                          "of the simdgroup, in uniform control flow");
      }
    }
  }
  size = 0;
  for (uint32_t i = first; i < last; ++i) g.fibers[i].matrix_ops = 0;
}

// Equal strings: the same literal almost always (one call site), so compare pointers before characters.
bool same_text(const char* a, const char* b) { return a == b || std::strcmp(a, b) == 0; }

bool same_site(const Fiber& a, const Fiber& b) {
  return a.loc.line == b.loc.line && same_text(a.loc.file, b.loc.file) && same_text(a.what, b.what);
}

// Releases simdgroup s if every live lane waits at the same collective.
bool release_simdgroup(Group& g, uint32_t s) {
  const uint32_t first = s * kSimd, last = std::min(g.n, first + kSimd);
  const Fiber* lead = nullptr;
  uint32_t active = 0;
  for (uint32_t i = first; i < last; ++i) {
    const Fiber& f = g.fibers[i];
    if (f.state == State::done) continue;
    if (f.state != State::simd) return false;
    if (lead && !same_site(*lead, f))
      throw KernelError(kernel_text(g) + ": lanes of simdgroup " + std::to_string(s) +
                        " reach different collectives (divergent simd code): " + states(g));
    lead = &f;
    active |= 1u << (i - first);
  }
  if (!active) return false;
  check_matrix_ops(g, s);
  Exchange& ex = g.exchange[s];
  ex.active = active;
  std::memcpy(ex.value, &g.arrivals[size_t(first) * kSlotBytes], size_t(last - first) * kSlotBytes);
  for (uint32_t i = first; i < last; ++i)
    if (g.fibers[i].state == State::simd) g.fibers[i].state = State::ready;
  return true;
}

void run_group(Group& g, Order order, std::mt19937_64& rng) {
  std::vector<uint32_t> seq(g.n);
  std::iota(seq.begin(), seq.end(), 0u);
  if (order == Order::reverse) std::reverse(seq.begin(), seq.end());
  for (;;) {
    if (order == Order::random) std::shuffle(seq.begin(), seq.end(), rng);
    for (uint32_t i : seq) {
      if (g.fibers[i].state != State::ready) continue;
      switch_to_fiber(g, g.fibers[i]);
      if (g.error) std::rethrow_exception(g.error);
    }
    bool released = false;
    for (uint32_t s = 0; s * kSimd < g.n; ++s) released |= release_simdgroup(g, s);
    if (released) continue;
    uint32_t done = 0, at_barrier = 0;
    for (const Fiber& f : g.fibers) done += f.state == State::done, at_barrier += f.state == State::barrier;
    if (done == g.n) {
      for (uint32_t s = 0; s * kSimd < g.n; ++s) check_matrix_ops(g, s);
      return;
    }
    bool one_barrier = at_barrier == g.n;
    for (const Fiber& f : g.fibers) one_barrier = one_barrier && same_site(f, g.fibers[0]);
    if (!one_barrier)
      throw KernelError(kernel_text(g) + ": threads do not meet at one barrier (divergent barrier or early return "
                        "before a barrier): " + states(g));
    for (uint32_t s = 0; s * kSimd < g.n; ++s) check_matrix_ops(g, s);
    for (Fiber& f : g.fibers) f.state = State::ready;
  }
}

}  // namespace

void register_kernel(const Kernel& k) {
  auto [it, fresh] = registry().try_emplace(k.name, k);
  if (!fresh)
    throw KernelError("kernel name '" + std::string(k.name) + "' is defined twice: " + where(it->second.k.loc) +
                      " and " + where(k.loc));
}

const Kernel* find_kernel(const char* name) {
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : &it->second.k;
}

void kernel_dispatches(void (*visit)(void* ctx, const char* name, uint64_t dispatches), void* ctx) {
  for (auto& [name, r] : registry()) visit(ctx, name.c_str(), r.dispatches.load());
}

void run(const Kernel& k, const Bindings& b, U3 groups, U3 threads, Order order, uint64_t seed) {
  const uint64_t n = uint64_t(threads.x) * threads.y * threads.z;
  if (n == 0 || n > kMaxThreads)
    throw KernelError("kernel '" + std::string(k.name) + "': " + std::to_string(n) + " threads per threadgroup " +
                      str(threads) + "; Metal allows 1 to 1024");
  if (n > k.max_threads)  // Apple's pipeline state allows at most this many (maxTotalThreadsPerThreadgroup)
    throw KernelError("kernel '" + std::string(k.name) + "': " + std::to_string(n) + " threads per threadgroup " +
                      str(threads) + "; it declares max_total_threads_per_threadgroup(" +
                      std::to_string(k.max_threads) + ") at " + where(k.loc));
  const uint64_t n_groups = uint64_t(groups.x) * groups.y * groups.z;
  if (auto it = registry().find(k.name); it != registry().end()) ++it->second.dispatches;
  if (n_groups == 0) return;
  Group g;
  g.k = &k, g.b = &b, g.n = uint32_t(n);
  g.fibers.resize(n);
  const uint32_t sgs = uint32_t((n + kSimd - 1) / kSimd);
  g.exchange.resize(sgs);
  g.arrivals.assign(size_t(sgs) * kSimd * kSlotBytes, 0);
  while (g_logs.size() < sgs) g_logs.emplace_back(new MatrixOp[kMatrixLog]);
  for (uint32_t s = 0; s < sgs; ++s) g.matrix_log.push_back(g_logs[s].get());
  g.matrix_log_size.assign(sgs, 0);
  std::vector<uint64_t> order_of_groups(n_groups);
  std::iota(order_of_groups.begin(), order_of_groups.end(), uint64_t(0));
  std::mt19937_64 rng(seed);
  if (order == Order::reverse) std::reverse(order_of_groups.begin(), order_of_groups.end());
  if (order == Order::random) std::shuffle(order_of_groups.begin(), order_of_groups.end(), rng);

  Group* outer = g_group;
  g_group = &g;
  struct Restore {
    Group* outer;
    ~Restore() { g_group = outer; }
  } restore{outer};
  for (uint64_t lin : order_of_groups) {
    g.id = {uint32_t(lin % groups.x), uint32_t(lin / groups.x % groups.y), uint32_t(lin / groups.x / groups.y)};
    g.mem.clear();
    g.statics.clear();
    g.tg_total = 0;
    for (int i = 0; i < kMaxBindings; ++i)
      g.dynamic[i] = b.tg_bytes[i] ? tg_alloc(g, b.tg_bytes[i], "set_threadgroup_memory(" + std::to_string(i) + ")")
                                   : nullptr;
    for (uint32_t t = 0; t < n; ++t) {
      Fiber& f = g.fibers[t];
      f.state = State::ready, f.fake_stack = nullptr, f.matrix_ops = 0;
      f.matrix = {g.matrix_log[t / kSimd], &g.matrix_log_size[t / kSimd], &f.matrix_ops, t % kSimd == 0};
      f.what = "", f.loc = {"", 0};
      f.stack = g_stacks.get(t);
      Pos& p = f.pos;
      p.tg = g.id, p.tpg = threads, p.groups = groups;
      p.tid = {t % threads.x, t / threads.x % threads.y, t / threads.x / threads.y};
      p.grid = {g.id.x * threads.x + p.tid.x, g.id.y * threads.y + p.tid.y, g.id.z * threads.z + p.tid.z};
      p.index = t, p.sg = t / kSimd, p.lane = t % kSimd, p.sgs = sgs;
      f.sp = new_fiber_stack(f.stack);
    }
    std::fill(g.matrix_log_size.begin(), g.matrix_log_size.end(), 0u);
    try {
      run_group(g, order, rng);
    } catch (...) {
#ifdef METAL_EMU_ASAN
      for (char* stack : g_stacks.stacks) __asan_unpoison_memory_region(stack, kStackBytes);  // abandoned frames
#endif
      throw;
    }
  }
}

void barrier(const char* what, Loc loc) {
  current(what);
  block(State::barrier, what, loc);
}

const Exchange& simd_exchange(const void* value, size_t bytes, const char* what, Loc loc, int& lane) {
  Fiber& f = current(what);
  if (bytes > kSlotBytes) fail(what, loc, "value wider than 32 bytes");
  std::memcpy(&g_group->arrivals[size_t(f.pos.index) * kSlotBytes], value, bytes);
  block(State::simd, what, loc);
  lane = int(f.pos.lane);
  return g_group->exchange[f.pos.sg];
}

__thread MatrixLane* g_matrix = nullptr;

void matrix_outside(const char* what) { throw KernelError(std::string(what) + " called outside a kernel dispatch"); }

void matrix_mismatch(const MatrixOp& first, const char* what, Loc loc, uint32_t k) {
  fail(what, loc, ("lanes disagree on simdgroup matrix operation " + std::to_string(k) + " since the last "
                   "sync (first seen as " + first.what + " at " + where(first.loc) +
                   "): the address, the layout or the operation differ (non-uniform use)").c_str());
}

void matrix_overflow(const char* what, Loc loc) {
  fail(what, loc, ("more than " + std::to_string(kMatrixLog) + " simdgroup matrix operations between two "
                   "barriers or collectives (the harness's log)").c_str());
}

void* tg_dynamic(int index) {
  current("threadgroup memory");
  void* p = g_group->dynamic[index];
  if (!p) {
    const std::string i = std::to_string(index);
    fail("threadgroup memory", g_group->k->loc,
         ("[[threadgroup(" + i + ")]] has no memory: the launcher must call set_threadgroup_memory(" + i + ", bytes)")
             .c_str());
  }
  return p;
}

void* tg_static(const void* tag, size_t bytes, size_t align, Loc loc) {
  current("threadgroup array");
  Group& g = *g_group;
  void*& p = g.statics[tag];
  if (!p) p = tg_alloc(g, (bytes + align - 1) / align * align, where(loc) + ": a threadgroup array");
  return p;
}

void fail(const char* what, Loc loc, const char* message) {
  std::string m = where(loc) + ": " + what + ": " + message;
  if (g_group) m += " (" + kernel_text(*g_group) + ", thread " + std::to_string(g_group->cur->pos.index) + ")";
  throw KernelError(m);
}

}  // namespace metal_emu
