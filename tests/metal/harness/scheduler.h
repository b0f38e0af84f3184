// scheduler.h: the CPU harness runtime that .metal kernels compiled as C++ call into (through the shim
// include/metal_stdlib) and that the emulated device (emu_device.cpp) dispatches through.
//
// A dispatch runs threadgroup by threadgroup on the calling thread. Every thread of a group is a fiber; it runs
// until a scheduling point (threadgroup_barrier, simdgroup_barrier, any simd collective, simdgroup matrix
// load/store) and the scheduler resumes the fibers in forward, reverse or random order. Divergent barriers and
// collectives, reads of inactive lanes, threadgroup memory over Apple's limit and too many threads are errors
// (KernelError, naming the .metal file and line).
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace metal_emu {

struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A source location in the .metal file (the generated C++ keeps its lines with #line).
struct Loc {
  const char* file;
  int line;
};

struct U3 {
  uint32_t x = 1, y = 1, z = 1;
};

// The position attributes of one thread.
struct Pos {
  U3 tg, tid, tpg, groups, grid;  // threadgroup_position_in_grid, thread_position_in_threadgroup,
                                  // threads_per_threadgroup, threadgroups_per_grid, thread_position_in_grid
  uint32_t index, sg, lane, sgs;  // thread_index_in_threadgroup, simdgroup_index_in_threadgroup,
                                  // thread_index_in_simdgroup, simdgroups_per_threadgroup
};

enum class Attr {
  threadgroup_position_in_grid, thread_position_in_threadgroup, thread_index_in_threadgroup, threads_per_threadgroup,
  threadgroups_per_grid, thread_position_in_grid, simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
  simdgroups_per_threadgroup, threads_per_simdgroup
};

constexpr int kMaxBindings = 31;       // Metal's buffer and threadgroup argument tables
constexpr size_t kFromBuffer = ~size_t(0);

// The argument tables of a dispatch: buffer(i) (bytes[i] is the size given to set_bytes, or kFromBuffer) and
// the dynamic threadgroup memory sizes of threadgroup(i).
struct Bindings {
  const void* buf[kMaxBindings] = {};
  size_t bytes[kMaxBindings] = {};
  bool set[kMaxBindings] = {};
  size_t tg_bytes[kMaxBindings] = {};
};

using Entry = void (*)(const Bindings&, const Pos&);

struct Kernel {
  const char* name;  // the host name
  Entry entry;
  Loc loc;           // where the kernel (or its instantiation) is written
};

// Kernel registry: the generated kernel sources register every entry (host name → wrapper).
void register_kernel(const Kernel& k);
const Kernel* find_kernel(const char* name);
void register_all_kernels();  // generated: calls every .metal file's registration function

enum class Order { forward, reverse, random };

// Runs `groups` threadgroups of `threads` threads; throws KernelError on any reported misuse.
void run(const Kernel& k, const Bindings& b, U3 groups, U3 threads, Order order, uint64_t seed);

// ---- called from kernel code, on the current thread's fiber ----------------------------------------------------

constexpr int kSimd = 32;
constexpr size_t kSlotBytes = 32;

// What every active lane of a simdgroup gave at a collective, available after it completes (until the next one).
struct Exchange {
  alignas(16) unsigned char value[kSimd][kSlotBytes];
  uint32_t active;  // bit l: lane l took part
};

void barrier(const char* what, Loc loc);  // threadgroup_barrier
// Blocks until every live lane of the caller's simdgroup gives its value at the same collective; `lane` is the
// caller's lane.
const Exchange& simd_exchange(const void* value, size_t bytes, const char* what, Loc loc, int& lane);
// A simdgroup matrix load, store or multiply: every lane calls it with kSlotBytes of what the lanes must agree on
// (address, layout); the scheduler checks that all 32 lanes run the same sequence. True for the lane that does
// the work (lane 0; every lane holds the matrix only in name).
bool matrix_op(const void* key, const char* what, Loc loc);
void* tg_dynamic(int index);                            // this group's [[threadgroup(index)]] memory
void* tg_static(const void* tag, size_t bytes, size_t align, Loc loc);  // this group's `threadgroup T x[N]`
[[noreturn]] void fail(const char* what, Loc loc, const char* message);

}  // namespace metal_emu
