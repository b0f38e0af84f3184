// gdn.cu: Gated DeltaNet's causal conv, delta-rule recurrence and gated RMSNorm (architecture.md §5.2–§5.8).
//
// Math     conv:  C[t, c] = silu(Σ_{k<K} w[c, k] · U[t + k, c]),  U = [state (K−1 rows); x];
//                 state ← last K−1 rows of U
//          scan, value head h, key head kh = h / (NV/NK), token by token (§5.4–§5.7):
//            q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK),  k̂ = k / sqrt(Σk² + 1e-6),  β = σ(b),
//            g = exp(−exp(A_log) · softplus(α + dt_bias)),  softplus(x) = max(x, 0) + log1p(exp(−|x|))
//            S ← g·S;  u = S·k̂;  δ = β·(v − u);  S ← S + δ ⊗ k̂;  y = S·q̂        (S [DV, DK] fp32, row i = value i)
//          evaluated per state row i from one pass over the old row (the same function, regrouped):
//            a_k = S_i·k̂,  a_q = S_i·q̂;  δ_i = β·(v_i − g·a_k);  y_i = g·a_q + δ_i·(k̂·q̂);  S_i ← g·S_i + δ_i·k̂
//          norm:  o = y / sqrt(mean(y²) + eps) · w · silu(z)     per (token, value head) over DV values
// Layout   x, out bf16 [T, C], C = 2·NK·DK + NV·DV = [q heads | k heads | v heads]; conv w fp32 [C, K];
//          conv_state bf16 [K−1, C]; b, alpha bf16 [T, NV]; state fp32 [NV, DV, DK]; y, z, out bf16 [T, NV·DV].
//          Scratch (kSlotGdn): q̂k̂ fp32 [NK, T, 2·DK] (q̂ then k̂) and gates float4 [NV, T] = (g, β, k̂·q̂, ln g).
// Traffic  real shapes (C = 8192, NK=16, NV=32, DK=DV=128), decode T=1:
//            conv  x 16 KB + w 128 KB + state 48 KB read + 48 KB written + out 16 KB = 0.26 MB
//            scan  state 2.1 MB read + 2.1 MB written + c 16 KB + y 8 KB = 4.2 MB → floor 0.9 µs @ 4.8 TB/s
//            norm  y, z, out 8 KB each
//          prefill T=4096: conv 64 MB in + 64 MB out = 128 MB → 27 µs;  scan prep 32 MB in + 64 MB out, scan
//          64 MB q̂k̂ (+ L2 re-reads) + 32 MB v + 32 MB y + 4 MB state ≈ 0.2 GB → 40 µs;  norm 96 MB → 20 µs
// Work     scan ≈ 7 FLOP per state element per token: 32·128·128·7 = 3.7 MFLOP per token, 15 GFLOP at T=4096
//          (0.23 ms at 67 TFLOP/s fp32), but sequential in T: ~4096 dependent steps of ~0.1–0.2 µs each.
// Mapping  conv: thread = 8 adjacent channels (a prefill chunk of the real window; else 4) × a chunk of kConvChunk
//            tokens; with 8 channels its rows go to shared memory by cp.async, all in flight at once (~70 KB per
//            block), then the K−1 previous rows slide through registers. Only the chunk-0 thread of a channel reads or
//            writes that channel's state, and it reads every row it needs (old state, x) before it writes, so there
//            are no races between blocks.
//          scan: (1) prep kernel, one warp per (token, key head): q̂, k̂, k̂·q̂ and the gates of its value heads.
//            (2) scan kernel, block = (value head, 32 state rows), 128 threads: 8 lanes per state row, 2 rows per
//            thread, each lane holding DK/8 columns (float4 chunks 4·s + 32·m) of its rows in registers for the
//            whole call; per-row dot products reduced with 3 xor-shuffles. Tokens stream through shared memory in
//            chunks of kScanChunk, double buffered with cp.async; y is staged in shared memory and written 16 bytes
//            at a time per chunk.
//            Real model: 32 heads × 4 row blocks = 128 blocks; the state is read and written once per call.
//          chunked scan (T ≥ kChunkMinT, switch gdn_chunked): see "chunked prefill" below (the WY form per 64 tokens,
//            gdn_wy_mma_kernel (or gdn_wy_kernel) then gdn_chunk_scan_kernel on the tensor cores).
//          norm: one warp per (token, value head), 4 adjacent values per lane per 128.
//          one decode token (gdn_conv_scan_norm, T = 1, the switches above): block = value head, 128 threads per 32
//            state rows (≤ 512), scan_kernel's lanes and rows; threads i < DK hold q_i and k_i of the key head and
//            the block reduces Σq², Σk², Σqk itself; the gated norm's Σy² is one block sum. With the conv (K = 4,
//            NV = 2·NK): each thread convolves the channels it reads from x, the taps and the state rows loaded
//            before the PDL wait; the two value heads of a key head are a cluster of two blocks (__cluster_dims__):
//            both arrive at the cluster barrier once they have read the old state, and the even head writes the
//            q/k channels' new state after waiting on it; each head writes its own v channels' state.
// Checks   conv: C % 4 == 0, 1 ≤ K ≤ 9, T ≥ 0, x/out/state 8-byte aligned (8 channels per thread only where C % 8 == 0
//          and they are 16-byte aligned).  scan: DK ∈ {32, 64, 128}, DV % 8 == 0, NV % NK == 0, c and y 16-byte
//          aligned, state 16-byte aligned.  norm: DV % 4 == 0, DV ≤ 256.  one decode token in one kernel: DV ≤ 128
//          (else the three ops apart); its conv: K = 4, NV = 2·NK and 16-byte aligned taps (else the conv apart).
// Ref      cpu/gdn.cpp (conv, scan), cpu/norm.cpp (gdn_norm)
// History  v1, H200, real shapes, per call (stream-timed, launch included): conv 5 µs (T=1), 33 µs (512),
//          168 µs (4096); scan (prep + scan) 8–10 µs (T=1), 156 µs (512), 1.22 ms (4096; 1 row per thread: 1.39 ms,
//          4 rows: 1.71 ms); gdn_norm 4.7 µs (T=1), 62 µs (4096).
//          v2 (2026-12-01) the chunked scan for T ≥ 16, ncu at T = 4096: gdn_wy 337 µs + gdn_chunk_scan
//          376 µs per layer (the token scan: 1.19 ms); +9.6 % on a 4K prompt. Tried and removed: the chunk scan in fp32
//          SIMT, 8 lanes per state row (1.55 ms: 64 latency-bound steps per chunk); one fused kernel for a decode
//          token (conv, norms, gates, state, gated norm; arrival counters): 9.2 µs against 4 kernels of 15 µs in ncu,
//          no gain in the replayed step (+0.3 %).
//          v3 (2026-12-02), ncu at T = 4096 per layer: gdn_chunk_scan on 8 warps 376 → 348 µs; gdn_wy with
//          16-byte shared loads 337 → 321 µs; gdn_conv with 8 channels per thread for a prefill chunk 102 → 88.5 µs.
//          v4 (2026-12-02), same measure: gdn_wy_mma_kernel (switch gdn_wy_mma) 324 → 190 µs; gdn_chunk_scan
//          on 16 warps with the state in registers, 16-byte fragment loads and three barriers per chunk 351 → 318 µs.
//          Tried and removed: the chunk scan prefetching chunk c + 2's operands into L2 (cp.async.bulk.prefetch),
//          351 → 403 µs; W = (I + A)⁻¹·B as a tf32 GEMM after inverting by columns, 192 → 189 µs (not worth the
//          rounding: the solve is exact fp32).
//          v5 (2026-12-02), same measure: gdn_conv's 16-byte rows staged by cp.async 88.5 → 80.5 µs;
//          gdn_norm loading z with y before the reduction 41.3 → 35.7 µs.
//          v6 (2026-12-03) decode: before the PDL wait the conv loads its taps and state rows, the scan its
//          state rows (only this layer's own kernel wrote them, a step earlier), the prep its gate weights and the
//          norm its weights, so that after the wait each reads only what the previous kernel wrote: with route_fused,
//          decode 519 → 532 tok/s at 4K (the same run's builds; benchmarks/NOTES.md v11).
//          v7 (2026-12-04) a decode token's layer in one kernel, one switch per step: gdn_scan_token_kernel
//          (gdn_prep_fused: the prep in the scan, +3.0 %), one block per head with the gated norm (gdn_norm_fused,
//          +2.2 %), gdn_conv_token_kernel with the conv too (gdn_conv_fused, +1.7 %): decode 568 → 601 tok/s at 4K
//          (benchmarks/probes/ab_decode.py; NOTES.md v14). Where v2's fused kernel waited on arrival counters, these
//          recompute what a block needs (q/k norms, gates).
//          v8 (current, 2026-12-05) gdn_conv_token_kernel removed: on v16/v17's step (dp4a GEMVs) it measured
//          +0.38 / −0.83 % and −0.38 / −0.17 % at 4K / 32K (H100, two sessions' A/Bs), under the 1 % bar. It lives
//          in git history (commit 70f4a9f); Metal keeps its own form (gdn_conv_token_dk*, one threadgroup per key
//          head, no cluster).
//          Tried and removed (session 44, benchmarks/NOTES.md): the decode conv done by the input projections'
//          streaming GEMV as each row's sum comes out (gdn_conv_proj, branch exp/conv-proj): −0.2 to +0.6 %, the
//          conv's time moving into the GEMV and the scan, whose blocks then reach the SMs later; with the scan in
//          32-row blocks beside the GEMV and the gated norm in the output projection's staging (gdn_layer, branch
//          exp/gdn-layer): −4 % on the H200. Tried and removed (session 45): the projections, conv, scan and gated
//          norm of a decode token in one kernel of 16-block clusters per key head (gdn_cluster, branch
//          exp/gdn-cluster): −10.6 % at 4K on the H100.
#include <algorithm>
#include <type_traits>

#include "backend/cuda/ops.cuh"
#include "core/config.h"

