// forward.cpp: the whole forward pass of Qwen3.6-35B-A3B, top to bottom (architecture.md §2), and the session
// state it runs on. It calls Backend ops only: no kernel code, no backend #ifdef, no allocation once a
// session's buffers are sized.
//
//   x ← Embed[token]
//   for each layer:  x ← x + Mixer(RMSNorm(x))      Mixer = GatedAttention (every 4th layer) or GatedDeltaNet
//                    x ← x + MoE(RMSNorm(x))
//   logits ← RMSNorm(x) · W_lmᵀ
#include <algorithm>
#include <cstring>

#include "core/common.h"
#include "model/model.h"

namespace lily {

Model::Model(const Config& cfg, const TensorMap& tensors, const std::string& backend, const Optimisations& opts)
    : cfg_(cfg) {
  cfg_.validate();  // before anything is sized from the config
  be_ = std::make_shared<SharedBackend>();
  be_->backend = make_backend(backend);
  be_->backend->set_optimisations(opts);
  fingerprint_ = lily::fingerprint(cfg_, tensors);
  w_ = bind_weights(cfg_, tensors, *be_->backend);
}

Model::~Model() {
  std::lock_guard<std::recursive_mutex> lock(be_->lock);
  for (void* p : w_.owned) be_->backend->release(p);
}

StateMemory::StateMemory(std::shared_ptr<SharedBackend> be, size_t bytes) : size_(bytes) {
  try {
    std::lock_guard<std::recursive_mutex> lock(be->lock);
    device_ = be->backend->alloc_state(std::max<size_t>(bytes, 1));
    be_ = std::move(be);
  } catch (const std::bad_alloc&) {  // no room on the device: the host holds it
    host_.resize(bytes);
  }
}

StateMemory::StateMemory(std::vector<uint8_t> host) : host_(std::move(host)), size_(host_.size()) {}

StateMemory::~StateMemory() {
  if (!device_) return;
  std::lock_guard<std::recursive_mutex> lock(be_->lock);
  try {
    be_->backend->release_state(device_);
  } catch (...) {  // a destructor must not throw; the memory goes with the backend
  }
}

void StateMemory::read(size_t at, void* dst, size_t n) const {
  LILY_ASSERT(at <= size_ && n <= size_ - at, "StateMemory::read out of bounds");
  if (!n) return;
  if (!device_) {
    std::memcpy(dst, host_.data() + at, n);
    return;
  }
  std::lock_guard<std::recursive_mutex> lock(be_->lock);
  be_->backend->to_host(dst, static_cast<const uint8_t*>(device_) + at, n);
}

namespace {
constexpr char kSnapshotMagic[8] = {'L', 'I', 'L', 'Y', 'S', 'N', 'A', 'P'};
// 1: no fingerprint (refused: a snapshot that cannot say which model made it is not restored). 2: fingerprint.
// 3: the tokens the state holds.
constexpr uint32_t kSnapshotVersion = 3;
constexpr uint32_t kMaxFingerprintBytes = 256;

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}
}  // namespace

// Layout on the wire: magic, version u32, fingerprint (u32 size, bytes), pos i32, tokens (pos × i32), then three
// groups (KV per attention layer, conv per GDN layer, recurrent per GDN layer), each a u64 count of blobs, every
// blob a u64 size and its bytes.
std::vector<uint8_t> Snapshot::serialize() const {
  std::vector<uint8_t> out(kSnapshotMagic, kSnapshotMagic + 8);
  out.reserve(nbytes() + 64 + fingerprint.size() + 4 * tokens.size() + 8 * (attn_layers + 2 * gdn_layers));
  put(out, kSnapshotVersion);
  put(out, uint32_t(fingerprint.size()));
  out.insert(out.end(), fingerprint.begin(), fingerprint.end());
  put(out, int32_t(pos));
  for (int32_t t : tokens) put(out, t);
  auto blob = [&](size_t at, size_t n) {
    put(out, uint64_t(n));
    const size_t end = out.size();
    out.resize(end + n);
    memory->read(at, out.data() + end, n);
  };
  put(out, uint64_t(attn_layers));
  for (int l = 0; l < attn_layers; ++l) blob(kv_offset(l), kv_bytes());
  put(out, uint64_t(gdn_layers));
  for (int l = 0; l < gdn_layers; ++l) blob(gdn_offset(l), conv_bytes);
  put(out, uint64_t(gdn_layers));
  for (int l = 0; l < gdn_layers; ++l) blob(gdn_offset(l) + conv_bytes, rec_bytes);
  return out;
}

