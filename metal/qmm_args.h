// qmm_args.h: the args structs and tile constants of metal/qmv.metal (GEMV) and metal/qmm.metal (GEMM, grouped
// expert GEMM), shared by those kernels and their launcher csrc/backend/metal/qmm.cpp. Plain 4-byte fields only, so
// the layout is the same in MSL and C++.
#pragma once

// GEMV (qmv.metal): a threadgroup of kQmvSimdgroups simdgroups, each owning kQmvRows weight rows; x is staged in
// slabs of at most kQmvXFloats floats (T rows × KS columns) of threadgroup memory.
enum QmvShape : int {
  kQmvRows = 4,
  kQmvSimdgroups = 8,
  kQmvRowsPerGroup = kQmvRows * kQmvSimdgroups,
  kQmvThreads = 32 * kQmvSimdgroups,
  kQmvXFloats = 4096,
  kQmvMaxSegs = 4,  // matrices sharing x in one dispatch
};

struct QmvArgs {
  int K;                // columns of every matrix (a multiple of the group size)
  int chunks;           // 16-byte chunks per weight row: K·bits/128
  int groups;           // groups per row: K/group
  int gshift;           // chunk → group: c >> gshift
  int KS;               // x slab width (a multiple of 32)
  int nseg;             // matrices in this dispatch, 1..kQmvMaxSegs
  int y_f32;            // 1: the y buffers are fp32, else bf16 bits
  int N[kQmvMaxSegs];   // rows of matrix i
  int tg0[kQmvMaxSegs]; // first threadgroup of matrix i
  int nparts;           // qmv_fold: partial sums of x² in parts
  float eps;            // qmv_fold: the RMSNorm epsilon
};

// GEMM (qmm.metal): a threadgroup of 4 simdgroups computes a BM × kQmmBN tile of y (BM = 16 or 32 token rows,
// kQmmBN weight rows), kQmmBK columns of K per step. The threadgroup tiles are padded by 4 floats per row (pitches
// kQmmXP, kQmmWP) so that the rows of an 8×8 simdgroup load start in different banks.
enum QmmShape : int {
  kQmmBN = 64,
  kQmmBK = 32,
  kQmmMaxBM = 32,
  kQmmThreads = 128,
  kQmmXP = kQmmBK + 4,  // xs[BM][kQmmXP]: x tile, token-major
  kQmmWP = kQmmBN + 4,  // ws[kQmmBK][kQmmWP]: W tile, k-major; after the last step the y tile [BM][kQmmWP]
};

struct QmmArgs {
  int K;       // columns of x and W
  int N;       // weight rows (output columns)
  int rows;    // qmm: T (rows of x and y); moe_gemm: unused (the row ranges come from the device offsets)
  int groups;  // groups per weight row: K/group
  int gshift;  // k → group: k >> gshift
  int y_f32;   // qmm: 1 when y is fp32, else bf16 bits; moe_gemm: 0
  int E;       // moe_gemm: experts in the stack; qmm: 1
  int gather;  // moe_gemm: 1 when row r reads x[rows[r]], 0 when it reads x[r]
};
