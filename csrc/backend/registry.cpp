// registry.cpp: the backends Lily has, which of them are compiled into this build, which can run here and why not.
#include <cstdlib>

#include "backend/backend.h"
#include "core/common.h"
#include "core/parallel.h"

#ifdef LILY_HAS_CUDA
#include <cuda_runtime_api.h>
#ifdef __linux__
#include <dlfcn.h>
#endif
#endif

namespace lily {

std::unique_ptr<Backend> make_cpu_backend();
#ifdef LILY_HAS_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif
#if defined(LILY_HAS_METAL) || defined(LILY_HAS_METAL_EMU)
std::unique_ptr<Backend> make_metal_backend();  // metal_backend.mm, or the CPU harness in test builds
#endif
#ifdef LILY_HAS_METAL
// metal_backend.mm: the name of the system's Metal GPU, or the reason Lily cannot use it ("" and *usable false).
std::string metal_probe(bool* usable);
#endif

namespace {

const char* const kBackends[] = {"cuda", "metal", "cpu"};  // the order a default choice tries them

std::string cpu_device() {
#if defined(__x86_64__) || defined(_M_X64)
  const char* arch = "x86_64";
#elif defined(__aarch64__) || defined(_M_ARM64)
  const char* arch = "arm64";
#else
  const char* arch = "cpu";
#endif
  return cat(arch, ", ", num_threads(), " threads");
}

#ifdef LILY_HAS_CUDA
std::string cuda_version(int v) { return cat(v / 1000, ".", v % 1000 / 10); }

// Why cudaGetDeviceCount gave no device, in the user's terms. The runtime is linked statically and loads the driver
// (libcuda.so.1) itself when first called, so a machine without the driver reaches this point with an error.
std::string cuda_unusable_reason(cudaError_t e) {
#ifdef __linux__
  if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    dlclose(driver);
  } else {
    return "no CUDA driver is installed (libcuda.so.1, the NVIDIA driver's library, was not found), so there is no "
           "NVIDIA GPU to use";
  }
#endif
  int driver = 0;
  cudaDriverGetVersion(&driver);
  switch (e) {
    case cudaSuccess:  // and no device
    case cudaErrorNoDevice: {
      std::string why = cat("no CUDA GPU found (the NVIDIA driver, CUDA ", cuda_version(driver),
                            ", is installed but reports no device)");
      if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"))
        why += cat("; CUDA_VISIBLE_DEVICES='", visible, "' may hide the GPUs");
      return why;
    }
    case cudaErrorInsufficientDriver:
      return cat("the NVIDIA driver is too old: it supports CUDA ", driver ? cuda_version(driver) : "(unknown)",
                 ", and this build of Lily needs a driver for CUDA ", cuda_version(CUDART_VERSION),
                 " or newer; update the NVIDIA driver");
    case cudaErrorStubLibrary:
      return "no CUDA driver is installed: libcuda.so.1 is the CUDA toolkit's stub library, not the NVIDIA driver";
    default:
      return cat("CUDA cannot start: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
  }
}

BackendStatus probe_cuda() {
  BackendStatus s;
  s.name = "cuda";
  s.compiled = true;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();  // the error is reported here; it must not surface at a later call
    s.reason = cuda_unusable_reason(e);
    return s;
  }
  cudaDeviceProp prop;
  const cudaError_t pe = cudaGetDeviceProperties(&prop, 0);
  if (pe != cudaSuccess) {
    cudaGetLastError();
    s.reason = cat("CUDA cannot read the properties of GPU 0: ", cudaGetErrorString(pe));
    return s;
  }
#ifdef LILY_CUDA_MIN_ARCH
  const int cc = prop.major * 10 + prop.minor;
  if (cc < LILY_CUDA_MIN_ARCH) {
    s.reason = cat(prop.name, " (compute capability ", prop.major, ".", prop.minor,
                   ") is older than the GPUs this build's kernels are compiled for (compute capability ",
                   LILY_CUDA_MIN_ARCH / 10, ".", LILY_CUDA_MIN_ARCH % 10, " and newer)");
    return s;
  }
#endif
  s.usable = true;
  s.device = prop.name;
  return s;
}
#endif

}  // namespace

BackendStatus probe_backend(const std::string& name) {
  if (name == "cpu") return {"cpu", true, true, "", cpu_device()};
  if (name == "cuda") {
#ifdef LILY_HAS_CUDA
    return probe_cuda();
#else
    return {"cuda", false, false,
            "not compiled into this build of Lily (it is built when the CUDA toolkit is found: install it and "
            "reinstall Lily, or set LILY_CUDA=ON to require it)",
            ""};
#endif
  }
  if (name == "metal") {
#if defined(LILY_HAS_METAL)
    BackendStatus s;
    s.name = "metal";
    s.compiled = true;
    const std::string what = metal_probe(&s.usable);
    (s.usable ? s.device : s.reason) = what;
    return s;
#elif defined(LILY_HAS_METAL_EMU)
    return {"metal", true, true, "", "the Metal CPU harness (tests/metal)"};
#else
    return {"metal", false, false, "not compiled into this build of Lily (Metal is built on macOS only)", ""};
#endif
  }
  throw InputError(cat("unknown backend '", name, "' (Lily has cuda, metal and cpu)"));
}

std::vector<BackendStatus> backend_statuses() {
  std::vector<BackendStatus> out;
  for (const char* name : kBackends) out.push_back(probe_backend(name));
  return out;
}

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names;
#ifdef LILY_HAS_CUDA
  names.push_back("cuda");
#endif
#if defined(LILY_HAS_METAL) || defined(LILY_HAS_METAL_EMU)
  names.push_back("metal");
#endif
  names.push_back("cpu");
  return names;
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  std::string compiled;
  for (auto& b : compiled_backends()) compiled += (compiled.empty() ? "" : ", ") + b;
  if (name != "cpu" && name != "cuda" && name != "metal")
    throw InputError(cat("unknown backend '", name, "' (Lily has cuda, metal and cpu; compiled into this build: ",
                         compiled, ")"));
  const BackendStatus s = probe_backend(name);
  if (!s.usable)
    throw InputError(cat("backend '", name, "' cannot run here: ", s.reason));
  if (name == "cpu") return make_cpu_backend();
#ifdef LILY_HAS_CUDA
  if (name == "cuda") return make_cuda_backend();
#endif
#if defined(LILY_HAS_METAL) || defined(LILY_HAS_METAL_EMU)
  if (name == "metal") return make_metal_backend();
#endif
  throw std::logic_error(cat("backend '", name, "' is usable but has no constructor"));
}

}  // namespace lily
