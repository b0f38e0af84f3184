// allocations.h: the bookkeeping every backend does for its own memory: each live allocation with its size, the
// total in use and the peak (Model.peak_memory), and the list to free when the backend goes away.
#pragma once
#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace lily {

class Allocations {
 public:
  void add(void* p, size_t bytes);
  // Forgets p and returns its size; a pointer that was never added is a bug in the caller (std::logic_error).
  size_t remove(void* p);
  std::vector<void*> live() const;
  size_t in_use() const { return in_use_; }
  size_t peak() const { return peak_; }
  void reset_peak() { peak_ = in_use_; }

 private:
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  size_t in_use_ = 0, peak_ = 0;
};

}  // namespace lily
