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
//          Scratch (kSlotGdn): q̂k̂ fp32 [NK, T, 2·DK] (q̂ then k̂) and gates float4 [NV, T] = (g, β, k̂·q̂, 0).
// Traffic  real shapes (C = 8192, NK=16, NV=32, DK=DV=128), decode T=1:
//            conv  x 16 KB + w 128 KB + state 48 KB read + 48 KB written + out 16 KB = 0.26 MB
//            scan  state 2.1 MB read + 2.1 MB written + c 16 KB + y 8 KB = 4.2 MB → floor 0.9 µs @ 4.8 TB/s
//            norm  y, z, out 8 KB each
//          prefill T=4096: conv 64 MB in + 64 MB out = 128 MB → 27 µs;  scan prep 32 MB in + 64 MB out, scan
//          64 MB q̂k̂ (+ L2 re-reads) + 32 MB v + 32 MB y + 4 MB state ≈ 0.2 GB → 40 µs;  norm 96 MB → 20 µs
// Work     scan ≈ 7 FLOP per state element per token: 32·128·128·7 = 3.7 MFLOP per token, 15 GFLOP at T=4096
//          (0.23 ms at 67 TFLOP/s fp32), but sequential in T: ~4096 dependent steps of ~0.1–0.2 µs each.
// Mapping  conv: thread = 4 adjacent channels × a chunk of kConvChunk tokens; the K−1 previous raw rows slide
//            through registers. Only the chunk-0 thread of a channel reads or writes that channel's state, and it
//            reads every row it needs (old state, x) before it writes, so there are no races between blocks.
//          scan: (1) prep kernel, one warp per (token, key head): q̂, k̂, k̂·q̂ and the gates of its value heads.
//            (2) scan kernel, block = (value head, 32 state rows), 128 threads: 8 lanes per state row, 2 rows per
//            thread, each lane holding DK/8 columns (float4 chunks 4·s + 32·m) of its rows in registers for the
//            whole call; per-row dot products reduced with 3 xor-shuffles. Tokens stream through shared memory in
//            chunks of kScanChunk, double buffered with cp.async; y is staged in shared memory and written 16 bytes
//            at a time per chunk.
//            Real model: 32 heads × 4 row blocks = 128 blocks; the state is read and written once per call.
//          norm: one warp per (token, value head), 4 adjacent values per lane per 128.
// Checks   conv: C % 4 == 0, 1 ≤ K ≤ 9, T ≥ 0, x/out/state 8-byte aligned.  scan: DK ∈ {32, 64, 128}, DV % 8 == 0,
//          NV % NK == 0, c and y 16-byte aligned, state 16-byte aligned.  norm: DV % 4 == 0, DV ≤ 256.
// Ref      cpu/gdn.cpp (conv, scan), cpu/norm.cpp (gdn_norm)
// History  v1 (this), H200, real shapes, per call (stream-timed, launch included): conv 5 µs (T=1), 33 µs (512),
//          168 µs (4096); scan (prep + scan) 8–10 µs (T=1), 156 µs (512), 1.22 ms (4096; 1 row per thread: 1.39 ms,
//          4 rows: 1.71 ms); gdn_norm 4.7 µs (T=1), 62 µs (4096)
#include "backend/cuda/ops.cuh"

namespace lily::cuda {

namespace {

constexpr int kConvMaxK = 9;       // taps (config check: linear_conv_kernel_dim ≤ 9)
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

// ---- kernels ------------------------------------------------------------------------------------------------------

// Thread = channels c..c+3 (c = 4·(block.x·blockDim + tid)) × tokens [t0, t0 + kConvChunk), t0 = block.y·kConvChunk.
// The window win[] is right-aligned: before the output for token t, win[kConvMaxK − K + k] = U[t + k], k < K, so the
// newest row U[t + K − 1] = x[t] always lands in win[kConvMaxK − 1] and every register index is a constant.
__global__ void __launch_bounds__(kConvThreads) gdn_conv_kernel(const bf16* __restrict__ x,
                                                                const float* __restrict__ w, bf16* conv_state,
                                                                bf16* __restrict__ out, int T, int C, int K) {
  const int c = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= C) return;
  const int S = K - 1, lo = kConvMaxK - K;  // state rows; first live window slot
  const int t0 = blockIdx.y * kConvChunk, t1 = min(T, t0 + kConvChunk);
  auto U = [&](int r) -> const bf16* { return r < S ? conv_state + size_t(r) * C + c : x + size_t(r - S) * C + c; };

