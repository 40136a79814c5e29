// The CUDA backend's AttentionImpl: argument checks on the host (shapes, dtypes, devices,
// strides, alignment — never device contents), then the launches: reshape_and_cache (through
// the public op, which checks every argument first), the paged attention kernel, and the
// combine when the plan has splits or a cascade prefix. forward allocates nothing and never
// synchronizes.
#if PAGEDATTN_HAS_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backends/cuda/attention/cuda_backend_internal.h"
#include "backends/cuda/attention/kernel_launch.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/ops.h"

namespace pagedattn::cuda {
namespace {

Tensor upload_f32(const std::vector<float>& values) {
  if (values.empty()) return {};
  Tensor host(Shape{static_cast<int64_t>(values.size())}, DType::f32, Device::cpu);
  std::copy(values.begin(), values.end(), host.data_as<float>());
  return host.to(Device::cuda);
}

// The kernel reads 16-byte chunks of every row: unit stride on the last dim, 16-byte aligned
// base and row strides.
void check_vector_rows(const TensorView& t, std::string_view argument, int leading_dims) {
  const auto elem = static_cast<int64_t>(t.element_size());
  bool ok = t.stride(t.ndim() - 1) == 1 && reinterpret_cast<uintptr_t>(t.data()) % 16 == 0;
  for (int i = 0; i < leading_dims; ++i) ok = ok && (t.stride(i) * elem) % 16 == 0;
  PAGEDATTN_CHECK(ok, std::string(argument), "CUDA forward: ", argument, " (", t.describe(), ", strides ",
                  t.strides().str(), ") must have a unit stride on its last dim and 16-byte aligned rows");
}

void check_tensor(const TensorView& t, std::string_view argument, DType dtype, const Shape& min_shape,
                  int exact_from) {
  check_defined(t, argument);
  check_device(t, argument, Device::cuda);
  const DType allowed[] = {dtype};
  check_dtype(t, argument, allowed);
  check_ndim(t, argument, min_shape.ndim());
  bool ok = true;
  for (int i = 0; i < min_shape.ndim(); ++i) {
    ok = ok && (i < exact_from ? t.size(i) >= min_shape[i] : t.size(i) == min_shape[i]);
  }
  PAGEDATTN_CHECK(ok, std::string(argument), "CUDA forward: ", argument, " has shape ", t.shape().str(),
                  ": expected ", min_shape.str(), " (dims before ", exact_from, " may be larger)");
}

}  // namespace

CudaAttentionImpl::CudaAttentionImpl(AttentionImplParams params) : AttentionImpl(std::move(params)) {
  SelectorConfig sc;
  sc.head_size = params_.head_size;
  sc.head_size_v = params_.head_size_v;
  sc.dtype = params_.dtype;
  sc.kv_cache_dtype = params_.kv_cache_dtype;
  sc.block_size = params_.block_size;
  sc.has_sink = !params_.sinks.empty();
  sc.attn_type = params_.attn_type;
  sc.device = params_.device;
  sc.use_alibi = !params_.alibi_slopes.empty();
  sc.use_sliding_window = params_.sliding_window.has_value();
  sc.use_logits_soft_cap = params_.logits_soft_cap.has_value();
  const std::vector<std::string> reasons = unsupported_reasons(sc);
  PAGEDATTN_CHECK(reasons.empty(), "params", "CUDA backend cannot run this layer: ", reasons.front());
  PAGEDATTN_CHECK(params_.num_heads > 0 && params_.kv_heads() > 0 && params_.num_heads % params_.kv_heads() == 0,
                  "num_kv_heads", "CUDA backend: num_heads = ", params_.num_heads, ", num_kv_heads = ",
                  params_.kv_heads(), ": expected num_heads to be a positive multiple of num_kv_heads");
  PAGEDATTN_CHECK(params_.alibi_slopes.empty() || static_cast<int>(params_.alibi_slopes.size()) == params_.num_heads,
                  "alibi_slopes", "CUDA backend: alibi_slopes has ", params_.alibi_slopes.size(),
                  " entries, expected num_heads = ", params_.num_heads);
  PAGEDATTN_CHECK(params_.sinks.empty() || static_cast<int>(params_.sinks.size()) == params_.num_heads, "sinks",
                  "CUDA backend: sinks has ", params_.sinks.size(), " entries, expected num_heads = ",
                  params_.num_heads);
  PAGEDATTN_CHECK(!params_.logits_soft_cap || (std::isfinite(*params_.logits_soft_cap) && *params_.logits_soft_cap > 0.f),
                  "logits_soft_cap", "CUDA backend: logits_soft_cap = ", params_.logits_soft_cap.value_or(0.f),
                  " must be a positive finite number");
  PAGEDATTN_CHECK(!params_.sliding_window || *params_.sliding_window >= 1, "sliding_window",
                  "CUDA backend: sliding_window = ", params_.sliding_window.value_or(0), " must be >= 1");
  cache_dtype_ = kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype);
  alibi_slopes_ = upload_f32(params_.alibi_slopes);
  sinks_ = upload_f32(params_.sinks);
}

