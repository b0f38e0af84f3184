// out_of_bounds.metal: the last thread reads one element past the input (found by the ASan build).
#include <metal_stdlib>
using namespace metal;

[[kernel]] void out_of_bounds(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              constant uint& n [[buffer(2)]],
                              uint i [[thread_position_in_grid]]) {
  out[i] = in[i] + in[i + 1];
}
