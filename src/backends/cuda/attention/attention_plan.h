// The CUDA backend's plan (what the builder writes into device memory) and the kernel
// parameters. Plain structs shared by host (.cpp) and device (.cu) code; no CUDA types.
//
// A batch is cut into WORK ITEMS. One work item = one CTA's unit of work:
//   (request r, kv head g, a tile of packed query rows, a range of key positions)
// Packed query rows: the query heads of one kv head are packed with the tokens, row
//   m = token_in_request * G + head_in_group   (G = num_heads / num_kv_heads)
// so one KV tile loaded into shared memory serves the whole GQA group (each KV byte is read once
// per group). Two code paths share one kernel (one launch serves a mixed batch):
//   decode path   (item.num_rows <= 16): 16 rows; the 4 warps split each 64-key tile (16 keys
//                  each) and merge their softmax states at the end (flash-decoding inside a CTA);
//   prefill path  (more rows): 64 or 128 rows (16 or 32 per warp); each warp sees every key.
// A long key range may be SPLIT over several items (flash-decoding across CTAs); their partial
// outputs (f32) and LSEs land in the builder's workspace and a COMBINE item merges them.
// CASCADE (a common prefix of P keys whose pages every request shares): PREFIX items treat the
// whole batch as one request of num_tokens queries over keys [0, P) (rows = flat_token * G +
// head_in_group, block-table row 0), writing f32 partials indexed by (kv head, global row);
// the requests' own items cover [P, seq_len) and always write partials; each combine item merges
// its suffix states with the prefix states of its rows.
// head_size_v != head_size: the kernel for D = max(head_size, head_size_v) runs with runtime
// dims head_size_qk, head_size_v <= D (Q/K/V columns beyond them are zero-filled in shared
// memory, never read from global memory); outputs and partials have head_size_v columns.
#pragma once

#include <cstdint>