bool CudaAttentionImpl::supports_quant_query_input() const {
  return is_fp8(cache_dtype_) && uses_kv_cache(params_.attn_type);
}

const CudaAttentionMetadata& CudaAttentionImpl::checked_metadata(const AttentionMetadata& metadata,
                                                                 std::string_view entry) const {
  const auto* md = dynamic_cast<const CudaAttentionMetadata*>(&metadata);
  PAGEDATTN_CHECK(md != nullptr, "metadata", "CUDA ", entry, ": metadata was not built by the CUDA backend's builder");
  PAGEDATTN_CHECK(md->stamp.current(), "metadata", "CUDA ", entry, ": metadata is stale (plan ",
                  md->stamp.generation, " but its builder has since built another or been destroyed): a "
                  "plan is valid until its builder's next build()");
  PAGEDATTN_CHECK(md->attn_type == params_.attn_type, "metadata", "CUDA ", entry,
                  ": metadata was built for attn_type = ", attention_type_name(md->attn_type),
                  " but this layer has attn_type = ", attention_type_name(params_.attn_type));
  PAGEDATTN_CHECK(md->head_size == params_.head_size && md->head_size_v == params_.value_head_size() &&
                      md->num_heads == params_.num_heads && md->num_kv_heads == params_.kv_heads(),
                  "metadata", "CUDA ", entry, ": metadata was built for num_heads = ", md->num_heads,
                  ", num_kv_heads = ", md->num_kv_heads, ", head_size = ", md->head_size, ", head_size_v = ",
                  md->head_size_v, " but this layer has ", params_.num_heads, ", ", params_.kv_heads(), ", ",
                  params_.head_size, ", ", params_.value_head_size());
  PAGEDATTN_CHECK(!md->use_cascade || params_.alibi_slopes.empty(), "metadata", "CUDA ", entry,
                  ": metadata was planned with a cascade prefix but this layer uses ALiBi "
                  "(BuilderConfig::use_alibi must match the group's layers)");
  PAGEDATTN_CHECK(md->sliding_window == params_.sliding_window, "metadata", "CUDA ", entry,
                  ": metadata was planned with sliding_window = ", md->sliding_window.value_or(0),
                  " but this layer has sliding_window = ", params_.sliding_window.value_or(0),
                  " (0 = none; BuilderConfig::sliding_window must match the group's layers)");
  return *md;
}

void CudaAttentionImpl::do_kv_cache_update(const LayerScales& scales, const TensorView& key,
                                           const TensorView& value, const TensorView& kv_cache,
                                           const AttentionMetadata& metadata) {
  const CudaAttentionMetadata& md = checked_metadata(metadata, "do_kv_cache_update");
  if (!uses_kv_cache(params_.attn_type)) return;  // encoder types keep no cache
  if (!key.defined() && !value.defined()) return;  // e.g. cross-attention after the encoder step
  PAGEDATTN_CHECK(key.defined() && value.defined(), key.defined() ? "value" : "key",
                  "CUDA do_kv_cache_update: key and value must be given together");
  check_defined(kv_cache, "kv_cache");
  check_ndim(kv_cache, "kv_cache", 5);
  check_ndim(key, "key", 3);
  PAGEDATTN_CHECK(kv_cache.size(2) == md.block_size, "kv_cache", "CUDA do_kv_cache_update: kv_cache has shape ",
                  kv_cache.shape().str(), ": expected block_size ", md.block_size, " in dim 2");
  md.cache_footprint.check_fits(kv_cache.size(1), md.block_size, "CUDA", "do_kv_cache_update");
  const KVCacheViews views = split_kv_cache(kv_cache, params_.head_size, params_.value_head_size());
  const int64_t live = std::min(key.size(0), md.slot_mapping.size(0));
  // The op checks every argument (shapes, dtypes, devices, scales) before anything is written.
  reshape_and_cache_flash(key, value, views.key_cache, views.value_cache, md.slot_mapping.narrow(0, 0, live),
                          params_.kv_cache_dtype, scales);
}

