// The MLAAttention layer (vLLM MLAAttention): validates its parameters, selects an MLA backend
// through the one selector (use_mla = true, head_size = kv_lora_rank + qk_rope_head_dim), owns
// the backend's MLAAttentionImpl, reports its latent cache spec, and in forward checks the
// activations once, writes the latent cache (unless it shares another layer's) and attends.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "layer/layer_registration.h"
#include "ops/kv_amax.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/mla.h"
#include "pagedattn/selector.h"

namespace pagedattn {
namespace {

void validate_mla_layer_params(const MLAAttentionLayerParams& p) {
  const std::string& layer = p.prefix;
  const auto positive = [&](int value, const char* name) {
    PAGEDATTN_CHECK(value > 0, name, "MLAAttention '", layer, "': ", name, " = ", value,
                    " must be > 0");
  };
  positive(p.num_heads, "num_heads");
  positive(p.kv_lora_rank, "kv_lora_rank");
  positive(p.qk_nope_head_dim, "qk_nope_head_dim");
  positive(p.qk_rope_head_dim, "qk_rope_head_dim");
  positive(p.v_head_dim, "v_head_dim");
  positive(p.block_size, "block_size");
  PAGEDATTN_CHECK(p.qk_head_dim == p.qk_nope_head_dim + p.qk_rope_head_dim, "qk_head_dim",
                  "MLAAttention '", layer, "': qk_head_dim = ", p.qk_head_dim,
                  ", expected qk_nope_head_dim + qk_rope_head_dim = ",
                  p.qk_nope_head_dim + p.qk_rope_head_dim);
  if (p.q_lora_rank) positive(*p.q_lora_rank, "q_lora_rank");
  PAGEDATTN_CHECK(!p.scale || (std::isfinite(*p.scale) && *p.scale > 0.f), "scale",
                  "MLAAttention '", layer, "': scale = ", p.scale.value_or(0.f),
                  " must be a finite value > 0 (or unset = qk_head_dim^-0.5)");
  validate_kv_cache_dtype(p.kv_cache_dtype);
  PAGEDATTN_CHECK(p.dtype == DType::f32 || p.dtype == DType::f16 || p.dtype == DType::bf16,
                  "dtype", "MLAAttention '", layer, "': dtype = ", dtype_name(p.dtype),
                  " must be float32, float16 or bfloat16");
  if (p.kv_sharing_target_layer_name) {
    PAGEDATTN_CHECK(!p.kv_sharing_target_layer_name->empty(), "kv_sharing_target_layer_name",
                    "MLAAttention '", layer, "': kv_sharing_target_layer_name is empty: expected "
                    "the name of the layer whose cache this layer reads");
    PAGEDATTN_CHECK(*p.kv_sharing_target_layer_name != layer, "kv_sharing_target_layer_name",
                    "MLAAttention '", layer, "': kv_sharing_target_layer_name names the layer itself");
  }
}

}  // namespace

MLAAttention::MLAAttention(MLAAttentionLayerParams params,
                           StaticForwardContext* static_forward_context)
    : params_(std::move(params)) {
  validate_mla_layer_params(params_);
  params_.dcp.validate(params_.block_size);
  if (!params_.scale) {
    params_.scale = 1.f / std::sqrt(static_cast<float>(params_.qk_head_dim));
  }
  // As Attention: checked against the layers created so far, registered once fully built.
  std::optional<StaticForwardContext::Layer> entry = check_layer_registration(
      static_forward_context, "MLAAttention", params_.prefix, params_.kv_sharing_target_layer_name, [&] {
        return StaticForwardContext::Layer{params_.prefix, true, AttentionType::decoder, params_.device,
                                           kv_cache_spec(), params_.kv_sharing_target_layer_name};
      });
  PAGEDATTN_CHECK(!(params_.calculate_kv_scales && params_.kv_sharing_target_layer_name),
                  "calculate_kv_scales", "MLAAttention '", params_.prefix,
                  "': calculate_kv_scales = true but kv_sharing_target_layer_name = '",
                  params_.kv_sharing_target_layer_name.value_or(""), "': a sharing layer writes "
                  "nothing to measure; expected calculate_kv_scales = false and the target's k_scale");
  k_scale_pending_ = params_.calculate_kv_scales && is_fp8(kv_cache_storage_dtype());
  backend_ = &get_attn_backend(selector_config(), params_.backend);
  const MLABackend* mla = backend_->as_mla();
  PAGEDATTN_CHECK(mla != nullptr, "backend", "MLAAttention '", params_.prefix, "': backend ",
                  backend_->name(), " is not an MLA backend (it accepted use_mla = true but has no "
                  "make_mla_impl)");
  MLAImplParams ip;
  ip.num_heads = params_.num_heads;
  ip.scale = *params_.scale;
  ip.dims = params_.dims();
  ip.q_lora_rank = params_.q_lora_rank;
  ip.kv_cache_dtype = params_.kv_cache_dtype;
  ip.kv_sharing_target_layer_name = params_.kv_sharing_target_layer_name;
  ip.dtype = params_.dtype;
  ip.device = params_.device;
  ip.block_size = params_.block_size;
  ip.prefill_backend = params_.prefill_backend;
  ip.dcp = params_.dcp;
  impl_ = mla->make_mla_impl(ip);
  PAGEDATTN_CHECK(impl_ != nullptr, "backend", "MLAAttention '", params_.prefix, "': backend ",
                  backend_->name(), " returned no impl");
  if (entry) static_forward_context->add(std::move(*entry));
}

SelectorConfig MLAAttention::selector_config() const {
  SelectorConfig c;
  c.head_size = params_.dims().latent_head_size();
  c.dtype = params_.dtype;
  c.kv_cache_dtype = params_.kv_cache_dtype;
  c.block_size = params_.block_size;
  c.use_mla = true;
  c.attn_type = AttentionType::decoder;
  c.device = params_.device;
  c.mla_dimensions = params_.dims();
  c.num_heads = params_.num_heads;
  c.fp8_output = params_.fp8_output;
  return c;
}

DType MLAAttention::kv_cache_storage_dtype() const {
  return pagedattn::kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype);
}