namespace lily::cuda {

namespace {

constexpr int kConvMaxK = kMaxConvKernel;  // taps (core/config.h: linear_conv_kernel_dim ≤ 9)
constexpr int kConvChunk = 32;     // tokens per thread; ≥ kConvMaxK − 1 so that only chunk 0 touches the state
constexpr int kConvThreads = 128;  // threads per block, 4 channels each
constexpr int kPrepWarps = 8;      // warps per prep block
constexpr int kScanLanes = 8;      // lanes per state row
constexpr int kScanRows = 32;      // state rows per scan block
constexpr int kScanRpt = 2;        // state rows per thread
constexpr int kScanRowStride = kScanRows / kScanRpt;
constexpr int kScanThreads = kScanRowStride * kScanLanes;
constexpr int kScanChunk = 16;     // tokens per shared-memory chunk
constexpr int kNormWarps = 8;      // warps per gdn_norm block
constexpr int kNormMaxDv = 256;    // gdn_norm: two float4 chunks of 4 values per lane

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// One row of a conv thread (8 or 16 bytes) into shared memory.
template <typename Row>
__device__ __forceinline__ void cp_async_row(Row* smem, const void* gmem) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (sizeof(Row) == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(gmem) : "memory");
}

// ---- kernels ------------------------------------------------------------------------------------------------------

// V bf16 values already loaded as one V·2-byte row (uint2 for V = 4, uint4 for V = 8), as floats.
template <int V, typename Row>
__device__ __forceinline__ void unpack_bf16v(const Row& r, float (&f)[V]) {
  static_assert(sizeof(Row) == 2 * V, "one row of V bf16 values");
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&r);
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}
template <int V>
__device__ __forceinline__ void store_bf16v(bf16* p, const float (&f)[V]) {
  uint32_t w[V / 2];
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    const __nv_bfloat162 t = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&t);
  }
  if constexpr (V == 4)
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  else
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Thread = channels c..c+V−1 (c = V·(block.x·blockDim + tid)) × tokens [t0, t0 + kConvChunk), t0 =
// block.y·kConvChunk. With V = 8 (a prefill chunk) the thread first requests every row it reads, U[t0 .. t1 + K − 1),
// by cp.async into its own column of shared memory (rows[r][tid], no barrier: no thread reads another's), so that all
// of them are in flight at once (88.5 → 80.5 µs per layer at T = 4096, H200), then slides through them. The window
// win[] is right-aligned: before the output for token t, win[KW − K + k] = U[t + k], k < K, so the newest row
// U[t + K − 1] = x[t] always lands in win[KW − 1] and every register index is a constant. KW = 4 where K ≤ 4 (the
// real model), with V = 8 (16-byte rows) where C % 8 == 0: fewer registers and copy instructions; else V = 4.
template <int V, int KW>
__global__ void __launch_bounds__(kConvThreads, 4) gdn_conv_kernel(const bf16* __restrict__ x,
                                                                const float* __restrict__ w, bf16* conv_state,
                                                                bf16* __restrict__ out, int T, int C, int K) {
  using Row = std::conditional_t<V == 4, uint2, uint4>;  // V bf16 channels of one row
  extern __shared__ __align__(16) unsigned char conv_smem[];
  Row* rows = reinterpret_cast<Row*>(conv_smem) + threadIdx.x;  // this thread's column: row r at rows[r·blockDim]
  pdl_trigger();
  const int c = V * (blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= C) return;
  const int S = K - 1, lo = KW - K;  // state rows; first live window slot
  const int t0 = blockIdx.y * kConvChunk, t1 = min(T, t0 + kConvChunk);
  auto U = [&](int r) -> const bf16* { return r < S ? conv_state + size_t(r) * C + c : x + size_t(r - S) * C + c; };
  // Row U[t0 + r]: staged in shared memory for a prefill chunk's 16-byte rows; read directly for 8-byte rows (a
  // decode token: a copy and a wait would only add to its latency)
  constexpr bool kStaged = V == 8;
  auto row = [&](int r) -> Row {
    if constexpr (kStaged) return rows[r * kConvThreads];
    else return *reinterpret_cast<const Row*>(U(t0 + r));
  };

  if constexpr (kStaged) {  // a prefill chunk (no PDL): every row requested first
    pdl_wait();
    for (int r = 0; r < t1 - t0 + S; ++r) cp_async_row(rows + r * kConvThreads, U(t0 + r));
    cp_async_commit();
  }
  // Direct rows: before the PDL wait, what no kernel of this step writes: the taps, and the window rows that are
  // state, which only this layer's conv of an earlier step wrote. x comes from the previous kernel.
  float wk[KW][V];  // right-aligned taps of the V channels: wk[lo + k][v] = w[c + v, k]
  float win[KW][V];
#pragma unroll
  for (int i = 0; i < KW; ++i) {
#pragma unroll
    for (int v = 0; v < V; ++v) wk[i][v] = win[i][v] = 0.0f;
    if (i >= lo) {
      const int k = i - lo;
#pragma unroll
      for (int v = 0; v < V; ++v) wk[i][v] = w[size_t(c + v) * K + k];
    }
  }
  if constexpr (kStaged) {
    cp_async_wait<0>();
  } else {
#pragma unroll
    for (int i = 0; i < KW - 1; ++i)
      if (i >= lo && t0 + i - lo < S) unpack_bf16v<V>(row(i - lo), win[i]);  // U[t0 + k] = state row t0 + k
    pdl_wait();
  }
#pragma unroll
  for (int i = 0; i < KW - 1; ++i)
    if (i >= lo && (kStaged || t0 + i - lo >= S)) unpack_bf16v<V>(row(i - lo), win[i]);  // U[t0 + k], k < K − 1
#pragma unroll 4
  for (int t = t0; t < t1; ++t) {
    unpack_bf16v<V>(row(t - t0 + S), win[KW - 1]);  // U[t + K − 1]
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
#pragma unroll
    for (int i = 0; i < KW; ++i)
      if (i >= lo)  // Σ_k w[c, k] · U[t + k, c]
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] += wk[i][v] * win[i][v];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = siluf_(acc[v]);
    store_bf16v<V>(out + size_t(t) * C + c, acc);
#pragma unroll
    for (int i = 0; i < KW - 1; ++i)
#pragma unroll
      for (int v = 0; v < V; ++v) win[i][v] = win[i + 1][v];
  }
  // Chunk 0 owns the state of its channels (later chunks start at t0 ≥ K − 1 and never read it): read all new rows
  // U[T + r] (old state rows when T + r < K − 1) before writing any of them.
  if (blockIdx.y != 0) return;
  Row keep[KW - 1];
#pragma unroll
  for (int r = 0; r < KW - 1; ++r)
    if (r < S) keep[r] = *reinterpret_cast<const Row*>(U(T + r));
#pragma unroll
  for (int r = 0; r < KW - 1; ++r)
    if (r < S) *reinterpret_cast<Row*>(conv_state + size_t(r) * C + c) = keep[r];
}

// Shared memory of a conv block: the rows of its tokens and the window before them, one row of V per thread each
// (staged rows only: V = 8).
size_t conv_smem_bytes(int V, int K, int T) {
  return V == 8 ? size_t(std::min(T, kConvChunk) + K - 1) * kConvThreads * V * sizeof(bf16) : 0;
}

// One warp per (token t, key head kh): q̂, k̂ (fp32) and k̂·q̂ into qk [NK, T, 2·DK], and the gates of the value
// heads h = kh·R .. kh·R + R − 1 into gates [NV, T].
template <int DK>
__global__ void __launch_bounds__(kPrepWarps * 32) gdn_scan_prep_kernel(const bf16* c, const bf16* b,
                                                                        const bf16* alpha, const float* A_log,
                                                                        const float* dt_bias, float* qk,
                                                                        float4* gates, int T, int NK, int NV, int C) {
  pdl_trigger();
  constexpr int kPer = DK / 32;  // values per lane
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * kPrepWarps + (threadIdx.x >> 5);
  if (item >= T * NK) return;
  const int t = item / NK, kh = item % NK, R = NV / NK;
  // The weights of the first value head per lane (the real model: R = 2) before the PDL wait.
  const int h0 = kh * R + lane;
  const float a_log0 = lane < R ? A_log[h0] : 0.0f, dt_bias0 = lane < R ? dt_bias[h0] : 0.0f;
  pdl_wait();
  const bf16* qr = c + size_t(t) * C + size_t(kh) * DK;
  const bf16* kr = qr + size_t(NK) * DK;
  float q[kPer], k[kPer], sq = 0.0f, sk = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    q[i] = to_f(qr[lane + 32 * i]);
    k[i] = to_f(kr[lane + 32 * i]);
    sq += q[i] * q[i];
    sk += k[i] * k[i];
  }
  const float rq = (1.0f / sqrtf(float(DK))) / sqrtf(warp_sum(sq) + 1e-6f);  // q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK)
  const float rk = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);                       // k̂ = k / sqrt(Σk² + 1e-6)
  float* out = qk + (size_t(kh) * T + t) * (2 * DK);
  float kq = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    q[i] *= rq;
    k[i] *= rk;
    out[lane + 32 * i] = q[i];
    out[DK + lane + 32 * i] = k[i];
    kq += k[i] * q[i];
  }
  kq = warp_sum(kq);
  for (int j = lane; j < R; j += 32) {
    const int h = kh * R + j;
    const float beta = 1.0f / (1.0f + expf(-to_f(b[size_t(t) * NV + h])));  // β = σ(b)
    const float x = to_f(alpha[size_t(t) * NV + h]) + (j == lane ? dt_bias0 : dt_bias[h]);
    const float softplus = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
    // ln g = −exp(A_log)·softplus(α + dt_bias), finite even if g = 0
    const float lng = -expf(j == lane ? a_log0 : A_log[h]) * softplus;
    gates[size_t(h) * T + t] = make_float4(expf(lng), beta, kq, lng);
  }
}