Snapshot Snapshot::deserialize(const uint8_t* data, size_t n) {
  size_t at = 0;
  auto take = [&](void* dst, size_t k) {
    LILY_CHECK(k <= n - at, "snapshot data is truncated (", n, " bytes)");
    std::memcpy(dst, data + at, k);
    at += k;
  };
  char magic[8];
  take(magic, 8);
  LILY_CHECK(std::memcmp(magic, kSnapshotMagic, 8) == 0, "not a Lily snapshot (bad magic)");
  uint32_t version;
  take(&version, 4);
  LILY_CHECK(version != 1, "snapshot format version 1 is no longer supported: it does not record which model made "
             "it (make the snapshot again)");
  LILY_CHECK(version != 2, "snapshot format version 2 is no longer supported: it does not record the tokens the state "
             "holds (make the snapshot again)");
  LILY_CHECK(version == kSnapshotVersion, "snapshot format version ", version, " is not supported (expected ",
             kSnapshotVersion, ")");
  Snapshot s;
  uint32_t fp_bytes;
  take(&fp_bytes, 4);
  LILY_CHECK(fp_bytes <= kMaxFingerprintBytes, "snapshot data is corrupt (a model fingerprint of ", fp_bytes,
             " bytes)");
  s.fingerprint.resize(fp_bytes);
  take(s.fingerprint.data(), fp_bytes);
  int32_t pos;
  take(&pos, 4);
  LILY_CHECK(pos >= 0 && size_t(pos) <= (n - at) / 4, "snapshot data is corrupt (a position of ", pos, ")");
  s.pos = pos;
  s.tokens.resize(size_t(pos));
  take(s.tokens.data(), 4 * size_t(pos));
  // Three groups of blobs; every blob of a group has the same size (the layout above), checked before copying.
  size_t sizes[3] = {0, 0, 0};
  uint64_t counts[3];
  std::vector<std::pair<size_t, size_t>> blobs;  // (offset in data, size), group by group
  for (int g = 0; g < 3; ++g) {
    take(&counts[g], 8);
    LILY_CHECK(counts[g] <= uint64_t(kMaxLayers), "snapshot data is corrupt (", counts[g], " blobs)");
    for (uint64_t i = 0; i < counts[g]; ++i) {
      uint64_t size;
      take(&size, 8);
      LILY_CHECK(size <= n - at, "snapshot data is truncated (", n, " bytes)");
      LILY_CHECK(i == 0 || size == sizes[g], "snapshot data is corrupt (layers of different sizes)");
      sizes[g] = size;
      blobs.emplace_back(at, size);
      at += size;
    }
  }
  LILY_CHECK(at == n, "snapshot data has ", n - at, " trailing bytes");
  LILY_CHECK(counts[1] == counts[2], "snapshot data is corrupt (", counts[1], " conv states, ", counts[2],
             " recurrent states)");
  LILY_CHECK(pos == 0 ? sizes[0] == 0 : sizes[0] % (2 * size_t(pos)) == 0, "snapshot data is corrupt (KV rows of ",
             sizes[0], " bytes for ", pos, " tokens)");
  s.attn_layers = int(counts[0]);
  s.gdn_layers = int(counts[1]);
  s.kv_row_bytes = pos ? sizes[0] / (2 * size_t(pos)) : 0;
  s.conv_bytes = sizes[1];
  s.rec_bytes = sizes[2];
  // Into the layout: the KV layers, then the conv and recurrent state of each GDN layer side by side.
  std::vector<uint8_t> memory(size_t(s.attn_layers) * s.kv_bytes() +
                              size_t(s.gdn_layers) * (s.conv_bytes + s.rec_bytes));
  for (int l = 0; l < s.attn_layers; ++l)
    std::memcpy(memory.data() + s.kv_offset(l), data + blobs[l].first, s.kv_bytes());
  for (int l = 0; l < s.gdn_layers; ++l) {
    std::memcpy(memory.data() + s.gdn_offset(l), data + blobs[s.attn_layers + l].first, s.conv_bytes);
    std::memcpy(memory.data() + s.gdn_offset(l) + s.conv_bytes, data + blobs[s.attn_layers + s.gdn_layers + l].first,
                s.rec_bytes);
  }
  s.memory = std::make_shared<StateMemory>(std::move(memory));
  return s;
}

