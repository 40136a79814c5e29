// Internal classes of the REFERENCE backend: its plan (metadata), builder and impl.
// Shared by reference_backend.cpp (backend, builder, checks) and reference_attention.cpp (math).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/tensor.h"

namespace pagedattn::reference {

inline constexpr int kMaxHeadSize = 1024;

// The plan: the host arrays only (host_backend_common.h); the reference needs nothing more.
struct ReferenceAttentionMetadata final : host::HostBatchPlan {};

class ReferenceMetadataBuilder final : public AttentionMetadataBuilder {
 public:
  ReferenceMetadataBuilder(KVCacheSpec spec, BuilderConfig config);
  // Copies the host mirrors, block table and slot mapping into the plan; validates the common
  // metadata. use_cascade = common_prefix_len > 0 && decoder (causal) && no window && no ALiBi
  // (the reference always takes the cascade path when it may, so that path is tested); the
  // prefix must be a multiple of block_size, at most every request's num_computed_tokens, and
  // its blocks must be shared (same ids) by every request. fast_build: never cascade (the
  // plan has nothing else to choose).
  std::shared_ptr<const AttentionMetadata> build(int common_prefix_len,
                                                 const CommonAttentionMetadata& common,
                                                 bool fast_build = false) override;
  bool supports_cascade() const override { return !config_.batch_invariant; }  // no cascade in the mode
  int reorder_batch_threshold() const override { return speculative_decode_threshold(config_); }

 private:
  BuilderConfig config_;
};

class ReferenceAttentionImpl final : public AttentionImpl {
 public:
  explicit ReferenceAttentionImpl(AttentionImplParams params);

  void do_kv_cache_update(const LayerScales& scales, const TensorView& key, const TensorView& value,
                          const TensorView& kv_cache, const AttentionMetadata& metadata) override;
  void check_forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
                     const TensorView& value, const TensorView& kv_cache,
                     const AttentionMetadata& metadata, const TensorView& output,
                     const TensorView& output_scale = {},
                     const TensorView& output_lse = {}) const override;
  void forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
               const TensorView& value, const TensorView& kv_cache,
               const AttentionMetadata& metadata, const TensorView& output,
               const TensorView& output_scale = {}, const TensorView& output_lse = {}) override;

  bool can_return_lse_for_decode() const override { return true; }
  // The query is never quantized: LayerScales::q_scale is ignored (vLLM only applies q_scale
  // when the impl declares quantized query input).
  bool supports_quant_query_input() const override;  // fp8 caches: an e4m3 query times q_scale
  bool fused_output_quant_supported(const QuantKey& key) const override;

 private:
  // Checks shared by do_kv_cache_update and forward. Throw Error naming the argument.
  const ReferenceAttentionMetadata& checked_metadata(const AttentionMetadata& metadata,
                                                     std::string_view entry) const;
  void check_kv_cache(const TensorView& kv_cache, const ReferenceAttentionMetadata& metadata,
                      std::string_view entry) const;
  void check_scales(const LayerScales& scales, std::string_view entry) const;
  DType cache_dtype_;  // storage dtype of the cache
};

// Throws Error naming the offending parameter when the REFERENCE cannot run `params`.
void check_impl_params(const AttentionImplParams& params);

}  // namespace pagedattn::reference
