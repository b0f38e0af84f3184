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
#include <cstring>
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
  uint32_t max_threads = 1024;  // its [[max_total_threads_per_threadgroup(N)]], else Metal's 1024
};

// Kernel registry: the generated kernel sources register every entry (host name → wrapper).
void register_kernel(const Kernel& k);
const Kernel* find_kernel(const char* name);
void register_all_kernels();  // generated: calls every .metal file's registration function
// Every registered kernel (host name) with the number of dispatches it has run in this process.
void kernel_dispatches(void (*visit)(void* ctx, const char* name, uint64_t dispatches), void* ctx);

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
// What the lanes must agree on at a simdgroup matrix operation: its address (null for a multiply) and layout.
struct MatrixKey {
  const void* first;
  uint64_t elements_per_row;
  bool transpose;
};

// A simdgroup matrix operation as the first lane to reach it saw it; the other lanes must agree.
struct MatrixOp {
  MatrixKey key;
  const char* what;
  Loc loc;
};

// The running fiber's view of its simdgroup's matrix log (the scheduler points g_matrix at it on every switch).
struct MatrixLane {
  MatrixOp* log;        // the simdgroup's operations since its last sync (capacity kMatrixLog)
  uint32_t* log_size;
  uint32_t* ran;        // operations this lane ran since the last sync
  bool lane0;
};
constexpr uint32_t kMatrixLog = 4096;
extern __thread MatrixLane* g_matrix __attribute__((tls_model("initial-exec")));

[[noreturn]] void matrix_mismatch(const MatrixOp& first, const char* what, Loc loc, uint32_t k);
[[noreturn]] void matrix_overflow(const char* what, Loc loc);
[[noreturn]] void matrix_outside(const char* what);

// A simdgroup matrix load, store or multiply: every lane calls it; the scheduler checks at the next sync that all
// 32 lanes ran the same sequence. True for the lane that does the work (lane 0; every lane holds the matrix only
// in name). Inline, with the key in registers: the GEMM kernels call it once per lane and operation, and as an
// out-of-line call comparing keys in memory it was half of their run time in the harness.
__attribute__((always_inline)) inline bool matrix_op(MatrixKey key, const char* what, Loc loc) {
  MatrixLane* m = g_matrix;
  if (!m) matrix_outside(what);
  const uint32_t k = (*m->ran)++;
  if (k < *m->log_size) {
    const MatrixOp& op = m->log[k];
    if (op.key.first != key.first || op.key.elements_per_row != key.elements_per_row ||
        op.key.transpose != key.transpose || (op.what != what && std::strcmp(op.what, what) != 0))
      matrix_mismatch(op, what, loc, k);
  } else {
    if (k == kMatrixLog) matrix_overflow(what, loc);
    m->log[k] = {key, what, loc};
    *m->log_size = k + 1;
  }
  return m->lane0;
}

void* tg_dynamic(int index);                            // this group's [[threadgroup(index)]] memory
void* tg_static(const void* tag, size_t bytes, size_t align, Loc loc);  // this group's `threadgroup T x[N]`
[[noreturn]] void fail(const char* what, Loc loc, const char* message);

}  // namespace metal_emu
