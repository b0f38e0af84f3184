// address_space.metal: a device pointer passed where a thread pointer is expected. Apple's compiler rejects it; the
// run build accepts it (and computes the right thing), the lint (rewrite.py --lint) must reject it.
#include <metal_stdlib>
using namespace metal;

inline float twice(thread const float* p) { return 2.0f * p[0]; }

[[kernel]] void address_space(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              constant uint& n [[buffer(2)]],
                              uint i [[thread_position_in_grid]]) {
  out[i] = twice(in + i);
}
