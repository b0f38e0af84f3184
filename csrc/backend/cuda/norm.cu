// norm.cu: the embedding lookup, RMSNorm and the fused residual-add + RMSNorm (architecture.md §3.1, §7, §9.3).
//
// Math     embed:         x[t, k] = s[id, k/group] · q[id, k] + b[id, k/group],  id = tokens[t]
//          rms_norm:      out = x / sqrt(mean(x²) + eps) · w                (w already holds 1 + w, §3.1)
//          add_rms_norm:  x ← x + d;  out = x / sqrt(mean(x²) + eps) · w
// Layout   table u32[vocab, H·bits/32] (LSB first), s, b bf16[vocab, H/group]; tokens i32[T]; x fp32[T, H];
//          d, out bf16[T, H]; w fp32[H]
// Traffic  H=2048, per row: embed 4-bit 1.0 KB codes + 0.1 KB s,b + 8 KB x;  rms_norm x 8 KB + w 8 KB + out 4 KB;
//          add_rms_norm x 8 KB read + 8 KB written + d 4 KB + w 8 KB + out 4 KB = 32 KB
// Work     ~4 FLOP per element: bandwidth- (prefill) or latency-bound (decode, T=1: one block, ~2 µs launch to end).
//          Floor at T=4096: add_rms_norm 4096·(24 KB) + w = 101 MB @ 4.8 TB/s = 21 µs
// Mapping  embed: one block per token, one thread per packed word (8 or 4 codes), two float4 stores per 8 codes.
//          norms: one block per row; thread i holds float4 chunks i, i + blockDim, … (VPT of them) in registers,
//          so x is read once; one block-wide sum; 16-byte fp32 and 8-byte bf16 accesses.
// Checks   H % 4 == 0 and H ≤ 32768; 16-byte aligned fp32 rows, 8-byte aligned bf16 rows; embed: K % group == 0,
//          group % (32/bits) == 0, bits 4 or 8, any group. Token ids are validated on the host (backend).
// Ref      cpu/norm.cpp, cpu/qmm.cpp (embed)
// History  v1, H200, H=2048, stream-timed with launch: rms_norm 4–5 µs (T=1), 15 µs (T=4096);
//          add_rms_norm 4–5 µs (T=1), 28 µs (T=4096). v2 (current, 2026-12-03): the norms' weights loaded before the
//          PDL wait (up to 4 float4 a thread), as attention's prep does its q/k norm weights: one memory latency
//          fewer after the wait; decode 532 → 560 tok/s at 4K on the H200 (benchmarks/NOTES.md v11).
#include "backend/cuda/ops.cuh"

