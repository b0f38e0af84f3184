// metal/gdn.metal
// gdn_conv, gdn_scan_dk{32,64,128}, gdn_norm: Gated DeltaNet's causal conv, delta-rule recurrence and gated RMSNorm
// (architecture.md §5.2–§5.8).
//
// Math     conv:  C[t, c] = silu(Σ_{k<K} w[c, k] · U[t + k, c]),  U = [state (K−1 rows); x];
//                 state ← last K−1 rows of U
//          scan, value head h, key head kh = h / (NV/NK), token by token (§5.4–§5.7):
//            q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK),  k̂ = k / sqrt(Σk² + 1e-6),  β = σ(b),
//            g = exp(−exp(A_log) · softplus(α + dt_bias)),  softplus(x) = max(x, 0) + log(1 + exp(−|x|))
//            S ← g·S;  u = S·k̂;  δ = β·(v − u);  S ← S + δ ⊗ k̂;  y = S·q̂        (S [DV, DK] fp32, row i = value i)
//          evaluated per state row i from one pass over the old row (the same function, regrouped):
//            a_k = S_i·k̂,  a_q = S_i·q̂;  δ_i = β·(v_i − g·a_k);  y_i = g·a_q + δ_i·(k̂·q̂);  S_i ← g·S_i + δ_i·k̂
//          norm:  o = y / sqrt(mean(y²) + eps) · w · silu(z)     per (token, value head) over DV values
// Layout   x, out bf16 [T, C], C = 2·NK·DK + NV·DV = [q heads | k heads | v heads]; conv w fp32 [C, K];
//          conv_state bf16 [K−1, C]; b, alpha bf16 [T, NV]; state fp32 [NV, DV, DK]; y, z, out bf16 [T, NV·DV].
// Traffic  real shapes (C = 8192, NK=16, NV=32, DK=DV=128), decode T=1:
//            conv  x 16 KB + w 128 KB + state 48 KB read + 48 KB written + out 16 KB = 0.26 MB → 0.6 µs
//            scan  state 2.1 MB read + 2.1 MB written + c 16 KB + y 8 KB = 4.2 MB → 10.5 µs
//            norm  y, z, out 8 KB each
//          prefill T=4096: conv 64 MB in + 64 MB out = 128 MB → 0.32 ms;  scan c 64 MB + y 32 MB + state 4 MB
//          (q, k re-read by each of the 16 threadgroups of a key head, from the cache) → 0.25 ms;  norm 96 MB →
//          0.24 ms.  Floors on an M3 Max at 400 GB/s.
// Work     scan ≈ 7 FLOP per state element per token: 32·128·128·7 = 3.7 MFLOP per token, 15 GFLOP at T=4096
//          (~1 ms at ~14 TFLOP/s fp32), and sequential in T: 4096 dependent steps.
// Mapping  conv: thread = 4 adjacent channels × a chunk of kGdnConvChunk tokens; the K−1 previous raw rows slide
//            through registers. Only the chunk-0 thread of a channel reads or writes that channel's state, and it
//            reads every row it needs (old state, x) before it writes, so there are no races, even for T < K−1.
//          scan: threadgroup = (value head h, kGdnScanRows = 16 state rows), 4 simdgroups; simdgroup sg owns rows
//            4·sg .. 4·sg + 3 of the block and each lane holds DK/32 entries (columns lane + 32·m) of each of
//            its rows in REGISTERS for the whole call, so the state is read and written once per call. Tokens
//            go in chunks of kGdnScanChunk: the simdgroups stage q̂, k̂ (fp32, normalised with simd_sum), k̂·q̂, the
//            gates and v of the chunk in threadgroup memory (9 KB); after a barrier each simdgroup runs the
//            recurrence over the chunk's tokens on its rows, both row dot products per token with simd_sum (the
//            two are independent, so they reduce in parallel); y is staged in threadgroup memory and written,
//            one coalesced row block per token, after a second barrier.
//            Real model: 32 heads × 8 row blocks = 256 threadgroups of 128 threads.
//          norm: one simdgroup per (token, value head), values lane + 32·m per lane.
// Checks   conv: C % 4 == 0, 1 ≤ K ≤ 9, x/out/state 8-byte aligned.  scan: DK ∈ {32, 64, 128}, DV % 16 == 0,
//          NV % NK == 0.  norm: DV ≤ 256.
// Ref      cpu/gdn.cpp (conv, scan), cpu/norm.cpp (gdn_norm) · Test tests/metal/test_metal_ops.py
// History  v1 (this): scan structure of cuda/gdn.cu with the normalisation fused into the scan kernel (no scratch,
//          one dispatch); not yet timed on Apple hardware
#include "common.h"
#include "gdn_args.h"

