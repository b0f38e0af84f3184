// metal_backend.mm: lily::metal::Device and Encoder on an Apple GPU (Objective-C++ with ARC over the system Metal
// framework). MetalBackend (metal_backend.cpp) and the launchers (ops.h) are shared with the CPU harness of the
// tests; this file is what only a real GPU needs.
//
// Library    lily.metallib next to the extension module (built by metal/metal.cmake with `xcrun metal`); when it
//            is missing, each metal/*.metal file is compiled at load from the sources embedded in the binary.
// Pipelines  one per function of the library, all built at load, so a kernel that this GPU rejects fails
//            lily.load() rather than a later step. Each pipeline's reflection says which buffer arguments the
//            kernel may write (`device T*`) and which it only reads (`device const T*`, `constant`).
// Memory     alloc: a shared-storage MTLBuffer, whose contents are the pointer the backend sees. weight: the
//            page-aligned span of the mapped checkpoint holding the tensor, wrapped without a copy
//            (newBufferWithBytesNoCopy); one copy only where Metal refuses to wrap it. The wrapped pointer keeps
//            the checkpoint's alignment, which is only the element size (MLX writes unpadded safetensors), so
//            kernels load weights one element (u32 word, bf16) at a time. A map from address ranges to
//            (MTLBuffer, base) resolves set_buffer(ptr) for any pointer inside an allocation or a weight.
// Encoding   one concurrent compute encoder (MTLDispatchTypeConcurrent) per command buffer. A dispatch gets a
//            barrier before it only if it reads a buffer written since the last barrier, or writes one read or
//            written since then (RAW, WAR, WAW; whole MTLBuffers, which are per tensor). Bindings do not carry
//            over from one kernel() to the next: every argument the kernel declares must be set after kernel().
// Commits    a command buffer is committed at flush() (and so at synchronize()) or at the first kernel() after
//            kMaxDispatches dispatches; flush() returns a ticket, wait(ticket) waits for that work only.
// Threads    alloc, release and weight may come from any thread (the address map has a lock); the encoder is
//            used by one thread at a time, as the Backend is.
//
// This file has not run on Apple hardware: on Linux it is only compiled (never linked or run) against stub headers
// (tests/metal/test_apple_host.py).
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/metal/device.h"
#include "backend/metal/metal_backend.h"
#include "core/common.h"

namespace lily {

std::unique_ptr<Backend> make_metal_backend();
std::string metal_probe(bool* usable);  // registry.cpp

namespace metal {

// metal/*.metal, each with its headers inlined; generated at build time by metal/metal.cmake.
struct EmbeddedSource {
  const char* file;
  const char* text;
};
extern const EmbeddedSource kEmbeddedSources[];
extern const size_t kNumEmbeddedSources;

namespace {

constexpr int kMaxDispatches = 64;      // per command buffer: the GPU starts early on long recordings (prefill)
constexpr int kMaxArguments = 31;       // entries of Metal's buffer and threadgroup argument tables
constexpr size_t kMaxSetBytes = 4096;   // setBytes:length:atIndex: limit

std::string text(NSString* s) { return s ? std::string([s UTF8String]) : std::string(); }
NSString* ns(const char* s) { return [NSString stringWithUTF8String:s]; }
std::string describe(NSError* e) { return e ? text(e.localizedDescription) : std::string("no description"); }

[[noreturn]] void fail(const std::string& message) { throw std::runtime_error("Metal: " + message); }

id<MTLDevice> system_device() {
  id<MTLDevice> device = MTLCreateSystemDefaultDevice();
  if (!device) fail("no GPU found (MTLCreateSystemDefaultDevice returned nil)");
  if (!device.hasUnifiedMemory)
    fail(text(device.name) + " has no unified memory; Lily's Metal backend runs on Apple silicon only");
  return device;
}

// lily.metallib sits next to the extension module that contains this code.
std::string metallib_path() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<const void*>(&make_metal_backend), &info) || !info.dli_fname)
    fail("cannot locate the extension module (dladdr failed), so not lily.metallib either");
  const std::string module = info.dli_fname;
  const size_t slash = module.rfind('/');
  return (slash == std::string::npos ? std::string(".") : module.substr(0, slash)) + "/lily.metallib";
}

// ---- kernels ------------------------------------------------------------------------------------------------

// A kernel's pipeline and its arguments: bit i of a mask is [[buffer(i)]] or [[threadgroup(i)]].
struct Pipeline {
  std::string name;
  id<MTLComputePipelineState> state;
  uint32_t buffers = 0;      // every buffer argument (the args struct included)
  uint32_t writes = 0;       // the buffer arguments declared writable
  uint32_t threadgroup = 0;  // dynamic threadgroup memory arguments
};