KVCacheSpec MLAAttention::kv_cache_spec() const {
  return mla_attention_spec(params_.block_size, params_.dims(), params_.dtype,
                            params_.kv_cache_dtype);
}

BuilderConfig MLAAttention::builder_config(int max_num_seqs, int max_num_batched_tokens,
                                           int max_model_len,
                                           int64_t chunked_prefill_workspace_tokens) const {
  const std::string& layer = params_.prefix;
  PAGEDATTN_CHECK(max_num_seqs > 0, "max_num_seqs", "MLAAttention '", layer,
                  "': max_num_seqs = ", max_num_seqs, " must be > 0");
  PAGEDATTN_CHECK(max_num_batched_tokens > 0, "max_num_batched_tokens", "MLAAttention '", layer,
                  "': max_num_batched_tokens = ", max_num_batched_tokens, " must be > 0");
  PAGEDATTN_CHECK(max_model_len > 0, "max_model_len", "MLAAttention '", layer,
                  "': max_model_len = ", max_model_len, " must be > 0");
  PAGEDATTN_CHECK(chunked_prefill_workspace_tokens >= 0, "chunked_prefill_workspace_tokens",
                  "MLAAttention '", layer, "': chunked_prefill_workspace_tokens = ",
                  chunked_prefill_workspace_tokens, " must be >= 0 (0 = vLLM's rule)");
  BuilderConfig c;
  c.num_heads = params_.num_heads;
  c.num_kv_heads = 1;
  c.head_size = params_.dims().latent_head_size();
  c.head_size_v = params_.v_head_dim;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = max_model_len;
  c.attn_type = AttentionType::decoder;
  c.mla_dimensions = params_.dims();
  c.mla_dtype = params_.dtype;
  c.mla_chunked_prefill_workspace_tokens =
      chunked_prefill_workspace_tokens > 0
          ? chunked_prefill_workspace_tokens
          : mla_chunked_prefill_workspace_tokens(max_model_len, max_num_seqs, params_.block_size);
  return c;
}

Tensor MLAAttention::allocate_kv_cache(int64_t num_blocks) const {
  return backend_->allocate_kv_cache(num_blocks, params_.block_size, 1,
                                     params_.dims().latent_head_size(), kv_cache_storage_dtype(),
                                     params_.device);
}

void MLAAttention::process_weights_after_loading(const TensorView& kv_b_proj_weight) {
  impl_->process_weights_after_loading(kv_b_proj_weight);
  weights_loaded_ = true;
}

