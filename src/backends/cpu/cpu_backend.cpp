// The CPU backend object (capabilities, selector reasons) and its impl: argument checks, the KV
// cache write (reshape_and_cache_flash on the standard NHD / HND layouts) and forward, which
// turns the plan built by cpu_plan.cpp into kernel arguments and runs it on the ISA chosen by
// cpu_dispatch.cpp. forward allocates nothing in the common case: its buffers are a set leased
// from the builder's workspace pool (a new set only while forwards overlap: cpu_internal.h).
#include "backends/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "backends/cpu/cpu_internal.h"
#include "backends/host_backend_common.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/ops.h"

namespace pagedattn {
namespace cpu {
namespace {

using host::accepted_kv_cache_dtypes;
using host::is_accepted_kv_cache_dtype;
using host::is_activation_dtype;

bool is_fp8_kv_cache_dtype(std::string_view s) {
  return s == "fp8" || s == "fp8_e4m3" || s == "fp8_e5m2";
}

// vLLM's encoder attention raises NotImplementedError for a quantized KV cache: the keys and
// values come straight from the layer inputs, so there is nothing to dequantize.
constexpr const char* kEncoderFp8Reason =
    "encoder attention reads its keys and values from the inputs, never from an fp8 cache, so "
    "fp8 scales have nothing to apply to (vLLM raises NotImplementedError here too)";

bool head_size_supported(int size) {
  return size >= kHeadSizeMultiple && size <= kMaxHeadSize && size % kHeadSizeMultiple == 0;
}

class CpuBackend final : public AttentionBackend {
 public:
  std::string_view name() const override { return "CPU"; }

  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<CpuAttentionImpl>(params);
  }

  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(const KVCacheSpec& spec,
                                                                 const BuilderConfig& config,
                                                                 Device device) const override {
    PAGEDATTN_CHECK(device == Device::cpu, "device", "CPU make_builder: device = ",
                    device_name(device), " is not supported: the CPU backend runs on the cpu");
    PAGEDATTN_CHECK(spec.kind != KVCacheSpecKind::mla, "spec",
                    "CPU make_builder: spec kind = mla is not supported: the CPU backend computes "
                    "standard multi-head attention only");
    PAGEDATTN_CHECK(spec.block_size > 0, "spec.block_size", "CPU make_builder: block_size = ",
                    spec.block_size, " must be positive");
    return std::make_unique<CpuMetadataBuilder>(spec, config);
  }

  // Any block size; multiples of 16 take the fast path (one page lookup per 16 keys).
  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override {
    return {MultipleOf{1}};
  }