namespace lily::cuda {

namespace {

constexpr int kEmbedThreads = 256;
constexpr int kNormThreads = 256;  // target block size; VPT float4 chunks per thread cover the row

// ---- kernels ------------------------------------------------------------------------------------------------------

// One block per token; thread i dequantises packed words i, i + blockDim, … of the token's table row.
template <int BITS>
__global__ void __launch_bounds__(kEmbedThreads) embed_kernel(const uint32_t* w, const uint16_t* scales,
                                                              const uint16_t* biases, const int32_t* tokens, int K,
                                                              int group, float* x) {
  pdl_trigger();
  pdl_wait();
  constexpr int kPerWord = 32 / BITS;
  const int t = blockIdx.x;
  const size_t id = size_t(tokens[t]);
  const int words = K / kPerWord, groups = K / group;
  const uint32_t* wr = w + id * words;
  const uint16_t* sr = scales + id * groups;
  const uint16_t* br = biases + id * groups;
  float* xr = x + size_t(t) * K;
  for (int i = threadIdx.x; i < words; i += blockDim.x) {
    const int k0 = i * kPerWord, g = k0 / group;  // group % kPerWord == 0: a word never straddles two groups
    float v[kPerWord];
    dequant_word<BITS>(wr[i], bf16_bits_to_f(sr[g]), bf16_bits_to_f(br[g]), v);  // x = s·q + b
#pragma unroll
    for (int j = 0; j < kPerWord; j += 4)
      *reinterpret_cast<float4*>(xr + k0 + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
  }
}

// One block per row of H = 4·H4 values. ADD: x + d is written to x_sum (= x for add_rms_norm) and normalised;
// else x is normalised as it is (d, x_sum unused). Thread i owns float4 chunks i + blockDim·j, j < VPT.
template <int VPT, bool ADD>
__global__ void __launch_bounds__(1024) rms_norm_kernel(const float* x, const bf16* d, float* x_sum, const float* w,
                                                        int H4, float eps, bf16* out) {
  pdl_trigger();
  const size_t row = size_t(blockIdx.x) * H4;
  const float4* xr = reinterpret_cast<const float4*>(x) + row;
  const float4* wr = reinterpret_cast<const float4*>(w);
  // The weights before the PDL wait (one memory latency fewer after it), up to 4 chunks a thread: 8 more would spill
  // under the 1024-thread bound (rows past 4096 values load them at the end).
  constexpr bool kEarlyW = VPT <= 4;
  float4 wv[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (kEarlyW) wv[j] = i < H4 ? wr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  pdl_wait();
  float4 v[VPT];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i < H4) {
      v[j] = xr[i];
      if constexpr (ADD) {
        const float4 dv = load_bf16x4(d + (row + i) * 4);
        v[j].x += dv.x;  // x ← x + d
        v[j].y += dv.y;
        v[j].z += dv.z;
        v[j].w += dv.w;
        reinterpret_cast<float4*>(x_sum)[row + i] = v[j];
      }
    }
    ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
  const float r = 1.0f / sqrtf(block_sum(ss) / float(4 * H4) + eps);  // 1 / sqrt(mean(x²) + eps)
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < H4) {
      const float4 w4 = kEarlyW ? wv[j] : wr[i];
      store_bf16x4(out + (row + i) * 4,
                   make_float4(v[j].x * r * w4.x, v[j].y * r * w4.y, v[j].z * r * w4.z, v[j].w * r * w4.w));
    }
  }
}

// ---- launcher helpers ---------------------------------------------------------------------------------------------

// Chooses VPT (float4 chunks per thread) and the block size for a row of H values, then launches.
template <bool ADD>
void launch_rms_norm(Ctx& ctx, const float* x, const bf16* d, float* x_sum, const float* w, int T, int H, float eps,
                     bf16* out, const char* name) {
  static_assert(8 * 1024 * 4 == kNormMaxH, "rows of up to 1024 threads × 8 float4 chunks");
  check_norm(name, T, H, x, w, d, out);
  if (T == 0) return;
  const int H4 = H / 4;
  auto go = [&](auto vpt) {
    constexpr int VPT = decltype(vpt)::value;
    const int threads = int(cdiv(cdiv(H4, VPT), 32) * 32);
    launch(ctx, rms_norm_kernel<VPT, ADD>, T, threads, 0, x, d, x_sum, w, H4, eps, out);
  };
  if (H4 <= kNormThreads)
    go(std::integral_constant<int, 1>{});
  else if (H4 <= 2 * kNormThreads)
    go(std::integral_constant<int, 2>{});
  else if (H4 <= 4 * kNormThreads)
    go(std::integral_constant<int, 4>{});
  else
    go(std::integral_constant<int, 8>{});  // up to 1024 threads × 8 chunks
  check_launch(name);
}

}  // namespace

// ---- launchers ----------------------------------------------------------------------------------------------------

void embed(Ctx& ctx, const QMatrix& table, const int32_t* tokens, int T, float* x) {
  check_embed(table, T, x);
  if (T == 0) return;
  dispatch_bits(table.bits, [&](auto bits) {
    constexpr int BITS = decltype(bits)::value;
    launch(ctx, embed_kernel<BITS>, T, kEmbedThreads, 0, table.w, table.scales, table.biases, tokens, table.K,
           table.group, x);
  });
  check_launch("embed");
}

void rms_norm(Ctx& ctx, const float* x, const float* w, int T, int H, float eps, bf16* out) {
  launch_rms_norm<false>(ctx, x, nullptr, nullptr, w, T, H, eps, out, "rms_norm");
}

void add_rms_norm(Ctx& ctx, float* x, const bf16* d, const float* w, int T, int H, float eps, bf16* out) {
  launch_rms_norm<true>(ctx, x, d, x, w, T, H, eps, out, "add_rms_norm");
}

}  // namespace lily::cuda