// Four bf16 values (8 bytes, 8-byte aligned) as floats, and back.
inline float4 load_bf16x4(device const ushort* p) {
  const uint2 u = *(device const uint2*)p;
  return float4(as_type<float>(u.x << 16), as_type<float>(u.x & 0xffff0000u), as_type<float>(u.y << 16),
                as_type<float>(u.y & 0xffff0000u));
}

inline void store_bf16x4(device ushort* p, float4 v) {
  *(device uint2*)p = uint2(uint(float_to_bf16(v.x)) | (uint(float_to_bf16(v.y)) << 16),
                            uint(float_to_bf16(v.z)) | (uint(float_to_bf16(v.w)) << 16));
}

// ---- conv -----------------------------------------------------------------------------------------------------------

// Thread = channels c..c+3 (c = 4·(tg.x·kGdnConvThreads + tid)) × tokens [t0, t0 + kGdnConvChunk),
// t0 = tg.y·kGdnConvChunk. The window win[] is right-aligned: before the output for token t,
// win[kGdnConvMaxK − K + k] = U[t + k], k < K, so the newest row U[t + K − 1] = x[t] always lands in
// win[kGdnConvMaxK − 1] and every register index is a constant.
[[kernel]] void gdn_conv(constant GdnKernelArgs& args [[buffer(0)]],
                         device const ushort* x [[buffer(1)]],
                         device const float* w [[buffer(2)]],
                         device ushort* conv_state [[buffer(3)]],
                         device ushort* out [[buffer(4)]],
                         uint3 tg [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]]) {
  const int C = args.C, K = args.K, S = K - 1, lo = kGdnConvMaxK - K;  // state rows; first live window slot
  const int c = 4 * int(tg.x * kGdnConvThreads + tid);
  if (c >= C) return;
  const int t0 = int(tg.y) * kGdnConvChunk, t1 = min(args.T, t0 + kGdnConvChunk);

  float4 wk[kGdnConvMaxK];  // right-aligned taps of the 4 channels: wk[lo + k] = w[c..c+3, k]
  float4 win[kGdnConvMaxK];
  for (int i = 0; i < kGdnConvMaxK; ++i) {
    wk[i] = win[i] = float4(0.0f);
    if (i >= lo) {
      const int k = i - lo;
      wk[i] = float4(w[c * K + k], w[(c + 1) * K + k], w[(c + 2) * K + k], w[(c + 3) * K + k]);
    }
    if (i >= lo && i < kGdnConvMaxK - 1) {  // U[t0 + k], k < K − 1
      const int r = t0 + i - lo;
      win[i] = load_bf16x4(r < S ? conv_state + r * C + c : x + (r - S) * C + c);
    }
  }
  for (int t = t0; t < t1; ++t) {
    win[kGdnConvMaxK - 1] = load_bf16x4(x + t * C + c);  // U[t + K − 1]
    float4 acc = float4(0.0f);
    for (int i = 0; i < kGdnConvMaxK; ++i)
      if (i >= lo) acc += wk[i] * win[i];  // Σ_k w[c, k] · U[t + k, c]
    store_bf16x4(out + t * C + c, float4(silu_f(acc.x), silu_f(acc.y), silu_f(acc.z), silu_f(acc.w)));
    for (int i = 0; i < kGdnConvMaxK - 1; ++i) win[i] = win[i + 1];
  }
  // Chunk 0 owns the state of its channels (later chunks start at t0 ≥ K − 1 and never read it): read all new rows
  // U[T + r] (old state rows when T + r < K − 1) before writing any of them.
  if (tg.y != 0) return;
  uint2 keep[kGdnConvMaxK - 1];
  for (int r = 0; r < kGdnConvMaxK - 1; ++r) {
    const int u = args.T + r;
    if (r < S) keep[r] = *(device const uint2*)(u < S ? conv_state + u * C + c : x + (u - S) * C + c);
  }
  for (int r = 0; r < kGdnConvMaxK - 1; ++r)
    if (r < S) *(device uint2*)(conv_state + r * C + c) = keep[r];
}