  std::vector<std::string> validate_configuration(const SelectorConfig& config) const override {
    std::vector<std::string> reasons;
    auto add = [&reasons](auto&&... parts) {
      reasons.push_back(detail::concat(std::forward<decltype(parts)>(parts)...));
    };
    host::add_host_selector_reasons(config, "CPU", reasons);
    if (config.use_mla) {
      add("use_mla = true is not supported: the CPU backend computes standard multi-head "
          "attention only; MLA layers on the cpu use the CPU_MLA backend.");
    }
    if (!head_size_supported(config.head_size)) {
      add("head_size = ", config.head_size, " is not supported: the CPU backend supports head "
          "sizes that are multiples of ", kHeadSizeMultiple, " from ", kHeadSizeMultiple, " to ",
          kMaxHeadSize, " (e.g. 64, 80, 96, 128, 192, 256).");
    }
    if (config.head_size_v != 0 && !head_size_supported(config.head_size_v)) {
      add("head_size_v = ", config.head_size_v, " is not supported: the CPU backend supports "
          "value head sizes that are multiples of ", kHeadSizeMultiple, " from ", kHeadSizeMultiple,
          " to ", kMaxHeadSize, " (0 = head_size).");
    }
    const auto block_sizes = supported_kernel_block_sizes();
    if (!block_size_supported(block_sizes, config.block_size)) {
      add("block_size = ", config.block_size, " is not supported: the CPU backend supports block "
          "sizes that are ", describe_block_sizes(block_sizes), ".");
    }
    if (!uses_kv_cache(config.attn_type) && is_fp8_kv_cache_dtype(config.kv_cache_dtype)) {
      add("kv_cache_dtype = '", config.kv_cache_dtype, "' with attn_type = ",
          attention_type_name(config.attn_type), " is not supported: ", kEncoderFp8Reason, ".");
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
    for (int d = kHeadSizeMultiple; d <= kMaxHeadSize; d += kHeadSizeMultiple) caps.head_sizes.push_back(d);
    caps.attn_types = {AttentionType::decoder, AttentionType::encoder, AttentionType::encoder_only,
                       AttentionType::encoder_decoder};
    caps.features = {"alibi",        "sliding_window",     "soft_cap", "sinks",
                     "lse",          "cascade",            "fp8_output", "head_size_v",
                     "fp8_kv_cache", "per_head_kv_scales", "gqa",      "non_causal_decoder",
                     "split_kv",     "avx512_bf16",        "avx2",     "openmp",
                     "batch_invariant"};
    if (isa_supported(Isa::amx)) caps.features.push_back("amx");  // AMX-BF16 tiles usable here
    return caps;
  }
};

}  // namespace

// ---- impl parameters ------------------------------------------------------------------------

void check_impl_params(const AttentionImplParams& p) {
  const char* who = "CPU AttentionImpl: ";
  PAGEDATTN_CHECK(p.device == Device::cpu, "device", who, "device = ", device_name(p.device),
                  " is not supported: the CPU backend runs on the cpu");
  PAGEDATTN_CHECK(is_activation_dtype(p.dtype), "dtype", who, "dtype = ", dtype_name(p.dtype),
                  " is not supported: expected float32, float16 or bfloat16");
  PAGEDATTN_CHECK(is_accepted_kv_cache_dtype(p.kv_cache_dtype), "kv_cache_dtype", who,
                  "kv_cache_dtype = '", p.kv_cache_dtype, "' is not supported: expected one of ",
                  accepted_kv_cache_dtypes());
  PAGEDATTN_CHECK(p.num_heads > 0, "num_heads", who, "num_heads = ", p.num_heads, " must be positive");
  PAGEDATTN_CHECK(p.num_kv_heads >= 0, "num_kv_heads", who, "num_kv_heads = ", p.num_kv_heads,
                  " must be >= 0 (0 = num_heads)");
  PAGEDATTN_CHECK(p.num_heads % p.kv_heads() == 0, "num_kv_heads", who, "num_kv_heads = ",
                  p.kv_heads(), " must divide num_heads = ", p.num_heads);
  PAGEDATTN_CHECK(head_size_supported(p.head_size), "head_size", who, "head_size = ", p.head_size,
                  " is not supported: expected a multiple of ", kHeadSizeMultiple, " from ",
                  kHeadSizeMultiple, " to ", kMaxHeadSize);
  PAGEDATTN_CHECK(p.head_size_v == 0 || head_size_supported(p.head_size_v), "head_size_v", who,
                  "head_size_v = ", p.head_size_v, " is not supported: expected 0 (= head_size) or a "
                  "multiple of ", kHeadSizeMultiple, " from ", kHeadSizeMultiple, " to ", kMaxHeadSize);
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
                  "sinks has ", p.sinks.size(), " entries: expected none or num_heads = ", p.num_heads);
  for (size_t h = 0; h < p.sinks.size(); ++h) {
    PAGEDATTN_CHECK(std::isfinite(p.sinks[h]), "sinks", who, "sinks[", h, "] = ", p.sinks[h],
                    " must be finite");
  }
  if (p.sliding_window) {
    PAGEDATTN_CHECK(*p.sliding_window >= 1, "sliding_window", who, "sliding_window = ",
                    *p.sliding_window, " must be >= 1 (or not given for full attention)");
  }
  if (p.logits_soft_cap) {
    PAGEDATTN_CHECK(std::isfinite(*p.logits_soft_cap) && *p.logits_soft_cap > 0.f,
                    "logits_soft_cap", who, "logits_soft_cap = ", *p.logits_soft_cap,
                    " must be a positive finite number (or not given)");
  }
  PAGEDATTN_CHECK(uses_kv_cache(p.attn_type) || !is_fp8_kv_cache_dtype(p.kv_cache_dtype),
                  "kv_cache_dtype", who, "kv_cache_dtype = '", p.kv_cache_dtype,
                  "' with attn_type = ", attention_type_name(p.attn_type), " is not supported: ",
                  kEncoderFp8Reason);
  if (p.attn_type == AttentionType::encoder_decoder) {
    PAGEDATTN_CHECK(!p.sliding_window, "sliding_window", who, "sliding_window = ",
                    p.sliding_window.value_or(0), " is not supported with attn_type = "
                    "encoder_decoder: cross-attention has no query/key position relation for a window");
    PAGEDATTN_CHECK(p.alibi_slopes.empty(), "alibi_slopes", who,
                    "alibi_slopes are not supported with attn_type = encoder_decoder: "
                    "cross-attention has no query/key distance for ALiBi");
  }
}

// ---- impl --------------------------------------------------------------------------------------

CpuAttentionImpl::CpuAttentionImpl(AttentionImplParams params) : AttentionImpl(std::move(params)) {
  check_impl_params(params_);
  cache_dtype_ = kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype);
  active_kernels();  // surfaces a bad PAGEDATTN_CPU_ISA at construction
}