class Library {
 public:
  explicit Library(id<MTLDevice> device) {
    @autoreleasepool {
      std::vector<id<MTLLibrary>> libraries;
      const std::string path = metallib_path();
      struct stat st;
      if (stat(path.c_str(), &st) == 0) {
        NSError* error = nil;
        id<MTLLibrary> library = [device newLibraryWithURL:[NSURL fileURLWithPath:ns(path.c_str())] error:&error];
        if (!library) fail("cannot load " + path + ": " + describe(error));
        libraries.push_back(library);
        origin_ = path;
      } else {
        MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
        options.fastMathEnabled = NO;  // the kernels are tested against exact CPU references
        options.languageVersion = MTLLanguageVersion3_0;
        for (size_t i = 0; i < kNumEmbeddedSources; ++i) {
          NSError* error = nil;
          id<MTLLibrary> library = [device newLibraryWithSource:ns(kEmbeddedSources[i].text)
                                                        options:options
                                                          error:&error];
          if (!library)
            fail(cat(path, " is missing, and compiling the embedded ", kEmbeddedSources[i].file,
                     " failed:\n", describe(error)));
          libraries.push_back(library);
        }
        origin_ = "the embedded kernel sources (" + path + " is missing)";
      }
      std::string failures;
      for (id<MTLLibrary> library : libraries) {
        NSArray<NSString*>* names = library.functionNames;
        for (NSUInteger i = 0; i < names.count; ++i) add(device, library, [names objectAtIndex:i], failures);
      }
      if (!failures.empty()) fail("kernels of " + origin_ + " that " + text(device.name) + " cannot run:" + failures);
      if (pipelines_.empty()) fail(origin_ + " holds no kernels");
    }
  }

  const Pipeline& pipeline(const char* name) const {
    auto it = pipelines_.find(name);
    if (it == pipelines_.end()) {
      std::vector<std::string> known;
      for (const auto& kv : pipelines_) known.push_back(kv.first);
      std::sort(known.begin(), known.end());
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw std::logic_error(cat("Metal: no kernel named '", name, "' in ", origin_, " (it has: ", list, ")"));
    }
    return it->second;
  }

 private:
  void add(id<MTLDevice> device, id<MTLLibrary> library, NSString* function, std::string& failures) {
    const std::string name = text(function);
    if (pipelines_.count(name)) {
      failures += "\n  " + name + ": defined by two kernel files";
      return;
    }
    Pipeline p;
    p.name = name;
    NSError* error = nil;
    MTLAutoreleasedComputePipelineReflection reflection = nil;
    p.state = [device newComputePipelineStateWithFunction:[library newFunctionWithName:function]
                                                  options:MTLPipelineOptionBindingInfo
                                               reflection:&reflection
                                                    error:&error];
    if (!p.state) {
      failures += "\n  " + name + ": " + describe(error);
      return;
    }
    NSArray<id<MTLBinding>>* bindings = reflection.bindings;
    for (NSUInteger i = 0; i < bindings.count; ++i) {
      id<MTLBinding> b = [bindings objectAtIndex:i];
      const uint32_t bit = 1u << b.index;
      if (b.type == MTLBindingTypeBuffer) {
        p.buffers |= bit;
        if (b.access != MTLBindingAccessReadOnly) p.writes |= bit;
      } else if (b.type == MTLBindingTypeThreadgroupMemory) {
        p.threadgroup |= bit;
      }
    }
    pipelines_.emplace(name, std::move(p));
  }

  std::unordered_map<std::string, Pipeline> pipelines_;
  std::string origin_;  // where the kernels came from, for messages
};

// ---- memory -------------------------------------------------------------------------------------------------

// Every address range the GPU can see, keyed by its first byte. Ranges never overlap: allocations are distinct
// buffers and weights are distinct tensors of the checkpoint.
class Memory {
 public:
  struct Location {
    id<MTLBuffer> buffer;
    size_t offset;
  };

  explicit Memory(id<MTLDevice> device) : device_(device), page_(uintptr_t(sysconf(_SC_PAGESIZE))) {}

  void* alloc(size_t bytes) {
    id<MTLBuffer> buffer = [device_ newBufferWithLength:bytes options:MTLResourceStorageModeShared];
    if (!buffer) throw std::bad_alloc();
    const uintptr_t p = uintptr_t([buffer contents]);
    std::lock_guard<std::mutex> lock(mu_);
    ranges_[p] = Range{p + bytes, p + bytes, buffer, p, true};
    return reinterpret_cast<void*>(p);
  }

