// The REFERENCE backend object: capabilities, selector reasons, the metadata builder (plan) and
// the impl parameter checks. The attention math is in reference_attention.cpp.
#include "backends/reference/reference_backend.h"

#include <cmath>
#include <sstream>
#include <string>

#include "backends/host_backend_common.h"
#include "backends/reference/reference_internal.h"
#include "pagedattn/batch_invariance.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace reference {
namespace {

using host::accepted_kv_cache_dtypes;
using host::is_accepted_kv_cache_dtype;
using host::is_activation_dtype;

class ReferenceBackend final : public AttentionBackend {
 public:
  std::string_view name() const override { return "REFERENCE"; }

  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<ReferenceAttentionImpl>(params);
  }

  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(const KVCacheSpec& spec,
                                                                 const BuilderConfig& config,
                                                                 Device device) const override {
    PAGEDATTN_CHECK(device == Device::cpu, "device",
                    "REFERENCE make_builder: device = ", device_name(device),
                    " is not supported: the REFERENCE backend runs on the cpu");
    PAGEDATTN_CHECK(spec.kind != KVCacheSpecKind::mla, "spec",
                    "REFERENCE make_builder: spec kind = mla is not supported: the REFERENCE "
                    "backend computes standard attention; MLA layers use REFERENCE_MLA");
    PAGEDATTN_CHECK(spec.block_size > 0, "spec.block_size",
                    "REFERENCE make_builder: block_size = ", spec.block_size, " must be positive");
    return std::make_unique<ReferenceMetadataBuilder>(spec, config);
  }

  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override {
    return {MultipleOf{1}};
  }

  std::vector<std::string> validate_configuration(const SelectorConfig& config) const override {
    std::vector<std::string> reasons;
    auto add = [&reasons](auto&&... parts) {
      reasons.push_back(detail::concat(std::forward<decltype(parts)>(parts)...));
    };
    host::add_host_selector_reasons(config, "REFERENCE", reasons);
    if (config.use_mla) {
      add("use_mla = true is not supported: the REFERENCE backend computes standard multi-head "
          "attention only; the fp64 MLA oracle is the REFERENCE_MLA backend.");
    }
    if (config.head_size < 1 || config.head_size > kMaxHeadSize) {
      add("head_size = ", config.head_size,
          " is not supported: the REFERENCE backend supports "
          "head sizes 1 to ",
          kMaxHeadSize, ".");
    }
    if (config.head_size_v < 0 || config.head_size_v > kMaxHeadSize) {
      add("head_size_v = ", config.head_size_v,
          " is not supported: the REFERENCE backend supports "
          "value head sizes 1 to ",
          kMaxHeadSize, " (0 = head_size).");
    }
    const auto block_sizes = supported_kernel_block_sizes();
    if (!block_size_supported(block_sizes, config.block_size)) {
      add("block_size = ", config.block_size,
          " is not supported: the REFERENCE backend supports "
          "block sizes that are ",
          describe_block_sizes(block_sizes), ".");
    }
    if (config.attn_type == AttentionType::encoder_decoder && config.use_sliding_window) {
      add("use_sliding_window = true with attn_type = encoder_decoder is not supported: "
          "cross-attention has no query/key position relation for a window to apply to.");
    }
    if (config.attn_type == AttentionType::encoder_decoder && config.use_alibi) {
      add("use_alibi = true with attn_type = encoder_decoder is not supported: cross-attention "
          "has no query/key distance for ALiBi to apply to.");
    }
    return reasons;
  }

  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.devices = {Device::cpu};
    caps.dtypes = {DType::f32, DType::f16, DType::bf16};
    caps.kv_cache_dtypes = host::kv_cache_dtype_names();
    caps.head_sizes = {};  // any size 1..kMaxHeadSize
    caps.attn_types = {AttentionType::decoder, AttentionType::encoder, AttentionType::encoder_only,
                       AttentionType::encoder_decoder};
    caps.features = {
        "alibi",   "sliding_window",    "soft_cap",    "sinks",        "lse",
        "cascade", "fp8_output",        "quant_query", "head_size_v", "fp8_kv_cache", "per_head_kv_scales",
        "gqa",     "non_causal_decoder", "batch_invariant"};
    return caps;
  }
};

}  // namespace

// ---- impl parameters ------------------------------------------------------------------------

