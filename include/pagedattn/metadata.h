// Per-step batch metadata (vLLM's CommonAttentionMetadata) and the batch utilities of
// vllm/v1/attention/backends/utils.py, with exactly their semantics.
//
// A batch holds num_reqs requests; request r has query tokens
//   [query_start_loc[r], query_start_loc[r+1])  of the flat token axis, query_len = difference,
// and seq_len = num_computed_tokens + query_len keys (its full context after this step).
// Query i of request r sits at absolute position seq_len - query_len + i (causal with context).
// For encoder / encoder_only layers seq_lens == query lens (no cache). For encoder_decoder
// (cross) layers seq_lens are the ENCODER lengths, block_table maps the encoder K/V pages and
// slot_mapping maps the encoder tokens being written this step (all -1 once cached) — what
// vLLM's cross-attention builder passes to the kernels.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/tensor.h"

namespace pagedattn {

struct CommonAttentionMetadata {
  // On the backend's device (for a CPU backend the same memory as the host mirrors).
  TensorView query_start_loc;     // (>= num_reqs + 1,) i32, non-decreasing, [0] == 0
  TensorView seq_lens;            // (>= num_reqs,) i32
  TensorView block_table_tensor;  // (>= num_reqs, max_num_blocks_per_req) i32
  TensorView slot_mapping;        // (>= num_actual_tokens,) i64; -1 = skip; tail is -1
  // Host mirrors (always Device::cpu).
  TensorView query_start_loc_cpu;      // (num_reqs + 1,) i32
  TensorView seq_lens_cpu;             // (num_reqs,) i32
  TensorView num_computed_tokens_cpu;  // (num_reqs,) i32 == seq_lens - query_lens
  // Optional host mirrors of block_table_tensor and slot_mapping (Device::cpu, same shapes).
  // Builders check every block id and slot on the host at plan time (kv_cache_footprint): with
  // these mirrors a CUDA builder reads them; without them it copies the device tensors to the
  // host (one synchronous copy per build()). make_common_attention_metadata fills them.
  TensorView block_table_cpu;          // (>= num_reqs, max_num_blocks_per_req) i32
  TensorView slot_mapping_cpu;         // (>= num_actual_tokens,) i64

  int num_reqs = 0;
  int num_actual_tokens = 0;  // == query_start_loc_cpu[num_reqs]
  int max_query_len = 0;
  int max_seq_len = 0;
  bool causal = true;

  // Host-side accessors (read the mirrors).
  int query_len(int req) const;
  int seq_len(int req) const;
  int num_computed_tokens(int req) const;

  // Rejects every inconsistency with an Error naming the field and the request index:
  // dtypes/shapes/devices of every tensor, query_start_loc[0] != 0 or decreasing,
  // num_actual_tokens / max_query_len / max_seq_len not matching the arrays, seq_len <
  // query_len, num_computed_tokens != seq_len - query_len, block ids outside [0, num_blocks)
  // in the blocks a request uses (cdiv(seq_len, block_size) of its row; pass num_blocks < 0 or
  // block_size <= 0 to skip), slots outside [0, num_blocks * block_size) other than -1.
  // Device tensors are checked only for dtype/shape/device (their contents are not read); the
  // optional host mirrors block_table_cpu / slot_mapping_cpu, when given, get the content checks
  // (and must equal the tensors they mirror when those are on the host too).
  void validate(int64_t num_blocks = -1, int block_size = 0) const;

