#include "backends/host_backend_common.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <tuple>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/ops.h"

namespace pagedattn::host {
namespace {
constexpr const char* kKvCacheDtypes[] = {"auto",     "fp8",     "fp8_e4m3", "fp8_e5m2",
                                          "bfloat16", "float16", "float32"};
}  // namespace

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

}  // namespace pagedattn::host