// The lane's part of the thread's kScanRpt state rows against k̂ and q̂ (qs, ks: DK floats each, in shared memory):
// a_k = S_i·k̂ and a_q = S_i·q̂ with the old S, summed over the row's kScanLanes lanes; kv gets the lane's k̂ chunks
// for the update. Shared by gdn_scan_kernel and the one-token kernels, so the two compute y bit for bit alike.
template <int kM>
__device__ __forceinline__ void scan_dots(const float4 (&S)[kScanRpt][kM], const float* qs, const float* ks, int s,
                                          float4 (&kv)[kM], float (&ak)[kScanRpt], float (&aq)[kScanRpt]) {
  float4 qv[kM];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    kv[m] = *reinterpret_cast<const float4*>(ks + 4 * s + 4 * kScanLanes * m);
    qv[m] = *reinterpret_cast<const float4*>(qs + 4 * s + 4 * kScanLanes * m);
  }
#pragma unroll
  for (int j = 0; j < kScanRpt; ++j) {
    ak[j] = aq[j] = 0.0f;
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const float4 sv = S[j][m];
      ak[j] += sv.x * kv[m].x + sv.y * kv[m].y + sv.z * kv[m].z + sv.w * kv[m].w;  // S_i·k̂ (old S)
      aq[j] += sv.x * qv[m].x + sv.y * qv[m].y + sv.z * qv[m].z + sv.w * qv[m].w;  // S_i·q̂ (old S)
    }
  }
#pragma unroll
  for (int o = 1; o < kScanLanes; o <<= 1) {
#pragma unroll
    for (int j = 0; j < kScanRpt; ++j) {
      ak[j] += __shfl_xor_sync(0xffffffffu, ak[j], o);
      aq[j] += __shfl_xor_sync(0xffffffffu, aq[j], o);
    }
  }
}

// One state row's lane part after a token: S_i ← g·S_i + δ_i·k̂ (kv: the lane's k̂ chunks, from scan_dots).
template <int kM>
__device__ __forceinline__ void state_step(float4 (&S)[kM], float g, float delta, const float4 (&kv)[kM]) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    S[m].x = fmaf(S[m].x, g, delta * kv[m].x);
    S[m].y = fmaf(S[m].y, g, delta * kv[m].y);
    S[m].z = fmaf(S[m].z, g, delta * kv[m].z);
    S[m].w = fmaf(S[m].w, g, delta * kv[m].w);
  }
}

// Block = (value head h = block.x, state rows r0 = 32·block.y ..). Thread tid: rows r0 + lr + kScanRowStride·j
// (lr = tid/8, j < kScanRpt), lane-in-row s = tid%8, columns 4·s + 32·m + {0..3}, m < DK/32: the k̂, q̂ values a
// lane loads from shared memory serve kScanRpt rows. Rows ≥ DV compute on zeros and are never stored (the
// shuffles stay inside a row's 8 lanes).
template <int DK>
__global__ void __launch_bounds__(kScanThreads) gdn_scan_kernel(const float* qk, const float4* gates, const bf16* c,
                                                                float* state, bf16* y, int T, int NK, int NV,
                                                                int DV, int C) {
  pdl_trigger();
  constexpr int kM = DK / (4 * kScanLanes);  // float4 chunks per lane and row
  constexpr int kVPieces = kScanRows / 8;    // 16-byte pieces of bf16 v (or y) per token and block
  __shared__ __align__(16) float s_qk[2][kScanChunk][2 * DK];
  __shared__ __align__(16) float4 s_gate[2][kScanChunk];
  __shared__ __align__(16) uint16_t s_v[2][kScanChunk][kScanRows];
  __shared__ __align__(16) uint16_t s_y[kScanChunk][kScanRows];

  const int h = blockIdx.x, kh = h / (NV / NK), r0 = blockIdx.y * kScanRows;
  const int tid = threadIdx.x, lr = tid / kScanLanes, s = tid % kScanLanes;
  const size_t v_col = size_t(2 * NK) * DK + size_t(h) * DV + r0;  // column of v[h, r0] in c

  // Copy chunk ch (tokens t0 .. t0 + nt − 1) into buffer buf: q̂k̂ of key head kh, gates and v rows of head h.
  auto load_chunk = [&](int ch, int buf) {
    const int t0 = ch * kScanChunk, nt = min(kScanChunk, T - t0);
    const float* src = qk + (size_t(kh) * T + t0) * (2 * DK);
    for (int i = tid; i < nt * (2 * DK / 4); i += kScanThreads) cp_async16(&s_qk[buf][0][0] + 4 * i, src + 4 * i);
    for (int i = tid; i < nt; i += kScanThreads) cp_async16(&s_gate[buf][i], gates + size_t(h) * T + t0 + i);
    for (int i = tid; i < nt * kVPieces; i += kScanThreads) {
      const int tt = i / kVPieces, p = 8 * (i % kVPieces);
      if (r0 + p < DV) cp_async16(&s_v[buf][tt][p], c + size_t(t0 + tt) * C + v_col + p);
    }
  };

  // The state before the PDL wait: only this layer's scan writes it, in an earlier step (or an earlier call).
  float4 S[kScanRpt][kM];
#pragma unroll
  for (int j = 0; j < kScanRpt; ++j) {
    const int row = r0 + lr + kScanRowStride * j;
    const float4* src = reinterpret_cast<const float4*>(state + (size_t(h) * DV + row) * DK) + s;
#pragma unroll
    for (int m = 0; m < kM; ++m) S[j][m] = row < DV ? src[kScanLanes * m] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  pdl_wait();

  const int chunks = int(cdiv(T, kScanChunk));
  load_chunk(0, 0);
  cp_async_commit();
  for (int ch = 0; ch < chunks; ++ch) {
    const int buf = ch & 1, t0 = ch * kScanChunk, nt = min(kScanChunk, T - t0);
    if (ch + 1 < chunks) load_chunk(ch + 1, buf ^ 1);  // buf ^ 1 was last read before the previous trailing barrier
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of chunk ch are done …
    __syncthreads();     // … and everyone's
#pragma unroll 2
    for (int tt = 0; tt < nt; ++tt) {
      const float* qs = s_qk[buf][tt];
      const float* ks = qs + DK;
      float4 kv[kM];
      float ak[kScanRpt], aq[kScanRpt];
      scan_dots(S, qs, ks, s, kv, ak, aq);
      const float4 gt = s_gate[buf][tt];  // (g, β, k̂·q̂)
      const float g = gt.x;
#pragma unroll
      for (int j = 0; j < kScanRpt; ++j) {
        const int rl = lr + kScanRowStride * j;
        const float v = bf16_bits_to_f(s_v[buf][tt][rl]);
        const float delta = gt.y * (v - g * ak[j]);  // δ = β·(v − (g·S)·k̂)
        const float out = g * aq[j] + delta * gt.z;  // y = (g·S + δ⊗k̂)·q̂
        state_step(S[j], g, delta, kv);  // S ← g·S + δ ⊗ k̂
        if (s == 0) s_y[tt][rl] = __bfloat16_as_ushort(__float2bfloat16(out));
      }
    }
    __syncthreads();  // s_y complete; buffer buf free for the copy issued next iteration
    for (int i = tid; i < nt * kVPieces; i += kScanThreads) {
      const int tt = i / kVPieces, p = 8 * (i % kVPieces);
      if (r0 + p < DV)
        *reinterpret_cast<uint4*>(y + (size_t(t0 + tt) * NV + h) * DV + r0 + p) =
            *reinterpret_cast<const uint4*>(&s_y[tt][p]);
    }
  }
#pragma unroll
  for (int j = 0; j < kScanRpt; ++j) {
    const int row = r0 + lr + kScanRowStride * j;
    float4* dst = reinterpret_cast<float4*>(state + (size_t(h) * DV + row) * DK) + s;
    if (row < DV) {
#pragma unroll
      for (int m = 0; m < kM; ++m) dst[kScanLanes * m] = S[j][m];
    }
  }
}

// What the one-token kernel reads and writes (gdn_scan_token_kernel).
struct TokenArgs {
  const bf16* c;  // conv output [C]
  const bf16 *b, *alpha;
  const float *A_log, *dt_bias;
  float* state;
  bf16* y;        // y [NV·DV], or (NORM) the gated norm o
  const bf16* z;  // NORM: z and the norm weight
  const float* nw;
  float eps;
  int NK, NV, DV;
};

// Switch gdn_prep_fused: one token (T = 1, decode) in one kernel. Block (value head h, 32 state rows) as
// gdn_scan_kernel's, 128 threads ≥ DK: thread i < DK normalises q_i and k_i of key head kh itself (the block's three
// sums Σq², Σk², Σqk by warp shuffles then across the 4 warps in order), every thread computes the head's gates, and
// the state update is gdn_scan_kernel's for one token. What gdn_scan_prep_kernel hands on through scratch is
// recomputed by each of the head's blocks (512 bytes of c and two scalars): one kernel and one round trip fewer.
// NORM (switch gdn_norm_fused): one block per head, kScanThreads per 32 rows (blockDim = 128·⌈DV/32⌉ ≤ 512), and the
// head's gated norm done here: o = bf16(y) / sqrt(mean(bf16(y)²) + eps) · w · silu(z) (gdn_norm_kernel's arithmetic,
// the mean by one block sum), written to out instead of y: the gdn_norm kernel and y's round trip fewer.
template <int DK, bool NORM>
__global__ void __launch_bounds__(NORM ? 4 * kScanThreads : kScanThreads)
    gdn_scan_token_kernel(const __grid_constant__ TokenArgs p) {
  pdl_trigger();
  static_assert(DK <= kScanThreads, "one thread per key column");
  constexpr int kM = DK / (4 * kScanLanes);
  constexpr int kWarps = kScanThreads / 32;
  constexpr int kBlockWarps = NORM ? 4 * kWarps : kWarps;
  __shared__ __align__(16) float s_qk[2 * DK];  // q̂ then k̂
  __shared__ float s_red[kWarps][3];
  __shared__ float s_ss[kBlockWarps];
  const int NK = p.NK, NV = p.NV, DV = p.DV;
  const int tid = threadIdx.x, sub = tid / kScanThreads, st = tid % kScanThreads;
  const int h = blockIdx.x, kh = h / (NV / NK), r0 = (NORM ? sub : int(blockIdx.y)) * kScanRows;
  const int lr = st / kScanLanes, s = st % kScanLanes, lane = tid & 31, warp = tid >> 5;
  const int ch_q = kh * DK + tid, ch_k = (NK + kh) * DK + tid, ch_v = 2 * NK * DK + h * DV;  // c's channels

  // The state and the head's gate (and norm) weights before the PDL wait (only this layer's kernel of an earlier
  // step wrote the state).
  float4 S[kScanRpt][kM];
  float wn[kScanRpt];
#pragma unroll
  for (int j = 0; j < kScanRpt; ++j) {
    const int row = r0 + lr + kScanRowStride * j;
    const float4* src = reinterpret_cast<const float4*>(p.state + (size_t(h) * DV + row) * DK) + s;
#pragma unroll
    for (int m = 0; m < kM; ++m) S[j][m] = row < DV ? src[kScanLanes * m] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    wn[j] = NORM && row < DV ? p.nw[row] : 0.0f;
  }
  const float a_log = p.A_log[h], dtb = p.dt_bias[h];
  pdl_wait();

  float qi = 0.0f, ki = 0.0f;
  float v[kScanRpt], zr[kScanRpt];
  if (tid < DK) {
    qi = to_f(p.c[ch_q]);
    ki = to_f(p.c[ch_k]);
  }
#pragma unroll
  for (int j = 0; j < kScanRpt; ++j) {
    const int row = r0 + lr + kScanRowStride * j;
    v[j] = row < DV ? to_f(p.c[ch_v + row]) : 0.0f;
    zr[j] = NORM && row < DV ? to_f(p.z[size_t(h) * DV + row]) : 0.0f;
  }
  const float bh = to_f(p.b[h]), ah = to_f(p.alpha[h]);
  const float wq = warp_sum(qi * qi), wk = warp_sum(ki * ki), wkq = warp_sum(ki * qi);
  if (lane == 0 && warp < kWarps) s_red[warp][0] = wq, s_red[warp][1] = wk, s_red[warp][2] = wkq;
  __syncthreads();
  float sq = 0.0f, sk = 0.0f, skq = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sq += s_red[w][0], sk += s_red[w][1], skq += s_red[w][2];
  const float rq = (1.0f / sqrtf(float(DK))) / sqrtf(sq + 1e-6f);  // q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK)
  const float rk = 1.0f / sqrtf(sk + 1e-6f);                       // k̂ = k / sqrt(Σk² + 1e-6)
  if (tid < DK) s_qk[tid] = qi * rq, s_qk[DK + tid] = ki * rk;
  const float kq = skq * rq * rk;                    // k̂·q̂
  const float beta = 1.0f / (1.0f + expf(-bh));      // β = σ(b)
  const float x = ah + dtb;
  const float g = expf(-expf(a_log) * (fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)))));  // g = exp(−exp(A_log)·softplus)
  __syncthreads();

  float4 kv[kM];
  float ak[kScanRpt], aq[kScanRpt];
  scan_dots(S, s_qk, s_qk + DK, s, kv, ak, aq);
  float out[kScanRpt];
