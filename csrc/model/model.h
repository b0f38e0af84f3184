// model.h: Model (config + weights on a backend), Session (the state of one conversation) and Snapshot.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/config.h"
#include "model/weights.h"

namespace lily {

// A model's backend and the lock that orders every use of it: one backend serves every session of the model, and a
// backend is one device queue with shared scratch memory, so each call that uses it (Session::Hold) holds the lock
// and calls on different sessions from different threads run one after the other. Recursive: a Generator's call
// nests its Session's. Shared by the model and by the snapshots that live in its memory (StateMemory), so that it
// outlives both.
struct SharedBackend {
  std::unique_ptr<Backend> backend;
  std::recursive_mutex lock;
};

class Model {
 public:
  // opts: the ablation switches the backend runs with (core/optimisations.h).
  Model(const Config& cfg, const TensorMap& tensors, const std::string& backend,
        const Optimisations& opts = Optimisations());
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const Config& config() const { return cfg_; }
  const Weights& weights() const { return w_; }
  Backend& backend() const { return *be_->backend; }
  const std::shared_ptr<SharedBackend>& shared_backend() const { return be_; }
  // The identity of the weights (weights.h, fingerprint): snapshots carry it, restore requires it.
  const std::string& fingerprint() const { return fingerprint_; }

  std::recursive_mutex& backend_lock() const { return be_->lock; }
  // The device-loop generation (Generator serial) that last used the backend's result slots (Backend::fetch_result):
  // another one's in-flight results are overwritten by it.
  std::atomic<uint64_t>& device_loop_owner() const { return device_loop_owner_; }

