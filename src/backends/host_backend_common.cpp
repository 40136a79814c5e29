#include "backends/host_backend_common.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <utility>
#include <tuple>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/ops.h"

namespace pagedattn::host {
namespace {
// Elements [0, n) of a 1-D i32 or i64 host tensor (validated) into `out`; the stride is read
// once (a TensorView::stride() call per element costs more than the copy).
template <typename T>
void read_indices(const TensorView& t, int64_t n, T* out) {
  if (n <= 0) return;
  const int64_t stride = t.stride(0);
  if (t.dtype() == DType::i64) {
    const int64_t* src = t.data_as<const int64_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(src[i * stride]);
  } else {
    const int32_t* src = t.data_as<const int32_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(src[i * stride]);
  }
}

constexpr const char* kKvCacheDtypes[] = {"auto",     "fp8",     "fp8_e4m3", "fp8_e5m2",
                                          "bfloat16", "float16", "float32"};
}  // namespace

void store_rounded_f64(void* data, DType dtype, int64_t index, double value) {
  if (dtype == DType::f32) {
    static_cast<float*>(data)[index] = static_cast<float>(value);
    return;
  }
  // double -> float rounding to odd: truncate toward zero, then set the last bit when inexact.
  float f = static_cast<float>(value);  // round to nearest even
  if (static_cast<double>(f) != value && !std::isnan(value)) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(value)) f = std::nextafter(f, 0.f);
    f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) | 1u);
  }
  store_f32(data, dtype, index, f);
}