Session::Session(const Model& model, int max_context, int prefill_chunk)
    : model_(model),
      be_(model.backend()),
      max_context_(max_context),
      chunk_(prefill_chunk ? prefill_chunk : model.backend().default_prefill_chunk()) {
  const Config& c = model.config();
  LILY_CHECK(max_context > 0 && max_context <= c.max_position_embeddings, "max_context must be in 1..",
             c.max_position_embeddings, " (max_position_embeddings), got ", max_context);
  LILY_CHECK(prefill_chunk >= 0, "prefill_chunk must be positive (or 0 for the backend's default), got ",
             prefill_chunk);
  Hold hold(*this);
  const int64_t conv_raw = int64_t(c.linear_conv_kernel_dim - 1) * c.conv_dim() * be_.act_bytes();
  const size_t conv_bytes = size_t(ceil_div(conv_raw, 256)) * 256;  // the recurrent state after it stays aligned
  const size_t rec_bytes = size_t(c.linear_num_value_heads) * c.linear_value_head_dim * c.linear_key_head_dim * 4;
  const int gdn_layers = c.num_hidden_layers - c.num_full_attention_layers();
  if (gdn_layers > 0) {
    gdn_state_bytes_ = size_t(gdn_layers) * (conv_bytes + rec_bytes);
    gdn_state_ = be_.alloc(gdn_state_bytes_);
    auto* at = static_cast<uint8_t*>(gdn_state_);
    for (int l = 0; l < gdn_layers; ++l, at += conv_bytes + rec_bytes) {
      conv_.push_back(at);
      rec_.push_back(reinterpret_cast<float*>(at + conv_bytes));
    }
  }
  kv_.assign(c.num_full_attention_layers(), nullptr);
  k_cache_.assign(c.num_full_attention_layers(), nullptr);
  v_cache_.assign(c.num_full_attention_layers(), nullptr);
  pos_dev_ = static_cast<int32_t*>(be_.alloc(sizeof(int32_t)));
  reset();
}

Session::Hold::Hold(const Session& s) : s_(s) {
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id none;
  if (!s.holder_.compare_exchange_strong(none, me, std::memory_order_acquire) && none != me)
    throw SessionConflict(
        "this session is in use by another thread: a session holds one conversation and is never shared "
        "(give each thread its own session, or serialise the calls with a lock)");
  ++s.holds_;
  backend_ = std::unique_lock<std::recursive_mutex>(s.model_.backend_lock());
}

Session::Hold::~Hold() {
  backend_.unlock();
  if (--s_.holds_ == 0) s_.holder_.store(std::thread::id(), std::memory_order_release);
}

Session::~Session() {
  std::lock_guard<std::recursive_mutex> lock(model_.backend_lock());  // another session may be computing
  for (auto* group : {&kv_, &work_})
    for (void* p : *group) be_.release(p);
  be_.release(gdn_state_);
  be_.release(logits_);
}

void Session::reset() {
  Hold hold(*this);
  changed();
  if (gdn_state_) be_.zero(gdn_state_, gdn_state_bytes_);
  pos_ = 0;
  tokens_.clear();
  pos_dev_valid_ = false;
}