namespace pagedattn::cuda {

inline constexpr int kThreadsPerCta = 128;     // 4 warps
inline constexpr int kKeysPerTile = 64;        // keys per pipeline stage
inline constexpr int kDecodeRows = 16;         // rows of a decode-path item
inline constexpr int kMaxPrefillRows = 128;    // rows of a prefill-path item (D <= 128)

// Rows of a prefill-path item for head size d (two 16-row MMA tiles per warp up to d = 128).
constexpr int prefill_rows_for_head_size(int head_size) { return head_size <= 128 ? 128 : 64; }

enum WorkItemFlags : int32_t {
  kItemDecodePath = 1,   // 16-row path (warps split the keys)
  kItemOwnsSink = 2,     // adds the sink logit (exactly one split of a row group does)
  // Decode-path item over the kv-head PAIR kv_head = j (heads 2j, 2j + 1; fp8 caches at head size
  // 64): rows m = token * 2G + h, h < 2G the pair's query heads 2jG + h, each token's K / V rows
  // of both heads read as one 128-byte row (PlannerConfig::pair_kv_heads, decode_path.cuh).
  kItemPairedHeads = 4,
};

// 48 bytes; read once per item by every thread of the CTA.
struct WorkItem {
  int32_t request;          // row of the block table
  int32_t kv_head;
  int32_t query_start;      // flat index of the request's first query token
  int32_t query_len;
  int32_t seq_len;          // keys of the request (context + this step's tokens)
  int32_t row_start;        // first packed row of this item (within the request)
  int32_t num_rows;         // packed rows of this item (<= 16 decode, <= 128 prefill)
  int32_t kv_start;         // key positions [kv_start, kv_end) of this item
  int32_t kv_end;
  int32_t flags;            // WorkItemFlags
  int32_t partial_row;      // -1: write the output; else first row in the partial buffers
  int32_t reserved;
};

// One group of partial states to merge: rows [row_start, row_start + num_rows) of (request,
// kv head), num_splits partial states at partial_row + split * num_rows + row, plus (cascade)
// prefix_splits prefix states at prefix_row + split * prefix_stride + row. 48 bytes.
struct CombineItem {
  int32_t query_start;
  int32_t row_start;
  int32_t num_rows;
  int32_t kv_head;
  int32_t num_splits;
  int32_t partial_row;
  int32_t prefix_splits;    // 0: no cascade prefix
  int32_t prefix_row;
  int32_t prefix_stride;
  int32_t group_size;       // rows of one kv_head's group: 0 = the launch's; 2G for a kv-head pair
  int32_t reserved[2];
};

// Device plan header: counts read by the kernels (so a captured graph replays any plan).
struct PlanHeader {
  int32_t num_work_items;
  int32_t num_combine_items;
  int32_t reserved[2];
};

// Kernel parameters (passed by value). Strides in elements.
struct AttentionKernelParams {
  // query (T, Hq, D):(q_token_stride, q_head_stride, 1) in the activation dtype, or fp8 e4m3 when
  // query_fp8 (a pre-quantized query: q = q8 * q_scale, the q_scale folded into `scale`)
  const void* query;
  int64_t q_token_stride, q_head_stride;
  int32_t query_fp8;
  // output (T, Hq, D):(o_token_stride, o_head_stride, 1), activation dtype, or fp8 e4m3 when
  // output_scale is given: (1,) f32 on the device, output = o / output_scale[0] (output_store.cuh)
  void* output;
  int64_t o_token_stride, o_head_stride;
  const float* output_scale;
  // output_lse (Hq, T):(lse_head_stride, lse_token_stride) f32 natural log; nullptr = none
  float* lse;
  int64_t lse_head_stride, lse_token_stride;
  // Keys / values. Paged: (num_blocks, block_size, Hkv, D):(block, token, head, 1) (NHD and
  // HND differ only in strides). Not paged (encoder types): (T, Hkv, D):(token, head, 1).
  const void* key;
  const void* value;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  const int32_t* block_table;  // (num_reqs, cols):(block_table_stride, 1)
  int64_t block_table_stride;
  int32_t block_size;
  int32_t paged;
  int64_t num_blocks;          // page ids outside [0, num_blocks) read as zeros (never out of bounds)
  // Plan (builder workspace).
  const PlanHeader* header;
  const WorkItem* items;
  float* partial_out;          // (partial rows, head_size_v) f32
  float* partial_lse;          // (partial rows,) f32, natural log
  // Heads and features. head_size_qk / head_size_v <= D (the kernel's head size), multiples of
  // 8 (16 with an fp8 cache); query / key rows have head_size_qk elements, value / output rows
  // head_size_v.
  int32_t head_size_qk, head_size_v;
  int32_t num_heads, num_kv_heads, group_size;
  int32_t fp8_format;          // 0: 16-bit KV, 1: e4m3, 2: e5m2
  float scale;                 // softmax scale (times q_scale for an e4m3 query)
  float k_scale, v_scale;      // fp8 dequantization (1 otherwise)
  const float* k_scale_per_head;  // (Hkv,) or nullptr
  const float* v_scale_per_head;
  float soft_cap;              // 0 = none
  const float* alibi_slopes;   // (Hq,) or nullptr
  const float* sinks;          // (Hq,) or nullptr
  // Visibility of key k for a query at position p: p - window_left <= k <= p + window_right
  // (-1 = unbounded on that side); causal decoder: window_right = 0.
  int32_t window_left, window_right;
};

struct CombineKernelParams {
  const PlanHeader* header;
  const CombineItem* items;
  const float* partial_out;
  const float* partial_lse;
  void* output;
  int64_t o_token_stride, o_head_stride;
  const float* output_scale;   // as AttentionKernelParams::output_scale
  float* lse;
  int64_t lse_head_stride, lse_token_stride;
  int32_t group_size;
  int32_t head_size;           // head_size_v: columns of the output and of a partial row
};

}  // namespace pagedattn::cuda