bool CpuAttentionImpl::fused_output_quant_supported(const QuantKey& key) const {
  return key.kind == QuantKey::Kind::fp8_e4m3_per_tensor_static;
}

const CpuAttentionMetadata& CpuAttentionImpl::checked_metadata(const AttentionMetadata& metadata,
                                                               std::string_view entry) const {
  const auto* md = dynamic_cast<const CpuAttentionMetadata*>(&metadata);
  PAGEDATTN_CHECK(md != nullptr, "metadata", "CPU ", entry,
                  ": metadata was not built by the CPU backend's builder");
  PAGEDATTN_CHECK(md->attn_type == params_.attn_type, "metadata", "CPU ", entry,
                  ": metadata was built for attn_type = ", attention_type_name(md->attn_type),
                  " but this layer has attn_type = ", attention_type_name(params_.attn_type));
  PAGEDATTN_CHECK(md->num_heads == params_.num_heads && md->num_kv_heads == params_.kv_heads() &&
                      md->head_size == params_.head_size &&
                      md->head_size_v == params_.value_head_size(),
                  "metadata", "CPU ", entry, ": metadata was built for num_heads = ", md->num_heads,
                  ", num_kv_heads = ", md->num_kv_heads, ", head_size = ", md->head_size,
                  ", head_size_v = ", md->head_size_v, " but this layer has ", params_.num_heads,
                  ", ", params_.kv_heads(), ", ", params_.head_size, ", ", params_.value_head_size(),
                  " (its workspace is sized for the builder's BuilderConfig)");
  return *md;
}

void CpuAttentionImpl::check_kv_cache(const TensorView& kv_cache, const CpuAttentionMetadata& md,
                                      std::string_view entry) const {
  host::check_standard_kv_cache(params_, cache_dtype_, kv_cache, md, "CPU", entry);
  PAGEDATTN_CHECK(kv_cache.stride(4) == 1, "kv_cache", "CPU ", entry, ": kv_cache has strides ",
                  kv_cache.strides().str(), ": expected the head_size dim contiguous (stride 1), "
                  "as in the NHD and HND layouts");
}

void CpuAttentionImpl::check_scales(const LayerScales& scales, std::string_view entry) const {
  host::check_layer_scales(params_, cache_dtype_, scales, "CPU", entry);
}

void CpuAttentionImpl::do_kv_cache_update(const LayerScales& scales, const TensorView& key,
                                          const TensorView& value, const TensorView& kv_cache,
                                          const AttentionMetadata& metadata) {
  const char* entry = "do_kv_cache_update";
  const CpuAttentionMetadata& md = checked_metadata(metadata, entry);
  host::write_step_kv_cache(params_, scales, key, value, kv_cache, md.slot_mapping, "CPU", [&] {
    check_kv_cache(kv_cache, md, entry);
    check_scales(scales, entry);
  });
}

