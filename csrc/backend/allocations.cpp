#include "backend/allocations.h"

#include <algorithm>

#include "core/common.h"

namespace lily {

void Allocations::add(void* p, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  sizes_[p] = bytes;
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
}

size_t Allocations::remove(void* p) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sizes_.find(p);
  LILY_ASSERT(it != sizes_.end(), "release of a pointer this backend did not allocate");
  const size_t n = it->second;
  in_use_ -= n;
  sizes_.erase(it);
  return n;
}

std::vector<void*> Allocations::live() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<void*> v;
  for (auto& kv : sizes_) v.push_back(kv.first);
  return v;
}

}  // namespace lily
