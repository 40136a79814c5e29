// Defaults of the backend interface (include/pagedattn/backend.h): the standard cache shape and
// stride order, cache allocation, make_builder (the local-attention builder for chunked local
// specs, the backend's own builder otherwise), and the builder defaults (cascade heuristic,
// drafting build, batch reorder).
#include <algorithm>
#include <cmath>
#include <optional>
#include <span>
#include <string>

#include "backends/local_attention_builder.h"
#include "pagedattn/backend.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"

namespace pagedattn {

void AttentionImpl::check_query_dtype(const LayerScales& scales, const TensorView& query,
                                      std::string_view who) const {
  if (query.dtype() != DType::fp8_e4m3) {
    const DType activation[] = {params_.dtype};
    check_dtype(query, "query", activation);
    return;
  }
  PAGEDATTN_CHECK(supports_quant_query_input(), "query", who, " forward: query is ", query.describe(),
                  " but a quantized (fp8_e4m3) query needs an fp8 KV cache (kv_cache_dtype = ",
                  params_.kv_cache_dtype, "): expected ", dtype_name(params_.dtype));
  PAGEDATTN_CHECK(std::isfinite(scales.q_scale) && scales.q_scale > 0.f, "scales.q_scale", who,
                  " forward: q_scale = ", scales.q_scale,
                  " must be a positive finite number for an fp8_e4m3 query");
}

std::string MLADimensions::to_string() const {
  return "MLADimensions(kv_lora_rank=" + std::to_string(kv_lora_rank) +
         ", qk_nope_head_dim=" + std::to_string(qk_nope_head_dim) +
         ", qk_rope_head_dim=" + std::to_string(qk_rope_head_dim) +
         ", v_head_dim=" + std::to_string(v_head_dim) + ")";
}

Shape AttentionBackend::kv_cache_shape(int64_t num_blocks, int block_size, int num_kv_heads,
                                       int head_size, std::string_view cache_dtype) const {
  const std::string backend(name());
  PAGEDATTN_CHECK(num_blocks >= 0, "num_blocks", backend, ": kv_cache_shape: num_blocks = ",
                  num_blocks, " must be >= 0");
  PAGEDATTN_CHECK(block_size > 0, "block_size", backend, ": kv_cache_shape: block_size = ",
                  block_size, " must be > 0");
  PAGEDATTN_CHECK(num_kv_heads > 0, "num_kv_heads", backend,
                  ": kv_cache_shape: num_kv_heads = ", num_kv_heads, " must be > 0");
  PAGEDATTN_CHECK(head_size > 0, "head_size", backend, ": kv_cache_shape: head_size = ",
                  head_size, " must be > 0");
  validate_kv_cache_dtype(cache_dtype);
  // (2, num_blocks, block_size, num_kv_heads, head_size): [0] keys, [1] values (kv_cache.h).
  return Shape{2, num_blocks, block_size, num_kv_heads, head_size};
}

std::vector<int> AttentionBackend::kv_cache_stride_order() const {
  return standard_kv_cache_stride_order(get_kv_cache_layout());
}

Tensor AttentionBackend::allocate_kv_cache(int64_t num_blocks, int block_size, int num_kv_heads,
                                           int head_size, DType storage_dtype,
                                           Device device) const {
  PAGEDATTN_CHECK(is_floating(storage_dtype), "storage_dtype", name(),
                  ": allocate_kv_cache: storage_dtype = ", dtype_name(storage_dtype),
                  " is not a cache dtype: expected float32, float16, bfloat16, fp8_e4m3 or fp8_e5m2");
  // The storage dtype's name is a valid kv_cache_dtype string ("bfloat16", "fp8_e4m3", ...).
  const Shape shape =
      kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype_name(storage_dtype));
  const std::vector<int> order = kv_cache_stride_order();
  PAGEDATTN_CHECK(static_cast<int>(order.size()) == shape.ndim(), "kv_cache_stride_order", name(),
                  ": kv_cache_stride_order has ", order.size(), " entries but kv_cache_shape ",
                  shape.str(), " has ", shape.ndim(), " dims");
  return allocate_paged_cache(shape, order, storage_dtype, device);
}

void DcpConfig::validate(int block_size) const {
  PAGEDATTN_CHECK(world_size >= 1, "dcp.world_size", "DCP: dcp.world_size = ", world_size, " must be >= 1");
  PAGEDATTN_CHECK(rank >= 0 && rank < world_size, "dcp.rank", "DCP: dcp.rank = ", rank,
                  " must be in [0, world_size = ", world_size, ")");
  PAGEDATTN_CHECK(interleave >= 1 && block_size % interleave == 0, "dcp.interleave", "DCP: dcp.interleave = ",
                  interleave, " must be >= 1 and divide the block size ", block_size,
                  " (a block holds whole interleave groups)");
}

std::unique_ptr<AttentionMetadataBuilder> AttentionBackend::make_builder(
    const KVCacheSpec& spec, const BuilderConfig& config, Device device) const {
  PAGEDATTN_CHECK(config.num_speculative_tokens >= 0 &&
                      int64_t{config.num_speculative_tokens} + 1 <= config.max_num_batched_tokens,
                  "config.num_speculative_tokens", name(), " make_builder: config.num_speculative_tokens = ",
                  config.num_speculative_tokens, " must be >= 0 and leave room for the 1 + k tokens of a ",
                  "speculative decode in max_num_batched_tokens = ", config.max_num_batched_tokens);
  if (spec.kind != KVCacheSpecKind::chunked_local_attention) {
    return make_backend_builder(spec, config, device);
  }
  PAGEDATTN_CHECK(as_mla() == nullptr, "spec", name(), " make_builder: spec ", spec.describe(),
                  " is chunked local attention but ", name(),
                  " is an MLA backend: MLA layers have no attention_chunk_size");
  local_attention::check_local_attention_spec(spec, config, name());
  return local_attention::make_local_attention_builder(
      spec, config, device,
      make_backend_builder(local_attention::inner_spec(spec),
                           local_attention::inner_config(spec, config), device));
}

bool AttentionMetadataBuilder::use_cascade_attention(int common_prefix_len,
                                                     std::span<const int32_t> query_lens,
                                                     int num_query_heads, int num_kv_heads,
                                                     bool use_alibi, bool use_sliding_window,
                                                     bool use_local_attention, int num_sms) const {
  if (!supports_cascade()) return false;
  return pagedattn::use_cascade_attention(common_prefix_len, query_lens, num_query_heads,
                                          num_kv_heads, use_alibi, use_sliding_window,
                                          use_local_attention, num_sms);
}

std::shared_ptr<const AttentionMetadata> AttentionMetadataBuilder::build_for_drafting(
    const CommonAttentionMetadata& common, int draft_index) {
  PAGEDATTN_CHECK(draft_index >= 0, "draft_index", "build_for_drafting: draft_index = ",
                  draft_index, " must be >= 0 (the draft step, or token-tree level, of this plan)");
  // vLLM's default: build(common_prefix_len=0, common, fast_build=True). Every draft step of a
  // chain has the same shape of work, so no builder needs to know which one it is.
  return build(0, common, /*fast_build=*/true);
}

std::optional<BatchReorder> AttentionMetadataBuilder::reorder_batch(
    std::span<const int32_t> num_scheduled_tokens) const {
  const int threshold = reorder_batch_threshold();
  if (threshold == 0) return std::nullopt;
  BatchReorder reorder = reorder_batch_to_split_decodes_and_prefills(num_scheduled_tokens, threshold);
  if (!reorder.modified) return std::nullopt;
  return reorder;
}

}  // namespace pagedattn