#pragma unroll
  for (int j = 0; j < kScanRpt; ++j) {
    const int row = r0 + lr + kScanRowStride * j;
    const float delta = beta * (v[j] - g * ak[j]);  // δ = β·(v − (g·S)·k̂)
    out[j] = g * aq[j] + delta * kq;                // y = (g·S + δ⊗k̂)·q̂
    state_step(S[j], g, delta, kv);  // S ← g·S + δ ⊗ k̂
    if (row < DV) {
      if (!NORM && s == 0) p.y[size_t(h) * DV + row] = __float2bfloat16(out[j]);
      float4* dst = reinterpret_cast<float4*>(p.state + (size_t(h) * DV + row) * DK) + s;
#pragma unroll
      for (int m = 0; m < kM; ++m) dst[kScanLanes * m] = S[j][m];
    }
  }
  if constexpr (NORM) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kScanRpt; ++j) {
      out[j] = __bfloat162float(__float2bfloat16(out[j]));  // y as gdn_norm reads it
      if (s == 0 && r0 + lr + kScanRowStride * j < DV) ss += out[j] * out[j];
    }
    ss = warp_sum(ss);
    if (lane == 0) s_ss[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) tot += s_ss[w];
    const float rs = 1.0f / sqrtf(tot / float(DV) + p.eps);  // 1 / sqrt(mean(y²) + eps)
#pragma unroll
    for (int j = 0; j < kScanRpt; ++j) {
      const int row = r0 + lr + kScanRowStride * j;
      if (s == 0 && row < DV) p.y[size_t(h) * DV + row] = __float2bfloat16(out[j] * rs * wn[j] * siluf_(zr[j]));
    }
  }
}

