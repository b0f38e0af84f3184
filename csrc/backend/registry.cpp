// registry.cpp: backends compiled into this build, by name.
#include "backend/backend.h"
#include "core/common.h"

namespace lily {

std::unique_ptr<Backend> make_cpu_backend();
#ifdef LILY_HAS_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif
#if defined(LILY_HAS_METAL) || defined(LILY_HAS_METAL_EMU)
std::unique_ptr<Backend> make_metal_backend();  // metal_backend.mm, or the CPU harness in test builds
#endif

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names{"cpu"};
#ifdef LILY_HAS_CUDA
  names.push_back("cuda");
#endif
#if defined(LILY_HAS_METAL) || defined(LILY_HAS_METAL_EMU)
  names.push_back("metal");
#endif
  return names;
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "cpu") return make_cpu_backend();
#ifdef LILY_HAS_CUDA
  if (name == "cuda") return make_cuda_backend();
#endif
#if defined(LILY_HAS_METAL) || defined(LILY_HAS_METAL_EMU)
  if (name == "metal") return make_metal_backend();
#endif
  std::string known;
  for (auto& b : compiled_backends()) known += (known.empty() ? "" : ", ") + b;
  throw InputError(cat("unknown or unavailable backend '", name, "' (compiled in: ", known, ")"));
}

}  // namespace lily
