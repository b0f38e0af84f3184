// encoder.h: what the Metal launchers (csrc/backend/metal/*.cpp) need from a device, and nothing more. Two
// implementations: the real one on Apple (metal_backend.mm: a compute command encoder over MTL::Buffers of unified
// memory) and the CPU harness used in CI (tests/metal/harness: the same .metal sources compiled as C++ and run by a
// fiber scheduler). The launchers are shared, so the CI harness exercises exactly the dispatches the GPU will see.
//
// Memory is unified: a buffer argument is a plain pointer into a backend allocation; the Apple encoder maps it back
// to (MTL::Buffer, offset). Arguments follow the ggml/MLX convention: index 0 is the op's args struct (set_bytes),
// then the buffers in the order of the kernel's parameter list.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lily::metal {

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
};

class Encoder {
 public:
  virtual ~Encoder() = default;
  // Selects the compute pipeline by the kernel's instantiated name, e.g. "qmv_q4_t1" (see each .metal file's
  // instantiation list). An unknown name is an error at load time on Apple and here at first use.
  virtual void kernel(const char* name) = 0;
  virtual void set_bytes(int index, const void* data, size_t bytes) = 0;
  virtual void set_buffer(int index, const void* ptr) = 0;
  // Dynamic threadgroup memory for the kernel's `threadgroup T* [[threadgroup(index)]]` parameter.
  virtual void set_threadgroup_memory(int index, size_t bytes) = 0;
  // dispatchThreadgroups: `groups` threadgroups of `threads` threads each. Dispatches of one command buffer run
  // in order; the encoder puts a barrier between a dispatch and an earlier one whose outputs it reads.
  virtual void dispatch(Size3 groups, Size3 threads) = 0;
  // Scratch memory owned by the backend, grown on demand (never while a command buffer is being replayed).
  virtual void* scratch(int slot, size_t bytes) = 0;

  template <typename Args>
  void set_args(const Args& a) { set_bytes(0, &a, sizeof(Args)); }
};

}  // namespace lily::metal