// One warp per (token, value head) row of DV values: o = y / sqrt(mean(y²) + eps) · w · silu(z).
__global__ void __launch_bounds__(kNormWarps * 32) gdn_norm_kernel(const bf16* y, const bf16* z, const float* w,
                                                                   int rows, int DV, float eps, bf16* out) {
  pdl_trigger();
  constexpr int kChunks = kNormMaxDv / 128;
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kNormWarps + (threadIdx.x >> 5);
  if (r >= rows) return;
  const size_t o = size_t(r) * DV;
  float4 wv[kChunks];  // the weights before the PDL wait
#pragma unroll
  for (int m = 0; m < kChunks; ++m) {
    const int j = 4 * lane + 128 * m;
    wv[m] = j < DV ? *reinterpret_cast<const float4*>(w + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  pdl_wait();
  float4 v[kChunks], zv[kChunks];  // y and z both loaded before the reduction: one memory latency per row, not two
  float ss = 0.0f;
#pragma unroll
  for (int m = 0; m < kChunks; ++m) {
    const int j = 4 * lane + 128 * m;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    v[m] = j < DV ? load_bf16x4(y + o + j) : zero;
    zv[m] = j < DV ? load_bf16x4(z + o + j) : zero;
  }
#pragma unroll
  for (int m = 0; m < kChunks; ++m) ss += v[m].x * v[m].x + v[m].y * v[m].y + v[m].z * v[m].z + v[m].w * v[m].w;
  const float rs = 1.0f / sqrtf(warp_sum(ss) / float(DV) + eps);  // 1 / sqrt(mean(y²) + eps)
#pragma unroll
  for (int m = 0; m < kChunks; ++m) {
    const int j = 4 * lane + 128 * m;
    if (j < DV) {
      const float4 wm = wv[m], zm = zv[m];
      store_bf16x4(out + o + j, make_float4(v[m].x * rs * wm.x * siluf_(zm.x), v[m].y * rs * wm.y * siluf_(zm.y),
                                            v[m].z * rs * wm.z * siluf_(zm.z), v[m].w * rs * wm.w * siluf_(zm.w)));
    }
  }
}

// ---- chunked prefill (switch gdn_chunked) -------------------------------------------------------------------
// The delta rule in chunks of kChunk = 64 tokens (architecture.md §5, "Prefill algorithms"; HF/FLA's chunkwise form):
// per value head and chunk, with λ_t = Σ_{s≤t} ln g_s inside the chunk (λ_t − λ_i ≤ 0 for i ≤ t: no overflow),
//   A[t, i] = β_t·e^{λ_t−λ_i}·(k̂_t·k̂_i) (i < t),  W1 = (I + A)⁻¹·diag(β)·V,  W2 = (I + A)⁻¹·diag(β·e^λ)·K̂,
//   P[t, i] = e^{λ_t−λ_i}·(q̂_t·k̂_i) (i ≤ t)                                         (gdn_wy_kernel: parallel)
// and then, chunk after chunk, with S the state [DV, DK] at the chunk's start (gdn_chunk_scan_kernel: sequential):
//   U = W1 − W2·Sᵀ;  Y = diag(e^λ)·Q̂·Sᵀ + P·U;  S ← e^{λ_L}·S + Uᵀ·diag(e^{λ_L−λ})·K̂.
// Tokens past T in the last chunk are padded with g = 1, β = 0, q̂ = k̂ = v = 0: they change nothing. fp32 on the
// CUDA cores throughout (the reference's precision); the sequential dependency shrinks from T steps to T/64.
// Scratch per call (after the prep kernel's q̂k̂ and gates): W1 [NV, nc·L, DV], W2 [NV, nc·L, DK], P [NV, nc, L, L],
// λ [NV, nc·L] fp32 (nc = ⌈T/L⌉): 168 MB at T = 4096 for the real shapes.

// The chunk, the shapes and the threshold T ≥ kGdnChunkMinT are backend/policy.h's (gdn_chunked), shared with Metal.
constexpr int kChunk = kGdnChunk;            // tokens per chunk (L)
constexpr int kWyThreads = kGdnChunkMaxCols; // gdn_wy_kernel: one thread per column of [V | K̂] in the solve
constexpr int kCsRows = kGdnChunkRows;       // gdn_chunk_scan_kernel: state rows per block
constexpr int kCsThreads = 512;    // 16 warps

struct ChunkArgs {
  const float* qk;      // [NK, T, 2·DK] q̂ then k̂ (gdn_scan_prep_kernel)
  const float4* gates;  // [NV, T] (g, β, ·, ·)
  const bf16* c;        // [T, C] conv output (v at column 2·NK·DK + h·DV)
  float* W1;            // [NV, nc·L, DV]
  float* W2;            // [NV, nc·L, DK]
  float* P;             // [NV, nc, L, L]
  float* lam;           // [NV, nc·L]
  float* state;         // [NV, DV, DK]
  bf16* y;              // [T, NV·DV]
  int T, NK, NV, DV, C, nc;
};

// λ_t = Σ_{s≤t} ln g_s and β_t of chunk tokens t0 .. t0 + L − 1 of value head h into shared memory, by warp 0: lane l
// owns tokens 2l and 2l + 1 (padding past nt: ln g = 0, β = 0, which changes nothing).
__device__ __forceinline__ void chunk_gates(const ChunkArgs& a, int h, int t0, int nt, float* sLam, float* sBeta) {
  static_assert(kChunk == 64, "two tokens per lane of one warp");
  const int tid = threadIdx.x;
  if (tid >= 32) return;
  float lg[2], be[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int t = 2 * tid + u;
    const float4 gt = t < nt ? a.gates[size_t(h) * a.T + t0 + t] : make_float4(1.0f, 0.0f, 0.0f, 0.0f);
    lg[u] = gt.w;  // ln g
    be[u] = gt.y;
  }
  float incl = lg[0] + lg[1];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float v = __shfl_up_sync(0xffffffffu, incl, o);
    if (tid >= o) incl += v;
  }
  const float before = incl - (lg[0] + lg[1]);
  sLam[2 * tid] = before + lg[0];
  sLam[2 * tid + 1] = incl;
  sBeta[2 * tid] = be[0];
  sBeta[2 * tid + 1] = be[1];
}

// Block = (chunk c, value head h), 256 threads. k̂, q̂ of the chunk in shared memory (rows padded to 16 bytes);
// thread (ti, tj) computes the 4×4 tile t = ti + 16a, i = tj + 16b of K̂K̂ᵀ and Q̂K̂ᵀ; then thread j solves column j
// of (I + A)·W = [diag(β)V | diag(β·e^λ)K̂] by forward substitution, its column of W in registers, reading A four
// entries per load. Both loops were bound by shared-memory load issue (one 4-byte load per 2.7 and per 1 FMA) in the
// first form (4×4 tiles of consecutive rows, 4-byte loads: 337 µs per layer at T = 4096 in ncu).
template <int DK>
__global__ void __launch_bounds__(kWyThreads, 1) gdn_wy_kernel(const __grid_constant__ ChunkArgs a) {
  constexpr int L = kChunk, LDK = DK + 4, LDA = L + 4;  // 16-byte rows; LDK/4 ≡ 1 mod 8: rows in distinct banks
  extern __shared__ float4 wy_smem4[];
  float* wy_smem = reinterpret_cast<float*>(wy_smem4);
  float* sK = wy_smem;           // [L][DK + 4]
  float* sQ = sK + L * LDK;      // [L][DK + 4]
  float* sA = sQ + L * LDK;      // [L][L + 4]
  float* sLam = sA + L * LDA;    // [L]
  float* sBeta = sLam + L;       // [L]
  uint16_t* sV = reinterpret_cast<uint16_t*>(sBeta + L);  // [L][DV] bf16: v of the chunk
  pdl_trigger();
  pdl_wait();
  const int c = blockIdx.x, h = blockIdx.y, kh = h / (a.NV / a.NK), tid = threadIdx.x;
  const int t0 = c * L, nt = min(L, a.T - t0);
  for (int idx = tid; idx < L * DK; idx += kWyThreads) {
    const int t = idx / DK, d = idx % DK;
    const float* row = a.qk + (size_t(kh) * a.T + t0 + t) * (2 * DK);
    sQ[t * LDK + d] = t < nt ? row[d] : 0.0f;
    sK[t * LDK + d] = t < nt ? row[DK + d] : 0.0f;
  }
  for (int idx = tid; idx < L * a.DV; idx += kWyThreads) {  // v of value head h (coalesced rows of DV)
    const int t = idx / a.DV, j = idx % a.DV;
    sV[t * a.DV + j] = t < nt ? __bfloat16_as_ushort(a.c[size_t(t0 + t) * a.C + size_t(2 * a.NK) * DK +
                                                                 size_t(h) * a.DV + j])
                                    : uint16_t(0);
  }
  chunk_gates(a, h, t0, nt, sLam, sBeta);
  __syncthreads();

  {  // K̂K̂ᵀ → A (strictly lower, scaled), Q̂K̂ᵀ → P (lower with the diagonal, scaled); thread (ti, tj) owns rows
     // t = ti + 16u and columns i = tj + 16v, reading 4 d at a time (16-byte loads: a warp's 16 column rows fall in
     // distinct bank groups, its 2 row rows are broadcasts)
    const int ti = tid / 16, tj = tid % 16;
    float kk[4][4] = {}, qk[4][4] = {};
    for (int d = 0; d < DK; d += 4) {
      float4 kt[4], qt[4], ki[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        kt[u] = *reinterpret_cast<const float4*>(sK + (ti + 16 * u) * LDK + d);
        qt[u] = *reinterpret_cast<const float4*>(sQ + (ti + 16 * u) * LDK + d);
        ki[u] = *reinterpret_cast<const float4*>(sK + (tj + 16 * u) * LDK + d);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) {  // in d order, as one fma chain per output
          kk[u][v] = fmaf(kt[u].x, ki[v].x, kk[u][v]);
          kk[u][v] = fmaf(kt[u].y, ki[v].y, kk[u][v]);
          kk[u][v] = fmaf(kt[u].z, ki[v].z, kk[u][v]);
          kk[u][v] = fmaf(kt[u].w, ki[v].w, kk[u][v]);
          qk[u][v] = fmaf(qt[u].x, ki[v].x, qk[u][v]);
          qk[u][v] = fmaf(qt[u].y, ki[v].y, qk[u][v]);
          qk[u][v] = fmaf(qt[u].z, ki[v].z, qk[u][v]);
          qk[u][v] = fmaf(qt[u].w, ki[v].w, qk[u][v]);
        }
    }
    float* P = a.P + (size_t(h) * a.nc + c) * L * L;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int t = ti + 16 * u;
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int i = tj + 16 * v;
        const float decay = i <= t ? expf(sLam[t] - sLam[i]) : 0.0f;       // e^{λ_t − λ_i}
        sA[t * LDA + i] = i < t ? sBeta[t] * decay * kk[u][v] : 0.0f;      // A[t, i] = β_t·e^{λ_t−λ_i}·k̂_t·k̂_i
        P[t * L + i] = decay * qk[u][v];                                   // P[t, i] = e^{λ_t−λ_i}·q̂_t·k̂_i
      }
    }
  }
  if (tid < L) a.lam[(size_t(h) * a.nc + c) * L + tid] = sLam[tid];
  __syncthreads();

  // Column j of W = (I + A)⁻¹·B, B = [diag(β)V | diag(β·e^λ)K̂]: w_t = b_t − Σ_{i<t} A[t, i]·w_i.
  const int j = tid;
  if (j >= a.DV + DK) return;
  const bool is_v = j < a.DV;
  float w[L];
#pragma unroll
  for (int t = 0; t < L; ++t) w[t] = 0.0f;  // the terms past i = t − 1 below multiply A[t, i] = 0 by these zeros
#pragma unroll
  for (int t = 0; t < L; ++t) {
    const float bt = is_v ? sBeta[t] * bf16_bits_to_f(sV[t * a.DV + j])
                          : sBeta[t] * expf(sLam[t]) * sK[t * LDK + (j - a.DV)];
    float acc = bt;
#pragma unroll
    for (int i = 0; i < t; i += 4) {  // A[t, i..i+3] in one (broadcast) 16-byte load
      const float4 a4 = *reinterpret_cast<const float4*>(sA + t * LDA + i);
      acc = fmaf(-a4.x, w[i], acc);
      acc = fmaf(-a4.y, w[i + 1], acc);
      acc = fmaf(-a4.z, w[i + 2], acc);
      acc = fmaf(-a4.w, w[i + 3], acc);
    }
    w[t] = acc;
  }
  if (is_v) {
    float* dst = a.W1 + (size_t(h) * a.nc * L + size_t(c) * L) * a.DV + j;
#pragma unroll
    for (int t = 0; t < L; ++t) dst[size_t(t) * a.DV] = w[t];
  } else {
    float* dst = a.W2 + (size_t(h) * a.nc * L + size_t(c) * L) * DK + (j - a.DV);
#pragma unroll
    for (int t = 0; t < L; ++t) dst[size_t(t) * DK] = w[t];
  }
}

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}

