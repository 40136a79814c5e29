// The Attention layer (vLLM attention/layer.py): validates its parameters, picks a backend
// through the selector, owns the backend's impl, reports its KV-cache spec, and in forward
// checks the activations once (so every backend gets clean inputs), writes the new keys/values
// into the cache (unless it shares another layer's cache) and attends.
//
// Layers without a cache (attn_type encoder / encoder_only) have no KV-cache spec:
// kv_cache_spec() and allocate_kv_cache() throw Error naming "attn_type" for them; callers that
// walk every layer skip them with uses_kv_cache(layer.params().attn_type) (as vLLM's model
// runner skips encoder-only layers). A kv-sharing layer reports the spec of the cache it reads
// (equal to its target's); the caller does not allocate a cache for it. Such a layer is created
// with the model's StaticForwardContext (layer.h), which checks its target when it is created.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "layer/layer_registration.h"
#include "ops/kv_amax.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/selector.h"

namespace pagedattn {
namespace {

// Checks every layer parameter; errors name the argument and the layer.
void validate_layer_params(const AttentionLayerParams& p) {
  const std::string& layer = p.prefix;
  PAGEDATTN_CHECK(p.num_heads > 0, "num_heads", "Attention '", layer, "': num_heads = ",
                  p.num_heads, " must be > 0");
  PAGEDATTN_CHECK(p.head_size > 0, "head_size", "Attention '", layer, "': head_size = ",
                  p.head_size, " must be > 0");
  PAGEDATTN_CHECK(p.head_size_v >= 0, "head_size_v", "Attention '", layer, "': head_size_v = ",
                  p.head_size_v, " must be > 0 (or 0 = head_size)");
  PAGEDATTN_CHECK(p.num_kv_heads.value_or(1) > 0, "num_kv_heads", "Attention '", layer,
                  "': num_kv_heads = ", p.num_kv_heads.value_or(0),
                  " must be > 0 (or unset = num_heads)");
  const int kv_heads = p.num_kv_heads.value_or(p.num_heads);
  PAGEDATTN_CHECK(p.num_heads % kv_heads == 0, "num_kv_heads", "Attention '", layer,
                  "': num_kv_heads = ", kv_heads, " must divide num_heads = ", p.num_heads);
  PAGEDATTN_CHECK(!p.scale || (std::isfinite(*p.scale) && *p.scale > 0.f), "scale", "Attention '",
                  layer, "': scale = ", p.scale.value_or(0.f),
                  " must be a finite value > 0 (or unset = head_size^-0.5)");
  PAGEDATTN_CHECK(p.alibi_slopes.empty() ||
                      static_cast<int>(p.alibi_slopes.size()) == p.num_heads,
                  "alibi_slopes", "Attention '", layer, "': alibi_slopes has ",
                  p.alibi_slopes.size(), " entries, expected num_heads = ", p.num_heads,
                  " (or none)");
  for (size_t h = 0; h < p.alibi_slopes.size(); ++h) {
    PAGEDATTN_CHECK(std::isfinite(p.alibi_slopes[h]), "alibi_slopes", "Attention '", layer,
                    "': alibi_slopes[", h, "] = ", p.alibi_slopes[h], " must be finite");
  }
  PAGEDATTN_CHECK(p.sinks.empty() || static_cast<int>(p.sinks.size()) == p.num_heads, "sinks",
                  "Attention '", layer, "': sinks has ", p.sinks.size(),
                  " entries, expected num_heads = ", p.num_heads, " (or none)");
  for (size_t h = 0; h < p.sinks.size(); ++h) {
    PAGEDATTN_CHECK(std::isfinite(p.sinks[h]), "sinks", "Attention '", layer, "': sinks[", h,
                    "] = ", p.sinks[h], " must be finite");
  }
  if (p.sliding_window) {
    PAGEDATTN_CHECK(*p.sliding_window >= 1, "sliding_window", "Attention '", layer,
                    "': sliding_window = ", *p.sliding_window, " must be >= 1");
    PAGEDATTN_CHECK(p.attn_type != AttentionType::encoder_decoder, "sliding_window", "Attention '",
                    layer, "': sliding_window = ", *p.sliding_window,
                    " is not defined for attn_type=encoder_decoder (cross-attention sees every "
                    "encoder token)");
  }
  if (p.logits_soft_cap) {
    PAGEDATTN_CHECK(std::isfinite(*p.logits_soft_cap) && *p.logits_soft_cap > 0.f,
                    "logits_soft_cap", "Attention '", layer, "': logits_soft_cap = ",
                    *p.logits_soft_cap, " must be a finite value > 0 (or unset)");
  }
  PAGEDATTN_CHECK(p.block_size > 0, "block_size", "Attention '", layer, "': block_size = ",
                  p.block_size, " must be > 0");
  p.dcp.validate(p.block_size);
  validate_kv_cache_dtype(p.kv_cache_dtype);
  PAGEDATTN_CHECK(p.dtype == DType::f32 || p.dtype == DType::f16 || p.dtype == DType::bf16,
                  "dtype", "Attention '", layer, "': dtype = ", dtype_name(p.dtype),
                  " must be float32, float16 or bfloat16");
  if (p.attention_chunk_size) {
    const int chunk = *p.attention_chunk_size;
    PAGEDATTN_CHECK(chunk > 0 && chunk % p.block_size == 0, "attention_chunk_size", "Attention '",
                    layer, "': attention_chunk_size = ", chunk,
                    " must be a positive multiple of block_size = ", p.block_size);
    PAGEDATTN_CHECK(p.attn_type == AttentionType::decoder, "attention_chunk_size", "Attention '",
                    layer, "': attention_chunk_size is only defined for attn_type=decoder, not ",
                    attention_type_name(p.attn_type));
    PAGEDATTN_CHECK(!p.sliding_window, "attention_chunk_size", "Attention '", layer,
                    "': attention_chunk_size and sliding_window cannot both be set");
  }
  if (p.kv_sharing_target_layer_name) {
    const std::string& target = *p.kv_sharing_target_layer_name;
    PAGEDATTN_CHECK(!target.empty(), "kv_sharing_target_layer_name", "Attention '", layer,
                    "': kv_sharing_target_layer_name is empty: expected the name of the layer "
                    "whose cache this layer reads");
    PAGEDATTN_CHECK(target != layer, "kv_sharing_target_layer_name", "Attention '", layer,
                    "': kv_sharing_target_layer_name names the layer itself");
    PAGEDATTN_CHECK(uses_kv_cache(p.attn_type), "kv_sharing_target_layer_name", "Attention '",
                    layer, "': kv_sharing_target_layer_name = '", target,
                    "' but attn_type=", attention_type_name(p.attn_type), " layers have no cache");
    // The shared cache holds the target's keys quantized with the target's scales, and this
    // layer writes nothing it could measure: its scales must be the target's.
    PAGEDATTN_CHECK(!p.calculate_kv_scales, "calculate_kv_scales", "Attention '", layer,
                    "': calculate_kv_scales = true but kv_sharing_target_layer_name = '", target,
                    "': a layer that reads another layer's cache writes no keys/values to "
                    "measure; expected calculate_kv_scales = false and the target's k_scale / "
                    "v_scale");
  }
}

AttentionImplParams make_impl_params(const AttentionLayerParams& p) {
  AttentionImplParams ip;
  ip.num_heads = p.num_heads;
  ip.head_size = p.head_size;
  ip.head_size_v = p.head_size_v;
  ip.scale = *p.scale;  // resolved by the constructor
  ip.num_kv_heads = *p.num_kv_heads;
  ip.alibi_slopes = p.alibi_slopes;
  ip.sliding_window = p.sliding_window;
  ip.kv_cache_dtype = p.kv_cache_dtype;
  ip.logits_soft_cap = p.logits_soft_cap;
  ip.attn_type = p.attn_type;
  ip.kv_sharing_target_layer_name = p.kv_sharing_target_layer_name;
  ip.sinks = p.sinks;
  ip.dtype = p.dtype;
  ip.device = p.device;
  ip.block_size = p.block_size;
  ip.dcp = p.dcp;
  return ip;
}

}  // namespace

Attention::Attention(AttentionLayerParams params, StaticForwardContext* static_forward_context)
    : params_(std::move(params)) {
  validate_layer_params(params_);
  if (!params_.scale) params_.scale = 1.f / std::sqrt(static_cast<float>(params_.head_size));
  if (!params_.num_kv_heads) params_.num_kv_heads = params_.num_heads;
  // Checked against the layers created so far; registered once fully built (layer_registration.h).
  std::optional<StaticForwardContext::Layer> entry = check_layer_registration(
      static_forward_context, "Attention", params_.prefix, params_.kv_sharing_target_layer_name, [&] {
        return StaticForwardContext::Layer{
            params_.prefix, false, params_.attn_type, params_.device,
            uses_kv_cache(params_.attn_type) ? std::optional<KVCacheSpec>(kv_cache_spec()) : std::nullopt,
            params_.kv_sharing_target_layer_name};
      });
  // calculate_kv_scales measures only what an fp8 cache would use (no-op otherwise, as vLLM).
  const bool measure = params_.calculate_kv_scales && uses_kv_cache(params_.attn_type) &&
                       is_fp8(kv_cache_storage_dtype());
  k_scale_pending_ = v_scale_pending_ = measure;
  backend_ = &get_attn_backend(selector_config(), params_.backend);
  impl_ = backend_->make_impl(make_impl_params(params_));
  PAGEDATTN_CHECK(impl_ != nullptr, "backend", "Attention '", params_.prefix, "': backend ",
                  backend_->name(), " returned no impl");
  if (entry) static_forward_context->add(std::move(*entry));
}

SelectorConfig Attention::selector_config() const {
  SelectorConfig c;
  c.head_size = params_.head_size;
  c.dtype = params_.dtype;
  c.kv_cache_dtype = params_.kv_cache_dtype;
  c.block_size = params_.block_size;
  c.use_mla = false;
  c.has_sink = !params_.sinks.empty();
  c.use_sparse = false;
  c.attn_type = params_.attn_type;
  c.device = params_.device;
  c.head_size_v = params_.head_size_v;
  c.use_alibi = !params_.alibi_slopes.empty();
  c.use_sliding_window = params_.sliding_window.has_value();
  c.use_logits_soft_cap = params_.logits_soft_cap.has_value();
  c.fp8_output = params_.fp8_output;
  return c;
}

DType Attention::kv_cache_storage_dtype() const {
  return pagedattn::kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype);
}

