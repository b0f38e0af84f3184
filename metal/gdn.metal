// metal/gdn.metal
// gdn_conv, gdn_scan_dk{32,64,128}, gdn_norm: Gated DeltaNet's causal conv, delta-rule recurrence and gated RMSNorm
// (architecture.md §5.2–§5.8); gdn_chunk_prep_dk*, gdn_wy_dk*, gdn_chunk_scan_dk*: the recurrence in chunks of 64
// tokens for prefill (switch gdn_chunked; backend/policy.h decides when it runs: T ≥ 16 and the shapes it takes);
// gdn_token_dk*, gdn_conv_token_dk*: a decode token's scan and gated norm (and conv) in one dispatch (switches
// gdn_prep_fused, gdn_norm_fused, gdn_conv_fused; backend/policy.h: gdn_token_path).
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
//          chunked scan: the WY form of "chunked prefill" below (the same function in exact arithmetic).
// Layout   x, out bf16 [T, C], C = 2·NK·DK + NV·DV = [q heads | k heads | v heads]; conv w fp32 [C, K];
//          conv_state bf16 [K−1, C]; b, alpha bf16 [T, NV]; state fp32 [NV, DV, DK]; y, z, out bf16 [T, NV·DV].
//          Chunked scan scratch (backend/scratch.h, Tp = T rounded up to 64): kSlotGdn q̂k̂ fp32 [NK, Tp, 2·DK] and
//          gates float4 [NV, Tp]; kSlotGdnChunk W1 [NV, Tp, DV], W2 [NV, Tp, DK], P [NV, Tp/64, 64, 64], λ [NV, Tp].
// Traffic  real shapes (C = 8192, NK=16, NV=32, DK=DV=128), decode T=1:
//            conv  x 16 KB + w 128 KB + state 48 KB read + 48 KB written + out 16 KB = 0.26 MB → 0.6 µs
//            scan  state 2.1 MB read + 2.1 MB written + c 16 KB + y 8 KB = 4.2 MB → 10.5 µs
//            norm  y, z, out 8 KB each
//            one dispatch (gdn_conv_token): the state's 4.2 MB + the conv's 0.26 MB; c's and y's round trips gone
//          prefill T=4096: conv 64 MB in + 64 MB out = 128 MB → 0.32 ms;  scan c 64 MB + y 32 MB + state 4 MB
//          (q, k re-read by each of the 16 threadgroups of a key head, from the cache) → 0.25 ms;  norm 96 MB →
//          0.24 ms.  Floors on an M3 Max at 400 GB/s.
//          chunked, T=4096: prep c 32 MB in, q̂k̂ 64 MB out; wy q̂k̂ 64 MB (each key head's read by its 2 value heads,
//          from the cache) + v 32 MB in, W1 64 + W2 64 + P 32 MB out; chunk scan W1 64 + W2 64 + q̂k̂ 64 + P 32 MB in
//          (W2, q̂k̂ and P re-read by the 4 row blocks of a head, from the cache) + y 32 MB out ≈ 0.6 GB → 1.5 ms.
// Work     scan ≈ 7 FLOP per state element per token: 32·128·128·7 = 3.7 MFLOP per token, 15 GFLOP at T=4096
//          (~1 ms at ~14 TFLOP/s fp32), and sequential in T: 4096 dependent steps.
//          chunked, per (chunk, value head): wy 1.2 MFLOP (K̂K̂ᵀ, Q̂K̂ᵀ, lower halves) + 1 MFLOP (the solve);
//          chunk scan 4.2 (U, X2) + 0.6 (P·U) + 2.1 (state) MFLOP; T=4096 (64 chunks × 32 heads): 19 GFLOP, 1.3×
//          the token-by-token form, on simdgroup matrices, and only 64 dependent steps.
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
//          one token (gdn_token, gdn_conv_token): threadgroup = value head (or key head with its NV/NK value heads,
//            with the conv), blocks of 8 state rows, one per simdgroup and pass; see "one decode token" below. Real
//            model: 32 threadgroups of 512 threads, or 16 (two passes) with the conv.
//          chunked scan, three dispatches: gdn_chunk_prep, one simdgroup per (token, key head); gdn_wy, threadgroup
//            = (chunk, value head), 8 simdgroups: the K̂K̂ᵀ / Q̂K̂ᵀ row tiles on simdgroup matrices, then one thread
//            per column of the triangular solve; gdn_chunk_scan, threadgroup = (value head, 32 state rows), 4
//            simdgroups each holding 8 state rows as DK/8 simdgroup_float8x8 for the whole call, the chunk's
//            products in transposed form (rows = state rows), operands loaded from device memory, y staged in
//            threadgroup memory. Real model: 32 heads × 4 row blocks = 128 threadgroups of 128 threads; wy T/64 × 32
//            threadgroups of 256. Threadgroup memory: wy 17.9 KB, chunk scan 13.3 KB.
// Checks   conv: C % 4 == 0, 1 ≤ K ≤ 9, x/out/state 8-byte aligned.  scan: DK ∈ {32, 64, 128}, DV % 16 == 0,
//          NV % NK == 0; chunked also DV % 32 == 0, DV + DK ≤ 256 (else token by token), Tp·C < 2^31.
//          norm: DV ≤ 256.  one token: DV % 8 == 0, DV ≤ 256 (with the conv NV/NK·DV ≤ 256, else the conv apart).
// Ref      cpu/gdn.cpp (conv, scan), cpu/norm.cpp (gdn_norm) · Test tests/metal/test_metal_ops.py
// History  v1 (this): scan structure of cuda/gdn.cu with the normalisation fused into the scan kernel (no scratch,
//          one dispatch); not yet timed on Apple hardware.  v1 + chunked prefill (port of cuda/gdn.cu's gdn_chunked,
//          which measured +9.6 % prefill at 4K on the H200; simdgroup matrices in fp32 where CUDA uses tf32 mma):
//          not yet timed on Apple hardware.  v1 + one decode token in one dispatch (port of cuda/gdn.cu's
//          gdn_prep_fused, gdn_norm_fused and gdn_conv_fused, +3.0, +2.2 and +1.7 % decode on the H200; the conv's
//          shared state by one threadgroup per key head where CUDA uses a cluster of two blocks): not yet timed on
//          Apple hardware.
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