void check_impl_params(const AttentionImplParams& p) {
  const char* who = "REFERENCE AttentionImpl: ";
  PAGEDATTN_CHECK(p.device == Device::cpu, "device", who, "device = ", device_name(p.device),
                  " is not supported: the REFERENCE backend runs on the cpu");
  PAGEDATTN_CHECK(is_activation_dtype(p.dtype), "dtype", who, "dtype = ", dtype_name(p.dtype),
                  " is not supported: expected float32, float16 or bfloat16");
  PAGEDATTN_CHECK(is_accepted_kv_cache_dtype(p.kv_cache_dtype), "kv_cache_dtype", who,
                  "kv_cache_dtype = '", p.kv_cache_dtype, "' is not supported: expected one of ",
                  accepted_kv_cache_dtypes());
  PAGEDATTN_CHECK(p.num_heads > 0, "num_heads", who, "num_heads = ", p.num_heads,
                  " must be positive");
  PAGEDATTN_CHECK(p.num_kv_heads >= 0, "num_kv_heads", who, "num_kv_heads = ", p.num_kv_heads,
                  " must be >= 0 (0 = num_heads)");
  PAGEDATTN_CHECK(p.num_heads % p.kv_heads() == 0, "num_kv_heads", who,
                  "num_kv_heads = ", p.kv_heads(), " must divide num_heads = ", p.num_heads);
  PAGEDATTN_CHECK(p.head_size >= 1 && p.head_size <= kMaxHeadSize, "head_size", who,
                  "head_size = ", p.head_size, " is not supported: expected 1 to ", kMaxHeadSize);
  PAGEDATTN_CHECK(p.head_size_v >= 0 && p.head_size_v <= kMaxHeadSize, "head_size_v", who,
                  "head_size_v = ", p.head_size_v,
                  " is not supported: expected 0 (= head_size) or 1 to ", kMaxHeadSize);
  PAGEDATTN_CHECK(p.block_size > 0, "block_size", who, "block_size = ", p.block_size,
                  " must be positive");
  PAGEDATTN_CHECK(std::isfinite(p.scale), "scale", who, "scale = ", p.scale, " must be finite");
  PAGEDATTN_CHECK(p.alibi_slopes.empty() || static_cast<int>(p.alibi_slopes.size()) == p.num_heads,
                  "alibi_slopes", who, "alibi_slopes has ", p.alibi_slopes.size(),
                  " entries: expected none or num_heads = ", p.num_heads);
  for (size_t h = 0; h < p.alibi_slopes.size(); ++h) {
    PAGEDATTN_CHECK(std::isfinite(p.alibi_slopes[h]), "alibi_slopes", who, "alibi_slopes[", h,
                    "] = ", p.alibi_slopes[h], " must be finite");
  }
  PAGEDATTN_CHECK(p.sinks.empty() || static_cast<int>(p.sinks.size()) == p.num_heads, "sinks", who,
                  "sinks has ", p.sinks.size(),
                  " entries: expected none or num_heads = ", p.num_heads);
  for (size_t h = 0; h < p.sinks.size(); ++h) {
    PAGEDATTN_CHECK(std::isfinite(p.sinks[h]), "sinks", who, "sinks[", h, "] = ", p.sinks[h],
                    " must be finite");
  }
  if (p.sliding_window) {
    PAGEDATTN_CHECK(*p.sliding_window >= 1, "sliding_window", who,
                    "sliding_window = ", *p.sliding_window,
                    " must be >= 1 (or not given for full attention)");
  }
  if (p.logits_soft_cap) {
    PAGEDATTN_CHECK(std::isfinite(*p.logits_soft_cap) && *p.logits_soft_cap > 0.f,
                    "logits_soft_cap", who, "logits_soft_cap = ", *p.logits_soft_cap,
                    " must be a positive finite number (or not given)");
  }
  if (p.attn_type == AttentionType::encoder_decoder) {
    PAGEDATTN_CHECK(!p.sliding_window, "sliding_window", who,
                    "sliding_window = ", *p.sliding_window,
                    " is not supported with attn_type = encoder_decoder: "
                    "cross-attention has no query/key position relation for a window");
    PAGEDATTN_CHECK(p.alibi_slopes.empty(), "alibi_slopes", who,
                    "alibi_slopes are not supported with attn_type = encoder_decoder: "
                    "cross-attention has no query/key distance for ALiBi");
  }
}

// ---- builder ----------------------------------------------------------------------------------

// Batch-invariant mode: rows are computed independently in fp64 whatever the batch; the mode
// only turns the cascade path off (its prefix/suffix merge rounds differently).
ReferenceMetadataBuilder::ReferenceMetadataBuilder(KVCacheSpec spec, BuilderConfig config)
    : AttentionMetadataBuilder(std::move(spec)), config_(std::move(config)) {
  config_.batch_invariant = batch_invariant_mode(config_);
}

std::shared_ptr<const AttentionMetadata> ReferenceMetadataBuilder::build(
    int common_prefix_len, const CommonAttentionMetadata& common, bool fast_build) {
  auto md = std::make_shared<ReferenceAttentionMetadata>();
  host::fill_host_batch_plan(*md, common_prefix_len, common, spec_, config_, "REFERENCE build: ",
                             fast_build);
  return md;
}

}  // namespace reference

const AttentionBackend& reference_backend() {
  static const reference::ReferenceBackend backend;
  return backend;
}

}  // namespace pagedattn