void CudaAttentionImpl::check_forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
                                      const TensorView& value, const TensorView& kv_cache,
                                      const AttentionMetadata& metadata, const TensorView& output,
                                      const TensorView& output_scale, const TensorView& output_lse) const {
  const CudaAttentionMetadata& md = checked_metadata(metadata, "forward");
  const int num_heads = params_.num_heads;
  const int num_kv_heads = params_.kv_heads();
  const int head_size = params_.head_size;
  const int head_size_v = params_.value_head_size();
  const int64_t num_tokens = md.num_actual_tokens;
  const bool cached = uses_kv_cache(params_.attn_type);
  // The query: the activation dtype, or e4m3 (scaled by q_scale) when supports_quant_query_input.
  check_defined(query, "query");
  check_query_dtype(scales, query, "CUDA");
  check_tensor(query, "query", query.dtype(), Shape{num_tokens, num_heads, head_size}, 1);
  check_vector_rows(query, "query", 2);
  // Fused fp8 output: output is e4m3 = o / output_scale[0]; the scale is (1,) f32 on the device and
  // read there (a value that is not positive and finite gives NaN rows: output_store.cuh).
  const bool fp8_output = output_scale.defined();
  if (fp8_output) {
    check_tensor(output_scale, "output_scale", DType::f32, Shape{1}, 0);
    PAGEDATTN_CHECK(head_size_v % 16 == 0, "output_scale", "CUDA forward: fp8 output with head_size_v = ",
                    head_size_v, ": e4m3 output rows move in 16-byte chunks, so head_size_v must be a multiple of 16");
  }
  check_tensor(output, "output", fp8_output ? DType::fp8_e4m3 : params_.dtype, Shape{num_tokens, num_heads, head_size_v}, 1);
  check_vector_rows(output, "output", 2);
  if (output_lse.defined()) {
    check_defined(output_lse, "output_lse");
    check_device(output_lse, "output_lse", Device::cuda);
    const DType f32[] = {DType::f32};
    check_dtype(output_lse, "output_lse", f32);
    check_ndim(output_lse, "output_lse", 2);
    PAGEDATTN_CHECK(output_lse.size(0) == num_heads && output_lse.size(1) >= num_tokens, "output_lse",
                    "CUDA forward: output_lse has shape ", output_lse.shape().str(), ": expected (", num_heads,
                    ", >= ", num_tokens, ")");
  }
  if (is_fp8(cache_dtype_) && cached) {
    PAGEDATTN_CHECK(std::isfinite(scales.k_scale) && scales.k_scale > 0.f, "scales.k_scale",
                    "CUDA forward: k_scale = ", scales.k_scale, " must be a positive finite number for an fp8 cache");
    PAGEDATTN_CHECK(std::isfinite(scales.v_scale) && scales.v_scale > 0.f, "scales.v_scale",
                    "CUDA forward: v_scale = ", scales.v_scale, " must be a positive finite number for an fp8 cache");
    for (const auto& [t, arg] : {std::pair{&scales.k_scale_per_head, "scales.k_scale_per_head"},
                                 std::pair{&scales.v_scale_per_head, "scales.v_scale_per_head"}}) {
      if (!t->defined()) continue;
      check_tensor(*t, arg, DType::f32, Shape{num_kv_heads}, 0);
      PAGEDATTN_CHECK(t->stride(0) == 1, arg, "CUDA forward: ", arg, " must be contiguous");
    }
  }
  if (cached) {
    check_defined(kv_cache, "kv_cache");
    check_tensor(kv_cache, "kv_cache", cache_dtype_,
                 Shape{2, 0, md.block_size, num_kv_heads, std::max(head_size, head_size_v)}, 2);
    PAGEDATTN_CHECK(kv_cache.size(0) == 2, "kv_cache", "CUDA forward: kv_cache has shape ", kv_cache.shape().str(),
                    ": expected 2 in dim 0 (keys, values)");
    const KVCacheViews views = split_kv_cache(kv_cache, head_size, head_size_v);
    check_vector_rows(views.key_cache, "kv_cache", 3);
    check_vector_rows(views.value_cache, "kv_cache", 3);
    // Every block a request reads and every slot written lie in this cache (O(1): from build()).
    md.cache_footprint.check_fits(kv_cache.size(1), md.block_size, "CUDA", "forward");
  } else {
    check_tensor(key, "key", params_.dtype, Shape{num_tokens, num_kv_heads, head_size}, 1);
    check_tensor(value, "value", params_.dtype, Shape{num_tokens, num_kv_heads, head_size_v}, 1);
    check_vector_rows(key, "key", 2);
    check_vector_rows(value, "value", 2);
  }
}