// ---- chunked prefill (switch gdn_chunked) ---------------------------------------------------------------------------
// The delta rule in chunks of L = kGdnChunkL = 64 tokens (architecture.md §5, "Prefill algorithms"), as cuda/gdn.cu
// computes it: per value head and chunk, with λ_t = Σ_{s≤t} ln g_s inside the chunk (λ_t − λ_i ≤ 0 for i ≤ t),
//   A[t, i] = β_t·e^{λ_t−λ_i}·(k̂_t·k̂_i) (i < t),  W1 = (I + A)⁻¹·diag(β)·V,  W2 = (I + A)⁻¹·diag(β·e^λ)·K̂,
//   P[t, i] = e^{λ_t−λ_i}·(q̂_t·k̂_i) (i ≤ t)                                              (gdn_wy: all chunks at once)
// then chunk after chunk, with S [DV, DK] the state at the chunk's start (gdn_chunk_scan: sequential in chunks):
//   U = W1 − W2·Sᵀ;  Y = diag(e^λ)·Q̂·Sᵀ + P·U;  S ← e^{λ_L}·S + Uᵀ·diag(e^{λ_L−λ})·K̂.
// gdn_chunk_prep writes q̂, k̂ and the gates for Tp = nc·L tokens: the padding past T has g = 1 (ln g = 0), β = 0 and
// q̂ = k̂ = 0, so it changes nothing and no kernel after it needs a bound check on the chunk's tokens (v is read only
// for t < T). Every product runs on simdgroup_float8x8 matrices: fp32 operands and accumulation.

