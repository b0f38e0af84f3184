// sample.cpp: the launcher of metal/sample.metal (token selection on the device; the .metal header gives the rules,
// the numerics and the mapping). One threadgroup of SAMPLE_THREADS threads; nothing waits for the device.
#include <cstdint>

#include "../../../metal/sample_args.h"
#include "backend/metal/ops.h"
#include "backend/policy.h"
#include "core/common.h"

namespace lily::metal {

static_assert(SAMPLE_RESULT_SLOTS == kResultSlots, "metal/sample_args.h and backend.h disagree on the result slots");
static_assert(SAMPLE_MAX_CAND == kSampleMaxCand, "metal/sample_args.h and backend/policy.h disagree on the candidates");

void sample(Encoder& enc, const SamplingParams& p, int n_valid, const float* logits, const DeviceSampler& st) {
  LILY_CHECK(n_valid >= 1, "Metal sample: n_valid = ", n_valid, " must be at least 1");
  LILY_CHECK(device_can_sample(p, n_valid), "Metal sample: these sampling parameters need the host sampler");
  LILY_CHECK(logits && st.counts && st.seen && st.step && st.token && st.results,
             "Metal sample: logits and every DeviceSampler buffer but pos must be set");
  SampleKernelArgs a{};
  a.temperature = p.temperature;
  a.top_p = p.top_p;
  a.min_p = p.min_p;
  a.repetition_penalty = p.repetition_penalty;
  a.presence_penalty = p.presence_penalty;
  a.frequency_penalty = p.frequency_penalty;
  a.top_k = p.top_k;
  a.n_valid = n_valid;
  a.seed_lo = uint32_t(p.seed);
  a.seed_hi = uint32_t(p.seed >> 32);
  a.has_pos = st.pos ? 1 : 0;
  enc.kernel("sample");
  enc.set_args(a);
  enc.set_buffer(1, logits);      // logits
  enc.set_buffer(2, st.counts);   // counts
  enc.set_buffer(3, st.seen);     // seen
  enc.set_buffer(4, st.step);     // step
  enc.set_buffer(5, st.token);    // token
  enc.set_buffer(6, st.results);  // results
  // pos: without a position to advance, the kernel leaves buffer 7 alone; token stands in as a valid binding.
  enc.set_buffer(7, st.pos ? static_cast<const void*>(st.pos) : static_cast<const void*>(st.token));
  enc.dispatch({1, 1, 1}, {SAMPLE_THREADS, 1, 1});
}

}  // namespace lily::metal