KVCacheSpec Attention::kv_cache_spec() const {
  PAGEDATTN_CHECK(uses_kv_cache(params_.attn_type), "attn_type", "Attention '", params_.prefix,
                  "': attn_type=", attention_type_name(params_.attn_type),
                  " layers have no KV cache, so no kv_cache_spec (skip them when allocating caches)");
  const int block_size = params_.block_size;
  const int kv_heads = *params_.num_kv_heads;
  const int head_size = params_.head_size;
  const int head_size_v = params_.head_size_v == head_size ? 0 : params_.head_size_v;
  const DType dtype = kv_cache_storage_dtype();
  if (params_.attn_type == AttentionType::encoder_decoder) {
    return KVCacheSpec::cross_attention(block_size, kv_heads, head_size, dtype, head_size_v);
  }
  if (params_.sliding_window) {
    return KVCacheSpec::sliding_window_attention(block_size, kv_heads, head_size, dtype,
                                                 *params_.sliding_window, head_size_v);
  }
  if (params_.attention_chunk_size) {
    return KVCacheSpec::chunked_local_attention(block_size, kv_heads, head_size, dtype,
                                                *params_.attention_chunk_size, head_size_v);
  }
  return KVCacheSpec::full_attention(block_size, kv_heads, head_size, dtype, head_size_v);
}

