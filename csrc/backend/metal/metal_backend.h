// metal_backend.h: the Metal backend over any Device (real GPU or the CPU harness). Memory is unified, so host
// copies are memcpy after a synchronize; every op forwards to its launcher (ops.h).
#pragma once
#include <memory>

#include "backend/backend.h"
#include "backend/metal/device.h"

namespace lily::metal {

std::unique_ptr<Backend> make_backend(std::unique_ptr<Device> device);

}  // namespace lily::metal
