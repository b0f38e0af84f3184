// device.h: a unified-memory Metal device as MetalBackend sees it. Implemented by metal_backend.mm on Apple (MTL
// device, command queue, MTL::Buffers in shared storage) and by the CPU harness (tests/metal/harness) in CI.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "backend/metal/encoder.h"

namespace lily::metal {

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  // CPU-visible device memory (shared storage). Never null: throws std::bad_alloc.
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  // A weight as the kernels read it: the mapped host memory itself where the device can wrap it without a copy.
  virtual const void* weight(const void* host, size_t bytes) = 0;
  // The encoder of the command buffer being recorded (a new one is begun on demand).
  virtual Encoder& encoder() = 0;
  // Commits the command buffer being recorded (if any) and waits until the device has finished it.
  virtual void synchronize() = 0;
  // Commits the work recorded so far without waiting and returns a ticket for it (tickets increase); wait(ticket)
  // blocks until that work is done while later work keeps running. This is what lets the decode loop record step
  // k+1 while step k runs (two command buffers in flight). A device that runs dispatches eagerly keeps the defaults.
  virtual uint64_t flush() {
    synchronize();
    return 0;
  }
  virtual void wait(uint64_t ticket) {}
};

}  // namespace lily::metal
