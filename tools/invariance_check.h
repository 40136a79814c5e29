// `pagedattn run --check-invariance`: re-runs sampled requests of a step alone and in shuffled
// sub-batches of the step (random subsets of its other requests, random order, decodes first
// where the builder reorders) through the same layer, with a builder of its own, and compares the
// request's output rows bit for bit with what the step wrote. Under the batch-invariant mode
// (--batch-invariant, PAGEDATTN_BATCH_INVARIANT=1) every bit must match; without it the check
// shows what the default plans change (split-KV, cascade, kernel choice follow the batch).
// Re-running rewrites the step's new keys/values into the cache at the same slots with the same
// bytes, so the run itself is unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace pagedattn::cli {

struct InvarianceStats {
  int checked_steps = 0;
  int64_t reruns = 0;        // forwards of sub-batches (the request alone included)
  int64_t comparisons = 0;   // (request, sub-batch) pairs compared
  int64_t differences = 0;   // of which differed in some bit
  std::string first_difference;
};

class InvarianceChecker {
 public:
  // requests_per_step sampled requests per checked layer and step, each alone and in
  // batches_per_request shuffled sub-batches.
  InvarianceChecker(uint64_t seed, Device device, int requests_per_step = 2, int batches_per_request = 3);

  // The layer's forward on a sub-batch: its three (T, ...) inputs (q, k, v or q, kv_c_normed,
  // k_pe) on the run's device, the sub-batch's plan, and an output (T, H, Dv).
  using Forward = std::function<void(const TensorView&, const TensorView&, const TensorView&,
                                     const AttentionMetadata&, const TensorView&)>;

  // One layer of one step: `step` the step's batch (host arrays), `inputs` what the layer got,
  // `output` what it wrote (T, H, Dv); `group` names the checker's builder for the layer's KV-cache
  // group, made from backend / spec / config on first use. `layer` names the layer in messages.
  void check_layer(const std::string& layer, int group, const AttentionBackend& backend,
                   const KVCacheSpec& spec, const BuilderConfig& config,
                   const CommonAttentionMetadataArgs& step, int64_t num_blocks,
                   const TensorView (&inputs)[3], const TensorView& output, const Forward& forward);
  void finish_step() { ++stats_.checked_steps; }
  const InvarianceStats& stats() const { return stats_; }

 private:
  Device device_;
  int requests_per_step_, batches_per_request_;
  std::mt19937_64 rng_;
  std::map<int, std::unique_ptr<AttentionMetadataBuilder>> builders_;
  InvarianceStats stats_;
};

}  // namespace pagedattn::cli