BuilderConfig Attention::builder_config(int max_num_seqs, int max_num_batched_tokens,
                                        int max_model_len) const {
  PAGEDATTN_CHECK(max_num_seqs > 0, "max_num_seqs", "Attention '", params_.prefix,
                  "': max_num_seqs = ", max_num_seqs, " must be > 0");
  PAGEDATTN_CHECK(max_num_batched_tokens > 0, "max_num_batched_tokens", "Attention '",
                  params_.prefix, "': max_num_batched_tokens = ", max_num_batched_tokens,
                  " must be > 0");
  PAGEDATTN_CHECK(max_model_len > 0, "max_model_len", "Attention '", params_.prefix,
                  "': max_model_len = ", max_model_len, " must be > 0");
  BuilderConfig c;
  c.num_heads = params_.num_heads;
  c.num_kv_heads = *params_.num_kv_heads;
  c.head_size = params_.head_size;
  c.head_size_v = params_.head_size_v > 0 ? params_.head_size_v : params_.head_size;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = max_model_len;
  c.sliding_window = params_.sliding_window;
  c.use_alibi = !params_.alibi_slopes.empty();
  c.attn_type = params_.attn_type;
  c.num_sms = 0;
  return c;
}

Tensor Attention::allocate_kv_cache(int64_t num_blocks) const {
  PAGEDATTN_CHECK(uses_kv_cache(params_.attn_type), "attn_type", "Attention '", params_.prefix,
                  "': attn_type=", attention_type_name(params_.attn_type),
                  " layers have no KV cache to allocate");
  const int kv_heads = *params_.num_kv_heads;
  const int head_size_v = params_.head_size_v > 0 ? params_.head_size_v : params_.head_size;
  return backend_->allocate_kv_cache(num_blocks, params_.block_size, kv_heads,
                                     std::max(params_.head_size, head_size_v),
                                     kv_cache_storage_dtype(), params_.device);
}

