// sample_args.h: the args struct of metal/sample.metal, shared by the kernel and its launcher
// (csrc/backend/metal/sample.cpp). Plain C layout with 4-byte fields only, identical in MSL and C++.
#pragma once

// Threads of the one threadgroup, and the most candidates (ids kept by top-k) the kernel holds.
#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_CAND 1024
// Result slots of DeviceSampler::results (kResultSlots, backend.h): step s writes slot s % SAMPLE_RESULT_SLOTS.
#define SAMPLE_RESULT_SLOTS 4

struct SampleKernelArgs {
  float temperature;          // 0: greedy
  float top_p, min_p;
  float repetition_penalty, presence_penalty, frequency_penalty;
  int top_k;                  // 0: off
  int n_valid;                // ids ≥ n_valid are never chosen
  unsigned int seed_lo, seed_hi;  // the 64-bit seed of the draw
  int has_pos;                // 1: advance the session position buffer
};
