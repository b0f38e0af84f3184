// norm_args.h: the args structs and tiling of metal/norm.metal (embed, rms_norm, add_rms_norm), shared by the kernels
// and their launchers (csrc/backend/metal/norm.cpp). Plain C layout with 4-byte fields only, identical in MSL and C++.
#pragma once

struct EmbedKernelArgs {
  int K;      // values per table row (H)
  int group;  // values per scale/bias group
};

struct NormKernelArgs {
  int H;      // values per row
  float eps;  // RMSNorm epsilon
};

enum NormTiling : int {
  kEmbedThreads = 256,      // threads per embed threadgroup (at most; fewer for short rows)
  kNormThreads = 256,       // target rms_norm threadgroup: VPT float4 chunks per thread cover the row
  kNormMaxSimdgroups = 32,  // 1024 threads: with 8 chunks each, H ≤ 32768
};