void MLAAttention::forward(const TensorView& q, const TensorView& kv_c_normed,
                           const TensorView& k_pe, const TensorView& kv_cache,
                           const AttentionMetadata& metadata, const TensorView& output,
                           const TensorView& output_lse, const TensorView& output_scale) {
  // Checks build their message only on failure: the success path allocates nothing.
  const std::string& layer = params_.prefix;
  const int64_t H = params_.num_heads, L = params_.kv_lora_rank, R = params_.qk_rope_head_dim,
                QK = params_.qk_head_dim, V = params_.v_head_dim;
  const DType dtype = params_.dtype;
  const Device device = params_.device;
  PAGEDATTN_CHECK(weights_loaded_, "kv_b_proj_weight", "MLAAttention '", layer,
                  "': process_weights_after_loading(kv_b_proj_weight) must be called before "
                  "forward");
  PAGEDATTN_CHECK(dynamic_cast<const MLAMetadata*>(&metadata) != nullptr, "metadata",
                  "MLAAttention '", layer, "': metadata is not an MLAMetadata (build it with the "
                  "builder of backend ", backend_->name(), ")");
  PAGEDATTN_CHECK(q.defined() && q.ndim() == 3 && q.size(1) == H && q.size(2) == QK, "q",
                  "MLAAttention '", layer, "': q is ", q.describe(), ", expected (num_tokens, ", H,
                  ", ", QK, ") = (num_tokens, num_heads, qk_head_dim)");
  const int64_t T = q.size(0);
  PAGEDATTN_CHECK(metadata.num_actual_tokens <= T, "q", "MLAAttention '", layer, "': q has ", T,
                  " tokens but metadata.num_actual_tokens = ", metadata.num_actual_tokens);
  PAGEDATTN_CHECK(kv_c_normed.defined() && kv_c_normed.ndim() == 2 && kv_c_normed.size(0) == T &&
                      kv_c_normed.size(1) == L,
                  "kv_c_normed", "MLAAttention '", layer, "': kv_c_normed is ",
                  kv_c_normed.describe(), ", expected (", T, ", ", L,
                  ") = (num_tokens of q, kv_lora_rank)");
  const bool pe_ok = k_pe.defined() && k_pe.size(0) == T && k_pe.size(-1) == R &&
                     (k_pe.ndim() == 2 || (k_pe.ndim() == 3 && k_pe.size(1) == 1));
  PAGEDATTN_CHECK(pe_ok, "k_pe", "MLAAttention '", layer, "': k_pe is ", k_pe.describe(),
                  ", expected (", T, ", ", R, ") or (", T, ", 1, ", R,
                  ") = (num_tokens of q, [1,] qk_rope_head_dim)");
  const bool out3 = output.ndim() == 3 && output.size(0) == T && output.size(1) == H &&
                    output.size(2) == V;
  const bool out2 = output.ndim() == 2 && output.size(0) == T && output.size(1) == H * V;
  PAGEDATTN_CHECK(output.defined() && (out3 || out2), "output", "MLAAttention '", layer,
                  "': output is ", output.describe(), ", expected (", T, ", ", H, ", ", V,
                  ") or (", T, ", ", H * V, ") = (num_tokens of q, num_heads [*] v_head_dim)");
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&kv_c_normed, "kv_c_normed"},
                                std::pair{&k_pe, "k_pe"}}) {
    PAGEDATTN_CHECK(t->dtype() == dtype, name, "MLAAttention '", layer, "': ", name, " is ",
                    dtype_name(t->dtype()), ", expected the layer dtype ", dtype_name(dtype));
    PAGEDATTN_CHECK(t->device() == device, name, "MLAAttention '", layer, "': ", name, " is on ",
                    device_name(t->device()), ", expected the layer device ", device_name(device));
  }
  PAGEDATTN_CHECK(output.device() == device, "output", "MLAAttention '", layer, "': output is on ",
                  device_name(output.device()), ", expected the layer device ", device_name(device));
  // output in the layer dtype, or fp8_e4m3 with output_scale f32 (1,) (fused output quant).
  if (output_scale.defined()) {
    PAGEDATTN_CHECK(output_scale.dtype() == DType::f32 && output_scale.numel() == 1 &&
                        output_scale.device() == device,
                    "output_scale", "MLAAttention '", layer, "': output_scale is ",
                    output_scale.describe(), ", expected float32 (1,) on ", device_name(device));
    PAGEDATTN_CHECK(impl_->fused_output_quant_supported(QuantKey{}), "output_scale",
                    "MLAAttention '", layer, "': output_scale is given but backend ",
                    backend_->name(), " does not support fused fp8 output quantization");
    PAGEDATTN_CHECK(output.dtype() == DType::fp8_e4m3, "output", "MLAAttention '", layer,
                    "': output is ", dtype_name(output.dtype()),
                    ", expected fp8_e4m3 when output_scale is given");
  } else {
    PAGEDATTN_CHECK(output.dtype() == dtype, "output", "MLAAttention '", layer, "': output is ",
                    dtype_name(output.dtype()), ", expected the layer dtype ", dtype_name(dtype));
  }
  if (output_lse.defined()) {
    PAGEDATTN_CHECK(output_lse.dtype() == DType::f32 && output_lse.ndim() == 2 &&
                        output_lse.size(0) == H && output_lse.size(1) == T &&
                        output_lse.device() == device,
                    "output_lse", "MLAAttention '", layer, "': output_lse is ",
                    output_lse.describe(), ", expected float32 (", H, ", ", T,
                    ") = (num_heads, num_tokens) on ", device_name(device));
  }
  PAGEDATTN_CHECK(kv_cache.defined() && kv_cache.ndim() == 3 &&
                      kv_cache.size(1) == params_.block_size && kv_cache.size(2) == L + R,
                  "kv_cache", "MLAAttention '", layer, "': kv_cache is ", kv_cache.describe(),
                  ", expected (num_blocks, ", params_.block_size, ", ", L + R,
                  ") = (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)");
  PAGEDATTN_CHECK(kv_cache.dtype() == kv_cache_storage_dtype(), "kv_cache", "MLAAttention '",
                  layer, "': kv_cache is ", dtype_name(kv_cache.dtype()), ", expected ",
                  dtype_name(kv_cache_storage_dtype()), " for kv_cache_dtype \"",
                  params_.kv_cache_dtype, "\"");
  PAGEDATTN_CHECK(kv_cache.device() == device, "kv_cache", "MLAAttention '", layer,
                  "': kv_cache is on ", device_name(kv_cache.device()), ", expected ",
                  device_name(device));
  // Every check of the attention (block ids against this cache, output_scale's value on host
  // backends, ...) before the write, so a rejected call leaves the cache untouched.
  impl_->check_forward(scales_, q, kv_c_normed, k_pe, kv_cache, metadata, output, output_scale,
                       output_lse);
  if (!params_.kv_sharing_target_layer_name) {
    if (k_scale_pending_) {
      // calculate_kv_scales: the scale takes effect only once the write it quantizes passed its
      // own checks (a rejected call leaves the scale, like the cache, unchanged).
      const std::optional<float> k_scale = measure_k_scale(kv_c_normed, k_pe, metadata);
      LayerScales measured = scales_;
      if (k_scale) measured.k_scale = *k_scale;
      impl_->do_kv_cache_update(measured, kv_c_normed, k_pe, kv_cache, metadata);
      scales_ = measured;
      if (k_scale) k_scale_pending_ = false;
    } else {
      impl_->do_kv_cache_update(scales_, kv_c_normed, k_pe, kv_cache, metadata);
    }
  }
  impl_->forward(scales_, q, kv_c_normed, k_pe, kv_cache, metadata, output, output_scale,
                 output_lse);
}