AttentionKernelParams CudaAttentionImpl::kernel_params(const LayerScales& scales, const TensorView& query,
                                                     const TensorView& key, const TensorView& value,
                                                     const TensorView& kv_cache, const AttentionMetadata& metadata,
                                                     const TensorView& output, const TensorView& output_scale,
                                                     const TensorView& output_lse) const {
  const auto& md = static_cast<const CudaAttentionMetadata&>(metadata);
  const int num_heads = params_.num_heads;
  const int num_kv_heads = params_.kv_heads();
  const int head_size = params_.head_size;
  const int head_size_v = params_.value_head_size();
  const bool cached = uses_kv_cache(params_.attn_type);
  const bool fp8 = is_fp8(cache_dtype_);
  float k_scale = 1.f, v_scale = 1.f;
  const float* k_scale_per_head = nullptr;
  const float* v_scale_per_head = nullptr;
  if (fp8 && cached) {
    k_scale = scales.k_scale;
    v_scale = scales.v_scale;
    if (scales.k_scale_per_head.defined()) k_scale_per_head = scales.k_scale_per_head.data_as<const float>();
    if (scales.v_scale_per_head.defined()) v_scale_per_head = scales.v_scale_per_head.data_as<const float>();
  }

  AttentionKernelParams p{};
  KVCacheViews views;
  if (cached) {
    views = split_kv_cache(kv_cache, head_size, head_size_v);
    p.key = views.key_cache.data();
    p.value = views.value_cache.data();
    p.k_block_stride = views.key_cache.stride(0);
    p.k_token_stride = views.key_cache.stride(1);
    p.k_head_stride = views.key_cache.stride(2);
    p.v_block_stride = views.value_cache.stride(0);
    p.v_token_stride = views.value_cache.stride(1);
    p.v_head_stride = views.value_cache.stride(2);
    p.paged = 1;
    p.num_blocks = views.key_cache.size(0);
  } else {
    p.key = key.data();
    p.value = value.data();
    p.k_token_stride = key.stride(0);
    p.k_head_stride = key.stride(1);
    p.v_token_stride = value.stride(0);
    p.v_head_stride = value.stride(1);
    p.paged = 0;
    p.num_blocks = 0;
  }
  p.query = query.data();
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.query_fp8 = query.dtype() == DType::fp8_e4m3 ? 1 : 0;
  p.output = output.data();
  p.o_token_stride = output.stride(0);
  p.o_head_stride = output.stride(1);
  p.output_scale = output_scale.defined() ? output_scale.data_as<const float>() : nullptr;
  p.lse = output_lse.defined() ? output_lse.data_as<float>() : nullptr;
  p.lse_head_stride = output_lse.defined() ? output_lse.stride(0) : 0;
  p.lse_token_stride = output_lse.defined() ? output_lse.stride(1) : 0;
  p.block_table = md.block_table;
  p.block_table_stride = md.block_table_stride;
  p.block_size = md.block_size;
  p.header = md.header;
  p.items = md.items;
  p.partial_out = md.partial_out;
  p.partial_lse = md.partial_lse;
  p.head_size_qk = head_size;
  p.head_size_v = head_size_v;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group_size = num_heads / num_kv_heads;
  p.fp8_format = fp8_format_of(cache_dtype_);
  p.scale = p.query_fp8 ? params_.scale * scales.q_scale : params_.scale;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.k_scale_per_head = k_scale_per_head;
  p.v_scale_per_head = v_scale_per_head;
  p.soft_cap = params_.logits_soft_cap.value_or(0.f);
  p.alibi_slopes = alibi_slopes_.defined() ? alibi_slopes_.data_as<const float>() : nullptr;
  p.sinks = sinks_.defined() ? sinks_.data_as<const float>() : nullptr;
  const int window = params_.sliding_window.value_or(0);
  if (params_.attn_type == AttentionType::encoder_decoder) {
    p.window_left = -1;
    p.window_right = -1;
  } else {
    p.window_left = window > 0 ? window - 1 : -1;
    p.window_right = md.causal ? 0 : (window > 0 ? window - 1 : -1);
  }
  return p;
}

