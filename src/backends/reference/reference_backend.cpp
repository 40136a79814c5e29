// The REFERENCE backend object: capabilities, selector reasons, the metadata builder (plan) and
// the impl parameter checks. The attention math is in reference_attention.cpp.
#include "backends/reference/reference_backend.h"

#include <cmath>
#include <sstream>
#include <string>

#include "backends/host_backend_common.h"
#include "backends/reference/reference_internal.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace reference {
namespace {

using host::accepted_kv_cache_dtypes;
using host::is_accepted_kv_cache_dtype;
using host::is_activation_dtype;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Reads element i of a 1-D int tensor on the host (any stride).
int64_t load_index(const TensorView& t, int64_t i) {
  const int64_t offset = i * t.stride(0);
  if (t.dtype() == DType::i64) return t.data_as<const int64_t>()[offset];
  return t.data_as<const int32_t>()[offset];
}

class ReferenceBackend final : public AttentionBackend {
 public:
  std::string_view name() const override { return "REFERENCE"; }

  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<ReferenceAttentionImpl>(params);
  }

  std::unique_ptr<AttentionMetadataBuilder> make_builder(const KVCacheSpec& spec,
                                                         const BuilderConfig& config,
                                                         Device device) const override {
    PAGEDATTN_CHECK(device == Device::cpu, "device",
                    "REFERENCE make_builder: device = ", device_name(device),
                    " is not supported: the REFERENCE backend runs on the cpu");
    PAGEDATTN_CHECK(spec.kind != KVCacheSpecKind::mla, "spec",
                    "REFERENCE make_builder: spec kind = mla is not supported: the REFERENCE "
                    "backend has no MLA path yet");
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
    if (config.device != Device::cpu) {
      add("device = ", device_name(config.device),
          " is not supported: the REFERENCE backend runs on the cpu only.");
    }
    if (config.use_mla) {
      add("use_mla = true is not supported: the REFERENCE backend has no MLA path yet "
          "(it computes standard multi-head attention only).");
    }
    if (config.use_sparse) {
      add("use_sparse = true is not supported: the REFERENCE backend computes dense attention "
          "only.");
    }
    if (!is_activation_dtype(config.dtype)) {
      add("dtype = ", dtype_name(config.dtype),
          " is not supported: the REFERENCE backend supports float32, float16 and bfloat16 "
          "activations.");
    }
    if (!is_accepted_kv_cache_dtype(config.kv_cache_dtype)) {
      add("kv_cache_dtype = '", config.kv_cache_dtype, "' is not supported: expected one of ",
          accepted_kv_cache_dtypes(), ".");
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
        "cascade", "fp8_output",        "head_size_v", "fp8_kv_cache", "per_head_kv_scales",
        "gqa",     "non_causal_decoder"};
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

ReferenceMetadataBuilder::ReferenceMetadataBuilder(KVCacheSpec spec, BuilderConfig config)
    : AttentionMetadataBuilder(std::move(spec)), config_(std::move(config)) {}

std::shared_ptr<const AttentionMetadata> ReferenceMetadataBuilder::build(
    int common_prefix_len, const CommonAttentionMetadata& common, bool /*fast_build*/) {
  const char* who = "REFERENCE build: ";
  PAGEDATTN_CHECK(common_prefix_len >= 0, "common_prefix_len", who,
                  "common_prefix_len = ", common_prefix_len, " must be >= 0");
  common.validate(-1, spec_.block_size);
  // A CPU builder reads every array on the host.
  check_device(common.query_start_loc, "common.query_start_loc", Device::cpu);
  check_device(common.seq_lens, "common.seq_lens", Device::cpu);
  check_device(common.block_table_tensor, "common.block_table_tensor", Device::cpu);
  check_device(common.slot_mapping, "common.slot_mapping", Device::cpu);

  const AttentionType type = config_.attn_type;
  const bool cached = uses_kv_cache(type);
  const int num_reqs = common.num_reqs;
  PAGEDATTN_CHECK(num_reqs <= config_.max_num_seqs, "common.num_reqs", who, "num_reqs = ", num_reqs,
                  " exceeds the builder's max_num_seqs = ", config_.max_num_seqs);
  PAGEDATTN_CHECK(
      common.num_actual_tokens <= config_.max_num_batched_tokens, "common.num_actual_tokens", who,
      "num_actual_tokens = ", common.num_actual_tokens,
      " exceeds the builder's max_num_batched_tokens = ", config_.max_num_batched_tokens);
  if (type != AttentionType::encoder_decoder) {
    PAGEDATTN_CHECK(common.max_seq_len <= config_.max_model_len, "common.max_seq_len", who,
                    "max_seq_len = ", common.max_seq_len,
                    " exceeds the builder's max_model_len = ", config_.max_model_len);
  }

  auto md = std::make_shared<ReferenceAttentionMetadata>();
  md->num_actual_tokens = common.num_actual_tokens;
  md->num_reqs = num_reqs;
  md->attn_type = type;
  md->causal = type == AttentionType::decoder && common.causal;
  md->block_size = spec_.block_size;
  md->max_query_len = common.max_query_len;
  md->max_seq_len = common.max_seq_len;
  md->query_start_loc.resize(static_cast<size_t>(num_reqs) + 1);
  md->seq_lens.resize(static_cast<size_t>(num_reqs));
  for (int r = 0; r <= num_reqs; ++r)
    md->query_start_loc[r] = static_cast<int32_t>(load_index(common.query_start_loc_cpu, r));
  for (int r = 0; r < num_reqs; ++r)
    md->seq_lens[r] = static_cast<int32_t>(load_index(common.seq_lens_cpu, r));

  if (!cached) {
    for (int r = 0; r < num_reqs; ++r) {
      PAGEDATTN_CHECK(md->seq_lens[r] == md->query_len(r), "common.seq_lens", who, "seq_lens[", r,
                      "] = ", md->seq_lens[r], " must equal the query length ", md->query_len(r),
                      " for attn_type = ", attention_type_name(type), " (no KV cache)");
    }
  } else {
    const TensorView& bt = common.block_table_tensor;  // (>= num_reqs, cols) i32
    const int cols = static_cast<int>(bt.size(1));
    const int64_t needed = cdiv(md->max_seq_len, spec_.block_size);
    PAGEDATTN_CHECK(num_reqs == 0 || needed <= cols, "common.block_table_tensor", who,
                    "block_table_tensor has ", cols, " columns: max_seq_len = ", md->max_seq_len,
                    " with block_size = ", spec_.block_size, " needs ", needed);
    md->block_table_cols = cols;
    md->block_table.resize(static_cast<size_t>(num_reqs) * cols);
    const int32_t* base = bt.data_as<const int32_t>();
    for (int r = 0; r < num_reqs; ++r) {
      for (int c = 0; c < cols; ++c) {
        md->block_table[static_cast<size_t>(r) * cols + c] =
            base[r * bt.stride(0) + c * bt.stride(1)];
      }
    }
  }

  // Slots written this step: the first num_actual_tokens for self-attention; for cross-attention
  // the slots map encoder tokens (their count is not num_actual_tokens), so all are kept.
  const int64_t num_slots = type == AttentionType::encoder_decoder ? common.slot_mapping.size(0)
                                                                   : common.num_actual_tokens;
  md->slot_mapping_storage = Tensor(Shape{num_slots}, DType::i64, Device::cpu);
  int64_t* slots = md->slot_mapping_storage.data_as<int64_t>();
  for (int64_t i = 0; i < num_slots; ++i) slots[i] = load_index(common.slot_mapping, i);
  md->slot_mapping = md->slot_mapping_storage.view();

  // Cascade (see the class comment). A prefix the plan cannot use is ignored (plain path).
  const bool cascade_allowed = type == AttentionType::decoder && md->causal &&
                               !config_.sliding_window && !config_.use_alibi && num_reqs > 0;
  if (common_prefix_len > 0 && cascade_allowed) {
    PAGEDATTN_CHECK(common_prefix_len % spec_.block_size == 0, "common_prefix_len", who,
                    "common_prefix_len = ", common_prefix_len,
                    " must be a multiple of block_size = ", spec_.block_size);
    const int prefix_blocks = common_prefix_len / spec_.block_size;
    for (int r = 0; r < num_reqs; ++r) {
      const int computed = md->seq_lens[r] - md->query_len(r);
      PAGEDATTN_CHECK(common_prefix_len <= computed, "common_prefix_len", who,
                      "common_prefix_len = ", common_prefix_len,
                      " exceeds num_computed_tokens = ", computed, " of request ", r,
                      ": the common prefix must be cached for every request");
      for (int b = 0; b < prefix_blocks; ++b) {
        PAGEDATTN_CHECK(md->block_row(r)[b] == md->block_row(0)[b], "common_prefix_len", who,
                        "common_prefix_len = ", common_prefix_len, " spans block column ", b,
                        " but request ", r, " has block ", md->block_row(r)[b],
                        " there and request 0 has ", md->block_row(0)[b],
                        ": the prefix blocks must be shared");
      }
    }
    md->use_cascade = true;
    md->common_prefix_len = common_prefix_len;
  }
  return md;
}

}  // namespace reference

const AttentionBackend& reference_backend() {
  static const reference::ReferenceBackend backend;
  return backend;
}

}  // namespace pagedattn