  void release(void* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.find(uintptr_t(ptr));
    LILY_ASSERT(it != ranges_.end() && it->second.allocation, "Metal: release of a pointer alloc() did not return");
    ranges_.erase(it);  // a command buffer that still uses the buffer keeps it alive until it completes
  }

  const void* weight(const void* host, size_t bytes) {
    LILY_ASSERT(host && bytes > 0, "Metal: weight() of an empty tensor");
    const uintptr_t begin = uintptr_t(host), end = begin + bytes;
    std::lock_guard<std::mutex> lock(mu_);
    auto next = ranges_.upper_bound(begin);
    if (next != ranges_.begin()) {
      const Range& prev = std::prev(next)->second;
      if (end <= prev.end) return host;  // already visible: the same weight again, or backend memory
      LILY_ASSERT(begin >= prev.end, "Metal: weight [", begin, ", ", end, ") partly overlaps another one");
      if (end <= prev.span_end) {  // within the pages the previous weight's buffer already wraps
        ranges_[begin] = Range{end, prev.span_end, prev.buffer, prev.base, false};
        return host;
      }
    }
    LILY_ASSERT(next == ranges_.end() || end <= next->first, "Metal: weight [", begin, ", ", end,
                ") partly overlaps another one");
    const uintptr_t lo = begin & ~(page_ - 1), hi = (end + page_ - 1) & ~(page_ - 1);
    id<MTLBuffer> wrapped = [device_ newBufferWithBytesNoCopy:reinterpret_cast<void*>(lo)
                                                       length:hi - lo
                                                      options:MTLResourceStorageModeShared
                                                  deallocator:nil];
    if (wrapped) {
      ranges_[begin] = Range{end, hi, wrapped, lo, false};
      return host;
    }
    id<MTLBuffer> copy = [device_ newBufferWithBytes:host length:bytes options:MTLResourceStorageModeShared];
    if (!copy) throw std::bad_alloc();
    const uintptr_t p = uintptr_t([copy contents]);
    ranges_[p] = Range{p + bytes, p + bytes, copy, p, false};
    return reinterpret_cast<const void*>(p);
  }

  Location locate(const void* ptr) {
    const uintptr_t p = uintptr_t(ptr);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(p);
    LILY_ASSERT(it != ranges_.begin() && p < std::prev(it)->second.end, "Metal: pointer ", p,
                " is in no allocation or weight of this device");
    const Range& r = std::prev(it)->second;
    return Location{r.buffer, size_t(p - r.base)};
  }

 private:
  struct Range {
    uintptr_t end;
    uintptr_t span_end;  // end of the memory the buffer covers (a wrapped weight covers whole pages)
    id<MTLBuffer> buffer;
    uintptr_t base;      // address of the buffer's first byte
    bool allocation;     // from alloc(), so release() may free it
  };

  id<MTLDevice> device_;
  const uintptr_t page_;
  std::mutex mu_;
  std::map<uintptr_t, Range> ranges_;
};

// ---- command stream ---------------------------------------------------------------------------------------

class Stream final : public Encoder {
 public:
  Stream(id<MTLDevice> device, Memory& memory, const Library& library)
      : device_(device), queue_([device newCommandQueue]), memory_(memory), library_(library) {
    if (!queue_) fail("cannot create a command queue on " + text(device.name));
  }

  ~Stream() override {
    if (encoder_) [encoder_ endEncoding];  // recording was abandoned (an exception): drop it uncommitted
    for (const InFlight& f : in_flight_) [f.buffer waitUntilCompleted];
    for (const Scratch& s : scratch_)
      if (s.ptr) memory_.release(s.ptr);
  }

  void kernel(const char* name) override {
    const Pipeline& p = library_.pipeline(name);
    if (encoder_ && dispatches_ >= kMaxDispatches) commit();
    if (!encoder_) begin();
    [encoder_ setComputePipelineState:p.state];
    pipeline_ = &p;
    set_ = 0;
    threadgroup_set_ = 0;
    std::fill(bound_, bound_ + kMaxArguments, nullptr);
  }

  void set_bytes(int index, const void* data, size_t bytes) override {
    check_argument(index, "set_bytes");
    LILY_ASSERT(bytes <= kMaxSetBytes, "Metal kernel '", pipeline_->name, "': set_bytes(", index, ") of ", bytes,
                " bytes; Metal takes at most ", kMaxSetBytes);
    [encoder_ setBytes:data length:bytes atIndex:NSUInteger(index)];
    set_ |= 1u << index;
    bound_[index] = nullptr;
  }

