// emu_device.cpp: the Metal Device of the CPU harness. Memory is host memory (weights are used in place), and
// the encoder runs each dispatch at once through the fiber scheduler, so a command buffer is always complete and
// synchronize has nothing to wait for.
//
// Environment: LILY_METAL_ORDER = forward (default) | reverse | random orders the threads and threadgroups of every
// dispatch; LILY_METAL_SEED seeds the random order (dispatch i uses seed + i; default: a fresh seed per backend).
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "backend/metal/device.h"
#include "backend/metal/metal_backend.h"
#include "core/common.h"
#include "scheduler.h"

namespace lily {
namespace {

using metal_emu::KernelError;

void register_kernels() {
  static std::once_flag once;
  std::call_once(once, metal_emu::register_all_kernels);
}

// MTLBuffer contents are page aligned; 256 bytes covers every vector access. The size is exact, so ASan sees any
// access past the end.
void* aligned(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 256, bytes ? bytes : 1)) throw std::bad_alloc();
  return p;
}

class EmuEncoder final : public metal::Encoder {
 public:
  EmuEncoder() : seed_(std::random_device{}()) {}
  ~EmuEncoder() override {
    for (auto& s : scratch_) std::free(s.first);
  }

  void kernel(const char* name) override {
    b_ = {};  // bindings do not carry over to the next kernel, as on Apple (metal_backend.mm checks the same)
    kernel_ = metal_emu::find_kernel(name);
    if (!kernel_)
      throw KernelError(cat("Metal kernel '", name, "' is not implemented: no metal/*.metal file in this build "
                            "defines it"));
  }
  void set_bytes(int index, const void* data, size_t bytes) override {
    check(index, "set_bytes");
    bytes_[index].assign(static_cast<const unsigned char*>(data), static_cast<const unsigned char*>(data) + bytes);
    b_.buf[index] = bytes_[index].data(), b_.bytes[index] = bytes, b_.set[index] = true;
  }
  void set_buffer(int index, const void* ptr) override {
    check(index, "set_buffer");
    b_.buf[index] = ptr, b_.bytes[index] = metal_emu::kFromBuffer, b_.set[index] = true;
  }
  void set_threadgroup_memory(int index, size_t bytes) override {
    check(index, "set_threadgroup_memory");
    if (bytes % 16)
      throw KernelError(cat(name(), ": set_threadgroup_memory(", index, ", ", bytes,
                            "): Metal needs a multiple of 16 bytes"));
    b_.tg_bytes[index] = bytes;
  }
  void dispatch(metal::Size3 groups, metal::Size3 threads) override {
    if (!kernel_) throw KernelError("dispatch before any kernel() was selected");
    const char* o = std::getenv("LILY_METAL_ORDER");
    const std::string order = o && *o ? o : "forward";
    metal_emu::Order mode = metal_emu::Order::forward;
    if (order == "reverse") {
      mode = metal_emu::Order::reverse;
    } else if (order == "random") {
      mode = metal_emu::Order::random;
    } else if (order != "forward") {
      throw KernelError(cat("LILY_METAL_ORDER='", order, "': use forward, reverse or random"));
    }
    const char* s = std::getenv("LILY_METAL_SEED");
    const uint64_t seed = (s && *s ? std::strtoull(s, nullptr, 10) : seed_) + dispatches_++;
    try {
      metal_emu::run(*kernel_, b_, {groups.x, groups.y, groups.z}, {threads.x, threads.y, threads.z}, mode, seed);
    } catch (const KernelError& e) {
      throw KernelError(cat(e.what(), " [", order, " order", mode == metal_emu::Order::random ? cat(", seed ", seed) : "",
                            "]"));
    }
  }
  // Grown on demand; new memory is poisoned (0xff: NaN as float and bf16) so reads before writes show.
  void* scratch(int slot, size_t bytes) override {
    if (slot < 0) throw KernelError(cat("scratch slot ", slot));
    if (size_t(slot) >= scratch_.size()) scratch_.resize(slot + 1, {nullptr, 0});
    auto& [p, n] = scratch_[slot];
    if (bytes > n) {
      std::free(p);
      p = aligned(bytes), n = bytes;
      std::memset(p, 0xff, bytes);
    }
    return p;
  }

 private:
  std::string name() const { return kernel_ ? cat("kernel '", kernel_->name, "'") : std::string("encoder"); }
  void check(int index, const char* what) const {
    if (index < 0 || index >= metal_emu::kMaxBindings)
      throw KernelError(cat(name(), ": ", what, "(", index, "): Metal argument indices are 0 to 30"));
  }

  const metal_emu::Kernel* kernel_ = nullptr;
  metal_emu::Bindings b_;
  std::vector<unsigned char> bytes_[metal_emu::kMaxBindings];
  std::vector<std::pair<void*, size_t>> scratch_;
  uint64_t seed_, dispatches_ = 0;
};

class EmuDevice final : public metal::Device {
 public:
  EmuDevice() { register_kernels(); }
  std::string name() const override { return "Metal CPU harness (tests/metal/harness)"; }
  void* alloc(size_t bytes) override { return aligned(bytes); }
  void release(void* p) override { std::free(p); }
  const void* weight(const void* host, size_t) override { return host; }
  metal::Encoder& encoder() override { return encoder_; }
  void synchronize() override {}

 private:
  EmuEncoder encoder_;
};

}  // namespace

std::unique_ptr<Backend> make_metal_backend() { return metal::make_backend(std::make_unique<EmuDevice>()); }

std::map<std::string, uint64_t> metal_emu_dispatches() {
  register_kernels();
  std::map<std::string, uint64_t> out;
  metal_emu::kernel_dispatches(
      [](void* ctx, const char* name, uint64_t n) { (*static_cast<std::map<std::string, uint64_t>*>(ctx))[name] = n; },
      &out);
  return out;
}

}  // namespace lily