void Session::check_room(int n) const {
  const int pos = pos_;
  LILY_CHECK(n >= 0 && int64_t(pos) + n <= max_context_, "prompt of ", n, " tokens",
             pos ? cat(" (after ", pos, " tokens already in the session)") : std::string(),
             " exceeds the context limit of ", max_context_, " tokens");
}

void Session::reserve_kv(int rows) {
  if (rows <= kv_cap_) return;
  const Config& c = model_.config();
  // Whole 256-row steps, and at least a quarter more than before, so that token-by-token growth copies rarely
  // (a generation reserves its prompt and max_tokens up front: Session::reserve).
  const int cap = std::min<int64_t>(
      max_context_, std::max<int64_t>(ceil_div(rows, 256) * 256, int64_t(kv_cap_) + int64_t(kv_cap_) / 4));
  const size_t row_bytes = size_t(c.num_key_value_heads) * c.head_dim * be_.act_bytes();
  const size_t half = size_t(ceil_div(int64_t(cap) * row_bytes, 256)) * 256;
  // One allocation per layer, K then V, grown layer by layer (the old and new caches of one layer at a time).
  for (size_t l = 0; l < kv_.size(); ++l) {
    auto* grown = static_cast<uint8_t*>(be_.alloc(2 * half));
    if (kv_[l]) {
      be_.copy(grown, k_cache_[l], size_t(pos_) * row_bytes);
      be_.copy(grown + half, v_cache_[l], size_t(pos_) * row_bytes);
      be_.release(kv_[l]);
    }
    kv_[l] = grown;
    k_cache_[l] = grown;
    v_cache_[l] = grown + half;
  }
  kv_cap_ = cap;
}

void Session::reserve_work(int T) {
  if (T <= work_T_) return;
  for (void* p : work_) be_.release(p);
  work_.clear();
  const Config& c = model_.config();
  const size_t ab = be_.act_bytes(), t = size_t(T);
  auto take = [&](size_t bytes) { work_.push_back(be_.alloc(bytes)); return work_.back(); };
  const size_t NH = c.num_attention_heads, NKV = c.num_key_value_heads, HD = c.head_dim, NV = c.linear_num_value_heads;
  tok_ = take(t * sizeof(int32_t));
  x_ = static_cast<float*>(take(t * c.hidden_size * sizeof(float)));
  a_ = take(t * c.hidden_size * ab);
  d_ = take(t * c.hidden_size * ab);
  qg_x_ = take(t * std::max<size_t>(c.conv_dim(), 2 * NH * HD) * ab);
  k_z_ = take(t * std::max<size_t>(c.value_dim(), NKV * HD) * ab);
  v_b_ = take(t * std::max<size_t>(NV, NKV * HD) * ab);
  attn_alpha_ = take(t * std::max<size_t>(NV, NH * HD) * ab);
  conv_out_ = take(t * c.conv_dim() * ab);
  y_ = take(t * c.value_dim() * ab);
  work_T_ = T;
}

void Session::mixer_attention(const LayerWeights& L, int T, void* k_cache, void* v_cache, bool device_pos) {
  const Config& c = model_.config();
  AttnArgs a{T, pos_, kv_cap_, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim(),
             float(c.rope_theta), float(c.rms_norm_eps), device_pos ? pos_dev_ : nullptr};
  const QMatrix proj[3] = {L.q_proj, L.k_proj, L.v_proj};
  void* const out[3] = {qg_x_, k_z_, v_b_};  // qg [T, NH, 2·HD], k [T, NKV·HD], v [T, NKV·HD]
  be_.rms_norm_qmm(x_, L.input_norm, float(c.rms_norm_eps), proj, 3, T, a_, out, false);  // a = pre-norm(x)
  be_.attention(a, qg_x_, k_z_, v_b_, L.q_norm, L.k_norm, k_cache, v_cache, attn_alpha_);  // [T, NH·HD], gated
}

