// driver.cpp: metal_emu_run, the command-line runner of the harness feature tests (tests/metal/test_harness.py).
// Runs one kernel of tests/metal/harness/broken/*.metal on the floats read from stdin and prints its output, one
// value per line; a reported misuse prints the message to stderr and exits with status 1.
//
//   metal_emu_run KERNEL ORDER SEED GROUPS THREADS N_OUT < inputs
//
// The kernels take `device const float* in [[buffer(0)]]` (exactly the inputs, so ASan sees any read past them),
// `device float* out [[buffer(1)]]` (N_OUT floats, 0xff bytes before the run) and `constant uint& n [[buffer(2)]]`
// (the number of inputs); a 1-D grid of GROUPS threadgroups of THREADS threads.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "scheduler.h"

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: metal_emu_run KERNEL forward|reverse|random SEED GROUPS THREADS N_OUT < inputs\n");
    return 2;
  }
  metal_emu::register_all_kernels();
  const metal_emu::Kernel* k = metal_emu::find_kernel(argv[1]);
  const std::string order = argv[2];
  if (!k || (order != "forward" && order != "reverse" && order != "random")) {
    std::fprintf(stderr, "unknown kernel '%s' or order '%s'\n", argv[1], argv[2]);
    return 2;
  }
  const metal_emu::Order mode = order == "forward" ? metal_emu::Order::forward
                                : order == "reverse" ? metal_emu::Order::reverse
                                                     : metal_emu::Order::random;
  std::vector<float> values;
  for (float v; std::scanf("%f", &v) == 1;) values.push_back(v);
  const size_t n_out = std::strtoull(argv[6], nullptr, 10);
  // Exact sizes (at least one byte), so that ASan reports a read one element past the end.
  auto* in = static_cast<float*>(std::malloc(std::max<size_t>(values.size() * sizeof(float), 1)));
  auto* out = static_cast<float*>(std::malloc(std::max<size_t>(n_out * sizeof(float), 1)));
  std::memcpy(in, values.data(), values.size() * sizeof(float));
  std::memset(out, 0xff, n_out * sizeof(float));
  const uint32_t n = uint32_t(values.size());

  metal_emu::Bindings b;
  b.buf[0] = in, b.buf[1] = out, b.buf[2] = &n;
  b.bytes[0] = b.bytes[1] = metal_emu::kFromBuffer, b.bytes[2] = sizeof n;
  b.set[0] = b.set[1] = b.set[2] = true;
  try {
    metal_emu::run(*k, b, {uint32_t(std::atoi(argv[4])), 1, 1}, {uint32_t(std::atoi(argv[5])), 1, 1}, mode,
                   std::strtoull(argv[3], nullptr, 10));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  for (size_t i = 0; i < n_out; ++i) std::printf("%.9g\n", out[i]);
  std::free(in);
  std::free(out);
  return 0;
}