void CpuAttentionImpl::check_forward(const LayerScales& scales, const TensorView& query,
                                     const TensorView& key, const TensorView& value,
                                     const TensorView& kv_cache, const AttentionMetadata& metadata,
                                     const TensorView& output, const TensorView& output_scale,
                                     const TensorView& output_lse) const {
  const char* entry = "forward";
  const CpuAttentionMetadata& md = checked_metadata(metadata, entry);
  const int num_heads = params_.num_heads;
  const int num_kv_heads = params_.kv_heads();
  const int head_size = params_.head_size;
  const int head_size_v = params_.value_head_size();
  const int64_t num_tokens = md.num_actual_tokens;
  const DType activation[] = {params_.dtype};
  check_defined(query, "query");
  check_device(query, "query", Device::cpu);
  check_dtype(query, "query", activation);
  check_ndim(query, "query", 3);
  PAGEDATTN_CHECK(query.size(0) >= num_tokens && query.size(1) == num_heads &&
                      query.size(2) == head_size && query.stride(2) == 1,
                  "query", "CPU forward: query is ", query.describe(), " with strides ",
                  query.strides().str(), ": expected (>= ", num_tokens, ", ", num_heads, ", ",
                  head_size, ") with a contiguous last dim");
  check_defined(output, "output");
  check_device(output, "output", Device::cpu);
  check_ndim(output, "output", 3);
  const DType fp8_out[] = {DType::fp8_e4m3};
  check_dtype(output, "output", output_scale.defined() ? std::span<const DType>(fp8_out)
                                                       : std::span<const DType>(activation));
  PAGEDATTN_CHECK(output.size(0) >= num_tokens && output.size(1) == num_heads &&
                      output.size(2) == head_size_v && output.stride(2) == 1,
                  "output", "CPU forward: output is ", output.describe(), " with strides ",
                  output.strides().str(), ": expected (>= ", num_tokens, ", ", num_heads, ", ",
                  head_size_v, ") with a contiguous last dim");
  if (output_scale.defined()) {
    const DType f32[] = {DType::f32};
    check_device(output_scale, "output_scale", Device::cpu);
    check_dtype(output_scale, "output_scale", f32);
    check_shape(output_scale, "output_scale", Shape{1});
    const float divisor = output_scale.data_as<const float>()[0];
    PAGEDATTN_CHECK(std::isfinite(divisor) && divisor > 0.f, "output_scale",
                    "CPU forward: output_scale[0] = ", divisor,
                    " must be a positive finite number");
  }
  if (output_lse.defined()) {
    const DType f32[] = {DType::f32};
    check_device(output_lse, "output_lse", Device::cpu);
    check_dtype(output_lse, "output_lse", f32);
    check_ndim(output_lse, "output_lse", 2);
    PAGEDATTN_CHECK(output_lse.size(0) == num_heads && output_lse.size(1) >= num_tokens,
                    "output_lse", "CPU forward: output_lse has shape ", output_lse.shape().str(),
                    ": expected (", num_heads, ", >= ", num_tokens, ")");
  }
  check_scales(scales, entry);
  if (uses_kv_cache(params_.attn_type)) {
    check_kv_cache(kv_cache, md, entry);  // block ids and slots included (O(1))
  } else {
    for (const auto& [t, arg, dim] : {std::tuple{&key, "key", head_size},
                                      std::tuple{&value, "value", head_size_v}}) {
      check_defined(*t, arg);
      check_device(*t, arg, Device::cpu);
      check_dtype(*t, arg, activation);
      check_ndim(*t, arg, 3);
      PAGEDATTN_CHECK(t->size(0) >= num_tokens && t->size(1) == num_kv_heads && t->size(2) == dim &&
                          t->stride(2) == 1,
                      arg, "CPU forward: ", arg, " is ", t->describe(), " with strides ",
                      t->strides().str(), ": expected (>= ", num_tokens, ", ", num_kv_heads, ", ",
                      dim, ") with a contiguous last dim");
    }
  }
  PAGEDATTN_CHECK(md.query_start_loc.back() == num_tokens, "metadata",
                  "CPU forward: metadata query_start_loc ends at ", md.query_start_loc.back(),
                  " but num_actual_tokens = ", num_tokens);
}

