// Host planning of the CUDA backend (the "plan" half of plan/run): turns a batch's query
// lengths and sequence lengths into work items (attention_plan.h), chooses split-KV
// (flash-decoding) from the batch and the number of resident CTAs, and orders the items for
// the persistent kernel. Pure host code, no CUDA calls.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "backends/cuda/attention/attention_plan.h"

namespace pagedattn::cuda {

// The builder sizes the cascade states for batches of at most this many tokens; a larger batch
// attends the shared prefix in one pass (cuda_backend_internal.h).
inline constexpr int kCascadeMaxTokens = 2048;

// Batch-invariant plans (BuilderConfig::batch_invariant): a decode-path item's keys are cut in
// chunks of this many keys (32 tiles) counted from its first tile, whatever the batch and the SM
// count; prefill-path items are never split. (SGLang's deterministic FlashInfer mode cuts decodes
// at 2048 too.) Long enough that the extra items, partial rows and combine cost a few percent at
// large batches; small batches lose the fill-the-device splits (docs/batch_invariance.md).
inline constexpr int kBatchInvariantSplitKeys = 2048;

struct PlannerConfig {
  int group_size = 1;            // num_heads / num_kv_heads
  int num_kv_heads = 1;
  int prefill_rows = 128;        // rows of a prefill-path item (prefill_rows_for_head_size)
  int resident_ctas = 1;         // CTAs of the kernel resident at once on the device
  int decode_resident_ctas = 0;  // those of the decode-only kernel; 0: plans never use it
  bool force_decode_kernel = false;  // decode batches take it even when their chunks are short
  int64_t decode_kernel_max_tiles = 0;  // > 0: decode batches of more 64-key tiles do not take it
  int decode_step_tiles = 1;     // tiles of a decode-path pipeline step: split chunks are multiples
  // Decode rows of two kv heads in one item where they fit 16 rows (kItemPairedHeads; an even
  // num_kv_heads, no cascade), in batches of at least 16 decode tiles a CTA (every batch when the
  // decode-only kernel is forced): the fp8 d 64 decode, whose 64-byte rows of one head stream
  // slower than the 128-byte rows of a pair (docs/perf/cuda.md).
  bool pair_kv_heads = false;
  int paired_decode_step_tiles = 1;  // decode_step_tiles of a plan with paired items
  bool positional = true;        // false: cross-attention (every key visible)
  bool causal = true;
  std::optional<int> sliding_window;  // W: |k - p| <= W - 1 (causal: p - k <= W - 1)
  int partial_rows_capacity = 0; // rows of the partial buffers (splits and cascade states)
  int max_work_items = 0;        // capacity of the device item array
  int max_combine_items = 0;
  int max_splits = 256;
  bool allow_split = true;
  // > 0: a batch-invariant plan (see kBatchInvariantSplitKeys): decode-path items split in chunks
  // of this many tiles, prefill-path items never, no decode-only kernel, no search; allow_split
  // and the resident CTAs change nothing. Needs cascade_prefix = 0.
  int fixed_split_tiles = 0;
};

struct AttentionPlan {
  std::vector<WorkItem> items;
  std::vector<CombineItem> combine;
  int partial_rows = 0;          // rows of the partial buffers in use
  int cascade_prefix = 0;        // P > 0: the plan splits every request's keys at P
  int prefix_items = 0;          // work items over the shared prefix (after splits)
  int prefix_splits = 0;         // splits of each prefix row group (cascade)
  bool decode_kernel = false;    // every item is a decode-path item: the decode-only kernel runs it
};

// Visible key range [start, end) of the rows of tokens [t0, t1] of a request (query_len q,
// seq_len s); empty when start >= end.
struct KeyRange {
  int start = 0;
  int end = 0;
};
KeyRange visible_key_range(const PlannerConfig& config, int query_len, int seq_len, int t0, int t1);

// Batch-invariant plans (config.fixed_split_tiles > 0): each item and its splits are a function of
// its request alone (see PlannerConfig::fixed_split_tiles); only the order of the items follows
// the batch, which decides where an item runs, not what it computes.
// Decode-only plans (config.decode_resident_ctas > 0, every item a decode-path item, no cascade):
// the items are split so that the persistent CTAs finish together (wave balance), not only when
// they are fewer than the CTAs; see make_attention_plan.
// query_start_loc (num_reqs + 1), seq_lens (num_reqs). Throws Error naming "metadata" when the
// plan would exceed the configured capacities.
// cascade_prefix P > 0 (the caller checked: causal decoder, no window / ALiBi, P <= every
// request's computed tokens, prefix pages shared): prefix items cover keys [0, P) of every
// query row of the batch (block-table row 0), the requests' items keys [P, seq_len); every row
// is merged by a combine item (attention_plan.h).
AttentionPlan make_attention_plan(const PlannerConfig& config, std::span<const int32_t> query_start_loc,
                                  std::span<const int32_t> seq_lens, int cascade_prefix = 0);

// Upper bound of work items for a batch of at most max_num_seqs requests and
// max_num_batched_tokens tokens (without splits; splits add at most 2 * resident_ctas).
int64_t max_unsplit_work_items(const PlannerConfig& config, int64_t max_num_seqs,
                               int64_t max_num_batched_tokens);

// Upper bound of the (unsplit) prefix items of a cascade batch of max_num_batched_tokens tokens.
int64_t max_prefix_work_items(const PlannerConfig& config, int64_t max_num_batched_tokens);

// What batch-invariant plans (config.fixed_split_tiles > 0) need at most for batches within the
// builder's limits: every decode-path item (<= 16 rows, one per request and kv head) cut in
// ceil(max_model_len / split) parts.
struct FixedSplitCapacity {
  int64_t partial_rows = 0;
  int64_t work_items = 0;
  int64_t combine_items = 0;
};
FixedSplitCapacity fixed_split_capacity(const PlannerConfig& config, int64_t max_num_seqs,
                                        int64_t max_num_batched_tokens, int64_t max_model_len);

}  // namespace pagedattn::cuda