// tf32 m16n8k8 (row.col, fp32 accumulate) and its operand conversion. Fragments (g = lane/4, t4 = lane%4):
// A a0 (g, t4), a1 (g+8, t4), a2 (g, t4+4), a3 (g+8, t4+4); B b0 (t4, g), b1 (t4+4, g);
// C c0 (g, 2·t4), c1 (g, 2·t4+1), c2 (g+8, 2·t4), c3 (g+8, 2·t4+1).
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// gdn_wy_mma_kernel (switch gdn_wy_mma): gdn_wy_kernel's outputs with its three costs removed (ncu at T = 4096,
// real shapes: 321 µs per layer for ~330 MB of traffic, ~3× its memory floor; this kernel 190 µs). Block = (chunk c,
// value head h), 256 threads, two blocks per SM.
// - Loads: q̂, k̂ (fp32) and v (bf16) of the chunk in one batch of 16-byte cp.async (was a scalar loop of dependent
//   round trips), the gates read by warp 0 while they land.
// - K̂K̂ᵀ and Q̂K̂ᵀ as tf32 m16n8k8 (the chunk scan's precision; was 4,096 fp32 FMAs per thread): warp w rows
//   16·(w % 4) .. + 15, columns 32·(w / 4) .. + 31, sharing K̂'s B fragments; n8 tiles wholly above the diagonal
//   skipped (their A and P are zero). A is stored transposed (sAT[i][t] = A[t, i]).
// - The solve right-looking: once w_i is final every later b_t −= A[t, i]·w_i, A's column i read by 16-byte broadcast
//   loads. Per output these are the left-looking form's FMAs in its order (w_t = b_t − Σ_{i<t} A[t, i]·w_i, i
//   ascending), but the dependent chain from w_i to w_{i+1} is one FMA instead of i.
template <int DK>
__global__ void __launch_bounds__(kWyThreads, 2) gdn_wy_mma_kernel(const __grid_constant__ ChunkArgs a) {
  constexpr int L = kChunk, LDK = DK + 4, LDA = L + 4;  // rows ≡ 4 words mod 32: fragment loads conflict-free
  extern __shared__ float4 wym_smem4[];
  float* sK = reinterpret_cast<float*>(wym_smem4);  // [L][DK + 4]
  float* sQ = sK + L * LDK;                          // [L][DK + 4]
  float* sAT = sQ + L * LDK;                         // [L][L + 4]: sAT[i][t] = A[t, i]
  float* sLam = sAT + L * LDA;                       // [L]
  float* sBeta = sLam + L;                           // [L]
  uint16_t* sV = reinterpret_cast<uint16_t*>(sBeta + L);  // [L][DV] bf16
  pdl_trigger();
  pdl_wait();
  const int c = blockIdx.x, h = blockIdx.y, kh = h / (a.NV / a.NK), tid = threadIdx.x;
  const int t0 = c * L, nt = min(L, a.T - t0);
  for (int i = tid; i < L * (DK / 4); i += kWyThreads) {
    const int t = i / (DK / 4), d = 4 * (i % (DK / 4));
    const bool ok = t < nt;
    const float* row = a.qk + (size_t(kh) * a.T + (ok ? t0 + t : 0)) * (2 * DK);
    cp_async16_zfill(sQ + t * LDK + d, row + d, ok);
    cp_async16_zfill(sK + t * LDK + d, row + DK + d, ok);
  }
  const int vq = a.DV / 8;  // 16-byte pieces of a token's v
  const bf16* v0 = a.c + size_t(2 * a.NK) * DK + size_t(h) * a.DV;
  for (int i = tid; i < L * vq; i += kWyThreads) {
    const int t = i / vq, p = 8 * (i % vq);
    const bool ok = t < nt;
    cp_async16_zfill(sV + t * a.DV + p, v0 + size_t(ok ? t0 + t : 0) * a.C + p, ok);
  }
  cp_async_commit();
  chunk_gates(a, h, t0, nt, sLam, sBeta);
  cp_async_wait<0>();
  __syncthreads();

  {
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
    const int nj = min(4, max(0, (m0 + 16 - n0) / 8));  // n8 tiles holding a column i ≤ the tile's last row
    float kk[4][4] = {}, qk[4][4] = {};
    if (nj > 0) {
#pragma unroll 4
      for (int k0 = 0; k0 < DK; k0 += 8) {
        const float* kr = sK + (m0 + g) * LDK + k0 + t4;
        const float* qr = sQ + (m0 + g) * LDK + k0 + t4;
        const uint32_t ak[4] = {tf32(kr[0]), tf32(kr[8 * LDK]), tf32(kr[4]), tf32(kr[8 * LDK + 4])};
        const uint32_t aq[4] = {tf32(qr[0]), tf32(qr[8 * LDK]), tf32(qr[4]), tf32(qr[8 * LDK + 4])};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j < nj) {  // B[k][n] = K̂[n0 + 8j + n][k0 + k]
            const float* br = sK + (n0 + 8 * j + g) * LDK + k0 + t4;
            const uint32_t b0 = tf32(br[0]), b1 = tf32(br[4]);
            mma_tf32(kk[j], ak, b0, b1);
            mma_tf32(qk[j], aq, b0, b1);
          }
      }
    }
    float* P = a.P + (size_t(h) * a.nc + c) * L * L;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = m0 + g + 8 * hh, i = n0 + 8 * j + 2 * t4;
        float p[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ie = i + e;
          const float decay = ie <= t ? expf(sLam[t] - sLam[ie]) : 0.0f;  // e^{λ_t − λ_i}
          sAT[ie * LDA + t] = ie < t ? sBeta[t] * decay * kk[j][2 * hh + e] : 0.0f;
          p[e] = decay * qk[j][2 * hh + e];
        }
        *reinterpret_cast<float2*>(P + t * L + i) = make_float2(p[0], p[1]);
      }
  }
  if (tid < L) a.lam[(size_t(h) * a.nc + c) * L + tid] = sLam[tid];
  __syncthreads();

  const int j = tid;  // column j of W = (I + A)⁻¹·[diag(β)V | diag(β·e^λ)K̂]
  if (j >= a.DV + DK) return;
  const bool is_v = j < a.DV;
  float b[L];
#pragma unroll
  for (int t = 0; t < L; ++t)
    b[t] = is_v ? sBeta[t] * bf16_bits_to_f(sV[t * a.DV + j]) : sBeta[t] * expf(sLam[t]) * sK[t * LDK + (j - a.DV)];
#pragma unroll
  for (int i = 0; i + 1 < L; ++i) {
    const float wi = b[i];  // final
#pragma unroll
    for (int q = (i + 1) & ~3; q < L; q += 4) {
      const float4 a4 = *reinterpret_cast<const float4*>(sAT + i * LDA + q);
      const float av[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (q + e > i) b[q + e] = fmaf(-av[e], wi, b[q + e]);
    }
  }
  float* dst = is_v ? a.W1 + (size_t(h) * a.nc * L + size_t(c) * L) * a.DV + j
                    : a.W2 + (size_t(h) * a.nc * L + size_t(c) * L) * DK + (j - a.DV);
  const int ld = is_v ? a.DV : DK;
#pragma unroll
  for (int t = 0; t < L; ++t) dst[size_t(t) * ld] = b[t];
}

// Block = (value head h, state rows r0 = 32·block.y ..), 16 warps. Chunk after chunk, three products on the tensor
// cores (tf32 operands, fp32 accumulators; the state itself is only ever rounded as an operand, never stored rounded):
//   phase 1 (operands W2, Q̂, W1 tile): [W2; Q̂]·Sᵀ (M = 2L, N = 32, K = DK); warp w one m16 row tile × 16 columns,
//            warps 0–7 the W2 rows → U = W1 − W2·Sᵀ (stored transposed, tf32: Uᵀ [32, L]), warps 8–15 the Q̂ rows
//            → X2 = Q̂·Sᵀ;
//   phase 2 (operands P, K̂, λ): a pass writes (diag(e^{λ_L−λ})·K̂)ᵀ as tf32 (Kᵀ [DK, L]) while Y = diag(e^λ)·X2 + P·U
//            is computed (M = L, N = 32, K = L: warp w row tile w / 4 × n8 tile w % 4, the k-steps above P's diagonal
//            skipped); then S ← e^{λ_L}·S + Uᵀ·Kᵀᵀ (M = 32, N = DK, K = L), warp w rows 16·(w % 2) × the n8 tiles
//            w / 2 + 8q. S lives in those accumulator registers for the whole call; its tf32 copy in shared memory is
//            phase 1's B operand.
// Fragments come by 16-byte loads: within a pair of k8 steps thread t4 takes the four adjacent columns 4·t4 .. + 3
// (k-step one the first two, k-step two the last two) of both operands, a permutation of k that leaves every sum whole.
// Rows read that way have strides ≡ 16 words mod 32 (the 8 lanes of a phase fall in distinct banks).
// Each operand set has its own buffer, refilled by cp.async while the other phase computes; three barriers per chunk.
// (v3, 8 warps, fp32 state in shared memory, 4-byte fragment loads, five barriers per chunk: 351 µs per layer at
// T = 4096 in ncu, 2 warps per scheduler with 0.51 eligible, issue slots 40 % busy.)
template <int DK>
struct CsLayout {
  static constexpr int L = kChunk, R = kCsRows;
  // row strides in words: LD1, LDP, LDT ≡ 16 mod 32 (rows read as 16-byte fragments); LDW1, LDX ≡ 8 (8-byte
  // epilogue accesses); LDK ≡ 4 (the transposing pass reads 8 rows at one column per phase)
  static constexpr int LD1 = DK + 16, LDW1 = R + 8, LDP = L + 16, LDK = DK + 4, LDT = L + 16, LDX = R + 8;
  static constexpr int oW2 = 0, oQ = oW2 + L * LD1, oW1 = oQ + L * LD1;              // phase-1 operands
  static constexpr int oP = oW1 + L * LDW1, oK = oP + L * LDP, oLam = oK + L * LDK;  // phase-2 operands
  static constexpr int oKT = oLam + L, oSt = oKT + DK * LDT, oUT = oSt + R * LD1, oX2 = oUT + R * LDT;
  static constexpr int oY = oX2 + L * LDX;  // bf16 [L][R] from here
  static constexpr size_t bytes = size_t(oY) * 4 + size_t(L) * R * 2;
};

__device__ __forceinline__ float tf32r(float x) { return __uint_as_float(tf32(x)); }  // x rounded to tf32