// One simdgroup per (token t < Tp, key head kh): q̂, k̂ into qk[kh, t] (q̂ then k̂, fp32), and the gates of the value
// heads kh·R .. kh·R + R − 1 into gates[h, t] = (g, β, k̂·q̂, ln g); zeros and (1, 0, 0, 0) for the padding t ≥ T.
template <int DK>
[[kernel]] void gdn_chunk_prep(constant GdnKernelArgs& args [[buffer(0)]],
                               device const ushort* c [[buffer(1)]],
                               device const ushort* b [[buffer(2)]],
                               device const ushort* alpha [[buffer(3)]],
                               device const float* A_log [[buffer(4)]],
                               device const float* dt_bias [[buffer(5)]],
                               device float* qk [[buffer(6)]],
                               device float4* gates [[buffer(7)]],
                               uint3 tg [[threadgroup_position_in_grid]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  constexpr int kPer = DK / 32;
  const int NK = args.NK, NV = args.NV, Tp = args.Tp, R = NV / NK;
  const int item = int(tg.x) * kGdnPrepSgs + int(sg);
  if (item >= Tp * NK) return;  // the whole simdgroup; no threadgroup barrier in this kernel
  const int t = item / NK, kh = item % NK;
  device float* out = qk + (kh * Tp + t) * (2 * DK);
  if (t >= args.T) {  // padding of the last chunk (uniform across the simdgroup)
    for (int m = 0; m < kPer; ++m) out[int(lane) + 32 * m] = out[DK + int(lane) + 32 * m] = 0.0f;
    for (int j = int(lane); j < R; j += 32) gates[(kh * R + j) * Tp + t] = float4(1.0f, 0.0f, 0.0f, 0.0f);
    return;
  }
  device const ushort* qr = c + t * args.C + kh * DK;
  device const ushort* kr = qr + NK * DK;
  float q[kPer], k[kPer], sq = 0.0f, sk = 0.0f;
  for (int m = 0; m < kPer; ++m) {
    q[m] = bf16_to_float(qr[int(lane) + 32 * m]);
    k[m] = bf16_to_float(kr[int(lane) + 32 * m]);
    sq += q[m] * q[m];
    sk += k[m] * k[m];
  }
  const float rq = (1.0f / sqrt(float(DK))) / sqrt(simd_sum(sq) + 1e-6f);  // q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK)
  const float rk = 1.0f / sqrt(simd_sum(sk) + 1e-6f);                      // k̂ = k / sqrt(Σk² + 1e-6)
  float kq = 0.0f;
  for (int m = 0; m < kPer; ++m) {
    q[m] *= rq;
    k[m] *= rk;
    out[int(lane) + 32 * m] = q[m];
    out[DK + int(lane) + 32 * m] = k[m];
    kq += k[m] * q[m];
  }
  kq = simd_sum(kq);
  for (int j = int(lane); j < R; j += 32) {
    const int h = kh * R + j;
    const float beta = sigmoid_f(bf16_to_float(b[t * NV + h]));  // β = σ(b)
    const float a = bf16_to_float(alpha[t * NV + h]) + dt_bias[h];
    const float softplus = max(a, 0.0f) + log(1.0f + exp(-fabs(a)));
    const float lng = -exp(A_log[h]) * softplus;  // ln g = −exp(A_log)·softplus(α + dt_bias), finite even if g = 0
    gates[h * Tp + t] = float4(exp(lng), beta, kq, lng);
  }
}

// Threadgroup = (chunk ch = tg.x, value head h = tg.y), 8 simdgroups. (1) Simdgroup 0: λ and β of the chunk (a simd
// prefix sum of ln g, two tokens per lane). (2) Simdgroup s: the row tile of tokens 8s .. 8s + 7 of K̂K̂ᵀ (→ A, in
// threadgroup memory) and of Q̂K̂ᵀ (→ P, in device memory), tiles j ≤ s only (both are lower triangular), operands
// loaded straight from qk. (3) Every thread scales its elements of A and P by their decays (zero above the diagonal).
// (4) Thread j solves column j of (I + A)·W = [diag(β)V | diag(β·e^λ)K̂] by forward substitution, w_t = b_t −
// Σ_{i<t} A[t, i]·w_i, the column in registers, and writes it to W1 (j < DV) or W2.
template <int DK>
[[kernel]] void gdn_wy(constant GdnKernelArgs& args [[buffer(0)]],
                       device const float* qk [[buffer(1)]],
                       device const float4* gates [[buffer(2)]],
                       device const ushort* c [[buffer(3)]],
                       device float* W1 [[buffer(4)]],
                       device float* W2 [[buffer(5)]],
                       device float* P [[buffer(6)]],
                       device float* lam [[buffer(7)]],
                       uint3 tg [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  constexpr int L = kGdnChunkL, LDA = kGdnWyLda, LDQ = 2 * DK;
  static_assert(kGdnWySgs * 8 == L, "one row tile of 8 tokens per simdgroup");
  threadgroup float sA[L * LDA];  // K̂K̂ᵀ, then A
  threadgroup float sLam[L];      // λ_t
  threadgroup float sBeta[L];     // β_t

  const int NV = args.NV, NK = args.NK, DV = args.DV, Tp = args.Tp;
  const int ch = int(tg.x), h = int(tg.y), kh = h / (NV / NK), t0 = ch * L;
  const int row0 = h * Tp + t0;                         // the chunk's first row in gates, lam, W1, W2
  device const float* Q = qk + (kh * Tp + t0) * LDQ;    // q̂ of chunk token t at Q[t·LDQ], k̂ at Q[t·LDQ + DK]
  device float* Pc = P + (h * args.nc + ch) * (L * L);  // P of this chunk, [L, L]

  if (sg == 0) {  // λ_t = Σ_{s≤t} ln g_s: lane l owns tokens 2l, 2l + 1
    const float4 g0 = gates[row0 + 2 * int(lane)], g1 = gates[row0 + 2 * int(lane) + 1];
    const float own = g0.w + g1.w;
    const float before = simd_prefix_inclusive_sum(own) - own;
    sLam[2 * lane] = before + g0.w;
    sLam[2 * lane + 1] = before + own;
    sBeta[2 * lane] = g0.y;
    sBeta[2 * lane + 1] = g1.y;
    lam[row0 + 2 * int(lane)] = before + g0.w;
    lam[row0 + 2 * int(lane) + 1] = before + own;
  }

  {  // K̂K̂ᵀ → sA, Q̂K̂ᵀ → P: row tile s = sg, column tiles j ≤ s
    const int s = int(sg);
    simdgroup_float8x8 kk[kGdnWySgs], qq[kGdnWySgs];
    for (int j = 0; j < kGdnWySgs; ++j) {
      if (j > s) continue;
      kk[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      qq[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (int d = 0; d < DK; d += 8) {
      simdgroup_float8x8 ak, aq;
      simdgroup_load(ak, Q + 8 * s * LDQ + DK + d, LDQ);  // K̂[8s .., d ..]
      simdgroup_load(aq, Q + 8 * s * LDQ + d, LDQ);       // Q̂[8s .., d ..]
      for (int j = 0; j < kGdnWySgs; ++j) {
        if (j > s) continue;
        simdgroup_float8x8 bt;
        simdgroup_load(bt, Q + 8 * j * LDQ + DK + d, LDQ, ulong2(0, 0), true);  // K̂[8j .., d ..]ᵀ
        simdgroup_multiply_accumulate(kk[j], ak, bt, kk[j]);
        simdgroup_multiply_accumulate(qq[j], aq, bt, qq[j]);
      }
    }
    for (int j = 0; j < kGdnWySgs; ++j) {
      if (j > s) continue;
      simdgroup_store(kk[j], sA + 8 * s * LDA + 8 * j, LDA);
      simdgroup_store(qq[j], Pc + 8 * s * L + 8 * j, L);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);

  for (int idx = int(tid); idx < L * L; idx += kGdnWyThreads) {  // decays; entries above the diagonal are never read
    const int t = idx / L, i = idx % L;
    const float decay = i <= t ? exp(sLam[t] - sLam[i]) : 0.0f;                   // e^{λ_t − λ_i}
    sA[t * LDA + i] = i < t ? sBeta[t] * decay * sA[t * LDA + i] : 0.0f;          // A[t, i] = β_t·e^{λ_t−λ_i}·k̂_t·k̂_i
    Pc[idx] = i <= t ? decay * Pc[idx] : 0.0f;                                     // P[t, i] = e^{λ_t−λ_i}·q̂_t·k̂_i
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Column j of W = (I + A)⁻¹·B, B = [diag(β)V | diag(β·e^λ)K̂]: w_t = b_t − Σ_{i<t} A[t, i]·w_i.
  const int v_col = 2 * NK * DK + h * DV;  // v[h, 0] in a row of c
  for (int j = int(tid); j < DV + DK; j += kGdnWyThreads) {
    const bool is_v = j < DV;
    float w[L];
    for (int t = 0; t < L; ++t) {
      float acc;
      if (is_v)
        acc = t0 + t < args.T ? sBeta[t] * bf16_to_float(c[(t0 + t) * args.C + v_col + j]) : 0.0f;
      else
        acc = sBeta[t] * exp(sLam[t]) * Q[t * LDQ + DK + (j - DV)];
      for (int i = 0; i < t; ++i) acc = fma(-sA[t * LDA + i], w[i], acc);
      w[t] = acc;
    }
    if (is_v)
      for (int t = 0; t < L; ++t) W1[(row0 + t) * DV + j] = w[t];
    else
      for (int t = 0; t < L; ++t) W2[(row0 + t) * DK + (j - DV)] = w[t];
  }
}

// Threadgroup = (value head h = tg.x, state rows r0 = kGdnCsRows·tg.y ..), 4 simdgroups; simdgroup s owns the state
// rows rs = r0 + 8s .. rs + 7 as DK/8 simdgroup matrices for the whole call (the state is read and written once).
// Chunk after chunk, in transposed form (rows = the simdgroup's state rows, columns = the chunk's tokens):
//   Uᵀ = W1ᵀ − S·W2ᵀ  and  X2ᵀ = S·Q̂ᵀ  (per 8-token tile m, K = DK);
//   Yᵀ = X2ᵀ·diag(e^λ) + Uᵀ·Pᵀ  (the tiles k ≤ m of Pᵀ; staged in threadgroup memory, written as bf16);
//   S ← S·e^{λ_L} + (Uᵀ·diag(e^{λ_L−λ}))·K̂  (K = L).
// The diagonal matrices come from 8×8 tiles in threadgroup memory; scalars scale through diagonal matrices, and the
// subtraction multiplies by −I, so every step is a simdgroup matrix operation.
template <int DK>
[[kernel]] void gdn_chunk_scan(constant GdnKernelArgs& args [[buffer(0)]],
                               device const float* qk [[buffer(1)]],
                               device const float* W1 [[buffer(2)]],
                               device const float* W2 [[buffer(3)]],
                               device const float* P [[buffer(4)]],
                               device const float* lam [[buffer(5)]],
                               device float* state [[buffer(6)]],
                               device ushort* y [[buffer(7)]],
                               uint3 tg [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int L = kGdnChunkL, ND = DK / 8, NT = L / 8, LDQ = 2 * DK, LDY = kGdnCsLdy;
  threadgroup float sE[NT * 64];   // tile m: diag(e^{λ_t}), t = 8m ..
  threadgroup float sD[NT * 64];   // tile m: diag(e^{λ_L − λ_t})
  threadgroup float sY[L * LDY];   // Y of the chunk, [token][row of the block]

  const int NV = args.NV, NK = args.NK, DV = args.DV, Tp = args.Tp;
  const int h = int(tg.x), kh = h / (NV / NK), r0 = kGdnCsRows * int(tg.y), rs = r0 + 8 * int(sg);

  simdgroup_float8x8 S[ND];  // state rows rs .., columns 8d ..
  for (int d = 0; d < ND; ++d) simdgroup_load(S[d], state + (h * DV + rs) * DK + 8 * d, DK);
  const simdgroup_float8x8 minus_one = simdgroup_float8x8(-1.0f);  // −I

  for (int ch = 0; ch < args.nc; ++ch) {
    const int t0 = ch * L, row0 = h * Tp + t0, nt = min(L, args.T - t0);
    device const float* Q = qk + (kh * Tp + t0) * LDQ;  // q̂ then k̂ of the chunk's tokens
    device const float* Pc = P + (h * args.nc + ch) * (L * L);
    const float lam_last = lam[row0 + L - 1];  // λ_L
    for (int idx = int(tid); idx < NT * 64; idx += kGdnCsThreads) {
      const int m = idx / 64, a = (idx / 8) % 8, b = idx % 8;
      const float l = lam[row0 + 8 * m + a];
      sE[idx] = a == b ? exp(l) : 0.0f;
      sD[idx] = a == b ? exp(lam_last - l) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    simdgroup_float8x8 U[NT];  // Uᵀ, token tile m
    for (int m = 0; m < NT; ++m) {
      simdgroup_float8x8 ws = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      simdgroup_float8x8 x2 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < ND; ++d) {
        simdgroup_float8x8 bt;
        simdgroup_load(bt, W2 + (row0 + 8 * m) * DK + 8 * d, DK, ulong2(0, 0), true);  // W2ᵀ[d, m]
        simdgroup_multiply_accumulate(ws, S[d], bt, ws);                                // S·W2ᵀ
        simdgroup_load(bt, Q + 8 * m * LDQ + 8 * d, LDQ, ulong2(0, 0), true);          // Q̂ᵀ[d, m]
        simdgroup_multiply_accumulate(x2, S[d], bt, x2);                                // X2ᵀ = S·Q̂ᵀ
      }
      simdgroup_float8x8 w1;
      simdgroup_load(w1, W1 + (row0 + 8 * m) * DV + rs, DV, ulong2(0, 0), true);  // W1ᵀ[rows, m]
      simdgroup_multiply_accumulate(U[m], ws, minus_one, w1);                      // Uᵀ = W1ᵀ − S·W2ᵀ
      simdgroup_float8x8 e, yt;
      simdgroup_load(e, sE + 64 * m, 8);
      simdgroup_multiply(yt, x2, e);  // X2ᵀ·diag(e^λ)
      for (int k = 0; k <= m; ++k) {  // + Uᵀ·Pᵀ, P[t, i] = 0 for i > t
        simdgroup_float8x8 pt;
        simdgroup_load(pt, Pc + 8 * m * L + 8 * k, L, ulong2(0, 0), true);  // Pᵀ[k, m]
        simdgroup_multiply_accumulate(yt, U[k], pt, yt);
      }
      simdgroup_store(yt, sY + 8 * m * LDY + 8 * int(sg), LDY, ulong2(0, 0), true);  // Y[tokens 8m .., rows]
    }

    for (int k = 0; k < NT; ++k) {  // Uᵀ·diag(e^{λ_L − λ})
      simdgroup_float8x8 dk, scaled;
      simdgroup_load(dk, sD + 64 * k, 8);
      simdgroup_multiply(scaled, U[k], dk);
      U[k] = scaled;
    }
    const simdgroup_float8x8 decay = simdgroup_float8x8(exp(lam_last));  // e^{λ_L}·I
    for (int n = 0; n < ND; ++n) {  // S ← S·e^{λ_L} + Uᵀ·diag(e^{λ_L−λ})·K̂
      simdgroup_float8x8 acc;
      simdgroup_multiply(acc, S[n], decay);
      for (int k = 0; k < NT; ++k) {
        simdgroup_float8x8 kt;
        simdgroup_load(kt, Q + 8 * k * LDQ + DK + 8 * n, LDQ);  // K̂[k, n]
        simdgroup_multiply_accumulate(acc, U[k], kt, acc);
      }
      S[n] = acc;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // Y complete
    for (int i = int(tid); i < nt * kGdnCsRows; i += kGdnCsThreads) {
      const int t = i / kGdnCsRows, r = i % kGdnCsRows;
      y[(t0 + t) * NV * DV + h * DV + r0 + r] = float_to_bf16(sY[t * LDY + r]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // sE, sD and sY are rewritten by the next chunk
  }
  for (int d = 0; d < ND; ++d) simdgroup_store(S[d], state + (h * DV + rs) * DK + 8 * d, DK);
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

// ---- one decode token: the layer in one dispatch (switches gdn_prep_fused, gdn_norm_fused, gdn_conv_fused) --------
// backend/policy.h (gdn_token_path) decides when it runs: T = 1 with gdn_prep_fused and gdn_norm_fused on. The scan of
// gdn_scan_heads for one token, then the gated norm of gdn_norm, in one threadgroup per head (gdn_token_dk*: the
// conv before it is gdn_conv's dispatch) or, with CONV (gdn_conv_fused), per key head with its R = NV/NK value heads
// (gdn_conv_token_dk*: the conv done here). Per key head, because both value heads read the q/k channels' conv state
// and one of them must write it: within one threadgroup each channel has one thread, which reads its old rows and
// writes the new ones, so no other threadgroup waits (Metal promises no forward progress between threadgroups, so the
// cluster barrier CUDA uses has no counterpart).
// Mapping: the threadgroup's rows (DV, or R·DV with CONV; ≤ kGdnTokMaxRows) in blocks of kGdnTokRowsPerSg = 8, a block
// per simdgroup and pass: at most kGdnTokSgs simdgroups (512 threads), block b = pass·sgs + sg, so the real model's
// key head (256 rows) takes two passes and holds 8 rows of state per lane at a time (32 floats at DK = 128): 1024
// threads holding all 256 rows would need ~60 registers each, more than an Apple core's register file gives a full
// threadgroup. (1) Threads i < 2·DK stage q_i and k_i of the key head in threadgroup memory: the conv output (CONV:
// computed from x, the taps and the old state rows, the new rows written at once) or c. Lanes j < 8 of each block load
// its row j's v (CONV: convolve it), z and norm weight. (2) After a barrier every simdgroup normalises q and k itself
// (simd_sum over its lanes' DK/32 values); per pass, its block's head's gates and the one-token recurrence on the
// block's rows (lane holds columns lane + 32·m, as gdn_scan_heads). (3) Σy² of each block (y rounded to bf16, as
// gdn_norm reads it) in threadgroup memory; after a second barrier each block adds its head's partials in order and
// lanes j < 8 write o = y / sqrt(mean(y²) + eps) · w · silu(z).
// Traffic: the scan's (state 2·NV·DV·DK·4 B) plus, with CONV, the conv's 0.26 MB; c (16 KB) and y's round trip (two
// 8 KB writes and reads) are gone. Real model: 32 threadgroups of 512 threads, or 16 with CONV.

// One channel of a decode token's conv (gdn_conv's sum for T = 1): U = [state rows 0..K−2; x], returns
// bf16(silu(Σ_k w[ch, k]·U[k])) as gdn_conv stores it, and shifts the channel's state: row r ← U[r + 1].
inline float conv_token(device const ushort* x, device const float* w, device ushort* conv_state, int ch, int C,
                        int K) {
  ushort u[kGdnConvMaxK];
  for (int k = 0; k < kGdnConvMaxK; ++k)
    if (k < K) u[k] = k < K - 1 ? conv_state[k * C + ch] : x[ch];
  float acc = 0.0f;
  for (int k = 0; k < kGdnConvMaxK; ++k)
    if (k < K) acc += w[ch * K + k] * bf16_to_float(u[k]);
  for (int r = 0; r < kGdnConvMaxK - 1; ++r)
    if (r < K - 1) conv_state[r * C + ch] = u[r + 1];
  return bf16_to_float(float_to_bf16(silu_f(acc)));
}

template <int DK, bool CONV>
[[kernel, max_total_threads_per_threadgroup(512)]] void gdn_token(constant GdnKernelArgs& args [[buffer(0)]],
                                                                   device const ushort* in [[buffer(1)]],
                                                                   device const float* conv_w [[buffer(2)]],
                                                                   device ushort* conv_state [[buffer(3)]],
                                                                   device const ushort* b [[buffer(4)]],
                                                                   device const ushort* alpha [[buffer(5)]],
                                                                   device const float* A_log [[buffer(6)]],
                                                                   device const float* dt_bias [[buffer(7)]],
                                                                   device float* state [[buffer(8)]],
                                                                   device const ushort* z [[buffer(9)]],
                                                                   device const float* norm_w [[buffer(10)]],
                                                                   device ushort* out [[buffer(11)]],
                                                                   uint3 tg [[threadgroup_position_in_grid]],
                                                                   uint tid [[thread_index_in_threadgroup]],
                                                                   uint sg [[simdgroup_index_in_threadgroup]],
                                                                   uint lane [[thread_index_in_simdgroup]]) {
  constexpr int kPer = DK / 32, kRows = kGdnTokRowsPerSg, kPasses = kGdnTokMaxRows / (kRows * kGdnTokSgs);
  static_assert(kGdnTokMaxRows % (kRows * kGdnTokSgs) == 0, "whole passes");
  threadgroup float s_qk[2 * kGdnScanMaxDK];       // q then k of the key head, before the norms
  threadgroup float s_ss[kGdnTokMaxRows / kGdnTokRowsPerSg];  // Σy² of each block's rows

  const int NK = args.NK, NV = args.NV, DV = args.DV, C = args.C, R = NV / NK;
  const int per_head = DV / kRows, blocks = (CONV ? R : 1) * per_head;  // row blocks per head, per threadgroup
  const int sgs = min(blocks, int(kGdnTokSgs)), threads = 32 * sgs;
  const int h0 = CONV ? int(tg.x) * R : int(tg.x), kh = h0 / R;  // the threadgroup's first value head; key head

  // (1) The stage, and each block's row values.
  for (int i = int(tid); i < 2 * DK; i += threads) {
    const int ch = (i < DK ? kh * DK : (NK + kh) * DK - DK) + i;
    s_qk[i] = CONV ? conv_token(in, conv_w, conv_state, ch, C, args.K) : bf16_to_float(in[ch]);
  }
  float vl[kPasses], zl[kPasses], wl[kPasses];  // lane j < kRows: row j of block pass·sgs + sg
  for (int p = 0; p < kPasses; ++p) {
    const int blk = p * sgs + int(sg);
    vl[p] = zl[p] = wl[p] = 0.0f;
    if (blk < blocks && int(lane) < kRows) {
      const int h = h0 + blk / per_head, row = (blk % per_head) * kRows + int(lane);
      const int ch = 2 * NK * DK + h * DV + row;
      vl[p] = CONV ? conv_token(in, conv_w, conv_state, ch, C, args.K) : bf16_to_float(in[ch]);
      zl[p] = bf16_to_float(z[h * DV + row]);
      wl[p] = norm_w[row];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // (2) q̂, k̂, then per pass the recurrence on the block's rows.
  float q[kPer], k[kPer], sq = 0.0f, sk = 0.0f;
  for (int m = 0; m < kPer; ++m) {
    q[m] = s_qk[int(lane) + 32 * m];
    k[m] = s_qk[DK + int(lane) + 32 * m];
    sq += q[m] * q[m];
    sk += k[m] * k[m];
  }
  const float rq = (1.0f / sqrt(float(DK))) / sqrt(simd_sum(sq) + 1e-6f);  // q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK)
  const float rk = 1.0f / sqrt(simd_sum(sk) + 1e-6f);                      // k̂ = k / sqrt(Σk² + 1e-6)
  float kq = 0.0f;
  for (int m = 0; m < kPer; ++m) {
    q[m] *= rq;
    k[m] *= rk;
    kq += k[m] * q[m];
  }
  kq = simd_sum(kq);
  float yl[kPasses];  // lane j < kRows: bf16(y) of row j of the pass's block
  for (int p = 0; p < kPasses; ++p) {
    const int blk = p * sgs + int(sg);
    yl[p] = 0.0f;
    if (blk >= blocks) continue;  // uniform across the simdgroup
    const int h = h0 + blk / per_head, row0 = (blk % per_head) * kRows;
    device float* Sh = state + (h * DV + row0) * DK + int(lane);
    float S[kRows][kPer];
    for (int r = 0; r < kRows; ++r)
      for (int m = 0; m < kPer; ++m) S[r][m] = Sh[r * DK + 32 * m];
    const float beta = sigmoid_f(bf16_to_float(b[h]));  // β = σ(b)
    const float a = bf16_to_float(alpha[h]) + dt_bias[h];
    const float softplus = max(a, 0.0f) + log(1.0f + exp(-fabs(a)));
    const float g = exp(-exp(A_log[h]) * softplus);  // g = exp(−exp(A_log)·softplus(α + dt_bias))
    float ss = 0.0f;
    for (int r = 0; r < kRows; ++r) {
      float ak = 0.0f, aq = 0.0f;
      for (int m = 0; m < kPer; ++m) {
        ak += S[r][m] * k[m];  // S_i·k̂ (old S)
        aq += S[r][m] * q[m];  // S_i·q̂ (old S)
      }
      ak = simd_sum(ak);
      aq = simd_sum(aq);
      const float delta = beta * (simd_shuffle(vl[p], ushort(r)) - g * ak);  // δ = β·(v − (g·S)·k̂)
      for (int m = 0; m < kPer; ++m) S[r][m] = fma(S[r][m], g, delta * k[m]);  // S ← g·S + δ ⊗ k̂
      const float y = bf16_to_float(float_to_bf16(g * aq + delta * kq));  // y = (g·S + δ⊗k̂)·q̂, as gdn_norm reads
      ss += y * y;
      if (int(lane) == r) yl[p] = y;
    }
    for (int r = 0; r < kRows; ++r)
      for (int m = 0; m < kPer; ++m) Sh[r * DK + 32 * m] = S[r][m];
    if (lane == 0) s_ss[blk] = ss;
  }

  // (3) The gated norm over each head's DV rows.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int p = 0; p < kPasses; ++p) {
    const int blk = p * sgs + int(sg);
    if (blk >= blocks) continue;
    const int first = blk - blk % per_head, h = h0 + blk / per_head, row = (blk % per_head) * kRows + int(lane);
    float tot = 0.0f;
    for (int i = 0; i < per_head; ++i) tot += s_ss[first + i];
    const float rs = 1.0f / sqrt(tot / float(DV) + args.eps);  // 1 / sqrt(mean(y²) + eps)
    if (int(lane) < kRows) out[h * DV + row] = float_to_bf16(yl[p] * rs * wl[p] * silu_f(zl[p]));
  }
}

// ---- instantiations (host names used by csrc/backend/metal/gdn.cpp) -------------------------------------------------

template [[host_name("gdn_scan_dk32")]] [[kernel]] decltype(gdn_scan_heads<32>) gdn_scan_heads<32>;
template [[host_name("gdn_scan_dk64")]] [[kernel]] decltype(gdn_scan_heads<64>) gdn_scan_heads<64>;
template [[host_name("gdn_scan_dk128")]] [[kernel]] decltype(gdn_scan_heads<128>) gdn_scan_heads<128>;
template [[host_name("gdn_chunk_prep_dk32")]] [[kernel]] decltype(gdn_chunk_prep<32>) gdn_chunk_prep<32>;
template [[host_name("gdn_chunk_prep_dk64")]] [[kernel]] decltype(gdn_chunk_prep<64>) gdn_chunk_prep<64>;
template [[host_name("gdn_chunk_prep_dk128")]] [[kernel]] decltype(gdn_chunk_prep<128>) gdn_chunk_prep<128>;
template [[host_name("gdn_wy_dk32")]] [[kernel]] decltype(gdn_wy<32>) gdn_wy<32>;
template [[host_name("gdn_wy_dk64")]] [[kernel]] decltype(gdn_wy<64>) gdn_wy<64>;
template [[host_name("gdn_wy_dk128")]] [[kernel]] decltype(gdn_wy<128>) gdn_wy<128>;
template [[host_name("gdn_chunk_scan_dk32")]] [[kernel]] decltype(gdn_chunk_scan<32>) gdn_chunk_scan<32>;
template [[host_name("gdn_chunk_scan_dk64")]] [[kernel]] decltype(gdn_chunk_scan<64>) gdn_chunk_scan<64>;
template [[host_name("gdn_chunk_scan_dk128")]] [[kernel]] decltype(gdn_chunk_scan<128>) gdn_chunk_scan<128>;
template [[host_name("gdn_token_dk32")]] [[kernel]] decltype(gdn_token<32, false>) gdn_token<32, false>;
template [[host_name("gdn_token_dk64")]] [[kernel]] decltype(gdn_token<64, false>) gdn_token<64, false>;
template [[host_name("gdn_token_dk128")]] [[kernel]] decltype(gdn_token<128, false>) gdn_token<128, false>;
template [[host_name("gdn_conv_token_dk32")]] [[kernel]] decltype(gdn_token<32, true>) gdn_token<32, true>;
template [[host_name("gdn_conv_token_dk64")]] [[kernel]] decltype(gdn_token<64, true>) gdn_token<64, true>;
template [[host_name("gdn_conv_token_dk128")]] [[kernel]] decltype(gdn_token<128, true>) gdn_token<128, true>;