  float4 wk[kConvMaxK];  // right-aligned taps of the 4 channels: wk[lo + k] = w[c..c+3, k]
  float4 win[kConvMaxK];
#pragma unroll
  for (int i = 0; i < kConvMaxK; ++i) {
    wk[i] = win[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i >= lo) {
      const int k = i - lo;
      wk[i] = make_float4(w[size_t(c) * K + k], w[size_t(c + 1) * K + k], w[size_t(c + 2) * K + k],
                          w[size_t(c + 3) * K + k]);
    }
    if (i >= lo && i < kConvMaxK - 1) win[i] = load_bf16x4(U(t0 + i - lo));  // U[t0 + k], k < K − 1
  }
#pragma unroll 4
  for (int t = t0; t < t1; ++t) {
    win[kConvMaxK - 1] = load_bf16x4(x + size_t(t) * C + c);  // U[t + K − 1]
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < kConvMaxK; ++i) {
      if (i >= lo) {  // Σ_k w[c, k] · U[t + k, c]
        acc.x += wk[i].x * win[i].x;
        acc.y += wk[i].y * win[i].y;
        acc.z += wk[i].z * win[i].z;
        acc.w += wk[i].w * win[i].w;
      }
    }
    store_bf16x4(out + size_t(t) * C + c, make_float4(siluf_(acc.x), siluf_(acc.y), siluf_(acc.z), siluf_(acc.w)));
#pragma unroll
    for (int i = 0; i < kConvMaxK - 1; ++i) win[i] = win[i + 1];
  }
  // Chunk 0 owns the state of its channels (later chunks start at t0 ≥ K − 1 and never read it): read all new rows
  // U[T + r] (old state rows when T + r < K − 1) before writing any of them.
  if (blockIdx.y != 0) return;
  uint2 keep[kConvMaxK - 1];
#pragma unroll
  for (int r = 0; r < kConvMaxK - 1; ++r)
    if (r < S) keep[r] = *reinterpret_cast<const uint2*>(U(T + r));
#pragma unroll
  for (int r = 0; r < kConvMaxK - 1; ++r)
    if (r < S) *reinterpret_cast<uint2*>(conv_state + size_t(r) * C + c) = keep[r];
}

