// gdn_args.h: the args struct and tiling of metal/gdn.metal (gdn_conv, gdn_scan_dk*, gdn_norm and the chunked prefill
// gdn_chunk_prep_dk*, gdn_wy_dk*, gdn_chunk_scan_dk*), shared by the kernels and their launchers
// (csrc/backend/metal/gdn.cpp). Plain C layout with 4-byte fields only, identical in MSL and C++.
#pragma once

struct GdnKernelArgs {
  int T;               // tokens in the call
  int NK, NV, DK, DV;  // key heads, value heads, key dim, value dim
  int C;               // conv channels = 2·NK·DK + NV·DV (one row of x, out and c)
  int K;               // conv taps (the conv state holds K − 1 rows)
  float eps;           // gated RMSNorm epsilon
  int Tp;              // chunked prefill: T rounded up to whole chunks (rows per head of its scratch)
  int nc;              // chunked prefill: chunks, Tp / kGdnChunkL
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
  // One decode token in one dispatch (gdn_token, gdn_conv_token; backend/policy.h: gdn_token_path).
  kGdnTokRowsPerSg = 8,   // state rows per simdgroup and pass (a block)
  kGdnTokSgs = 16,        // simdgroups per threadgroup, at most (512 threads)
  kGdnTokMaxRows = 256,   // state rows per threadgroup (DV, or R·DV with the conv): two passes of 16 blocks
  // The chunked prefill (switch gdn_chunked; the launcher asserts these equal backend/policy.h's kGdnChunk,
  // kGdnChunkRows and kGdnChunkMaxCols, which decide when it runs).
  kGdnChunkL = 64,        // tokens per chunk
  kGdnPrepSgs = 8,        // gdn_chunk_prep: simdgroups (token, key head items) per threadgroup
  kGdnWySgs = 8,          // gdn_wy: simdgroups per threadgroup, one row tile of 8 tokens each
  kGdnWyThreads = 32 * kGdnWySgs,  // and one column of [V | K̂] per thread in the solve: DV + DK ≤ 256
  kGdnWyLda = kGdnChunkL + 4,      // row pitch of A in threadgroup memory
  kGdnCsSgs = 4,          // gdn_chunk_scan: simdgroups per threadgroup, 8 state rows each
  kGdnCsRows = 8 * kGdnCsSgs,      // state rows per threadgroup
  kGdnCsThreads = 32 * kGdnCsSgs,
  kGdnCsLdy = kGdnCsRows + 4,      // row pitch of the staged y tile
};