void Session::mixer_gdn(const LayerWeights& L, int T, void* conv_state, float* rec_state, int cut, Snapshot* save,
                        int gdn) {
  const Config& c = model_.config();
  GdnArgs a{T, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim, float(c.rms_norm_eps)};
  const QMatrix proj[4] = {L.in_proj_qkv, L.in_proj_z, L.in_proj_b, L.in_proj_a};
  void* const out[4] = {qg_x_, k_z_, v_b_, attn_alpha_};  // X [T, conv_dim], z [T, NV·DV], b [T, NV], α [T, NV]
  be_.rms_norm_qmm(x_, L.input_norm, a.eps, proj, 4, T, a_, out, false);  // a = pre-norm(x)
  if (!cut) {
    // C = silu(conv(X)), then y [T, NV, DV] and o = gated_norm(y) [T, NV·DV] in y_
    be_.gdn_conv_scan_norm(a, qg_x_, L.conv1d, conv_state, conv_out_, v_b_, attn_alpha_, L.A_log, L.dt_bias,
                           rec_state, k_z_, L.gdn_norm, y_);
  } else {  // the same in two parts, tokens [0, cut) and [cut, T), the state after the first saved between them
    const size_t ab = be_.act_bytes(), C = c.conv_dim(), NV = a.NV, Y = size_t(a.NV) * a.DV;
    auto row = [&](void* p, size_t width, int t) { return static_cast<uint8_t*>(p) + size_t(t) * width * ab; };
    GdnArgs a1 = a, a2 = a;
    a1.T = cut;
    a2.T = T - cut;
    be_.gdn_conv(a1, qg_x_, L.conv1d, conv_state, conv_out_);
    save_bytes(*save, save->gdn_offset(gdn), conv_state, save->conv_bytes);
    be_.gdn_conv(a2, row(qg_x_, C, cut), L.conv1d, conv_state, row(conv_out_, C, cut));
    be_.gdn_scan(a1, conv_out_, v_b_, attn_alpha_, L.A_log, L.dt_bias, rec_state, y_);
    save_bytes(*save, save->gdn_offset(gdn) + save->conv_bytes, rec_state, save->rec_bytes);
    be_.gdn_scan(a2, row(conv_out_, C, cut), row(v_b_, NV, cut), row(attn_alpha_, NV, cut), L.A_log, L.dt_bias,
                 rec_state, row(y_, Y, cut));
    be_.gdn_norm(a, y_, k_z_, L.gdn_norm, y_);  // o [T, NV·DV], in place
  }
}

void Session::forward(const int32_t* tokens, int T, Logits mode, float* logits, bool device_pos) {
  const Config& c = model_.config();
  const Weights& W = model_.weights();
  const int H = c.hidden_size;
  const float eps = float(c.rms_norm_eps);
  reserve_work(T);
  reserve_kv(pos_ + T);
  if (tokens) be_.to_device(tok_, tokens, size_t(T) * sizeof(int32_t));
  if (!device_pos) pos_dev_valid_ = false;
  // save_at inside this call: the state after `cut` of its tokens is saved on the way (the KV rows after the layers)
  if (tokens) save_if_at();
  const int cut = tokens && save_pos_ > pos_ && save_pos_ < pos_ + T ? save_pos_ - pos_ : 0;
  std::optional<Snapshot> part;
  if (cut) {
    std::vector<int32_t> held = tokens_;
    held.insert(held.end(), tokens, tokens + cut);
    part = snapshot_layout(save_pos_, std::move(held));
  }
  be_.embed(W.embed, static_cast<const int32_t*>(tok_), T, x_);
  int attn_i = 0, gdn_i = 0;
  for (size_t il = 0; il < W.layers.size(); ++il) {
    const LayerWeights& L = W.layers[il];
    if (L.full_attention) {
      mixer_attention(L, T, k_cache_[attn_i], v_cache_[attn_i], device_pos);
      ++attn_i;
    } else {
      mixer_gdn(L, T, conv_[gdn_i], rec_[gdn_i], cut, part ? &*part : nullptr, gdn_i);
      ++gdn_i;
    }
    MoeArgs m{T, H, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
              c.shared_expert_intermediate_size, c.norm_topk_prob};
    // x += the mixer's output projection; x += MoE(post-norm(x))
    if (L.full_attention)
      be_.moe_residual(x_, L.o_proj, attn_alpha_, L.post_norm, eps, m, L.moe, a_, d_);
    else
      be_.moe_residual(x_, L.out_proj, y_, L.post_norm, eps, m, L.moe, a_, d_);
  }
  if (part) {
    save_kv(*part);  // rows below the cut: final once the layers ran
    saved_ = std::move(part);
    save_pos_ = -1;
  }
  pos_ += T;
  processed_ += T;
  if (tokens) tokens_.insert(tokens_.end(), tokens, tokens + T);  // a device decode step's token: Generator::token_fed
  if (tokens) save_if_at();
  if (mode == Logits::None) return;
  const size_t V = c.vocab_size;
  const int rows = mode == Logits::All ? T : 1;
  if (rows > logits_rows_) {  // [rows, V] fp32: one row for generation, a chunk's worth for teacher forcing
    be_.release(logits_);
    logits_ = be_.alloc(size_t(rows) * V * sizeof(float));
    logits_rows_ = rows;
  }
  if (mode == Logits::All) {
    be_.rms_norm_qmm(x_, W.final_norm, eps, &W.lm_head, 1, T, a_, &logits_, true);
    be_.to_host(logits, logits_, size_t(T) * V * sizeof(float));
  } else {  // the last token's row only
    be_.rms_norm_qmm(x_ + size_t(T - 1) * H, W.final_norm, eps, &W.lm_head, 1, 1, a_, &logits_, true);
    if (mode == Logits::Last) be_.to_host(logits, logits_, V * sizeof(float));
  }
}