template <int DK>
__global__ void __launch_bounds__(kCsThreads) gdn_chunk_scan_kernel(const __grid_constant__ ChunkArgs a) {
  using Ly = CsLayout<DK>;
  constexpr int L = kChunk, R = kCsRows, NT = DK / 8, QS = (NT + 7) / 8;  // S's n8 tiles; per warp
  constexpr int LD1 = Ly::LD1, LDT = Ly::LDT;
  extern __shared__ __align__(16) float cs_smem[];
  float *sW2 = cs_smem + Ly::oW2, *sQ = cs_smem + Ly::oQ, *sW1 = cs_smem + Ly::oW1;
  float *sP = cs_smem + Ly::oP, *sK = cs_smem + Ly::oK, *sLam = cs_smem + Ly::oLam;
  float *sKT = cs_smem + Ly::oKT, *sSt = cs_smem + Ly::oSt, *sUT = cs_smem + Ly::oUT, *sX2 = cs_smem + Ly::oX2;
  uint16_t* sY = reinterpret_cast<uint16_t*>(cs_smem + Ly::oY);

  pdl_trigger();
  pdl_wait();
  const int h = blockIdx.x, r0 = blockIdx.y * R, kh = h / (a.NV / a.NK), tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;

  auto load_phase1 = [&](int c) {
    const int t0 = c * L;
    const float* W2 = a.W2 + (size_t(h) * a.nc * L + size_t(t0)) * DK;
    const float* W1 = a.W1 + (size_t(h) * a.nc * L + size_t(t0)) * a.DV + r0;
    for (int i = tid; i < L * DK / 4; i += kCsThreads) {
      const int t = i / (DK / 4), d = 4 * (i % (DK / 4));
      const bool ok = t0 + t < a.T;
      cp_async16_zfill(sW2 + t * LD1 + d, W2 + size_t(t) * DK + d, true);
      cp_async16_zfill(sQ + t * LD1 + d, a.qk + (size_t(kh) * a.T + (ok ? t0 + t : 0)) * (2 * DK) + d, ok);
    }
    for (int i = tid; i < L * R / 4; i += kCsThreads) {
      const int t = i / (R / 4), q = 4 * (i % (R / 4));
      cp_async16_zfill(sW1 + t * Ly::LDW1 + q, W1 + size_t(t) * a.DV + q, true);
    }
  };
  auto load_phase2 = [&](int c) {
    const int t0 = c * L;
    const float* P = a.P + (size_t(h) * a.nc + c) * L * L;
    for (int i = tid; i < L * L / 4; i += kCsThreads) {
      const int t = i / (L / 4), q = 4 * (i % (L / 4));
      cp_async16_zfill(sP + t * Ly::LDP + q, P + t * L + q, true);
    }
    for (int i = tid; i < L * DK / 4; i += kCsThreads) {
      const int t = i / (DK / 4), d = 4 * (i % (DK / 4));
      const bool ok = t0 + t < a.T;
      cp_async16_zfill(sK + t * Ly::LDK + d, a.qk + (size_t(kh) * a.T + (ok ? t0 + t : 0)) * (2 * DK) + DK + d, ok);
    }
    const float* lam = a.lam + (size_t(h) * a.nc + c) * L;
    for (int i = tid; i < L / 4; i += kCsThreads) cp_async16_zfill(sLam + 4 * i, lam + 4 * i, true);
  };

  // The S update's partition (rows 16·sr .. + 15, n8 tiles sj0 + 8q < NT), which also holds S in its accumulators.
  const int sr = warp & 1, sj0 = warp >> 1;
  float S[QS][4];
  auto state_at = [&](int q, int hh) {  // the block-row and column of S[q][2·hh], S[q][2·hh + 1]
    return make_int2(16 * sr + g + 8 * hh, 8 * (sj0 + 8 * q) + 2 * t4);
  };
  auto store_st = [&] {  // the tf32 copy phase 1 reads
#pragma unroll
    for (int q = 0; q < QS; ++q)
      if (sj0 + 8 * q < NT)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int2 p = state_at(q, hh);
          *reinterpret_cast<float2*>(sSt + p.x * LD1 + p.y) = make_float2(tf32r(S[q][2 * hh]), tf32r(S[q][2 * hh + 1]));
        }
  };
  load_phase1(0);
  cp_async_commit();
  load_phase2(0);
  cp_async_commit();
#pragma unroll
  for (int q = 0; q < QS; ++q)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int2 p = state_at(q, hh);
      float2 v = make_float2(0.0f, 0.0f);
      if (sj0 + 8 * q < NT) v = *reinterpret_cast<const float2*>(a.state + (size_t(h) * a.DV + r0 + p.x) * DK + p.y);
      S[q][2 * hh] = v.x, S[q][2 * hh + 1] = v.y;
    }
  store_st();

  for (int c = 0; c < a.nc; ++c) {
    const int t0 = c * L, nt = min(L, a.T - t0);
    cp_async_wait<1>();  // phase-1 operands of chunk c (the phase-2 ones may still be landing)
    __syncthreads();     // … for every thread; S's tf32 copy, Y and Kᵀ of chunk c − 1 consumed

    {  // phase 1: warp w rows 16·((w % 8) / 2) .. + 15 of W2·Sᵀ (w < 8) or Q̂·Sᵀ (w ≥ 8), columns 16·(w % 2) .. + 15
      const bool isq = warp >= 8;
      const float* A = isq ? sQ : sW2;
      const int m0 = 16 * ((warp & 7) >> 1), nb = 16 * (warp & 1);
      float acc[2][4] = {};
#pragma unroll
      for (int s = 0; s < DK / 16; ++s) {
        const int k = 16 * s + 4 * t4;
        const float4 lo = *reinterpret_cast<const float4*>(A + (m0 + g) * LD1 + k);
        const float4 hi = *reinterpret_cast<const float4*>(A + (m0 + g + 8) * LD1 + k);
        const uint32_t a0[4] = {tf32(lo.x), tf32(hi.x), tf32(lo.y), tf32(hi.y)};
        const uint32_t a1[4] = {tf32(lo.z), tf32(hi.z), tf32(lo.w), tf32(hi.w)};
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // B[k][n] = S[n][k]
          const float4 b = *reinterpret_cast<const float4*>(sSt + (nb + 8 * j + g) * LD1 + k);
          mma_tf32(acc[j], a0, __float_as_uint(b.x), __float_as_uint(b.y));
          mma_tf32(acc[j], a1, __float_as_uint(b.z), __float_as_uint(b.w));
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = m0 + g + 8 * hh, n = nb + 8 * j + 2 * t4;
          if (isq) {
            *reinterpret_cast<float2*>(sX2 + t * Ly::LDX + n) = make_float2(acc[j][2 * hh], acc[j][2 * hh + 1]);
          } else {  // U = W1 − W2·Sᵀ, stored as Uᵀ
            const float2 w1 = *reinterpret_cast<const float2*>(sW1 + t * Ly::LDW1 + n);
            sUT[n * LDT + t] = tf32r(w1.x - acc[j][2 * hh]);
            sUT[(n + 1) * LDT + t] = tf32r(w1.y - acc[j][2 * hh + 1]);
          }
        }
    }
    cp_async_wait<0>();  // phase-2 operands of chunk c
    __syncthreads();     // … for every thread; Uᵀ and X2 complete; the phase-1 buffer is free
    if (c + 1 < a.nc) load_phase1(c + 1);
    cp_async_commit();

    {  // Kᵀ[n][k] = tf32(e^{λ_L − λ_k}·K̂[k][n]): thread = token k × DK/8 columns
      constexpr int CPT = DK / 8;
      const int k = tid % L, n0 = (tid / L) * CPT;
      const float d = expf(sLam[L - 1] - sLam[k]);
#pragma unroll
      for (int v = 0; v < CPT; v += 4) {
        const float4 x = *reinterpret_cast<const float4*>(sK + k * Ly::LDK + n0 + v);
        sKT[(n0 + v) * LDT + k] = tf32r(d * x.x);
        sKT[(n0 + v + 1) * LDT + k] = tf32r(d * x.y);
        sKT[(n0 + v + 2) * LDT + k] = tf32r(d * x.z);
        sKT[(n0 + v + 3) * LDT + k] = tf32r(d * x.w);
      }
    }
    {  // Y = diag(e^λ)·X2 + P·U: warp w rows 16·(w / 4) .. + 15, columns 8·(w % 4) .. + 7, keys k < the tile's end
      const int mt = warp >> 2, m0 = 16 * mt, n = 8 * (warp & 3) + 2 * t4;
      float acc[4];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = m0 + g + 8 * hh;
        const float e = expf(sLam[t]);
        const float2 x = *reinterpret_cast<const float2*>(sX2 + t * Ly::LDX + n);
        acc[2 * hh] = e * x.x;
        acc[2 * hh + 1] = e * x.y;
      }
      for (int s = 0; s <= mt; ++s) {
        const int k = 16 * s + 4 * t4;
        const float4 lo = *reinterpret_cast<const float4*>(sP + (m0 + g) * Ly::LDP + k);
        const float4 hi = *reinterpret_cast<const float4*>(sP + (m0 + g + 8) * Ly::LDP + k);
        const float4 b = *reinterpret_cast<const float4*>(sUT + (8 * (warp & 3) + g) * LDT + k);  // B[k][n] = Uᵀ[n][k]
        const uint32_t a0[4] = {tf32(lo.x), tf32(hi.x), tf32(lo.y), tf32(hi.y)};
        const uint32_t a1[4] = {tf32(lo.z), tf32(hi.z), tf32(lo.w), tf32(hi.w)};
        mma_tf32(acc, a0, __float_as_uint(b.x), __float_as_uint(b.y));
        mma_tf32(acc, a1, __float_as_uint(b.z), __float_as_uint(b.w));
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = m0 + g + 8 * hh;
        const __nv_bfloat162 y2 = __floats2bfloat162_rn(acc[2 * hh], acc[2 * hh + 1]);
        *reinterpret_cast<__nv_bfloat162*>(sY + t * R + n) = y2;
      }
    }
    const float eL = expf(sLam[L - 1]);
    __syncthreads();  // Kᵀ and Y complete; the phase-2 buffer is free
    if (c + 1 < a.nc) load_phase2(c + 1);
    cp_async_commit();
    for (int i = tid; i < nt * (R / 8); i += kCsThreads) {  // 16 bytes = 8 rows of one token
      const int t = i / (R / 8), p = 8 * (i % (R / 8));
      *reinterpret_cast<uint4*>(a.y + (size_t(t0 + t) * a.NV + h) * a.DV + r0 + p) =
          *reinterpret_cast<const uint4*>(sY + t * R + p);
    }
    {  // S ← e^{λ_L}·S + Uᵀ·(Kᵀ)ᵀ: A[m][k] = Uᵀ[m][k], B[k][n] = Kᵀ[n][k]
#pragma unroll
      for (int q = 0; q < QS; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[q][e] *= eL;
#pragma unroll
      for (int s = 0; s < L / 16; ++s) {
        const int k = 16 * s + 4 * t4;
        const float4 lo = *reinterpret_cast<const float4*>(sUT + (16 * sr + g) * LDT + k);
        const float4 hi = *reinterpret_cast<const float4*>(sUT + (16 * sr + g + 8) * LDT + k);
        const uint32_t a0[4] = {__float_as_uint(lo.x), __float_as_uint(hi.x), __float_as_uint(lo.y),
                                __float_as_uint(hi.y)};
        const uint32_t a1[4] = {__float_as_uint(lo.z), __float_as_uint(hi.z), __float_as_uint(lo.w),
                                __float_as_uint(hi.w)};
#pragma unroll
        for (int q = 0; q < QS; ++q)
          if (sj0 + 8 * q < NT) {
            const float4 b = *reinterpret_cast<const float4*>(sKT + (8 * (sj0 + 8 * q) + g) * LDT + k);
            mma_tf32(S[q], a0, __float_as_uint(b.x), __float_as_uint(b.y));
            mma_tf32(S[q], a1, __float_as_uint(b.z), __float_as_uint(b.w));
          }
      }
      store_st();
    }
  }
