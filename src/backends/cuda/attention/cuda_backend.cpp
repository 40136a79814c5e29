// The CUDA backend object: capabilities, selector reasons, factories.
#if PAGEDATTN_HAS_CUDA

#include "backends/cuda/attention/cuda_backend.h"

#include <algorithm>
#include <string>

#include "backends/cuda/attention/cuda_backend_internal.h"
#include "backends/cuda/attention/kernel_launch.h"
#include "backends/cuda/common/device_runtime.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace cuda {
namespace {

constexpr const char* kKvCacheDtypes[] = {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"};

std::string head_size_list() {
  std::string s;
  for (int h : kSupportedHeadSizes) s += (s.empty() ? "" : ", ") + std::to_string(h);
  return s;
}

}  // namespace

std::vector<std::string> unsupported_reasons(const SelectorConfig& config) {
  std::vector<std::string> reasons;
  auto add = [&reasons](auto&&... parts) { reasons.push_back(detail::concat(parts...)); };
  if (config.device != Device::cuda) {
    add("device = ", device_name(config.device), ": the CUDA backend runs on cuda devices only.");
  } else if (cuda_device_count() == 0) {
    add("device = cuda but no CUDA device is visible (cuda_device_count() == 0).");
  } else if (const std::string problem = kernel_image_problem(); !problem.empty()) {
    add(problem);
  }
  if (config.dtype != DType::f16 && config.dtype != DType::bf16) {
    add("dtype = ", dtype_name(config.dtype), " is not supported: the CUDA kernels take float16 or bfloat16 activations.");
  }
  bool known_cache_dtype = false;
  for (const char* s : kKvCacheDtypes) known_cache_dtype = known_cache_dtype || config.kv_cache_dtype == s;
  if (config.head_size_v == 0 || config.head_size_v == config.head_size) {
    if (!attention_head_size_supported(config.head_size)) {
      add("head_size = ", config.head_size, " is not supported: the CUDA kernels exist for head sizes ",
          head_size_list(), ".");
    }
  } else {
    // The kernel for D = max(head_size, head_size_v) runs with the narrower dim zero-padded on chip;
    // rows move in 16-byte chunks (8 16-bit elements, 16 fp8 ones).
    const int kernel = std::max(config.head_size, config.head_size_v);
    const bool fp8_cache = config.kv_cache_dtype.rfind("fp8", 0) == 0;
    const int multiple = fp8_cache ? 16 : 8;
    if (config.head_size <= 0 || config.head_size_v < 0) {
      add("head_size = ", config.head_size, " with head_size_v = ", config.head_size_v,
          " is not supported: expected a positive head_size and head_size_v = 0 (= head_size) or positive.");
    } else if (!attention_head_size_supported(kernel)) {
      add("head_size = ", config.head_size, " with head_size_v = ", config.head_size_v,
          " is not supported: the CUDA kernels run max(head_size, head_size_v) = ", kernel,
          " and exist for head sizes ", head_size_list(), ".");
    } else if (config.head_size % multiple != 0 || config.head_size_v % multiple != 0) {
      add("head_size = ", config.head_size, " with head_size_v = ", config.head_size_v,
          " is not supported: with unequal sizes both must be multiples of ", multiple,
          fp8_cache ? " (an fp8 KV cache moves 16-element chunks)." : " (rows move in 16-byte chunks).");
    }
  }
  if (!known_cache_dtype) {
    add("kv_cache_dtype = \"", config.kv_cache_dtype,
        "\" is not supported: the CUDA backend accepts auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16.");
  } else if ((config.kv_cache_dtype == "bfloat16" && config.dtype != DType::bf16) ||
             (config.kv_cache_dtype == "float16" && config.dtype != DType::f16)) {
    add("kv_cache_dtype = \"", config.kv_cache_dtype, "\" with dtype = ", dtype_name(config.dtype),
        ": a 16-bit CUDA cache must hold the activation dtype (or use auto / fp8).");
  }
  if (config.block_size <= 0 || config.block_size % 16 != 0) {
    add("block_size = ", config.block_size, " is not supported: the CUDA kernels need a positive multiple of 16.");
  }
  if (config.use_mla) add("use_mla = true: the CUDA backend computes standard attention; MLA layers on cuda use CUDA_MLA.");
  if (config.use_sparse) add("use_sparse = true: the CUDA backend has no sparse attention.");
  if (config.fp8_output) {
    const int dv = config.head_size_v > 0 ? config.head_size_v : config.head_size;
    if (dv % 16 != 0) {
      add("fp8_output = true with head_size_v = ", dv,
          ": fp8 e4m3 output rows move in 16-byte chunks, so head_size_v must be a multiple of 16.");
    }
  }
  if (config.attn_type == AttentionType::encoder_decoder && config.use_alibi) {
    add("use_alibi = true with attn_type = encoder_decoder: cross-attention has no positions for ALiBi.");
  }
  if (config.attn_type == AttentionType::encoder_decoder && config.use_sliding_window) {
    add("use_sliding_window = true with attn_type = encoder_decoder: cross-attention has no positions for a window.");
  }
  return reasons;
}

namespace {

class CudaBackend final : public AttentionBackend {
 public:
  std::string_view name() const override { return kBackendName; }

  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<CudaAttentionImpl>(params);
  }

  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(
      const KVCacheSpec& spec, const BuilderConfig& config, Device device) const override {
    PAGEDATTN_CHECK(spec.kind != KVCacheSpecKind::mla, "spec",
                    "CUDA make_builder: spec kind = mla is not supported: MLA layers use the CUDA_MLA backend");
    PAGEDATTN_CHECK(spec.block_size > 0 && spec.block_size % 16 == 0, "spec.block_size",
                    "CUDA make_builder: block_size = ", spec.block_size, " must be a positive multiple of 16");
    return std::make_unique<CudaMetadataBuilder>(spec, config, device);
  }

  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override { return {MultipleOf{16}}; }

  std::vector<std::string> validate_configuration(const SelectorConfig& config) const override {
    return unsupported_reasons(config);
  }

  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.devices = {Device::cuda};
    caps.dtypes = {DType::f16, DType::bf16};
    caps.kv_cache_dtypes.assign(std::begin(kKvCacheDtypes), std::end(kKvCacheDtypes));
    caps.head_sizes.assign(std::begin(kSupportedHeadSizes), std::end(kSupportedHeadSizes));
    caps.attn_types = {AttentionType::decoder, AttentionType::encoder, AttentionType::encoder_only,
                       AttentionType::encoder_decoder};
    caps.features = {"alibi", "sliding_window", "soft_cap", "sinks", "lse", "split_kv", "cudagraph",
                     "cascade", "head_size_v", "fp8_output", "quant_query", "batch_invariant"};
    return caps;
  }
};

}  // namespace
}  // namespace cuda

const AttentionBackend& cuda_backend() {
  static const cuda::CudaBackend backend;
  return backend;
}

}  // namespace pagedattn

#endif  // PAGEDATTN_HAS_CUDA