 private:
  mutable std::atomic<uint64_t> device_loop_owner_{0};
  Config cfg_;
  std::shared_ptr<SharedBackend> be_;
  std::string fingerprint_;
  Weights w_;
};

// Runs between the chunks of a prefill, after every chunk but the last, once that chunk's work is complete, with
// (tokens done, tokens in the call): for progress reports and interrupts. It may throw to stop the prefill there;
// the session then holds exactly the tokens of the chunks done (position() says how many) and the exception leaves
// the call.
using ChunkHook = std::function<void(int done, int total)>;

// A session used by two threads at once, or a generation continued on a session that something else changed
// since its last step. Python: lily.SessionConflictError (a RuntimeError).
struct SessionConflict : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bytes of a snapshot's state, in the backend's memory where it has room (a snapshot a session made: made and
// restored by device copies, released under the backend's lock from whichever thread drops it), else in host memory
// (no room, or read from bytes). Immutable once filled; shared by the copies of a Snapshot.
class StateMemory {
 public:
  // Backend memory of `bytes` if the backend can allocate it, else host memory.
  StateMemory(std::shared_ptr<SharedBackend> be, size_t bytes);
  explicit StateMemory(std::vector<uint8_t> host);
  ~StateMemory();
  StateMemory(const StateMemory&) = delete;
  StateMemory& operator=(const StateMemory&) = delete;

  bool on_device() const { return device_ != nullptr; }
  size_t size() const { return size_; }
  // The bytes: a backend pointer when on_device(), else a host one.
  void* data() const { return device_ ? device_ : const_cast<uint8_t*>(host_.data()); }
  // Copies bytes [at, at + n) to host memory.
  void read(size_t at, void* dst, size_t n) const;

 private:
  std::shared_ptr<SharedBackend> be_;
  void* device_ = nullptr;
  std::vector<uint8_t> host_;
  size_t size_ = 0;
};

// The complete state at one position: the tokens it holds, KV rows 0..pos-1 of every attention layer, conv and fp32
// recurrent state of every Gated DeltaNet layer, in one StateMemory laid out as
//   per attention layer: K rows then V rows, [pos, NKV, HD] each (kv_bytes() = 2 · pos · kv_row_bytes)
//   per GDN layer: conv state [K-1, conv_dim] activations, then recurrent state fp32 [NV, DV, DK].
// Independent of the session that made it; copies share the memory.
struct Snapshot {
  int pos = 0;
  std::string fingerprint;       // of the model that made it (Model::fingerprint)
  std::vector<int32_t> tokens;   // the pos tokens the state holds
  size_t kv_row_bytes = 0;       // one KV row of one layer (NKV · HD · activation bytes)
  size_t conv_bytes = 0, rec_bytes = 0;  // one GDN layer's conv and recurrent state
  int attn_layers = 0, gdn_layers = 0;
  std::shared_ptr<const StateMemory> memory;

  size_t kv_bytes() const { return 2 * size_t(pos) * kv_row_bytes; }  // of one attention layer
  size_t kv_offset(int layer) const { return size_t(layer) * kv_bytes(); }
  size_t gdn_offset(int layer) const {
    return size_t(attn_layers) * kv_bytes() + size_t(layer) * (conv_bytes + rec_bytes);
  }
  size_t nbytes() const { return memory ? memory->size() : 0; }
  bool on_device() const { return memory && memory->on_device(); }
  // A self-describing byte string (magic, version, fingerprint, position, tokens, every layer's state with its size)
  // and back (host memory).
  std::vector<uint8_t> serialize() const;
  static Snapshot deserialize(const uint8_t* data, size_t n);
};

// Threads. A session is one conversation: it is never shared. Every call that reads or changes its state holds
// the session for the call's duration, and a call from another thread meanwhile throws SessionConflict (the core
// refuses rather than serialises: two conversations interleaved on one state could not both be right). The same
// thread may nest holds (a Generator holds the session across its own Session calls). position(),
// tokens_processed() and the limits may be read from any thread at any time.
class Session {
 public:
  // Holds `s` for the current thread until destroyed; throws SessionConflict if another thread holds it.
  class Hold {
   public:
    explicit Hold(const Session& s);
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    const Session& s_;
    std::unique_lock<std::recursive_mutex> backend_;  // the model's backend_lock, taken after the session
  };

  // max_context: the most tokens this session may hold (≤ max_position_embeddings);
  // prefill_chunk: tokens per forward call during prefill (bounds working memory); 0: the backend's default.
  Session(const Model& model, int max_context, int prefill_chunk);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int position() const { return pos_; }
  // The tokens whose effect is in the state, in order: position() of them after every call (the owner of the
  // conversation's token state; everything else asks here).
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Changes whenever the state does (prefill, decode, reset, restore, a generation's set-up): a Generator
  // compares it with the value after its own last step to find out whether the session was changed under it.
  uint64_t epoch() const { return epoch_; }
  int max_context() const { return max_context_; }
  int prefill_chunk() const { return chunk_; }
  int vocab_size() const { return model_.config().vocab_size; }
  const Model& model() const { return model_; }
  Backend& backend() const { return be_; }
  // Tokens this session has run through the model since it was made (prefill and decode).
  int64_t tokens_processed() const { return processed_; }

  // Feeds n tokens in chunks. If logits != null, writes the fp32 logits [vocab] of the last token there.
  void prefill(const int32_t* tokens, int n, float* logits, const ChunkHook& hook = nullptr);
  // Feeds n tokens and writes the fp32 logits of every one of them to logits [n, vocab] (teacher forcing).
  void forward_all(const int32_t* tokens, int n, float* logits, const ChunkHook& hook = nullptr);
  void reset();

  // Device decoding, for backends that select tokens themselves (Backend::can_sample). prefill_device is prefill
  // with the last logits left in device memory; decode_device feeds the token in token_buffer() (written there by
  // the previous selection) and selects the next one, as one replayable unit per `key`.
  void prefill_device(const int32_t* tokens, int n, const ChunkHook& hook = nullptr);
  void sample_device(const SamplingParams& p, int n_valid, const DeviceSampler& st);
  void decode_device(const SamplingParams& p, int n_valid, const DeviceSampler& st, uint64_t key);
  int32_t* token_buffer();

  // The state now, in backend memory where there is room (StateMemory); device copies of the used KV rows only.
  Snapshot snapshot() const;
  // Asks the next prefill (prefill, prefill_device, forward_all) to take a snapshot on the way, when the state holds
  // `pos` tokens, if it passes there: inside a chunk the same forward pass saves it (each GDN layer's conv and scan
  // run in two parts around `pos`, their state copied between them; the KV rows after the pass), so that a server
  // snapshotting a conversation's opening turn reads the weights once, not once more for the rest of the prompt.
  // The request lapses when that prefill ends; take_saved() returns the snapshot (none if it was not taken) and
  // drops a request still pending.
  void save_at(int pos);
  std::optional<Snapshot> take_saved();
  // Throws InputError for a snapshot of another model (fingerprint) or geometry, or one that holds too many tokens.
  void restore(const Snapshot& s);
  // Allocates the KV rows of `tokens` more tokens (up to max_context) at once, so that the caches do not grow, and
  // copy, while they fill.
  void reserve(int tokens);
  // Checks that n more tokens fit; throws InputError otherwise.
  void check_room(int n) const;
  // Checks that every id is inside the vocabulary; throws InputError otherwise (before any state changes).
  void check_tokens(const int32_t* tokens, int n) const;

 private:
  enum class Logits { None, Last, All, Device };
  // tokens == null: the token ids are already in tok_ (device decode). device_pos: attention reads pos_dev_.
  void forward(const int32_t* tokens, int T, Logits mode, float* logits, bool device_pos = false);
  void reserve_kv(int rows);
  void reserve_work(int T);
  void mixer_attention(const LayerWeights& L, int T, void* k_cache, void* v_cache, bool device_pos);
  // cut (0 < cut < T): the GDN state after the first cut tokens is saved into layer `gdn` of `save` on the way.
  void mixer_gdn(const LayerWeights& L, int T, void* conv_state, float* rec_state, int cut = 0, Snapshot* save = nullptr,
                 int gdn = 0);
  // A snapshot of the first `pos` positions holding `tokens`: its layout and memory, nothing copied yet; then its
  // parts copied from the session's state (the KV rows below s.pos; GDN layer l's conv and recurrent state).
  Snapshot snapshot_layout(int pos, std::vector<int32_t> tokens) const;
  void save_kv(Snapshot& s) const;
  void save_gdn(Snapshot& s, int l) const;
  void save_bytes(Snapshot& s, size_t at, const void* src, size_t n) const;
  // save_at: a snapshot is taken when a prefill's state holds this many tokens (-1: none asked for).
  void save_if_at();

  friend class Generator;  // records the tokens a device decode step fed (token_fed)
  // A device decode step fed a token the host learns only afterwards: the generator records it here.
  void token_fed(int32_t token) { tokens_.push_back(token); }
  void changed() { ++epoch_; }
  // After chunk [.., done) of a prefill of `total` tokens: waits for it and runs the hook, unless it was the last.
  void chunk_done(const ChunkHook& hook, int done, int total);

  const Model& model_;
  Backend& be_;
  int max_context_, chunk_;
  std::atomic<int> pos_{0};
  std::vector<int32_t> tokens_;  // touched by the holder only
  std::atomic<int64_t> processed_{0};
  std::atomic<uint64_t> epoch_{0};
  mutable std::atomic<std::thread::id> holder_{};  // the thread holding the session, or none
  mutable int holds_ = 0;                          // nesting depth (touched by the holder only)
  int kv_cap_ = 0;
  std::vector<void*> kv_;                  // per attention layer one allocation [K | V]:
  std::vector<void*> k_cache_, v_cache_;  //   [kv_cap, NKV, HD] each
  void* gdn_state_ = nullptr;              // every GDN layer's state in one allocation (one cudaMalloc, one zeroing)
  size_t gdn_state_bytes_ = 0;             //   of this many bytes:
  std::vector<void*> conv_;                //   per GDN layer [K-1, conv_dim]
  std::vector<float*> rec_;                //   per GDN layer [NV, DV, DK] fp32
  // working buffers for up to work_T_ tokens (activations unless noted)
  int work_T_ = 0;
  std::vector<void*> work_;
  float* x_ = nullptr;  // the residual stream, fp32 on every backend
  void *tok_ = nullptr, *a_ = nullptr, *d_ = nullptr;
  // Each holds one thing in an attention layer and another in a GDN layer (the mixers run one at a time):
  void* qg_x_ = nullptr;         // attention: q and gate [T, NH, 2·HD]; GDN: X [T, conv_dim], then the normed o
  void* k_z_ = nullptr;          // attention: k [T, NKV·HD]; GDN: z [T, NV·DV]
  void* v_b_ = nullptr;          // attention: v [T, NKV·HD]; GDN: b [T, NV]
  void* attn_alpha_ = nullptr;   // attention: its gated output [T, NH·HD]; GDN: α [T, NV]
  void* conv_out_ = nullptr;     // GDN: C = silu(conv(X)) [T, conv_dim]
  void* y_ = nullptr;            // GDN: the scan's output [T, NV·DV]
  void* logits_ = nullptr;  // fp32 [logits_rows_, vocab]
  int logits_rows_ = 0;
  int32_t* pos_dev_ = nullptr;  // device copy of pos_ for replayed decode steps
  bool pos_dev_valid_ = false;
  int save_pos_ = -1;                // save_at's position, until the prefill that asked for it ends
  std::optional<Snapshot> saved_;   // what it took, for take_saved()
};

}  // namespace lily