  void set_buffer(int index, const void* ptr) override {
    check_argument(index, "set_buffer");
    if (ptr) {
      const Memory::Location at = memory_.locate(ptr);
      [encoder_ setBuffer:at.buffer offset:at.offset atIndex:NSUInteger(index)];
      bound_[index] = (__bridge const void*)at.buffer;
    } else {
      [encoder_ setBuffer:nil offset:0 atIndex:NSUInteger(index)];
      bound_[index] = nullptr;
    }
    set_ |= 1u << index;
  }

  void set_threadgroup_memory(int index, size_t bytes) override {
    check_argument(index, "set_threadgroup_memory");
    const size_t rounded = (bytes + 15) & ~size_t(15);  // Metal wants a multiple of 16 bytes
    const size_t limit = device_.maxThreadgroupMemoryLength - pipeline_->state.staticThreadgroupMemoryLength;
    LILY_ASSERT(rounded <= limit, "Metal kernel '", pipeline_->name, "': ", bytes, " bytes of threadgroup memory",
                " at index ", index, "; this GPU leaves it ", limit);
    [encoder_ setThreadgroupMemoryLength:rounded atIndex:NSUInteger(index)];
    threadgroup_set_ |= 1u << index;
  }

  void dispatch(Size3 groups, Size3 threads) override {
    LILY_ASSERT(pipeline_, "Metal: dispatch() before kernel()");
    const Pipeline& p = *pipeline_;
    const uint64_t per_group = uint64_t(threads.x) * threads.y * threads.z;
    LILY_ASSERT(per_group >= 1 && per_group <= p.state.maxTotalThreadsPerThreadgroup, "Metal kernel '", p.name,
                "': ", per_group, " threads per threadgroup; its pipeline allows 1 to ",
                p.state.maxTotalThreadsPerThreadgroup);
    LILY_ASSERT((p.buffers & ~set_) == 0, "Metal kernel '", p.name, "': buffer arguments (mask ",
                p.buffers & ~set_, ") were not set after kernel()");
    LILY_ASSERT((p.threadgroup & ~threadgroup_set_) == 0, "Metal kernel '", p.name,
                "': threadgroup memory arguments (mask ", p.threadgroup & ~threadgroup_set_, ") were not set");
    if (uint64_t(groups.x) * groups.y * groups.z == 0) return;  // an empty grid does nothing
    order_after_conflicts(p);
    [encoder_ dispatchThreadgroups:MTLSizeMake(groups.x, groups.y, groups.z)
             threadsPerThreadgroup:MTLSizeMake(threads.x, threads.y, threads.z)];
    ++dispatches_;
  }

  void* scratch(int slot, size_t bytes) override {
    LILY_ASSERT(slot >= 0, "Metal: scratch slot ", slot);
    if (size_t(slot) >= scratch_.size()) scratch_.resize(size_t(slot) + 1);
    Scratch& s = scratch_[size_t(slot)];
    if (s.bytes < bytes) {
      if (s.ptr) memory_.release(s.ptr);  // command buffers that use it keep it alive until they complete
      s = Scratch{};
      s.ptr = memory_.alloc(bytes);
      s.bytes = bytes;
    }
    return s.ptr;
  }

  // Commits the command buffer being recorded, if any, and returns a ticket covering all work enqueued so far.
  uint64_t flush() {
    if (encoder_) commit();
    return committed_;
  }

  // Waits for the command buffers committed up to `ticket`; later ones keep running.
  void wait(uint64_t ticket) {
    while (!in_flight_.empty() && in_flight_.front().serial <= ticket) {
      id<MTLCommandBuffer> buffer = in_flight_.front().buffer;
      in_flight_.pop_front();
      [buffer waitUntilCompleted];
      if (buffer.status == MTLCommandBufferStatusError) fail("a command buffer failed: " + describe(buffer.error));
    }
  }