void Session::reserve(int tokens) {
  Hold hold(*this);
  LILY_CHECK(tokens >= 0, "reserve: ", tokens, " tokens");
  reserve_kv(int(std::min<int64_t>(int64_t(pos_) + tokens, max_context_)));
}

int32_t* Session::token_buffer() {
  Hold hold(*this);
  changed();
  reserve_work(1);
  return static_cast<int32_t*>(tok_);
}

void Session::chunk_done(const ChunkHook& hook, int done, int total) {
  if (!hook || done == total) return;
  be_.sync();  // the chunk is complete: what the hook reports, and where an interrupt leaves the state
  hook(done, total);
}

namespace {
// The end of a prefill, also by an exception: a save_at request it did not reach lapses.
struct SaveLapses {
  int& pos;
  ~SaveLapses() { pos = -1; }
};
}  // namespace

void Session::prefill_device(const int32_t* tokens, int n, const ChunkHook& hook) {
  Hold hold(*this);
  SaveLapses lapses{save_pos_};
  LILY_CHECK(n >= 1, "prefill needs at least one token");
  check_room(n);
  check_tokens(tokens, n);
  changed();
  reserve_kv(pos_ + n);
  for (int i = 0; i < n; i += chunk_) {
    const int T = std::min(chunk_, n - i);
    forward(tokens + i, T, i + T == n ? Logits::Device : Logits::None, nullptr);
    chunk_done(hook, i + T, n);
  }
}

void Session::sample_device(const SamplingParams& p, int n_valid, const DeviceSampler& st) {
  Hold hold(*this);
  changed();
  be_.sample(p, n_valid, static_cast<const float*>(logits_), st);
}

void Session::decode_device(const SamplingParams& p, int n_valid, const DeviceSampler& st, uint64_t key) {
  Hold hold(*this);
  check_room(1);
  changed();
  reserve_work(1);
  reserve_kv(pos_ + 1);  // may reallocate the caches (and so drop recorded units) before recording
  if (!pos_dev_valid_) {
    const int32_t pos = pos_;
    be_.to_device(pos_dev_, &pos, sizeof(int32_t));
    pos_dev_valid_ = true;
  }
  if (logits_rows_ < 1) {
    be_.release(logits_);
    logits_ = be_.alloc(size_t(model_.config().vocab_size) * sizeof(float));
    logits_rows_ = 1;
  }
  DeviceSampler advancing = st;
  advancing.pos = pos_dev_;
  const int pos = pos_;
  const int64_t processed = processed_;
  be_.replay(key * 0x9E3779B97F4A7C15ull + uint64_t(kv_cap_), [&] {
    pos_ = pos;  // the unit is recorded once and replayed at later positions: everything positional is on the device
    forward(nullptr, 1, Logits::Device, nullptr, true);
    be_.sample(p, n_valid, static_cast<const float*>(logits_), advancing);
  });
  pos_ = pos + 1;  // whether the unit ran eagerly, was recorded or was replayed
  processed_ = processed + 1;
}