// One warp per (token t, key head kh): q̂, k̂ (fp32) and k̂·q̂ into qk [NK, T, 2·DK], and the gates of the value
// heads h = kh·R .. kh·R + R − 1 into gates [NV, T].
template <int DK>
__global__ void __launch_bounds__(kPrepWarps * 32) gdn_scan_prep_kernel(const bf16* c, const bf16* b,
                                                                        const bf16* alpha, const float* A_log,
                                                                        const float* dt_bias, float* qk,
                                                                        float4* gates, int T, int NK, int NV, int C) {
  constexpr int kPer = DK / 32;  // values per lane
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * kPrepWarps + (threadIdx.x >> 5);
  if (item >= T * NK) return;
  const int t = item / NK, kh = item % NK, R = NV / NK;
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
    const float x = to_f(alpha[size_t(t) * NV + h]) + dt_bias[h];
    const float softplus = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
    const float g = expf(-expf(A_log[h]) * softplus);  // g = exp(−exp(A_log)·softplus(α + dt_bias))
    gates[size_t(h) * T + t] = make_float4(g, beta, kq, 0.0f);
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

  float4 S[kScanRpt][kM];
#pragma unroll
  for (int j = 0; j < kScanRpt; ++j) {
    const int row = r0 + lr + kScanRowStride * j;
    const float4* src = reinterpret_cast<const float4*>(state + (size_t(h) * DV + row) * DK) + s;
#pragma unroll
    for (int m = 0; m < kM; ++m) S[j][m] = row < DV ? src[kScanLanes * m] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

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
      float4 kv[kM], qv[kM];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        kv[m] = *reinterpret_cast<const float4*>(ks + 4 * s + 4 * kScanLanes * m);
        qv[m] = *reinterpret_cast<const float4*>(qs + 4 * s + 4 * kScanLanes * m);
      }
      float ak[kScanRpt], aq[kScanRpt];
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
      const float4 gt = s_gate[buf][tt];  // (g, β, k̂·q̂)
      const float g = gt.x;
#pragma unroll
      for (int j = 0; j < kScanRpt; ++j) {
        const int rl = lr + kScanRowStride * j;
        const float v = bf16_bits_to_f(s_v[buf][tt][rl]);
        const float delta = gt.y * (v - g * ak[j]);  // δ = β·(v − (g·S)·k̂)
        const float out = g * aq[j] + delta * gt.z;  // y = (g·S + δ⊗k̂)·q̂
#pragma unroll
        for (int m = 0; m < kM; ++m) {  // S ← g·S + δ ⊗ k̂
          S[j][m].x = fmaf(S[j][m].x, g, delta * kv[m].x);
          S[j][m].y = fmaf(S[j][m].y, g, delta * kv[m].y);
          S[j][m].z = fmaf(S[j][m].z, g, delta * kv[m].z);
          S[j][m].w = fmaf(S[j][m].w, g, delta * kv[m].w);
        }
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

// One warp per (token, value head) row of DV values: o = y / sqrt(mean(y²) + eps) · w · silu(z).
__global__ void __launch_bounds__(kNormWarps * 32) gdn_norm_kernel(const bf16* y, const bf16* z, const float* w,
                                                                   int rows, int DV, float eps, bf16* out) {
  constexpr int kChunks = kNormMaxDv / 128;
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kNormWarps + (threadIdx.x >> 5);
  if (r >= rows) return;
  const size_t o = size_t(r) * DV;
  float4 v[kChunks];
  float ss = 0.0f;
#pragma unroll
  for (int m = 0; m < kChunks; ++m) {
    const int j = 4 * lane + 128 * m;
    v[m] = j < DV ? load_bf16x4(y + o + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    ss += v[m].x * v[m].x + v[m].y * v[m].y + v[m].z * v[m].z + v[m].w * v[m].w;
  }
  const float rs = 1.0f / sqrtf(warp_sum(ss) / float(DV) + eps);  // 1 / sqrt(mean(y²) + eps)
#pragma unroll
  for (int m = 0; m < kChunks; ++m) {
    const int j = 4 * lane + 128 * m;
    if (j < DV) {
      const float4 wv = *reinterpret_cast<const float4*>(w + j), zv = load_bf16x4(z + o + j);
      store_bf16x4(out + o + j, make_float4(v[m].x * rs * wv.x * siluf_(zv.x), v[m].y * rs * wv.y * siluf_(zv.y),
                                            v[m].z * rs * wv.z * siluf_(zv.z), v[m].w * rs * wv.w * siluf_(zv.w)));
    }
  }
}

// ---- launcher helpers ---------------------------------------------------------------------------------------------

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int conv_dim(const GdnArgs& a) { return 2 * a.NK * a.DK + a.NV * a.DV; }

void check_heads(const GdnArgs& a, const char* name) {
  LILY_CHECK(a.T >= 0, name, ": T = ", a.T, " is negative");
  LILY_CHECK(a.NK > 0 && a.NV > 0 && a.NV % a.NK == 0, name, ": NV = ", a.NV, " must be a positive multiple of NK = ",
             a.NK);
  LILY_CHECK(a.DK > 0 && a.DV > 0, name, ": DK = ", a.DK, " and DV = ", a.DV, " must be positive");
}

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

}  // namespace

// ---- launchers ----------------------------------------------------------------------------------------------------

void gdn_conv(Ctx& ctx, const GdnArgs& a, const bf16* x, const float* w, bf16* conv_state, bf16* out) {
  check_heads(a, "gdn_conv");
  const int C = conv_dim(a);
  LILY_CHECK(C % 4 == 0, "gdn_conv: conv_dim ", C, " must be a multiple of 4");
  LILY_CHECK(a.conv_kernel >= 1 && a.conv_kernel <= kConvMaxK, "gdn_conv: conv_kernel ", a.conv_kernel,
             " must be in [1, ", kConvMaxK, "]");
  LILY_CHECK(aligned(x, 8) && aligned(out, 8) && aligned(conv_state, 8), "gdn_conv: x, out and conv_state must be ",
             "8-byte aligned");
  if (a.T == 0) return;
  const dim3 grid(unsigned(cdiv(C / 4, kConvThreads)), unsigned(cdiv(a.T, kConvChunk)));
  gdn_conv_kernel<<<grid, kConvThreads, 0, ctx.stream>>>(x, w, conv_state, out, a.T, C, a.conv_kernel);
  check_launch("gdn_conv");
}

void gdn_scan(Ctx& ctx, const GdnArgs& a, const bf16* c, const bf16* b, const bf16* alpha, const float* A_log,
              const float* dt_bias, float* state, bf16* y) {
  check_heads(a, "gdn_scan");
  LILY_CHECK(a.DV % 8 == 0, "gdn_scan: DV = ", a.DV, " must be a multiple of 8");
  LILY_CHECK(aligned(c, 16) && aligned(y, 16) && aligned(state, 16), "gdn_scan: c, y and state must be ",
             "16-byte aligned");
  const int C = conv_dim(a);
  dispatch_dk(a.DK, [&](auto dk) {
    constexpr int DK = decltype(dk)::value;
    if (a.T == 0) return;
    const size_t qk_bytes = size_t(a.NK) * a.T * 2 * DK * sizeof(float);
    char* scratch = static_cast<char*>(ctx.scratch(kSlotGdn, qk_bytes + size_t(a.NV) * a.T * sizeof(float4)));
    float* qk = reinterpret_cast<float*>(scratch);
    float4* gates = reinterpret_cast<float4*>(scratch + qk_bytes);
    gdn_scan_prep_kernel<DK><<<unsigned(cdiv(int64_t(a.T) * a.NK, kPrepWarps)), kPrepWarps * 32, 0, ctx.stream>>>(
        c, b, alpha, A_log, dt_bias, qk, gates, a.T, a.NK, a.NV, C);
    check_launch("gdn_scan_prep");
    const dim3 grid(unsigned(a.NV), unsigned(cdiv(a.DV, kScanRows)));
    gdn_scan_kernel<DK><<<grid, kScanThreads, 0, ctx.stream>>>(qk, gates, c, state, y, a.T, a.NK, a.NV, a.DV, C);
  });
  check_launch("gdn_scan");
}

void gdn_norm(Ctx& ctx, const GdnArgs& a, const bf16* y, const bf16* z, const float* w, bf16* out) {
  check_heads(a, "gdn_norm");
  LILY_CHECK(a.DV % 4 == 0 && a.DV <= kNormMaxDv, "gdn_norm: DV = ", a.DV, " must be a multiple of 4 and at most ",
             kNormMaxDv);
  LILY_CHECK(aligned(y, 8) && aligned(z, 8) && aligned(out, 8) && aligned(w, 16), "gdn_norm: y, z, out must be ",
             "8-byte aligned and w 16-byte aligned");
  if (a.T == 0) return;
  const int rows = a.T * a.NV;
  gdn_norm_kernel<<<unsigned(cdiv(rows, kNormWarps)), kNormWarps * 32, 0, ctx.stream>>>(y, z, w, rows, a.DV, a.eps,
                                                                                         out);
  check_launch("gdn_norm");
}

}  // namespace lily::cuda