void CudaAttentionImpl::forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
                                const TensorView& value, const TensorView& kv_cache,
                                const AttentionMetadata& metadata, const TensorView& output,
                                const TensorView& output_scale, const TensorView& output_lse) {
  // ---- every check before anything is launched ----
  check_forward(scales, query, key, value, kv_cache, metadata, output, output_scale, output_lse);
  const auto& md = static_cast<const CudaAttentionMetadata&>(metadata);
  const int head_size = params_.head_size;
  const int head_size_v = params_.value_head_size();
  const bool cached = uses_kv_cache(params_.attn_type);
  const bool fp8 = is_fp8(cache_dtype_);
  const AttentionKernelParams p =
      kernel_params(scales, query, key, value, kv_cache, metadata, output, output_scale, output_lse);
  if (md.num_actual_tokens == 0 || md.num_work_items == 0) {
    // Nothing to attend to (a captured graph would still have to launch: see below).
    void* stream = current_cuda_stream();
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
    if (status == cudaStreamCaptureStatusNone && !md.for_cudagraph) return;
  }

  // The plan's kernel must have an instance for this layer (attention_launch.cuh says so with an
  // Error) and, for the warp-specialized one, the tensors' strides must fit its 32-bit offsets.
  PAGEDATTN_CHECK(md.kernel != AttentionKernel::ws || ws_strides_fit(p), cached ? "kv_cache" : "key",
                  "CUDA forward: the plan runs the warp-specialized kernel, whose copies use 32-bit byte "
                  "offsets, but the K/V strides (block ", p.k_block_stride, " / ", p.v_block_stride, ", token ",
                  p.k_token_stride, " / ", p.v_token_stride,
                  " elements) do not fit them: build the plan with this layer's KV cache spec");
  void* stream = current_cuda_stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t capture_query = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
  PAGEDATTN_CHECK(capture_query == cudaSuccess, "device", "CUDA forward: cudaStreamIsCapturing failed: ",
                  cudaGetErrorString(capture_query));
  const bool graph_safe = md.for_cudagraph || status != cudaStreamCaptureStatusNone;
  // Graph-safe launches do not depend on the plan's counts: the kernels read them on the device.
  const int grid = graph_safe ? md.resident_ctas : md.attention_grid;
  // The plan's kernel for D = max(head_size, head_size_v); the narrower dim is zero-padded on chip.
  // Every kernel computes any plan of the builder, so a captured graph replays every later plan.
  launch_paged_attention(p, std::max(head_size, head_size_v), params_.dtype, fp8 && cached, md.kernel, grid,
                         stream);
  if (graph_safe || md.num_combine_items > 0) {
    CombineKernelParams c{};
    c.header = md.header;
    c.items = md.combine_items;
    c.partial_out = md.partial_out;
    c.partial_lse = md.partial_lse;
    c.output = output.data();
    c.o_token_stride = output.stride(0);
    c.o_head_stride = output.stride(1);
    c.output_scale = p.output_scale;
    c.lse = p.lse;
    c.lse_head_stride = p.lse_head_stride;
    c.lse_token_stride = p.lse_token_stride;
    c.group_size = p.group_size;
    c.head_size = head_size_v;
    const int combine_grid = graph_safe ? md.combine_grid_capacity : md.num_combine_items;
    launch_combine_splits(c, params_.dtype, combine_grid, stream);
  }
}

}  // namespace pagedattn::cuda

#endif  // PAGEDATTN_HAS_CUDA