bool is_activation_dtype(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

bool is_accepted_kv_cache_dtype(std::string_view s) {
  return std::any_of(std::begin(kKvCacheDtypes), std::end(kKvCacheDtypes),
                     [&](const char* accepted) { return s == accepted; });
}

std::string accepted_kv_cache_dtypes() {
  std::string list;
  for (const char* accepted : kKvCacheDtypes) {
    if (!list.empty()) list += ", ";
    list += accepted;
  }
  return list;
}

std::vector<std::string> kv_cache_dtype_names() {
  return {std::begin(kKvCacheDtypes), std::end(kKvCacheDtypes)};
}

void add_host_selector_reasons(const SelectorConfig& config, std::string_view who,
                               std::vector<std::string>& reasons) {
  if (config.device != Device::cpu) {
    reasons.push_back(detail::concat("device = ", device_name(config.device),
                                     " is not supported: the ", who, " backend runs on the cpu only."));
  }
  if (config.use_sparse) {
    reasons.push_back(detail::concat("use_sparse = true is not supported: the ", who,
                                     " backend computes dense attention only."));
  }
  if (!is_activation_dtype(config.dtype)) {
    reasons.push_back(detail::concat("dtype = ", dtype_name(config.dtype),
                                     " is not supported: the ", who,
                                     " backend supports float32, float16 and bfloat16 activations."));
  }
  if (!is_accepted_kv_cache_dtype(config.kv_cache_dtype)) {
    reasons.push_back(detail::concat("kv_cache_dtype = '", config.kv_cache_dtype,
                                     "' is not supported: expected one of ",
                                     accepted_kv_cache_dtypes(), "."));
  }
}

void check_standard_kv_cache(const AttentionImplParams& params, DType cache_dtype,
                             const TensorView& kv_cache, const HostBatchPlan& plan,
                             std::string_view who, std::string_view entry) {
  const int block_size = plan.block_size;
  const int64_t cache_head_size = std::max(params.head_size, params.value_head_size());
  PAGEDATTN_CHECK(kv_cache.defined(), "kv_cache", who, " ", entry,
                  ": kv_cache is required for attn_type = ", attention_type_name(params.attn_type));
  check_device(kv_cache, "kv_cache", Device::cpu);
  check_ndim(kv_cache, "kv_cache", 5);
  const DType expected[] = {cache_dtype};
  check_dtype(kv_cache, "kv_cache", expected);
  PAGEDATTN_CHECK(kv_cache.size(0) == 2 && kv_cache.size(2) == block_size &&
                      kv_cache.size(3) == params.kv_heads() && kv_cache.size(4) == cache_head_size,
                  "kv_cache", who, " ", entry, ": kv_cache has shape ", kv_cache.shape().str(),
                  ": expected (2, num_blocks, ", block_size, ", ", params.kv_heads(), ", ",
                  cache_head_size, ")");
  // Every block a request reads and every slot written fit this cache (O(1): found at build()).
  plan.cache_footprint.check_fits(kv_cache.size(1), block_size, who, entry);
}

void check_layer_scales(const AttentionImplParams& params, DType cache_dtype,
                        const LayerScales& scales, std::string_view who, std::string_view entry) {
  const DType f32[] = {DType::f32};
  const std::pair<const TensorView*, const char*> per_head[] = {
      {&scales.k_scale_per_head, "scales.k_scale_per_head"},
      {&scales.v_scale_per_head, "scales.v_scale_per_head"}};
  for (const auto& [t, arg] : per_head) {
    if (!t->defined()) continue;
    check_device(*t, arg, Device::cpu);
    check_dtype(*t, arg, f32);
    check_shape(*t, arg, Shape{params.kv_heads()});
  }
  if (is_fp8(cache_dtype)) {
    PAGEDATTN_CHECK(std::isfinite(scales.k_scale) && scales.k_scale > 0.f, "scales.k_scale", who,
                    " ", entry, ": k_scale = ", scales.k_scale,
                    " must be a positive finite number for an fp8 cache");
    PAGEDATTN_CHECK(std::isfinite(scales.v_scale) && scales.v_scale > 0.f, "scales.v_scale", who,
                    " ", entry, ": v_scale = ", scales.v_scale,
                    " must be a positive finite number for an fp8 cache");
  }
}

void write_step_kv_cache(const AttentionImplParams& params, const LayerScales& scales,
                         const TensorView& key, const TensorView& value,
                         const TensorView& kv_cache, const TensorView& slots, std::string_view who,
                         const std::function<void()>& check_cache_and_scales) {
  // encoder / encoder_only keep no cache (as vLLM's do_kv_cache_update, which returns early).
  if (!uses_kv_cache(params.attn_type)) return;
  const int64_t* slot = slots.data_as<const int64_t>();
  const int64_t num_slots = slots.size(0);
  if (!key.defined() && !value.defined()) {
    for (int64_t i = 0; i < num_slots; ++i) {
      PAGEDATTN_CHECK(slot[i] == -1, "key", who, " do_kv_cache_update: key/value are not given ",
                      "but slot_mapping[", i, "] = ", slot[i], " asks for a token to be written");
    }
    return;
  }
  PAGEDATTN_CHECK(key.defined() && value.defined(), key.defined() ? "value" : "key", who,
                  " do_kv_cache_update: key and value must be given together");
  check_cache_and_scales();
  const DType activation[] = {params.dtype};
  for (const auto& [t, arg, dim] : {std::tuple{&key, "key", params.head_size},
                                    std::tuple{&value, "value", params.value_head_size()}}) {
    check_device(*t, arg, Device::cpu);
    check_dtype(*t, arg, activation);
    check_ndim(*t, arg, 3);
    PAGEDATTN_CHECK(
        t->size(0) == key.size(0) && t->size(1) == params.kv_heads() && t->size(2) == dim, arg,
        who, " do_kv_cache_update: ", arg, " has shape ", t->shape().str(), ": expected (",
        key.size(0), ", ", params.kv_heads(), ", ", dim, ")");
  }
  const int64_t num_rows = key.size(0);
  // Slots past the given rows (padding) must all be -1.
  for (int64_t i = num_rows; i < num_slots; ++i) {
    PAGEDATTN_CHECK(slot[i] == -1, "key", who, " do_kv_cache_update: key has ", num_rows,
                    " rows but slot_mapping[", i, "] = ", slot[i], " asks for row ", i);
  }
  const TensorView live_slots = slots.narrow(0, 0, std::min(num_rows, num_slots));
  const KVCacheViews views = split_kv_cache(kv_cache, params.head_size, params.value_head_size());
  // The op checks every slot before it writes a byte (the cache stays untouched on error).
  reshape_and_cache_flash(key, value, views.key_cache, views.value_cache, live_slots,
                          params.kv_cache_dtype, scales);
}

void fill_host_batch_plan(HostBatchPlan& plan, int common_prefix_len,
                          const CommonAttentionMetadata& common, const KVCacheSpec& spec,
                          const BuilderConfig& config, std::string_view who, bool fast_build) {
  PAGEDATTN_CHECK(common_prefix_len >= 0, "common_prefix_len", who,
                  "common_prefix_len = ", common_prefix_len, " must be >= 0");
  common.validate(-1, spec.block_size);
  // A host builder reads every array on the host.
  check_device(common.query_start_loc, "common.query_start_loc", Device::cpu);
  check_device(common.seq_lens, "common.seq_lens", Device::cpu);
  check_device(common.block_table_tensor, "common.block_table_tensor", Device::cpu);
  check_device(common.slot_mapping, "common.slot_mapping", Device::cpu);

  const AttentionType type = config.attn_type;
  const int num_reqs = common.num_reqs;
  PAGEDATTN_CHECK(num_reqs <= config.max_num_seqs, "common.num_reqs", who, "num_reqs = ", num_reqs,
                  " exceeds the builder's max_num_seqs = ", config.max_num_seqs);
  PAGEDATTN_CHECK(
      common.num_actual_tokens <= config.max_num_batched_tokens, "common.num_actual_tokens", who,
      "num_actual_tokens = ", common.num_actual_tokens,
      " exceeds the builder's max_num_batched_tokens = ", config.max_num_batched_tokens);
  if (type != AttentionType::encoder_decoder) {
    PAGEDATTN_CHECK(common.max_seq_len <= config.max_model_len, "common.max_seq_len", who,
                    "max_seq_len = ", common.max_seq_len,
                    " exceeds the builder's max_model_len = ", config.max_model_len);
  }

  plan.num_actual_tokens = common.num_actual_tokens;
  plan.num_reqs = num_reqs;
  plan.batch_invariant = config.batch_invariant;
  plan.attn_type = type;
  plan.causal = type == AttentionType::decoder && common.causal;
  plan.block_size = spec.block_size;
  plan.max_query_len = common.max_query_len;
  plan.max_seq_len = common.max_seq_len;
  plan.query_start_loc.resize(static_cast<size_t>(num_reqs) + 1);
  plan.seq_lens.resize(static_cast<size_t>(num_reqs));
  read_indices(common.query_start_loc_cpu, num_reqs + 1, plan.query_start_loc.data());
  read_indices(common.seq_lens_cpu, num_reqs, plan.seq_lens.data());

  if (!uses_kv_cache(type)) {
    for (int r = 0; r < num_reqs; ++r) {
      PAGEDATTN_CHECK(plan.seq_lens[r] == plan.query_len(r), "common.seq_lens", who, "seq_lens[", r,
                      "] = ", plan.seq_lens[r], " must equal the query length ", plan.query_len(r),
                      " for attn_type = ", attention_type_name(type), " (no KV cache)");
    }
  } else {
    const TensorView& bt = common.block_table_tensor;  // (>= num_reqs, cols) i32
    const int cols = static_cast<int>(bt.size(1));
    const int64_t needed = (static_cast<int64_t>(plan.max_seq_len) + spec.block_size - 1) /
                           spec.block_size;
    PAGEDATTN_CHECK(num_reqs == 0 || needed <= cols, "common.block_table_tensor", who,
                    "block_table_tensor has ", cols, " columns: max_seq_len = ", plan.max_seq_len,
                    " with block_size = ", spec.block_size, " needs ", needed);
    plan.block_table_cols = cols;
    plan.block_table.resize(static_cast<size_t>(num_reqs) * cols);
    const int32_t* base = bt.data_as<const int32_t>();
    const int64_t row_stride = bt.stride(0), col_stride = bt.stride(1);  // hoisted: per-element
                                                                        // stride() calls cost
                                                                        // more than the copy
    for (int r = 0; r < num_reqs; ++r) {
      int32_t* dst = plan.block_table.data() + static_cast<size_t>(r) * cols;
      const int32_t* src = base + r * row_stride;
      if (col_stride == 1) {
        std::copy(src, src + cols, dst);
      } else {
        for (int c = 0; c < cols; ++c) dst[c] = src[c * col_stride];
      }
    }
    plan.cache_footprint = kv_cache_footprint(common, spec.block_size);
  }

  const int64_t num_slots = type == AttentionType::encoder_decoder ? common.slot_mapping.size(0)
                                                                   : common.num_actual_tokens;
  plan.slot_mapping_storage = Tensor(Shape{num_slots}, DType::i64, Device::cpu);
  int64_t* slots = plan.slot_mapping_storage.data_as<int64_t>();
  read_indices(common.slot_mapping, num_slots, slots);
  plan.slot_mapping = plan.slot_mapping_storage.view();

  const bool cascade_allowed = type == AttentionType::decoder && plan.causal &&
                               !config.sliding_window && !config.use_alibi && num_reqs > 0;
  if (common_prefix_len > 0 && cascade_allowed && !fast_build && !config.batch_invariant) {
    PAGEDATTN_CHECK(common_prefix_len % spec.block_size == 0, "common_prefix_len", who,
                    "common_prefix_len = ", common_prefix_len,
                    " must be a multiple of block_size = ", spec.block_size);
    const int prefix_blocks = common_prefix_len / spec.block_size;
    for (int r = 0; r < num_reqs; ++r) {
      const int computed = plan.seq_lens[r] - plan.query_len(r);
      PAGEDATTN_CHECK(common_prefix_len <= computed, "common_prefix_len", who,
                      "common_prefix_len = ", common_prefix_len,
                      " exceeds num_computed_tokens = ", computed, " of request ", r,
                      ": the common prefix must be cached for every request");
      for (int b = 0; b < prefix_blocks; ++b) {
        PAGEDATTN_CHECK(plan.block_row(r)[b] == plan.block_row(0)[b], "common_prefix_len", who,
                        "common_prefix_len = ", common_prefix_len, " spans block column ", b,
                        " but request ", r, " has block ", plan.block_row(r)[b],
                        " there and request 0 has ", plan.block_row(0)[b],
                        ": the prefix blocks must be shared");
      }
    }
    plan.use_cascade = true;
    plan.common_prefix_len = common_prefix_len;
  }
}

}  // namespace pagedattn::host
