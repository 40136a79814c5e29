// The MLABackend defaults (mla.h) and the selector reasons every MLA backend shares.
#include <cmath>
#include <string>
#include <vector>

#include "backends/mla/mla_common.h"
#include "pagedattn/error.h"
#include "pagedattn/mla.h"

namespace pagedattn {

std::unique_ptr<AttentionImpl> MLABackend::make_impl(const AttentionImplParams& /*params*/) const {
  throw Error("params", detail::concat(name(), ": make_impl(AttentionImplParams) is not how an MLA "
                                       "backend makes its impl: use make_mla_impl(MLAImplParams) "
                                       "(through MLAAttention)"));
}

Shape MLABackend::kv_cache_shape(int64_t num_blocks, int block_size, int num_kv_heads,
                                 int head_size, std::string_view cache_dtype) const {
  const std::string backend(name());
  PAGEDATTN_CHECK(num_blocks >= 0, "num_blocks", backend, ": kv_cache_shape: num_blocks = ",
                  num_blocks, " must be >= 0");
  PAGEDATTN_CHECK(block_size > 0, "block_size", backend, ": kv_cache_shape: block_size = ",
                  block_size, " must be > 0");
  PAGEDATTN_CHECK(num_kv_heads == 1, "num_kv_heads", backend, ": kv_cache_shape: num_kv_heads = ",
                  num_kv_heads, ", expected 1 (an MLA cache holds one latent row per token)");
  PAGEDATTN_CHECK(head_size > 0, "head_size", backend, ": kv_cache_shape: head_size = ",
                  head_size, " must be > 0 (kv_lora_rank + qk_rope_head_dim)");
  validate_kv_cache_dtype(cache_dtype);
  // (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim), as vLLM's MLA backends.
  return Shape{num_blocks, block_size, head_size};
}

namespace mla {

void check_mla_impl_params(std::string_view who, const MLAImplParams& q) {
  const MLADimensions& d = q.dims;
  PAGEDATTN_CHECK(q.num_heads > 0, "num_heads", who, ": num_heads = ", q.num_heads, " must be > 0");
  PAGEDATTN_CHECK(d.kv_lora_rank > 0 && d.qk_nope_head_dim > 0 && d.qk_rope_head_dim > 0 &&
                      d.v_head_dim > 0,
                  "dims", who, ": ", d.to_string(), ": every dimension must be > 0");
  PAGEDATTN_CHECK(std::isfinite(q.scale) && q.scale > 0.f, "scale", who, ": scale = ", q.scale,
                  " must be a finite value > 0");
  PAGEDATTN_CHECK(q.block_size > 0, "block_size", who, ": block_size = ", q.block_size,
                  " must be > 0");
}

void add_mla_common_reasons(std::string_view backend_name, const SelectorConfig& c,
                            std::vector<std::string>& reasons, bool fp8_output_supported) {
  const auto add = [&reasons](auto&&... parts) {
    reasons.push_back(detail::concat(std::forward<decltype(parts)>(parts)...));
  };
  if (!c.use_mla) {
    // One reason is enough: nothing else about a standard layer matters to an MLA backend (the
    // backends return right after this too).
    add("use_mla = false is not supported: ", backend_name,
        " is an MLA backend (multi-head latent attention layers only).");
    return;
  }
  if (!c.mla_dimensions.empty() && c.head_size != c.mla_dimensions.latent_head_size()) {
    add("head_size = ", c.head_size, " is not supported: an MLA cache row is kv_lora_rank + "
        "qk_rope_head_dim = ", c.mla_dimensions.latent_head_size(), " for ",
        c.mla_dimensions.to_string(), ".");
  }
  if (c.use_alibi) add("use_alibi = true is not supported: ", backend_name, " has no ALiBi.");
  if (c.use_sliding_window) {
    add("use_sliding_window = true is not supported: ", backend_name,
        " attends over the full context.");
  }
  if (c.use_logits_soft_cap) {
    add("use_logits_soft_cap = true is not supported: ", backend_name, " has no logit soft cap.");
  }
  if (c.has_sink) add("has_sink = true is not supported: ", backend_name, " has no sinks.");
  if (c.use_sparse) {
    add("use_sparse = true is not supported: ", backend_name, " computes dense attention.");
  }
  if (c.attn_type != AttentionType::decoder) {
    add("attn_type = ", attention_type_name(c.attn_type), " is not supported: ", backend_name,
        " supports decoder self-attention only.");
  }
  if (c.fp8_output && !fp8_output_supported) {
    add("fp8_output = true is not supported: ", backend_name,
        " writes its output in the activation dtype.");
  }
  if (c.head_size_v != 0 && c.head_size_v != c.head_size) {
    add("head_size_v = ", c.head_size_v, " is not supported: MLA value heads come from the ",
        "latent (v_head_dim is part of mla_dimensions).");
  }
}

}  // namespace mla
}  // namespace pagedattn
