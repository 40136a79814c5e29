// KV cache: specs (how much memory a layer's cache needs), layouts, and the block pool.
//
// The paged cache of a standard (non-MLA) layer is ONE tensor whose logical shape is
//     (2, num_blocks, block_size, num_kv_heads, head_size)        [0] = keys, [1] = values
// and whose physical order is the backend's kv_cache_stride_order():
//     NHD: (0, 1, 2, 3, 4)  -> pages of [block_size][num_kv_heads][head_size]
//     HND: (0, 1, 3, 2, 4)  -> pages of [num_kv_heads][block_size][head_size]
// It is allocated contiguous in physical order and handed around as the logical-order view with
// permuted strides (as vLLM does). When head_size_v != head_size the cache's last dim is
// max(head_size, head_size_v): keys use [:head_size], values use [:head_size_v].
// An MLA cache is (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim), one latent per token.
// slot = block_id * block_size + offset_in_block (int64); slot -1 = "do not write".
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pagedattn/dtype.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

// ---- layout ---------------------------------------------------------------------------------
enum class KVCacheLayout { NHD, HND };
std::string_view kv_cache_layout_name(KVCacheLayout layout);
KVCacheLayout parse_kv_cache_layout(std::string_view name);  // throws Error naming "kv_cache_layout"
// Order of precedence (as vLLM): set_kv_cache_layout override > env PAGEDATTN_KV_CACHE_LAYOUT
// (NHD|HND; anything else is an Error) > NHD.
KVCacheLayout get_kv_cache_layout();
void set_kv_cache_layout(std::optional<KVCacheLayout> layout);  // nullopt clears the override
// Stride order of the standard 5-D cache for a layout (see above).
std::vector<int> standard_kv_cache_stride_order(KVCacheLayout layout);

// Logical-order views of the key and value halves of a standard cache:
// (num_blocks, block_size, num_kv_heads, head_size[_v]) with the cache's strides.
struct KVCacheViews {
  TensorView key_cache;
  TensorView value_cache;
};
KVCacheViews split_kv_cache(const TensorView& kv_cache, int head_size, int head_size_v);

// Allocates a cache of `logical_shape` stored contiguously in `stride_order`, and returns the
// owning tensor whose view() is the logical-order view with permuted strides.
Tensor allocate_paged_cache(const Shape& logical_shape, std::span<const int> stride_order,
                            DType dtype, Device device = Device::cpu);

// ---- specs (vLLM kv_cache_interface) ----------------------------------------------------------
enum class KVCacheSpecKind { full_attention, sliding_window, chunked_local_attention,
                             cross_attention, mla };
std::string_view kv_cache_spec_kind_name(KVCacheSpecKind kind);

struct KVCacheSpec {
  KVCacheSpecKind kind = KVCacheSpecKind::full_attention;
  int block_size = 16;
  int num_kv_heads = 1;        // MLA: 1
  int head_size = 0;           // MLA: kv_lora_rank + qk_rope_head_dim
  int head_size_v = 0;         // 0 = same as head_size (not used by MLA)
  DType dtype = DType::bf16;   // storage dtype of the cache (fp8_* when quantized)
  int sliding_window = 0;      // kind == sliding_window
  int attention_chunk_size = 0;  // kind == chunked_local_attention

  static KVCacheSpec full_attention(int block_size, int num_kv_heads, int head_size, DType dtype,
                                    int head_size_v = 0);
  static KVCacheSpec sliding_window_attention(int block_size, int num_kv_heads, int head_size,
                                              DType dtype, int sliding_window, int head_size_v = 0);
  static KVCacheSpec chunked_local_attention(int block_size, int num_kv_heads, int head_size,
                                             DType dtype, int attention_chunk_size,
                                             int head_size_v = 0);
  static KVCacheSpec cross_attention(int block_size, int num_kv_heads, int head_size, DType dtype,
                                     int head_size_v = 0);
  static KVCacheSpec mla(int block_size, int latent_head_size, DType dtype);

  int value_head_size() const { return head_size_v > 0 ? head_size_v : head_size; }
  // Bytes of one block for this layer: 2 * block_size * num_kv_heads * max(head_size,
  // head_size_v) * dtype_size (MLA: block_size * head_size * dtype_size).
  int64_t page_size_bytes() const;
  // Most blocks one request can hold at once (vLLM's max_memory_usage_bytes / page_size):
  //   full: cdiv(max_model_len, block_size)
  //   sliding window: cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), bs) + 1
  //   chunked local: cdiv(min(chunk + max_num_batched_tokens, max_model_len), block_size)
  //   cross: cdiv(max_encoder_len, block_size)
  //   mla: as full.
  int64_t max_num_blocks_per_request(int64_t max_model_len, int64_t max_num_batched_tokens,
                                     int64_t max_encoder_len = 0) const;
  int64_t max_memory_usage_bytes(int64_t max_model_len, int64_t max_num_batched_tokens,
                                 int64_t max_encoder_len = 0) const;
  std::string describe() const;
  bool operator==(const KVCacheSpec&) const = default;
};

// ---- block pool ----------------------------------------------------------------------------
// Free list + reference counts. Blocks shared by several requests (a common prefix) are
// incref'd by each sharer and return to the free list when the last one frees them.
class BlockPool {
 public:
  explicit BlockPool(int num_blocks);
  int num_blocks() const { return static_cast<int>(ref_counts_.size()); }
  int num_free_blocks() const { return static_cast<int>(free_list_.size()); }
  bool can_allocate(int n) const { return n >= 0 && n <= num_free_blocks(); }
  // Takes n blocks (ref count 1 each), lowest ids first on a fresh pool. Throws Error naming
  // "num_blocks" when fewer than n are free; nothing is taken then.
  std::vector<int32_t> allocate(int n);
  // Adds one reference to each block (all must be allocated; checked before any change).
  void incref(std::span<const int32_t> blocks);
  // Drops one reference from each (all must be allocated; checked before any change).
  void free(std::span<const int32_t> blocks);
  int ref_count(int32_t block) const;

 private:
  std::vector<int32_t> free_list_;  // used as a stack; back() is handed out next
  std::vector<int32_t> ref_counts_;
};

}  // namespace pagedattn