void Session::check_tokens(const int32_t* tokens, int n) const {
  const int V = model_.config().vocab_size;
  for (int i = 0; i < n; ++i)
    LILY_CHECK(tokens[i] >= 0 && tokens[i] < V, "token id ", tokens[i], " at index ", i,
               " is outside the vocabulary [0, ", V, ")");
}

void Session::prefill(const int32_t* tokens, int n, float* logits, const ChunkHook& hook) {
  Hold hold(*this);
  SaveLapses lapses{save_pos_};
  LILY_CHECK(n >= 1, "prefill needs at least one token");
  check_room(n);
  check_tokens(tokens, n);
  changed();
  reserve_kv(pos_ + n);  // one allocation for the whole prompt: no grow-and-copy peaks between chunks
  for (int i = 0; i < n; i += chunk_) {
    const int T = std::min(chunk_, n - i);
    const bool last = i + T == n;
    forward(tokens + i, T, last && logits ? Logits::Last : Logits::None, logits);
    chunk_done(hook, i + T, n);
  }
}

void Session::forward_all(const int32_t* tokens, int n, float* logits, const ChunkHook& hook) {
  Hold hold(*this);
  SaveLapses lapses{save_pos_};
  LILY_CHECK(n >= 1, "forward_all needs at least one token");
  check_room(n);
  check_tokens(tokens, n);
  changed();
  reserve_kv(pos_ + n);
  const size_t V = model_.config().vocab_size;
  for (int i = 0; i < n; i += chunk_) {
    const int T = std::min(chunk_, n - i);
    forward(tokens + i, T, Logits::All, logits + size_t(i) * V);
    chunk_done(hook, i + T, n);
  }
}

Snapshot Session::snapshot_layout(int pos, std::vector<int32_t> tokens) const {
  const Config& c = model_.config();
  Snapshot s;
  s.fingerprint = model_.fingerprint();
  s.pos = pos;
  s.tokens = std::move(tokens);
  s.kv_row_bytes = size_t(c.num_key_value_heads) * c.head_dim * be_.act_bytes();
  s.conv_bytes = size_t(c.linear_conv_kernel_dim - 1) * c.conv_dim() * be_.act_bytes();
  s.rec_bytes = size_t(c.linear_num_value_heads) * c.linear_value_head_dim * c.linear_key_head_dim * sizeof(float);
  s.attn_layers = int(k_cache_.size());
  s.gdn_layers = int(conv_.size());
  s.memory = std::make_shared<StateMemory>(model_.shared_backend(),
                                           s.gdn_offset(s.gdn_layers));  // the end of the layout: its size
  return s;
}

// No sync: device copies are ordered with the work after them on the backend's queue (a restore, a read through
// to_host, the next forward), and a release waits for them; host copies (to_host) have completed already. So the
// server's snapshot of a prompt's opening turn does not stall the queue before the rest of the prompt.
void Session::save_bytes(Snapshot& s, size_t at, const void* src, size_t n) const {
  if (!n) return;
  uint8_t* dst = static_cast<uint8_t*>(s.memory->data()) + at;
  if (s.memory->on_device())
    be_.copy(dst, src, n);
  else
    be_.to_host(dst, src, n);
}

void Session::save_kv(Snapshot& s) const {
  const size_t rows = size_t(s.pos) * s.kv_row_bytes;  // the used rows only
  for (int l = 0; l < s.attn_layers; ++l) {
    save_bytes(s, s.kv_offset(l), k_cache_[l], rows);
    save_bytes(s, s.kv_offset(l) + rows, v_cache_[l], rows);
  }
}

