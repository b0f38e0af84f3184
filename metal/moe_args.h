// moe_args.h: the args structs of the MoE kernels (metal/moe.metal), shared by the kernels and their launcher
// (csrc/backend/metal/moe.cpp). Plain C layout with 4-byte int fields only, identical in MSL and C++.
#pragma once

// Largest E the routing kernels take: a simdgroup holds E/32 ≤ 8 probabilities per lane, and the sort kernels keep
// one count per expert per simdgroup in threadgroup memory.
#define MOE_MAX_EXPERTS 256
// Pairs (token, slot) per threadgroup of the sort kernels: one per thread, 8 simdgroups.
#define MOE_SORT_TILE 256
// Threads of the one threadgroup of moe_sort_scan (switch moe_sort_scan).
#define MOE_SORT_SCAN_THREADS 1024
// Decode kernels: simdgroups per threadgroup and rows per simdgroup (a threadgroup covers 16 rows).
#define MOE_DECODE_SIMDGROUPS 4
#define MOE_DECODE_ROWS 4
// Tokens per threadgroup of the routing kernel (one simdgroup each).
#define MOE_ROUTE_TOKENS 4
// Threads per threadgroup of the element-wise kernels (SwiGLU, combine).
#define MOE_ELEMENT_THREADS 256

// moe_route_s{4,8}: P = softmax(logits), top-k, ŵ, γ = σ(m·w_seg).
struct MoeRouteArgs {
  int T, E, k, H;
  int seg_group;   // group size of w_seg
  int norm_topk;   // 1: ŵ = P / Σ_topk P; 0: ŵ = P
};

// moe_gate_up_q{4,8} and moe_down_q{4,8}: the decode path (T ≤ kQmvMaxT).
struct MoeDecodeArgs {
  int T, H, k, I, IS;
  int hs;          // row stride of h: max(I, IS)
  int tiles;       // gate_up: threadgroups per slot (of 16 rows each)
  int gate_group, up_group, sgate_group, sup_group, down_group, sdown_group;
  int route_fused;  // switch route_fused: moe_gate_up routes from the logits (and writes ids, ŵ, γ for moe_down)
  int pick_logits;  // switch route_logits (with route_fused): its top-k picked on the logits (pick_expert, pick_write)
  int E, norm_topk, seg_bits, seg_group;  // the routing's, when route_fused
};

// moe_hist, moe_scan, moe_scatter (and moe_sort_scan): the expert-sorted order of the P = T·k (token, slot) pairs.
struct MoeSortArgs {
  int P, k, E;
  int tiles;       // ceil(P / MOE_SORT_TILE) (moe_sort_scan: unused)
};

// moe_swiglu: h = silu(g)·u over n values.
struct MoeSwigluArgs {
  int n;
};

// moe_combine: out[t] = Σ_j ŵ[t, j]·yd[pos[t, j]] + γ_t·s[t].
struct MoeCombineArgs {
  int T, H, k;
};
