// registry.cpp: backends compiled into this build, by name.
#include "backend/backend.h"
#include "core/common.h"

namespace lily {

std::unique_ptr<Backend> make_cpu_backend();

std::vector<std::string> compiled_backends() { return {"cpu"}; }

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "cpu") return make_cpu_backend();
  std::string known;
  for (auto& b : compiled_backends()) known += (known.empty() ? "" : ", ") + b;
  throw InputError(cat("unknown or unavailable backend '", name, "' (compiled in: ", known, ")"));
}

}  // namespace lily