#pragma unroll
  for (int q = 0; q < QS; ++q)
    if (sj0 + 8 * q < NT)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int2 p = state_at(q, hh);
        *reinterpret_cast<float2*>(a.state + (size_t(h) * a.DV + r0 + p.x) * DK + p.y) =
            make_float2(S[q][2 * hh], S[q][2 * hh + 1]);
      }
}

constexpr size_t wy_smem_bytes(int DK, int DV) {
  return (2 * kChunk * (DK + 4) + kChunk * (kChunk + 4) + 2 * kChunk) * 4 + size_t(kChunk) * DV * 2;
}
constexpr size_t cs_smem_bytes(int DK) {
  return DK == 32 ? CsLayout<32>::bytes : DK == 64 ? CsLayout<64>::bytes : CsLayout<128>::bytes;
}

// ---- launcher helpers ---------------------------------------------------------------------------------------------

int conv_dim(const GdnArgs& a) { return 2 * a.NK * a.DK + a.NV * a.DV; }

// Runs f with DK as a compile-time constant.
template <typename F>
void dispatch_dk(int DK, F&& f) {
  if (DK == 32)
    f(std::integral_constant<int, 32>{});
  else if (DK == 64)
    f(std::integral_constant<int, 64>{});
  else if (DK == 128)
    f(std::integral_constant<int, 128>{});
  else
    throw InputError(cat("gdn_scan: DK = ", DK, " is not supported by the CUDA backend (32, 64 or 128)"));
}

TokenArgs token_args(const GdnArgs& a, const bf16* c, const bf16* b, const bf16* alpha, const float* A_log,
                     const float* dt_bias, float* state, bf16* y) {
  TokenArgs p{};
  p.c = c, p.b = b, p.alpha = alpha, p.A_log = A_log, p.dt_bias = dt_bias, p.state = state, p.y = y;
  p.eps = a.eps, p.NK = a.NK, p.NV = a.NV, p.DV = a.DV;
  return p;
}

}  // namespace

// ---- launchers ----------------------------------------------------------------------------------------------------

void gdn_conv(Ctx& ctx, const GdnArgs& a, const bf16* x, const float* w, bf16* conv_state, bf16* out) {
  check_gdn_conv(a, x, conv_state, out);
  const int C = conv_dim(a);
  if (a.T == 0) return;
  // 8 channels per thread for a prefill chunk with the real model's window (K ≤ 4; a 9-tap window of 8 channels would
  // spill); a decode token keeps 4 per thread, twice the blocks (8 channels: decode 506 → 476 tok/s on the H200)
  const bool v8 = a.T >= kConvChunk && a.conv_kernel <= 4 && C % 8 == 0 && aligned(x, 16) && aligned(out, 16) &&
                  aligned(conv_state, 16);
  const dim3 grid(unsigned(cdiv(C / (v8 ? 8 : 4), kConvThreads)), unsigned(cdiv(a.T, kConvChunk)));
  const size_t smem = conv_smem_bytes(v8 ? 8 : 4, a.conv_kernel, a.T);
  allow_smem(ctx, gdn_conv_kernel<8, 4>, conv_smem_bytes(8, 4, kConvChunk));  // a prefill chunk's: past 48 KB
  auto go = [&](auto kernel) {
    launch(ctx, kernel, grid, kConvThreads, smem, x, w, conv_state, out, a.T, C, a.conv_kernel);
  };
  if (v8)
    go(gdn_conv_kernel<8, 4>);
  else if (a.conv_kernel <= 4)
    go(gdn_conv_kernel<4, 4>);
  else
    go(gdn_conv_kernel<4, kConvMaxK>);
  check_launch("gdn_conv");
}

void gdn_scan(Ctx& ctx, const GdnArgs& a, const bf16* c, const bf16* b, const bf16* alpha, const float* A_log,
              const float* dt_bias, float* state, bf16* y) {
  check_gdn_heads(a, "gdn_scan");
  LILY_CHECK(a.DV % 8 == 0, "gdn_scan: DV = ", a.DV, " must be a multiple of 8");
  LILY_CHECK(aligned(c, 16) && aligned(y, 16) && aligned(state, 16), "gdn_scan: c, y and state must be ",
             "16-byte aligned");
  const int C = conv_dim(a);
  dispatch_dk(a.DK, [&](auto dk) {
    constexpr int DK = decltype(dk)::value;
    if (a.T == 0) return;
    if (a.T == 1 && ctx.opts.on(Opt::gdn_prep_fused)) {  // a decode token: prep and recurrence in one kernel
      const TokenArgs p = token_args(a, c, b, alpha, A_log, dt_bias, state, y);
      launch(ctx, gdn_scan_token_kernel<DK, false>, dim3(unsigned(a.NV), unsigned(cdiv(a.DV, kScanRows))),
             kScanThreads, 0, p);
      check_launch("gdn_scan_token");
      return;
    }
    const Parts<2> sp = gdn_scan_parts(a, a.T);
    void* scratch = ctx.scratch(kSlotGdn, sp.bytes);
    float* qk = sp.at<float>(scratch, 0);
    float4* gates = sp.at<float4>(scratch, 1);
    launch(ctx, gdn_scan_prep_kernel<DK>, unsigned(cdiv(int64_t(a.T) * a.NK, kPrepWarps)), kPrepWarps * 32, 0, c, b,
           alpha, A_log, dt_bias, qk, gates, a.T, a.NK, a.NV, C);
    check_launch("gdn_scan_prep");
    if (gdn_chunked(a, ctx.opts)) {
      ChunkArgs ca{};
      ca.qk = qk, ca.gates = gates, ca.c = c, ca.state = state, ca.y = y;
      ca.T = a.T, ca.NK = a.NK, ca.NV = a.NV, ca.DV = a.DV, ca.C = C, ca.nc = int(cdiv(a.T, kChunk));
      const Parts<4> cp = gdn_chunk_parts(a);
      void* wy = ctx.scratch(kSlotGdnChunk, cp.bytes);
      ca.W1 = cp.at<float>(wy, kChunkW1), ca.W2 = cp.at<float>(wy, kChunkW2);
      ca.P = cp.at<float>(wy, kChunkP), ca.lam = cp.at<float>(wy, kChunkLam);
      allow_smem(ctx, gdn_chunk_scan_kernel<DK>, cs_smem_bytes(DK));
      if (ctx.opts.on(Opt::gdn_wy_mma)) {
        allow_smem(ctx, gdn_wy_mma_kernel<DK>, wy_smem_bytes(DK, kWyThreads - DK));
        launch(ctx, gdn_wy_mma_kernel<DK>, dim3(ca.nc, a.NV), kWyThreads, wy_smem_bytes(DK, a.DV), ca);
      } else {
        allow_smem(ctx, gdn_wy_kernel<DK>, wy_smem_bytes(DK, kWyThreads - DK));
        launch(ctx, gdn_wy_kernel<DK>, dim3(ca.nc, a.NV), kWyThreads, wy_smem_bytes(DK, a.DV), ca);
      }
      check_launch("gdn_wy");
      launch(ctx, gdn_chunk_scan_kernel<DK>, dim3(a.NV, a.DV / kCsRows), kCsThreads, cs_smem_bytes(DK), ca);
      check_launch("gdn_chunk_scan");
      return;
    }
    const dim3 grid(unsigned(a.NV), unsigned(cdiv(a.DV, kScanRows)));
    launch(ctx, gdn_scan_kernel<DK>, grid, kScanThreads, 0, qk, gates, c, state, y, a.T, a.NK, a.NV, a.DV, C);
  });
  check_launch("gdn_scan");
}

bool gdn_conv_scan_norm(Ctx& ctx, const GdnArgs& a, const bf16* x, const float* conv_w, bf16* conv_state,
                        bf16* conv_out, const bf16* b, const bf16* alpha, const float* A_log, const float* dt_bias,
                        float* state, const bf16* z, const float* w, bf16* out) {
  // One block per head holds DV ≤ 128 rows; the conv stays a kernel of its own (no conv fold on CUDA).
  const GdnToken path = gdn_token_path(a, ctx.opts, a.DV <= 4 * kScanRows, false);
  if (path == GdnToken::apart) return false;
  check_gdn_heads(a, "gdn_conv_scan_norm");
  LILY_CHECK(a.DV % 8 == 0, "gdn_conv_scan_norm: DV = ", a.DV, " must be a multiple of 8");
  LILY_CHECK(aligned(state, 16), "gdn_conv_scan_norm: state must be 16-byte aligned");
  LILY_CHECK(z && w && out, "gdn_conv_scan_norm: null z, w or out");
  TokenArgs p = token_args(a, conv_out, b, alpha, A_log, dt_bias, state, out);
  p.z = z, p.nw = w;
  gdn_conv(ctx, a, x, conv_w, conv_state, conv_out);
  const unsigned threads = unsigned(cdiv(a.DV, kScanRows) * kScanThreads);
  dispatch_dk(a.DK, [&](auto dk) {
    constexpr int DK = decltype(dk)::value;
    launch(ctx, gdn_scan_token_kernel<DK, true>, unsigned(a.NV), threads, 0, p);
  });
  check_launch("gdn_conv_scan_norm");
  return true;
}

void gdn_norm(Ctx& ctx, const GdnArgs& a, const bf16* y, const bf16* z, const float* w, bf16* out) {
  check_gdn_heads(a, "gdn_norm");
  LILY_CHECK(a.DV % 4 == 0 && a.DV <= kNormMaxDv, "gdn_norm: DV = ", a.DV, " must be a multiple of 4 and at most ",
             kNormMaxDv);
  LILY_CHECK(aligned(y, 8) && aligned(z, 8) && aligned(out, 8) && aligned(w, 16), "gdn_norm: y, z, out must be ",
             "8-byte aligned and w 16-byte aligned");
  if (a.T == 0) return;
  const int rows = a.T * a.NV;
  launch(ctx, gdn_norm_kernel, unsigned(cdiv(rows, kNormWarps)), kNormWarps * 32, 0, y, z, w, rows, a.DV, a.eps, out);
  check_launch("gdn_norm");
}

}  // namespace lily::cuda