// ---- scan -----------------------------------------------------------------------------------------------------------

// Threadgroup = (value head h = tg.x, state rows r0 = kGdnScanRows·tg.y ..); see Mapping above.
template <int DK>
[[kernel]] void gdn_scan_heads(constant GdnKernelArgs& args [[buffer(0)]],
                               device const ushort* c [[buffer(1)]],
                               device const ushort* b [[buffer(2)]],
                               device const ushort* alpha [[buffer(3)]],
                               device const float* A_log [[buffer(4)]],
                               device const float* dt_bias [[buffer(5)]],
                               device float* state [[buffer(6)]],
                               device ushort* y [[buffer(7)]],
                               uint3 tg [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  constexpr int kPer = DK / 32;  // state entries per lane and row
  static_assert(kGdnScanChunk * kGdnScanRows == kGdnScanSgs * 32, "one thread per staged v and y value");
  threadgroup float s_q[kGdnScanChunk * kGdnScanMaxDK];    // q̂ of the chunk's tokens
  threadgroup float s_k[kGdnScanChunk * kGdnScanMaxDK];    // k̂
  threadgroup float s_kq[kGdnScanChunk];                   // k̂·q̂
  threadgroup float s_g[kGdnScanChunk];                    // decay g
  threadgroup float s_beta[kGdnScanChunk];                 // β
  threadgroup float s_v[kGdnScanChunk * kGdnScanRows];     // v of the block's rows
  threadgroup float s_y[kGdnScanChunk * kGdnScanRows];     // y of the block's rows

  const int T = args.T, NK = args.NK, NV = args.NV, DV = args.DV, C = args.C;
  const int h = int(tg.x), kh = h / (NV / NK), r0 = kGdnScanRows * int(tg.y);
  const int row0 = r0 + kGdnScanRowsPerSg * int(sg);  // first state row of this simdgroup
  const float q_scale = 1.0f / sqrt(float(DK));
  const int v_col = 2 * NK * DK + h * DV + r0;  // column of v[h, r0] in a row of c

  float S[kGdnScanRowsPerSg][kPer];
  for (int r = 0; r < kGdnScanRowsPerSg; ++r)
    for (int m = 0; m < kPer; ++m) S[r][m] = state[(h * DV + row0 + r) * DK + int(lane) + 32 * m];

  for (int t0 = 0; t0 < T; t0 += kGdnScanChunk) {
    const int nt = min(int(kGdnScanChunk), T - t0);
    // Stage the chunk. Simdgroup sg normalises tokens sg, sg + kGdnScanSgs, … (a whole simdgroup per token).
    for (int tt = int(sg); tt < nt; tt += kGdnScanSgs) {
      device const ushort* qr = c + (t0 + tt) * C + kh * DK;
      device const ushort* kr = qr + NK * DK;
      float q[kPer], k[kPer], sq = 0.0f, sk = 0.0f;
      for (int m = 0; m < kPer; ++m) {
        q[m] = bf16_to_float(qr[int(lane) + 32 * m]);
        k[m] = bf16_to_float(kr[int(lane) + 32 * m]);
        sq += q[m] * q[m];
        sk += k[m] * k[m];
      }
      const float rq = q_scale / sqrt(simd_sum(sq) + 1e-6f);  // q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK)
      const float rk = 1.0f / sqrt(simd_sum(sk) + 1e-6f);     // k̂ = k / sqrt(Σk² + 1e-6)
      float kq = 0.0f;
      for (int m = 0; m < kPer; ++m) {
        q[m] *= rq;
        k[m] *= rk;
        s_q[tt * kGdnScanMaxDK + int(lane) + 32 * m] = q[m];
        s_k[tt * kGdnScanMaxDK + int(lane) + 32 * m] = k[m];
        kq += k[m] * q[m];
      }
      kq = simd_sum(kq);
      if (lane == 0) s_kq[tt] = kq;
    }
    if (int(tid) < nt) {
      const int t = t0 + int(tid);
      s_beta[tid] = sigmoid_f(bf16_to_float(b[t * NV + h]));  // β = σ(b)
      const float a = bf16_to_float(alpha[t * NV + h]) + dt_bias[h];
      const float softplus = max(a, 0.0f) + log(1.0f + exp(-fabs(a)));
      s_g[tid] = exp(-exp(A_log[h]) * softplus);  // g = exp(−exp(A_log)·softplus(α + dt_bias))
    }
    const int st = int(tid) / kGdnScanRows, si = int(tid) % kGdnScanRows;  // this thread's staged v / y value
    if (st < nt) s_v[tid] = bf16_to_float(c[(t0 + st) * C + v_col + si]);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int tt = 0; tt < nt; ++tt) {
      float kv[kPer], qv[kPer];
      for (int m = 0; m < kPer; ++m) {
        kv[m] = s_k[tt * kGdnScanMaxDK + int(lane) + 32 * m];
        qv[m] = s_q[tt * kGdnScanMaxDK + int(lane) + 32 * m];
      }
      float ak[kGdnScanRowsPerSg], aq[kGdnScanRowsPerSg];
      for (int r = 0; r < kGdnScanRowsPerSg; ++r) {
        ak[r] = aq[r] = 0.0f;
        for (int m = 0; m < kPer; ++m) {
          ak[r] += S[r][m] * kv[m];  // S_i·k̂ (old S)
          aq[r] += S[r][m] * qv[m];  // S_i·q̂ (old S)
        }
      }
      for (int r = 0; r < kGdnScanRowsPerSg; ++r) {
        ak[r] = simd_sum(ak[r]);
        aq[r] = simd_sum(aq[r]);
      }
      const float g = s_g[tt], beta = s_beta[tt], kq = s_kq[tt];
      for (int r = 0; r < kGdnScanRowsPerSg; ++r) {
        const int i = kGdnScanRowsPerSg * int(sg) + r;                         // row within the block
        const float delta = beta * (s_v[tt * kGdnScanRows + i] - g * ak[r]);  // δ = β·(v − (g·S)·k̂)
        for (int m = 0; m < kPer; ++m) S[r][m] = fma(S[r][m], g, delta * kv[m]);  // S ← g·S + δ ⊗ k̂
        if (lane == 0) s_y[tt * kGdnScanRows + i] = g * aq[r] + delta * kq;   // y = (g·S + δ⊗k̂)·q̂
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (st < nt) y[(t0 + st) * NV * DV + h * DV + r0 + si] = float_to_bf16(s_y[tid]);
  }

  for (int r = 0; r < kGdnScanRowsPerSg; ++r)
    for (int m = 0; m < kPer; ++m) state[(h * DV + row0 + r) * DK + int(lane) + 32 * m] = S[r][m];
}

// ---- gated RMSNorm --------------------------------------------------------------------------------------------------

// Simdgroup = one (token, value head) row of DV values: o = y / sqrt(mean(y²) + eps) · w · silu(z).
[[kernel]] void gdn_norm(constant GdnKernelArgs& args [[buffer(0)]],
                         device const ushort* y [[buffer(1)]],
                         device const ushort* z [[buffer(2)]],
                         device const float* w [[buffer(3)]],
                         device ushort* out [[buffer(4)]],
                         uint3 tg [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  const int DV = args.DV, row = int(tg.x) * kGdnNormSgs + int(sg);
  if (row >= args.T * args.NV) return;  // whole simdgroups only: the simd_sum below stays uniform
  const int o = row * DV;
  float v[kGdnNormMaxPer];
  float ss = 0.0f;
  for (int m = 0; m < kGdnNormMaxPer; ++m) {
    const int j = int(lane) + 32 * m;
    v[m] = j < DV ? bf16_to_float(y[o + j]) : 0.0f;
    ss += v[m] * v[m];
  }
  const float rs = 1.0f / sqrt(simd_sum(ss) / float(DV) + args.eps);  // 1 / sqrt(mean(y²) + eps)
  for (int m = 0; m < kGdnNormMaxPer; ++m) {
    const int j = int(lane) + 32 * m;
    if (j < DV) out[o + j] = float_to_bf16(v[m] * rs * w[j] * silu_f(bf16_to_float(z[o + j])));
  }
}

// ---- instantiations (host names used by csrc/backend/metal/gdn.cpp) -------------------------------------------------

template [[host_name("gdn_scan_dk32")]] [[kernel]] decltype(gdn_scan_heads<32>) gdn_scan_heads<32>;
template [[host_name("gdn_scan_dk64")]] [[kernel]] decltype(gdn_scan_heads<64>) gdn_scan_heads<64>;
template [[host_name("gdn_scan_dk128")]] [[kernel]] decltype(gdn_scan_heads<128>) gdn_scan_heads<128>;