void Attention::forward(const TensorView& query, const TensorView& key, const TensorView& value,
                        const TensorView& kv_cache, const AttentionMetadata& metadata,
                        const TensorView& output, const TensorView& output_lse,
                        const TensorView& output_scale) {
  // Checks below build their message only on failure: the success path allocates nothing.
  const std::string& layer = params_.prefix;
  const int64_t hq = params_.num_heads;
  const int64_t hkv = *params_.num_kv_heads;
  const int64_t d = params_.head_size;
  const int64_t dv = params_.head_size_v > 0 ? params_.head_size_v : params_.head_size;
  const DType dtype = params_.dtype;
  const Device device = params_.device;

  // query (T, Hq, D)
  PAGEDATTN_CHECK(query.defined() && query.ndim() == 3 && query.size(1) == hq &&
                      query.size(2) == d,
                  "query", "Attention '", layer, "': query is ", query.describe(),
                  ", expected (num_tokens, ", hq, ", ", d, ") = (num_tokens, num_heads, head_size)");
  // A pre-quantized query (vLLM's query_quant output): e4m3, q = q8 * scales().q_scale, where the
  // impl supports_quant_query_input (an fp8 cache on CUDA or REFERENCE).
  const bool quant_query = query.dtype() == DType::fp8_e4m3 && impl_->supports_quant_query_input();
  PAGEDATTN_CHECK(query.dtype() == dtype || quant_query, "query", "Attention '", layer,
                  "': query is ", dtype_name(query.dtype()), ", expected the layer dtype ",
                  dtype_name(dtype),
                  impl_->supports_quant_query_input()
                      ? " (or fp8_e4m3, a query quantized with scales().q_scale)"
                      : "");
  PAGEDATTN_CHECK(query.device() == device, "query", "Attention '", layer, "': query is on ",
                  device_name(query.device()), ", expected the layer device ", device_name(device));
  const int64_t num_tokens = query.size(0);
  PAGEDATTN_CHECK(metadata.num_actual_tokens >= 0 && metadata.num_actual_tokens <= num_tokens,
                  "query", "Attention '", layer, "': query has ", num_tokens,
                  " tokens but metadata.num_actual_tokens = ", metadata.num_actual_tokens,
                  " (expected query tokens >= num_actual_tokens)");

  // output (T, Hq, Dv) in the layer dtype, or fp8_e4m3 with output_scale f32 (1,)
  PAGEDATTN_CHECK(output.defined() && output.ndim() == 3 && output.size(0) == num_tokens &&
                      output.size(1) == hq && output.size(2) == dv,
                  "output", "Attention '", layer, "': output is ", output.describe(),
                  ", expected (", num_tokens, ", ", hq, ", ", dv,
                  ") = (num_tokens of query, num_heads, head_size_v)");
  PAGEDATTN_CHECK(output.device() == device, "output", "Attention '", layer, "': output is on ",
                  device_name(output.device()), ", expected ", device_name(device));
  if (output_scale.defined()) {
    PAGEDATTN_CHECK(output_scale.dtype() == DType::f32 && output_scale.numel() == 1 &&
                        output_scale.device() == device,
                    "output_scale", "Attention '", layer, "': output_scale is ",
                    output_scale.describe(), ", expected float32 (1,) on ", device_name(device));
    PAGEDATTN_CHECK(impl_->fused_output_quant_supported(QuantKey{}), "output_scale",
                    "Attention '", layer, "': output_scale is given but backend ",
                    backend_->name(), " does not support fused fp8 output quantization");
    PAGEDATTN_CHECK(output.dtype() == DType::fp8_e4m3, "output", "Attention '", layer,
                    "': output is ", dtype_name(output.dtype()),
                    ", expected fp8_e4m3 when output_scale is given");
  } else {
    PAGEDATTN_CHECK(output.dtype() == dtype, "output", "Attention '", layer, "': output is ",
                    dtype_name(output.dtype()), ", expected the layer dtype ", dtype_name(dtype));
  }
  if (output_lse.defined()) {
    PAGEDATTN_CHECK(output_lse.dtype() == DType::f32 && output_lse.ndim() == 2 &&
                        output_lse.size(0) == hq && output_lse.size(1) == num_tokens &&
                        output_lse.device() == device,
                    "output_lse", "Attention '", layer, "': output_lse is ", output_lse.describe(),
                    ", expected float32 (", hq, ", ", num_tokens, ") = (num_heads, num_tokens) on ",
                    device_name(device));
  }

  // key (Tk, Hkv, D), value (Tk, Hkv, Dv): both or neither.
  PAGEDATTN_CHECK(key.defined() == value.defined(), key.defined() ? "value" : "key", "Attention '",
                  layer, "': key and value must both be given or both be empty");
  const bool has_kv = key.defined();
  if (has_kv) {
    PAGEDATTN_CHECK(key.ndim() == 3 && key.size(1) == hkv && key.size(2) == d, "key",
                    "Attention '", layer, "': key is ", key.describe(), ", expected (num_tokens, ",
                    hkv, ", ", d, ") = (num_tokens, num_kv_heads, head_size)");
    PAGEDATTN_CHECK(value.ndim() == 3 && value.size(0) == key.size(0) && value.size(1) == hkv &&
                        value.size(2) == dv,
                    "value", "Attention '", layer, "': value is ", value.describe(), ", expected (",
                    key.size(0), ", ", hkv, ", ", dv,
                    ") = (num_tokens of key, num_kv_heads, head_size_v)");
    PAGEDATTN_CHECK(key.dtype() == dtype && value.dtype() == dtype, "key", "Attention '", layer,
                    "': key/value are ", dtype_name(key.dtype()), "/", dtype_name(value.dtype()),
                    ", expected the layer dtype ", dtype_name(dtype));
    PAGEDATTN_CHECK(key.device() == device && value.device() == device, "key", "Attention '",
                    layer, "': key/value are on ", device_name(key.device()), "/",
                    device_name(value.device()), ", expected ", device_name(device));
  }

  const AttentionType type = params_.attn_type;
  const bool owns_cache = !params_.kv_sharing_target_layer_name.has_value();
  if (!uses_kv_cache(type)) {
    // encoder / encoder_only: attention over the current tokens' key/value, no cache.
    PAGEDATTN_CHECK(has_kv && key.size(0) >= metadata.num_actual_tokens, "key", "Attention '",
                    layer, "': attn_type=", attention_type_name(type),
                    " layers attend over key/value of the current tokens: expected key/value with "
                    ">= ", metadata.num_actual_tokens, " tokens, got ",
                    has_kv ? key.describe() : std::string("none"));
  } else {
    PAGEDATTN_CHECK(has_kv || !owns_cache || type == AttentionType::encoder_decoder, "key",
                    "Attention '", layer,
                    "': key/value are required for a decoder layer that owns its cache");
    // The cache: kv_cache_shape(num_blocks, ...) of the backend; every dim but num_blocks fixed.
    const int head_dim = static_cast<int>(std::max(d, dv));
    const Shape one_block = backend_->kv_cache_shape(1, params_.block_size, static_cast<int>(hkv),
                                                     head_dim, params_.kv_cache_dtype);
    const Shape two_blocks = backend_->kv_cache_shape(2, params_.block_size, static_cast<int>(hkv),
                                                      head_dim, params_.kv_cache_dtype);
    bool shape_ok = kv_cache.ndim() == one_block.ndim();
    for (int i = 0; shape_ok && i < one_block.ndim(); ++i) {
      shape_ok = one_block[i] != two_blocks[i] || kv_cache.size(i) == one_block[i];
    }
    PAGEDATTN_CHECK(kv_cache.defined() && shape_ok, "kv_cache", "Attention '", layer,
                    "': kv_cache is ", kv_cache.describe(), ", expected backend ", backend_->name(),
                    "'s kv_cache_shape(num_blocks, ", params_.block_size, ", ", hkv, ", ", head_dim,
                    ") = ", one_block.str(), " with any num_blocks");
    PAGEDATTN_CHECK(kv_cache.dtype() == kv_cache_storage_dtype(), "kv_cache", "Attention '", layer,
                    "': kv_cache is ", dtype_name(kv_cache.dtype()), ", expected ",
                    dtype_name(kv_cache_storage_dtype()), " for kv_cache_dtype \"",
                    params_.kv_cache_dtype, "\"");
    PAGEDATTN_CHECK(kv_cache.device() == device, "kv_cache", "Attention '", layer,
                    "': kv_cache is on ", device_name(kv_cache.device()), ", expected ",
                    device_name(device));
  }
  // Every check of the attention itself (block ids against this cache, output_scale's value,
  // strides, ...) runs before the cache write, so a rejected call leaves the cache untouched.
  impl_->check_forward(scales_, query, key, value, kv_cache, metadata, output, output_scale,
                       output_lse);
  if (uses_kv_cache(type) && owns_cache && has_kv) {
    if (kv_scales_pending()) {
      // calculate_kv_scales: the scales take effect only once the write they quantize passed
      // its own checks (a rejected call leaves the scales, like the cache, unchanged).
      const MeasuredKVScales measured = measure_kv_scales(key, value, metadata);
      impl_->do_kv_cache_update(measured.scales, key, value, kv_cache, metadata);
      scales_ = measured.scales;
      if (measured.k_measured) k_scale_pending_ = false;
      if (measured.v_measured) v_scale_pending_ = false;
    } else {
      impl_->do_kv_cache_update(scales_, key, value, kv_cache, metadata);
    }
  }
  impl_->forward(scales_, query, key, value, kv_cache, metadata, output, output_scale, output_lse);
}