 private:
  void check_host_device_tensors() const;  // a CPU backend's tensors against their mirrors
  void check_block_ids_and_slots(const TensorView& table, const TensorView& slots,
                                 int64_t num_blocks, int block_size) const;
};

// What one step reads and writes of a paged KV cache, found at plan time on the host. A plan
// keeps it (AttentionMetadata::cache_footprint) and every entry point that writes or reads the
// cache checks it against the kv_cache it is given, in O(1), before its first write: a block
// table naming blocks the cache lacks, or a plan built for a larger cache, is rejected with the
// cache byte-identical.
struct KVCacheFootprint {
  bool scanned = false;         // false: not computed (a no-cache plan); check_fits accepts
  int64_t max_block = -1;       // largest block id a request reads (-1: none)
  int max_block_req = -1;       // where it sits: block_table[max_block_req][max_block_col]
  int64_t max_block_col = -1;
  int64_t max_slot = -1;        // largest slot written this step (-1: none)
  int64_t max_slot_index = -1;  // its index in slot_mapping
  // Error naming "metadata" (message "<who> <entry>: ...", e.g. "CPU forward: ") unless a cache
  // of num_blocks blocks of block_size tokens holds every block id and slot above.
  void check_fits(int64_t num_blocks, int64_t block_size, std::string_view who,
                  std::string_view entry) const;
};

// Scans the block-table columns each request reads (cdiv(seq_lens_cpu[r], block_size) of row r)
// and every entry of slot_mapping. A negative block id there, or a slot below -1, is an Error
// naming the entry. Reads block_table_cpu / slot_mapping_cpu when given, the tensors themselves
// when they live on the host, else a synchronous copy of the device tensors. Call after
// validate().
KVCacheFootprint kv_cache_footprint(const CommonAttentionMetadata& common, int block_size);

// Owns the tensors behind a CommonAttentionMetadata built from host arrays.
struct OwnedCommonAttentionMetadata {
  CommonAttentionMetadata common;  // views into the tensors below (stable across moves)
  Tensor query_start_loc, seq_lens, block_table, slot_mapping;           // device copies
  Tensor query_start_loc_cpu, seq_lens_cpu, num_computed_tokens_cpu;     // host mirrors
  Tensor block_table_cpu, slot_mapping_cpu;  // host mirrors (device != cpu only)
};

struct CommonAttentionMetadataArgs {
  std::vector<int32_t> query_start_loc;   // num_reqs + 1
  std::vector<int32_t> seq_lens;          // num_reqs
  std::vector<int32_t> block_table;       // row-major, num_reqs x max_num_blocks_per_req
  int max_num_blocks_per_req = 0;         // columns of block_table
  std::vector<int64_t> slot_mapping;      // >= num_actual_tokens (longer = padding, set to -1)
  bool causal = true;
  int num_reqs_padded = 0;       // block_table rows / seq_lens length (>= num_reqs; 0 = num_reqs)
  int num_tokens_padded = 0;     // slot_mapping length (>= num_actual_tokens; 0 = as given)
};
// Derives num_reqs, num_actual_tokens, max_query_len, max_seq_len, num_computed_tokens; pads
// slot_mapping past num_actual_tokens with -1; copies to `device`. Calls validate().
OwnedCommonAttentionMetadata make_common_attention_metadata(const CommonAttentionMetadataArgs& args,
                                                            Device device = Device::cpu,
                                                            int64_t num_blocks = -1,
                                                            int block_size = 0);

// ---- utilities (vLLM utils.py) ----------------------------------------------------------------
struct DecodePrefillSplit {
  int num_decodes = 0;
  int num_prefills = 0;
  int num_decode_tokens = 0;
  int num_prefill_tokens = 0;
  bool operator==(const DecodePrefillSplit&) const = default;
};
// Assumes a reordered batch (decodes first). require_uniform as in current vLLM: a batch whose
// query lens all equal the first one's (or are 0, i.e. padding) counts as all decodes.
DecodePrefillSplit split_decodes_and_prefills(const CommonAttentionMetadata& common,
                                              int decode_threshold = 1,
                                              bool require_uniform = false);

struct BatchReorder {
  std::vector<int> order;  // order[i] = original index of the request now at position i
  bool modified = false;
};
// Same swaps as vLLM (decodes from the back swapped with prefills from the front).
BatchReorder reorder_batch_to_split_decodes_and_prefills(std::span<const int32_t> num_scheduled_tokens,
                                                         int decode_threshold = 1);

struct LocalAttentionVirtualBatches {
  std::vector<int32_t> seqlens_q_local;     // (virtual_batches,)
  std::vector<int32_t> cu_seqlens_q_local;  // (virtual_batches + 1,)
  std::vector<int32_t> seqlens_k_local;     // (virtual_batches,)
  std::vector<int32_t> block_table_local;   // row-major (virtual_batches, pages_per_local_batch)
  int num_virtual_batches = 0;
  int pages_per_local_batch = 0;
};
// block_table: row-major (num_reqs, block_table_cols). attn_chunk_size % block_size must be 0.
LocalAttentionVirtualBatches make_local_attention_virtual_batches(
    int attn_chunk_size, std::span<const int32_t> query_start_loc, std::span<const int32_t> seq_lens,
    std::span<const int32_t> block_table, int block_table_cols, int block_size);

// FlashAttention's heuristic: prefix >= 256, >= 8 requests, no ALiBi / window / local attention,
// dcp_world_size == 1, then the CTA cost model against flash-decoding.
bool use_cascade_attention(int common_prefix_len, std::span<const int32_t> query_lens,
                           int num_query_heads, int num_kv_heads, bool use_alibi,
                           bool use_sliding_window, bool use_local_attention, int num_sms,
                           int dcp_world_size = 1);

// Length (tokens) of the prefix whose blocks every request shares: leading block-table columns
// equal across the first num_reqs rows, times block_size, capped by the smallest
// num_computed_tokens, rounded down to a multiple of block_size (as vLLM's model runner).
int common_prefix_len(const CommonAttentionMetadata& common, int block_size);

// ---- per-layer hyperparameters (FlashInfer-style planning) --------------------------------
struct PerLayerParameters {
  int window_left = -1;                    // sliding_window - 1, or -1
  std::optional<float> logits_soft_cap;
  float sm_scale = 1.f;
  bool operator==(const PerLayerParameters&) const = default;
};
// All layers must agree; throws Error naming the first layer that differs.
PerLayerParameters infer_global_hyperparameters(const std::map<std::string, PerLayerParameters>& per_layer);

}  // namespace pagedattn