 private:
  struct InFlight {
    uint64_t serial;
    id<MTLCommandBuffer> buffer;
  };
  struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
  };

  void check_argument(int index, const char* what) const {
    LILY_ASSERT(pipeline_, "Metal: ", what, "() before kernel()");
    LILY_ASSERT(index >= 0 && index < kMaxArguments, "Metal kernel '", pipeline_->name, "': ", what, "(", index,
                "): argument indices run from 0 to ", kMaxArguments - 1);
  }

  void begin() {
    @autoreleasepool {
      buffer_ = [queue_ commandBuffer];
      encoder_ = [buffer_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
    }
    if (!buffer_ || !encoder_) fail("cannot begin a command buffer");
    dispatches_ = 0;
    read_.clear();
    written_.clear();
  }

  void commit() {
    [encoder_ endEncoding];
    [buffer_ commit];
    in_flight_.push_back(InFlight{++committed_, buffer_});
    encoder_ = nil;
    buffer_ = nil;
    pipeline_ = nullptr;
  }

  // The barrier policy of the concurrent encoder: a dispatch waits for the earlier ones (all of them, since the
  // last barrier) only when it touches a buffer that one of them writes, or writes one that they read.
  void order_after_conflicts(const Pipeline& p) {
    const void* reads[kMaxArguments];
    const void* writes[kMaxArguments];
    int n_reads = 0, n_writes = 0;
    for (int i = 0; i < kMaxArguments; ++i) {
      if (!bound_[i] || !(p.buffers >> i & 1u)) continue;
      if (p.writes >> i & 1u)
        writes[n_writes++] = bound_[i];
      else
        reads[n_reads++] = bound_[i];
    }
    auto in = [](const std::vector<const void*>& set, const void* b) {
      return std::find(set.begin(), set.end(), b) != set.end();
    };
    bool conflict = false;
    for (int i = 0; i < n_reads && !conflict; ++i) conflict = in(written_, reads[i]);
    for (int i = 0; i < n_writes && !conflict; ++i) conflict = in(written_, writes[i]) || in(read_, writes[i]);
    if (conflict) {
      [encoder_ memoryBarrierWithScope:MTLBarrierScopeBuffers];
      read_.clear();
      written_.clear();
    }
    read_.insert(read_.end(), reads, reads + n_reads);
    written_.insert(written_.end(), writes, writes + n_writes);
  }

  id<MTLDevice> device_;
  id<MTLCommandQueue> queue_;
  Memory& memory_;
  const Library& library_;

  id<MTLCommandBuffer> buffer_;            // being recorded, or nil
  id<MTLComputeCommandEncoder> encoder_;   // its encoder, or nil
  int dispatches_ = 0;                     // recorded into buffer_
  uint64_t committed_ = 0;                 // command buffers committed so far (the last one's ticket)
  std::deque<InFlight> in_flight_;         // committed, not yet waited for

  const Pipeline* pipeline_ = nullptr;     // selected by kernel()
  uint32_t set_ = 0, threadgroup_set_ = 0; // arguments set since kernel()
  const void* bound_[kMaxArguments] = {};  // the MTLBuffer bound at each buffer index since kernel(), or null
  std::vector<const void*> read_, written_;  // buffers read / written by the dispatches since the last barrier

  std::vector<Scratch> scratch_;
};

// ---- device -------------------------------------------------------------------------------------------------

class AppleDevice final : public Device {
 public:
  AppleDevice() : device_(system_device()), memory_(device_), library_(device_), stream_(device_, memory_, library_) {}

  std::string name() const override { return text(device_.name); }
  void* alloc(size_t bytes) override { return memory_.alloc(bytes); }
  void release(void* p) override { memory_.release(p); }
  const void* weight(const void* host, size_t bytes) override { return memory_.weight(host, bytes); }
  Encoder& encoder() override { return stream_; }
  void synchronize() override { stream_.wait(stream_.flush()); }
  uint64_t flush() override { return stream_.flush(); }
  void wait(uint64_t ticket) override { stream_.wait(ticket); }

 private:
  id<MTLDevice> device_;
  Memory memory_;
  Library library_;
  Stream stream_;  // declared last: destroyed first, while the memory it releases still exists
};

}  // namespace
}  // namespace metal

std::unique_ptr<Backend> make_metal_backend() {
  return metal::make_backend(std::make_unique<metal::AppleDevice>());
}

// registry.cpp's probe: the system GPU's name, or why the backend cannot use it (with *usable left false).
std::string metal_probe(bool* usable) {
  @autoreleasepool {
    id<MTLDevice> device = MTLCreateSystemDefaultDevice();
    if (!device) return "no Metal GPU found (MTLCreateSystemDefaultDevice returned nil)";
    if (!device.hasUnifiedMemory)
      return metal::text(device.name) + " has no unified memory; Lily's Metal backend runs on Apple silicon only";
    *usable = true;
    return metal::text(device.name);
  }
}

}  // namespace lily