Attention::MeasuredKVScales Attention::measure_kv_scales(const TensorView& key,
                                                         const TensorView& value,
                                                         const AttentionMetadata& metadata) {
  const std::string& layer = params_.prefix;
  // Per-head scales replace the per-tensor ones in every kernel: measuring the per-tensor scales
  // under them would silently have no effect.
  PAGEDATTN_CHECK(!scales_.k_scale_per_head.defined() && !scales_.v_scale_per_head.defined(),
                  "calculate_kv_scales", "Attention '", layer,
                  "': calculate_kv_scales = true measures per-tensor k_scale / v_scale, but "
                  "scales().", scales_.k_scale_per_head.defined() ? "k" : "v",
                  "_scale_per_head is set (per-head scales replace the per-tensor ones): expected "
                  "either calculate_kv_scales or per-head scales, not both");
  // The rows the cache write stores (slot != -1), with the write's own checks of the slot mapping.
  if (key.device() == Device::cuda && !kv_amax_result_.defined()) {
    kv_amax_result_ = Tensor(Shape{2}, DType::i32, Device::cuda, key.device_index());
  }
  const detail::KVAmax amax = detail::written_rows_amax(key, value, metadata.slot_mapping, kv_amax_result_);
  PAGEDATTN_CHECK(!k_scale_pending_ || std::isfinite(amax.key), "key", "Attention '", layer,
                  "': calculate_kv_scales: the keys this forward writes hold a non-finite value "
                  "(amax |key| = ", amax.key, "): expected finite keys to measure k_scale from");
  PAGEDATTN_CHECK(!v_scale_pending_ || std::isfinite(amax.value), "value", "Attention '", layer,
                  "': calculate_kv_scales: the values this forward writes hold a non-finite value "
                  "(amax |value| = ", amax.value, "): expected finite values to measure v_scale "
                  "from");
  // scale = amax / fp8 max, one f32 division; 0 (all-zero rows, or an amax so small that the
  // quotient underflows) would divide by zero when quantizing: keep the scale, measure later.
  const float range = fp8_max_finite(kv_cache_storage_dtype());
  MeasuredKVScales measured{scales_};
  const float k_scale = amax.key / range, v_scale = amax.value / range;
  if (k_scale_pending_ && k_scale > 0.f) {
    measured.scales.k_scale = k_scale;
    measured.k_measured = true;
  }
  if (v_scale_pending_ && v_scale > 0.f) {
    measured.scales.v_scale = v_scale;
    measured.v_measured = true;
  }
  return measured;
}

}  // namespace pagedattn
