// sample_args.h: the args struct of metal/sample.metal, shared by the kernel and its launcher
// (csrc/backend/metal/sample.cpp). Plain C layout with 4-byte fields only, identical in MSL and C++.
#pragma once

// Threads of every threadgroup (sample, sample_part, sample_merge), and the most candidates (ids kept by top-k) the
// selection holds.
#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_CAND 1024
// Result slots of DeviceSampler::results (kResultSlots, backend.h): step s writes slot s % SAMPLE_RESULT_SLOTS.
#define SAMPLE_RESULT_SLOTS 4
// Switch sample_split: sample_part's threadgroup g owns ids [g·SAMPLE_SLICE, (g+1)·SAMPLE_SLICE), SAMPLE_PER
// consecutive ids a thread; a slice writes at most SAMPLE_MAX_CAND + top_k − 1 candidates (sample.metal's header
// says why), so SAMPLE_SLICE_CAND ≥ 2·SAMPLE_MAX_CAND − 1; sample_merge takes one slice a thread.
#define SAMPLE_SLICE 4096
#define SAMPLE_PER 4
#define SAMPLE_SLICE_CAND 2048
#define SAMPLE_MAX_PARTS 1024

struct SampleKernelArgs {
  float temperature;          // 0: greedy
  float top_p, min_p;
  float repetition_penalty, presence_penalty, frequency_penalty;
  int top_k;                  // 0: off
  int n_valid;                // ids ≥ n_valid are never chosen
  unsigned int seed_lo, seed_hi;  // the 64-bit seed of the draw
  int has_pos;                // 1: advance the session position buffer
};

// What sample_part hands sample_merge about its slice (the scratch's first part, one per slice).
struct SamplePartial {
  float raw_max;  // max raw logit
  float sum;      // Σ exp(raw − raw_max)
  float x_max;    // max processed logit x
  int x_arg;      // the lowest id holding it
  int n_cand;     // candidates written (0 when greedy)
};