std::optional<float> MLAAttention::measure_k_scale(const TensorView& kv_c_normed,
                                                   const TensorView& k_pe,
                                                   const AttentionMetadata& metadata) {
  const std::string& layer = params_.prefix;
  PAGEDATTN_CHECK(!scales_.k_scale_per_head.defined(), "calculate_kv_scales", "MLAAttention '",
                  layer, "': calculate_kv_scales = true measures the per-tensor k_scale, but "
                  "scales().k_scale_per_head is set: expected one or the other");
  // The latent rows as (N, 1, L) and (N, 1, R): the cache write's rows (slot != -1) of both.
  const auto as_rows = [](const TensorView& t) {
    if (t.ndim() == 3) return t;
    return TensorView(t.data(), t.dtype(), Shape{t.size(0), 1, t.size(1)},
                      Shape{t.stride(0), t.size(1), t.stride(1)}, t.device(), t.device_index());
  };
  if (kv_c_normed.device() == Device::cuda && !kv_amax_result_.defined()) {
    kv_amax_result_ = Tensor(Shape{2}, DType::i32, Device::cuda, kv_c_normed.device_index());
  }
  const detail::KVAmax amax = detail::written_rows_amax(as_rows(kv_c_normed), as_rows(k_pe),
                                                        metadata.slot_mapping, kv_amax_result_);
  PAGEDATTN_CHECK(std::isfinite(amax.key), "kv_c_normed", "MLAAttention '", layer,
                  "': calculate_kv_scales: the kv_c_normed rows this forward writes hold a "
                  "non-finite value (amax = ", amax.key, "): expected finite values to measure "
                  "k_scale from");
  PAGEDATTN_CHECK(std::isfinite(amax.value), "k_pe", "MLAAttention '", layer,
                  "': calculate_kv_scales: the k_pe rows this forward writes hold a non-finite "
                  "value (amax = ", amax.value, "): expected finite values to measure k_scale from");
  // One f32 division; 0 (all-zero rows, or an underflowing quotient) keeps the scale pending.
  const float k_scale = std::max(amax.key, amax.value) / fp8_max_finite(kv_cache_storage_dtype());
  if (k_scale > 0.f) return k_scale;
  return std::nullopt;
}

}  // namespace pagedattn
