// sample.cpp: the launcher of metal/sample.metal (token selection on the device; the .metal header gives the rules,
// the numerics and the mapping). Switch sample_split (default): sample_part over ⌈n_valid / SAMPLE_SLICE⌉
// threadgroups, then sample_merge, through the scratch slot kSlotSample (grown once, at the first token); off (or
// past SAMPLE_MAX_PARTS slices): `sample`, one threadgroup. Nothing waits for the device.
#include <cstdint>

#include "../../../metal/sample_args.h"
#include "backend/metal/ops.h"
#include "backend/policy.h"
#include "core/common.h"

namespace lily::metal {

static_assert(SAMPLE_RESULT_SLOTS == kResultSlots, "metal/sample_args.h and backend.h disagree on the result slots");
static_assert(SAMPLE_MAX_CAND == kSampleMaxCand, "metal/sample_args.h and backend/policy.h disagree on the candidates");
static_assert(SAMPLE_PER * SAMPLE_THREADS == SAMPLE_SLICE, "sample_part: a slice is SAMPLE_PER ids a thread");
static_assert(SAMPLE_SLICE_CAND >= 2 * SAMPLE_MAX_CAND - 1, "sample_part: a slice writes up to 2·cap − 1 candidates");
static_assert(SAMPLE_MAX_PARTS <= SAMPLE_THREADS, "sample_merge: one slice a thread");
static_assert(sizeof(SamplePartial) == 20, "SamplePartial: five 4-byte fields, as in MSL");

void sample(Encoder& enc, const Optimisations& opts, const SamplingParams& p, int n_valid, const float* logits,
            const DeviceSampler& st) {
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
  // pos: without a position to advance, the kernel leaves buffer 7 alone; token stands in as a valid binding.
  const void* pos = st.pos ? static_cast<const void*>(st.pos) : static_cast<const void*>(st.token);
  auto bind_state = [&] {  // buffers 1–7 of `sample` and `sample_merge`
    enc.set_args(a);
    enc.set_buffer(1, logits);      // logits
    enc.set_buffer(2, st.counts);   // counts
    enc.set_buffer(3, st.seen);     // seen
    enc.set_buffer(4, st.step);     // step
    enc.set_buffer(5, st.token);    // token
    enc.set_buffer(6, st.results);  // results
    enc.set_buffer(7, pos);         // pos
  };

  const int64_t parts = (int64_t(n_valid) + SAMPLE_SLICE - 1) / SAMPLE_SLICE;
  if (!opts.on(Opt::sample_split) || parts > SAMPLE_MAX_PARTS) {
    enc.kernel("sample");
    bind_state();
    enc.dispatch({1, 1, 1}, {SAMPLE_THREADS, 1, 1});
    return;
  }
  const Parts<3> sp = sample_parts(int(parts), sizeof(SamplePartial), SAMPLE_SLICE_CAND);
  void* scratch = enc.scratch(kSlotSample, sp.bytes);
  SamplePartial* part = sp.at<SamplePartial>(scratch, kSampleParts);
  int32_t* cand_id = sp.at<int32_t>(scratch, kSampleCandIds);
  float* cand_x = sp.at<float>(scratch, kSampleCandX);
  enc.kernel("sample_part");
  enc.set_args(a);
  enc.set_buffer(1, logits);
  enc.set_buffer(2, st.counts);
  enc.set_buffer(3, st.seen);
  enc.set_buffer(4, part);
  enc.set_buffer(5, cand_id);
  enc.set_buffer(6, cand_x);
  enc.dispatch({uint32_t(parts), 1, 1}, {SAMPLE_THREADS, 1, 1});
  enc.kernel("sample_merge");
  bind_state();
  enc.set_buffer(8, part);
  enc.set_buffer(9, cand_id);
  enc.set_buffer(10, cand_x);
  enc.dispatch({1, 1, 1}, {SAMPLE_THREADS, 1, 1});
}

}  // namespace lily::metal
