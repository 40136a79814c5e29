// Host planning of the CUDA backend (the "plan" half of plan/run): turns a batch's query
// lengths and sequence lengths into work items (attention_plan.h), chooses split-KV
// (flash-decoding) from the batch and the number of resident CTAs, and orders the items for
// the persistent kernel. Pure host code, no CUDA calls.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "backends/cuda/attention_plan.h"

namespace pagedattn::cuda {

struct PlannerConfig {
  int group_size = 1;            // num_heads / num_kv_heads
  int num_kv_heads = 1;
  int prefill_rows = 128;        // rows of a prefill-path item (prefill_rows_for_head_size)
  int resident_ctas = 1;         // CTAs of the kernel resident at once on the device
  bool positional = true;        // false: cross-attention (every key visible)
  bool causal = true;
  std::optional<int> sliding_window;  // W: |k - p| <= W - 1 (causal: p - k <= W - 1)
  int partial_rows_capacity = 0; // rows of the split partial buffers
  int max_work_items = 0;        // capacity of the device item array
  int max_combine_items = 0;
  int max_splits = 256;
  bool allow_split = true;
};

struct AttentionPlan {
  std::vector<WorkItem> items;
  std::vector<CombineItem> combine;
  int partial_rows = 0;          // rows of the partial buffers in use
};

// Visible key range [start, end) of the rows of tokens [t0, t1] of a request (query_len q,
// seq_len s); empty when start >= end.
struct KeyRange {
  int start = 0;
  int end = 0;
};
KeyRange visible_key_range(const PlannerConfig& config, int query_len, int seq_len, int t0, int t1);

// query_start_loc (num_reqs + 1), seq_lens (num_reqs). Throws Error naming "metadata" when the
// plan would exceed the configured capacities.
AttentionPlan make_attention_plan(const PlannerConfig& config, std::span<const int32_t> query_start_loc,
                                  std::span<const int32_t> seq_lens);

// Upper bound of work items for a batch of at most max_num_seqs requests and
// max_num_batched_tokens tokens (without splits; splits add at most 2 * resident_ctas).
int64_t max_unsplit_work_items(const PlannerConfig& config, int64_t max_num_seqs,
                               int64_t max_num_batched_tokens);

}  // namespace pagedattn::cuda
