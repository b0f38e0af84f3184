// gdn_args.h: the args struct and tiling of metal/gdn.metal (gdn_conv, gdn_scan_dk*, gdn_norm), shared by the kernels
// and their launchers (csrc/backend/metal/gdn.cpp). Plain C layout with 4-byte fields only, identical in MSL and C++.
#pragma once

struct GdnKernelArgs {
  int T;               // tokens in the call
  int NK, NV, DK, DV;  // key heads, value heads, key dim, value dim
  int C;               // conv channels = 2·NK·DK + NV·DV (one row of x, out and c)
  int K;               // conv taps (the conv state holds K − 1 rows)
  float eps;           // gated RMSNorm epsilon
};

enum GdnTiling : int {
  kGdnConvMaxK = 9,       // taps (config check: linear_conv_kernel_dim ≤ 9)
  kGdnConvChunk = 32,     // tokens per conv thread; ≥ kGdnConvMaxK − 1, so only chunk 0 touches the state
  kGdnConvThreads = 128,  // threads per conv threadgroup, 4 channels each
  kGdnScanRowsPerSg = 4,  // state rows per simdgroup
  kGdnScanSgs = 4,        // simdgroups per scan threadgroup
  kGdnScanRows = kGdnScanRowsPerSg * kGdnScanSgs,  // state rows per scan threadgroup
  kGdnScanThreads = 32 * kGdnScanSgs,
  kGdnScanChunk = 8,      // tokens staged in threadgroup memory at a time
  kGdnScanMaxDK = 128,
  kGdnNormSgs = 8,        // simdgroups (rows) per gdn_norm threadgroup
  kGdnNormMaxPer = 8,     // values per lane: DV ≤ 256
};
