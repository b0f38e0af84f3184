// optimisations.h: the ablation switches. Every optimisation a backend makes beyond its plain, tested path has a
// name here and can be turned off alone (LILY_DISABLE=name,… or lily.load(…, disable=[…])), so that its worth is
// measured by the difference it makes (benchmarks/bench_model.py --ablate, benchmarks/NOTES.md). Off means the
// plain path, which the op and end-to-end tests also run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lily {

enum class Opt : int {
  pdl,               // CUDA: programmatic dependent launch in the replayed decode step (weights load early)
  gdn_chunked,       // CUDA: Gated DeltaNet prefill in chunks of 64 tokens on tensor cores (WY form)
  moe_sort_scan,     // CUDA: MoE prefill routing sorted by one histogram + scan instead of a pass per expert
  qmv_stream,        // CUDA: decode GEMV as persistent warps streaming two-row units, two in flight each
  moe_tiles_128,     // CUDA: MoE prefill GEMMs in 128-row tiles from 96 rows per expert (else from 256)
  kCount
};

struct OptInfo {
  Opt id;
  const char* name;
  const char* backends;  // where it changes anything
  const char* what;      // one line
};

// Every switch, in enum order.
const std::vector<OptInfo>& optimisation_table();

// The set of switches that are on. Default: all.
class Optimisations {
 public:
  bool on(Opt o) const { return !((off_ >> int(o)) & 1u); }
  void disable(Opt o) { off_ |= uint64_t(1) << int(o); }
  // Names of the disabled switches, comma-separated, in table order ("" when all are on).
  std::string disabled_names() const;
  // From switch names; an unknown name is an InputError that lists the known ones.
  static Optimisations with_disabled(const std::vector<std::string>& names);
  bool operator==(const Optimisations& o) const { return off_ == o.off_; }

 private:
  uint64_t off_ = 0;
};

}  // namespace lily