void CpuAttentionImpl::forward(const LayerScales& scales, const TensorView& query,
                               const TensorView& key, const TensorView& value,
                               const TensorView& kv_cache, const AttentionMetadata& metadata,
                               const TensorView& output, const TensorView& output_scale,
                               const TensorView& output_lse) {
  // -- every check before anything is read or written --
  check_forward(scales, query, key, value, kv_cache, metadata, output, output_scale, output_lse);
  const CpuAttentionMetadata& md = static_cast<const CpuAttentionMetadata&>(metadata);
  const int num_heads = params_.num_heads;
  const int num_kv_heads = params_.kv_heads();
  const int head_size = params_.head_size;
  const int head_size_v = params_.value_head_size();
  const int64_t num_tokens = md.num_actual_tokens;
  const bool cached = uses_kv_cache(params_.attn_type);
  if (num_tokens == 0 || md.items.empty()) return;
  const float output_divisor = output_scale.defined() ? output_scale.data_as<const float>()[0] : 1.f;
  const KVCacheViews views = cached ? split_kv_cache(kv_cache, head_size, head_size_v) : KVCacheViews{};

  // -- kernel arguments (no allocation) --
  const KernelTable& kernels = active_kernels();
  CpuWorkspace& ws = *md.workspace;  // shared_ptr to non-const: the pool hands out sets
  AttentionArgs args;
  args.query = query.data();
  args.q_stride_t = query.stride(0);
  args.q_stride_h = query.stride(1);
  args.q_dtype = query.dtype();
  KvSource& kv = args.kv;
  kv.dtype = cached ? cache_dtype_ : params_.dtype;
  if (cached) {
    // (num_blocks, block_size, Hkv, D[v]) views with the cache's strides (NHD or HND).
    kv.key = views.key_cache.data();
    kv.value = views.value_cache.data();
    kv.k_block_stride = views.key_cache.stride(0);
    kv.k_token_stride = views.key_cache.stride(1);
    kv.k_head_stride = views.key_cache.stride(2);
    kv.v_block_stride = views.value_cache.stride(0);
    kv.v_token_stride = views.value_cache.stride(1);
    kv.v_head_stride = views.value_cache.stride(2);
    kv.paged = true;
    kv.block_table = md.block_table.data();
    kv.block_table_stride = md.block_table_cols;
    kv.block_size = md.block_size;
  } else {
    // (T, Hkv, D[v]) current tokens.
    kv.key = key.data();
    kv.value = value.data();
    kv.k_token_stride = key.stride(0);
    kv.k_head_stride = key.stride(1);
    kv.v_token_stride = value.stride(0);
    kv.v_head_stride = value.stride(1);
    kv.paged = false;
  }
  args.output = output.data();
  args.o_stride_t = output.stride(0);
  args.o_stride_h = output.stride(1);
  args.o_dtype = output.dtype();
  args.output_scale = output_divisor;
  if (output_lse.defined()) {
    args.lse = output_lse.data_as<float>();
    args.lse_stride_h = output_lse.stride(0);
    args.lse_stride_t = output_lse.stride(1);
  }
  args.num_heads = num_heads;
  args.num_kv_heads = num_kv_heads;
  args.group_size = num_heads / num_kv_heads;
  args.head_size = head_size;
  args.head_size_v = head_size_v;
  args.scale = params_.scale;
  args.k_scale = scales.k_scale;
  args.v_scale = scales.v_scale;
  if (scales.k_scale_per_head.defined()) {
    args.k_scale_per_head = scales.k_scale_per_head.data_as<const float>();
    args.k_scale_per_head_stride = scales.k_scale_per_head.stride(0);
  }
  if (scales.v_scale_per_head.defined()) {
    args.v_scale_per_head = scales.v_scale_per_head.data_as<const float>();
    args.v_scale_per_head_stride = scales.v_scale_per_head.stride(0);
  }
  args.soft_cap = params_.logits_soft_cap.value_or(0.f);
  args.alibi_slopes = params_.alibi_slopes.empty() ? nullptr : params_.alibi_slopes.data();
  args.sinks = params_.sinks.empty() ? nullptr : params_.sinks.data();
  // Cross-attention has no positions: no window (rejected at construction), no causal mask.
  args.window = params_.sliding_window.value_or(0);
  args.causal = md.causal;
  args.window_symmetric = !md.causal;
  const bool bf16_operands = params_.dtype == DType::bf16 || is_fp8(kv.dtype);
  args.precision = kernels.has_bf16_dot && bf16_operands ? Precision::bf16_dot : Precision::f32;
  const DecodeKernel decode = decode_kernel();
  args.direct_decode = decode != DecodeKernel::tile;
  args.direct_fma = decode == DecodeKernel::fma || (decode == DecodeKernel::automatic && direct_decode_prefers_fma());
  args.query_start_loc = md.query_start_loc.data();
  args.seq_lens = md.seq_lens.data();
  args.first_query_pos = md.first_query_pos.data();
  // This call's own scratch and partial rows: concurrent forwards (other plans of the builder, or
  // this plan on another thread) hold other sets. Allocates only when forwards overlap.
  const auto buffers = ws.buffers.acquire();
  args.max_rows = ws.max_rows;
  args.scratch = static_cast<char*>(buffers->scratch.data());
  args.scratch_stride = ws.scratch_stride;
  args.partial_o = buffers->partial_o.defined() ? buffers->partial_o.data_as<float>() : nullptr;
  args.partial_ml = buffers->partial_ml.defined() ? buffers->partial_ml.data_as<float>() : nullptr;
  args.partial_o_stride = ws.partial_o_stride;
  execute_plan(md, args, kernels);
}

}  // namespace cpu

const AttentionBackend& cpu_backend() {
  static const cpu::CpuBackend backend;
  return backend;
}

}  // namespace pagedattn