void Session::save_gdn(Snapshot& s, int l) const {
  save_bytes(s, s.gdn_offset(l), conv_[l], s.conv_bytes);
  save_bytes(s, s.gdn_offset(l) + s.conv_bytes, rec_[l], s.rec_bytes);
}

Snapshot Session::snapshot() const {
  Hold hold(*this);
  LILY_ASSERT(tokens_.size() == size_t(pos_), "session holds ", int(pos_), " positions but knows ", tokens_.size(),
              " tokens");
  Snapshot s = snapshot_layout(pos_, tokens_);
  save_kv(s);
  for (int l = 0; l < s.gdn_layers; ++l) save_gdn(s, l);
  return s;
}

void Session::save_at(int pos) {
  Hold hold(*this);
  LILY_CHECK(pos >= 0, "save_at: position ", pos, " is negative");
  save_pos_ = pos;
  saved_.reset();
}

std::optional<Snapshot> Session::take_saved() {
  Hold hold(*this);
  save_pos_ = -1;
  std::optional<Snapshot> s = std::move(saved_);
  saved_.reset();
  return s;
}

void Session::save_if_at() {
  if (save_pos_ < 0 || save_pos_ != pos_) return;
  saved_ = snapshot();
  save_pos_ = -1;
}

void Session::restore(const Snapshot& s) {
  Hold hold(*this);
  const Config& c = model_.config();
  const size_t row_bytes = size_t(c.num_key_value_heads) * c.head_dim * be_.act_bytes();
  const size_t conv_bytes = size_t(c.linear_conv_kernel_dim - 1) * c.conv_dim() * be_.act_bytes();
  const size_t rec_bytes = size_t(c.linear_num_value_heads) * c.linear_value_head_dim * c.linear_key_head_dim * 4;
  const bool ok = s.pos >= 0 && s.attn_layers == int(k_cache_.size()) && s.gdn_layers == int(conv_.size()) &&
                  (s.pos == 0 || s.kv_row_bytes == row_bytes) && s.conv_bytes == conv_bytes &&
                  s.rec_bytes == rec_bytes && s.memory && s.nbytes() == s.gdn_offset(s.gdn_layers);
  LILY_CHECK(ok, "snapshot does not belong to this model and backend (layer count, sizes or dtype differ)");
  LILY_CHECK(s.fingerprint == model_.fingerprint(), "snapshot was made by another model (fingerprint ",
             s.fingerprint.empty() ? std::string("none") : s.fingerprint, ", this model's is ", model_.fingerprint(),
             "): the same geometry with other weights");
  LILY_CHECK(s.tokens.size() == size_t(s.pos), "snapshot is corrupt: it holds ", s.pos, " positions but ",
             s.tokens.size(), " tokens");
  LILY_CHECK(s.pos <= max_context_, "snapshot holds ", s.pos, " tokens, more than this session's context limit of ",
             max_context_);
  check_tokens(s.tokens.data(), s.pos);
  changed();
  pos_ = 0;  // nothing to preserve while growing the caches
  tokens_.clear();
  reserve_kv(s.pos);
  const uint8_t* src = static_cast<const uint8_t*>(s.memory->data());
  auto load = [&](void* dst, size_t at, size_t n) {
    if (!n) return;
    if (s.memory->on_device())
      be_.copy(dst, src + at, n);
    else
      be_.to_device(dst, src + at, n);
  };
  const size_t rows = size_t(s.pos) * row_bytes;
  for (int l = 0; l < s.attn_layers; ++l) {
    load(k_cache_[l], s.kv_offset(l), rows);
    load(v_cache_[l], s.kv_offset(l) + rows, rows);
  }
  for (int l = 0; l < s.gdn_layers; ++l) {
    load(conv_[l], s.gdn_offset(l), conv_bytes);
    load(rec_[l], s.gdn_offset(l) + conv_bytes, rec_bytes);
  }
  be_.sync();
  pos_ = s.pos;
  tokens_ = s.tokens;
}

}  // namespace lily
