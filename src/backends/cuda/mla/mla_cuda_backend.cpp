// The CUDA_MLA backend: selector reasons, the builder (the shared MLA plan + the balanced
// split-KV decode plan, mla_decode.h) and the impl (the shared MLA run + the latent decode
// kernel). Plan/run split: the builder chooses the decode kernel of every tokens-per-request
// count once, at construction (mla_decode.h DecodeKernel, from the rows of a request =
// tokens_per_request x heads, under the PAGEDATTN_CUDA_KERNEL override); build() partitions the
// decode requests' key ranges on the host for that kernel's row tiles and uploads the plan into
// device arrays allocated at construction (async copy of a staged host image, no sync);
// forward_decode only launches the plan's kernel. A plan is valid until the builder's next build() (or its
// destruction): the shared MLA build stamps every plan (PlanStamp, backend.h) and forward /
// do_kv_cache_update / forward_decode / the prefill runners throw on an older one.
// CUDA graphs (cudagraph_support() == uniform_batch, as vLLM's FlashMLA): every array a decode
// step reads sits at a fixed address of the builder (the plan arrays here; the slot mapping and
// block-table rows in the common builder), and a plan from build_for_cudagraph_capture launches
// the kernel over every part the builder plans for its tokens-per-request count (empty parts exit
// at once) and always the combine (a request of one segment is skipped there). The kernel, its
// row tiles and its part count depend on that count q alone, so a graph captured on a batch of B
// decodes of q tokens each replays any later plan of at most B decode requests of the same q
// (plus padding requests of query_len 0) from build(): its cuBLAS products and cache write run
// over the captured B x q rows, whose slots past the step are -1 and whose rows past the step are
// scratch, as in vLLM's padded graphs. A batch of decodes of unequal q is not captured (vLLM
// keys its graphs by one uniform decode query length, 1 + num_speculative_tokens).
#if PAGEDATTN_HAS_CUDA

#include "backends/cuda/mla/mla_cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/cuda/common/device_runtime.h"
#include "backends/cuda/mla/mla_decode.h"
#include "backends/mla/mla_common.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"

namespace pagedattn {
namespace cuda {
namespace {

constexpr std::string_view kName = "CUDA_MLA";
constexpr const char* kKvCacheDtypes[] = {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"};
namespace md = mla_decode;

struct CudaMlaMetadata final : MLAMetadata {
  md::DecodeKernel decode_kernel = md::DecodeKernel::mma_16_rows;  // what forward_decode launches
  int tokens_per_request = 1;  // the decodes' largest query_len: rows of a request = this x heads
  int num_parts = 0;       // parts launched: the plan's, or every part the builder plans (capture)
  md::Combine combine = md::Combine::none;  // the combine's launch (narrow for a capture plan)
  const md::Segment* segments = nullptr;
  const int32_t* part_begin = nullptr;
  const md::DecodeRequest* requests = nullptr;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  int num_heads = 0;
};

class CudaMlaMetadataBuilder final : public mla::MLACommonMetadataBuilder {
 public:
  CudaMlaMetadataBuilder(KVCacheSpec spec, const BuilderConfig& config, Device device)
      : MLACommonMetadataBuilder(std::move(spec), config, device) {
    PAGEDATTN_CHECK(device == Device::cuda, "device", kName, " make_builder: device = ", device_name(device),
                    ", expected cuda");
    PAGEDATTN_CHECK(config_.num_heads > 0, "config.num_heads", kName, " make_builder: num_heads = ",
                    config_.num_heads, " must be > 0");
    max_parts_ = std::max(1, config_.num_sms > 0 ? config_.num_sms : current_device_sm_count());
    // The kernel's requests are decode requests (a speculative decode's q tokens are its rows).
    const int64_t s = std::max<int64_t>(1, std::min<int64_t>(config_.max_num_seqs, max_decode_tokens()));
    // Batch-invariant builders (config_ resolved by the common builder): fixed 2048-key segments
    // (md::make_fixed_plan), as many as the longest requests need.
    const int64_t fixed = config_.batch_invariant
                              ? md::max_fixed_segments(s, config_.max_model_len, md::kBatchInvariantSplitTiles)
                              : 0;
    max_segments_ = std::max(md::max_segments(s, max_parts_), fixed);
    // One kernel per tokens-per-request count T (1 .. the reorder threshold), from the rows of a
    // request (T x heads); batch-invariant builders keep the single-token choice for every T, so a
    // token's arithmetic does not depend on how many tokens its request has. The partial buffers
    // hold the largest T's slots x rows.
    const int threshold = reorder_batch_threshold();
    kernels_.assign(static_cast<size_t>(threshold) + 1, md::DecodeKernel::mma_16_rows);
    for (int t = 1; t <= threshold; ++t) {
      kernels_[t] = md::resolve_decode_kernel((config_.batch_invariant ? 1 : t) * config_.num_heads, spec_.dtype);
      const int parts = std::max(1, max_parts_ / md::row_tiles(kernels_[t], t * config_.num_heads));
      const int64_t slots = std::max(md::max_partial_slots(parts), fixed);
      max_partial_rows_ = std::max(max_partial_rows_, slots * t * config_.num_heads);
    }
    part_begin_offset_ = 0;
    segments_offset_ = align16((max_parts_ + 1) * sizeof(int32_t));
    requests_offset_ = segments_offset_ + align16(max_segments_ * sizeof(md::Segment));
    const size_t bytes = requests_offset_ + align16(s * sizeof(md::DecodeRequest));
    plan_ = Tensor(Shape{static_cast<int64_t>(bytes)}, DType::u8, Device::cuda);
    staging_.resize(bytes);
    partial_out_ = Tensor(Shape{max_partial_rows_, md::kValue}, DType::f32, Device::cuda);
    partial_lse_ = Tensor(Shape{max_partial_rows_}, DType::f32, Device::cuda);
  }

  // Decode-only batches whose decodes share one query_len (1 .. the reorder threshold; padding
  // requests of query_len 0 anywhere) within the limits.
  bool can_run_in_cudagraph(const CommonAttentionMetadata& common) const override {
    return graph_problem(common).empty();
  }
  CudaGraphSupport cudagraph_support() const override { return CudaGraphSupport::uniform_batch; }
  std::shared_ptr<const AttentionMetadata> build_for_cudagraph_capture(const CommonAttentionMetadata& common) override {
    const std::string problem = graph_problem(common);
    PAGEDATTN_CHECK(problem.empty(), "common", kName, " build_for_cudagraph_capture: ", problem);
    capturing_ = true;
    try {
      auto md = build(0, common);
      capturing_ = false;
      return md;
    } catch (...) {
      capturing_ = false;
      throw;
    }
  }

  size_t workspace_bytes() const override {
    return MLACommonMetadataBuilder::workspace_bytes() + plan_.nbytes() + partial_out_.nbytes() + partial_lse_.nbytes();
  }

 protected:
  std::shared_ptr<MLAMetadata> make_metadata() const override { return std::make_shared<CudaMlaMetadata>(); }

  // fast_build changes nothing here: make_plan prices two partitions (balanced, and whole
  // requests when the balanced one cuts), O(n log n + parts) host work with no search to skip, and
  // MLA has no cascade. Batch-invariant builders: the fixed segments of make_fixed_plan.
  void plan_decode(MLAMetadata& metadata, const CommonAttentionMetadata& /*common*/,
                   bool /*fast_build*/) override {
    auto& m = static_cast<CudaMlaMetadata&>(metadata);
    const std::vector<int32_t>& qsl = m.decode.query_start_loc;
    int tokens = 1;  // the decodes' largest query_len (<= the reorder threshold: the common build)
    for (size_t r = 0; r + 1 < qsl.size(); ++r) tokens = std::max(tokens, qsl[r + 1] - qsl[r]);
    PAGEDATTN_CHECK(tokens < static_cast<int>(kernels_.size()), "common", kName, " plan: a decode of ", tokens,
                    " tokens exceeds the reorder threshold ", kernels_.size() - 1, " (internal error)");
    const md::DecodeKernel kernel = kernels_[tokens];
    const int parts = std::max(1, max_parts_ / md::row_tiles(kernel, tokens * config_.num_heads));
    const md::Plan plan =
        config_.batch_invariant
            ? md::make_fixed_plan(m.decode.seq_lens, qsl, md::kBatchInvariantSplitTiles, parts)
            : md::make_plan(m.decode.seq_lens, qsl, parts, kernel);
    PAGEDATTN_CHECK(plan.num_parts <= parts && static_cast<int64_t>(plan.segments.size()) <= max_segments_ &&
                        int64_t{plan.num_partial_slots} * tokens * config_.num_heads <= max_partial_rows_ &&
                        plan.tokens_per_request == tokens,
                    "common", kName, " plan: ", plan.segments.size(), " segments / ", plan.num_partial_slots,
                    " partial slots of ", tokens, " tokens a request exceed the builder's capacity (internal error)");
    // Every part the builder plans gets its range (the parts past the plan's empty) and every
    // request slot its split (those past the plan's 0: no combine), so a kernel captured over all
    // parts and requests reads this plan exactly.
    std::fill(staging_.begin(), staging_.end(), uint8_t{0});
    auto* part_begin = reinterpret_cast<int32_t*>(staging_.data() + part_begin_offset_);
    std::copy(plan.part_begin.begin(), plan.part_begin.end(), part_begin);
    std::fill(part_begin + plan.part_begin.size(), part_begin + parts + 1, static_cast<int32_t>(plan.segments.size()));
    std::memcpy(staging_.data() + segments_offset_, plan.segments.data(), plan.segments.size() * sizeof(md::Segment));
    std::memcpy(staging_.data() + requests_offset_, plan.requests.data(),
                plan.requests.size() * sizeof(md::DecodeRequest));
    // Pageable source: each copy is staged before cudaMemcpyAsync returns (staging_ is reusable).
    const auto upload = [&](size_t offset, size_t bytes) {
      const cudaError_t err = cudaMemcpyAsync(static_cast<uint8_t*>(plan_.data()) + offset, staging_.data() + offset,
                                              bytes, cudaMemcpyHostToDevice,
                                              static_cast<cudaStream_t>(current_cuda_stream()));
      PAGEDATTN_CHECK(err == cudaSuccess, "common", kName, " plan upload: ", cudaGetErrorString(err));
    };
    upload(0, segments_offset_ + plan.segments.size() * sizeof(md::Segment));
    upload(requests_offset_, staging_.size() - requests_offset_);
    auto* base = static_cast<uint8_t*>(plan_.data());
    m.decode_kernel = kernel;
    m.tokens_per_request = tokens;
    m.num_parts = capturing_ ? parts : plan.num_parts;
    m.combine = capturing_ ? md::Combine::narrow : md::plan_combine(plan);
    m.part_begin = reinterpret_cast<const int32_t*>(base + part_begin_offset_);
    m.segments = reinterpret_cast<const md::Segment*>(base + segments_offset_);
    m.requests = reinterpret_cast<const md::DecodeRequest*>(base + requests_offset_);
    m.partial_out = partial_out_.data_as<float>();
    m.partial_lse = partial_lse_.data_as<float>();
    m.num_heads = config_.num_heads;  // m.stamp: set by MLACommonMetadataBuilder::build
  }

 private:
  static size_t align16(size_t x) { return (x + 15) / 16 * 16; }
  // Why a batch cannot be captured or replayed (empty: it can).
  std::string graph_problem(const CommonAttentionMetadata& common) const {
    if (common.num_reqs > config_.max_num_seqs) {
      return detail::concat("num_reqs = ", common.num_reqs, " exceeds the builder's max_num_seqs = ", config_.max_num_seqs);
    }
    if (common.max_seq_len > config_.max_model_len) {
      return detail::concat("max_seq_len = ", common.max_seq_len, " exceeds the builder's max_model_len = ",
                            config_.max_model_len);
    }
    const TensorView& qsl = common.query_start_loc_cpu;
    const auto start = [&qsl](int r) {
      return static_cast<int64_t>(load_f64(qsl.data(), qsl.dtype(), r * qsl.stride(0)));
    };
    const int threshold = static_cast<int>(kernels_.size()) - 1;  // the largest decode query_len
    int64_t uniform = 0;  // the first decode's query_len (0: no decode yet)
    for (int r = 0; r < common.num_reqs; ++r) {
      const int64_t q = start(r + 1) - start(r);
      if (q == 0) continue;
      if (q > threshold) {
        return detail::concat("request ", r, " has query_len ", q, ": a graph runs batches of decodes (query_len 1 .. ",
                              threshold, ", the reorder threshold; 0 for padding)");
      }
      if (uniform == 0) uniform = q;
      if (q != uniform) {
        return detail::concat("request ", r, " has query_len ", q, " but an earlier decode has ", uniform,
                              ": a graph runs uniform batches (every decode of one query_len; 0 for padding)");
      }
    }
    if (uniform == 0) return "the batch has no decode request (every query_len is 0)";
    return {};
  }
  bool capturing_ = false;  // build_for_cudagraph_capture is building
  int max_parts_ = 1;
  int64_t max_segments_ = 0, max_partial_rows_ = 0;  // plan capacity (segments, partial rows)
  std::vector<md::DecodeKernel> kernels_;  // [T]: the kernel of plans of T tokens a request (construction)
  size_t part_begin_offset_ = 0, segments_offset_ = 0, requests_offset_ = 0;
  Tensor plan_, partial_out_, partial_lse_;
  std::vector<uint8_t> staging_;
};

void check_rows(const TensorView& t, std::string_view argument, int64_t d0, int64_t d1, int64_t d2, DType dtype,
                int align_bytes) {
  const std::string arg(argument);
  PAGEDATTN_CHECK(t.defined() && t.ndim() == 3, arg, kName, " forward_decode: ", argument, " ",
                  t.defined() ? t.describe() : std::string("(undefined)"), ": expected 3-D (", d0, ", ", d1, ", ", d2, ")");
  PAGEDATTN_CHECK(t.device() == Device::cuda, arg, kName, " forward_decode: ", argument, " is on ",
                  device_name(t.device()), ", expected cuda");
  PAGEDATTN_CHECK(t.dtype() == dtype, arg, kName, " forward_decode: ", argument, " is ", dtype_name(t.dtype()),
                  ", expected ", dtype_name(dtype));
  PAGEDATTN_CHECK((d0 < 0 || t.size(0) >= d0) && (d1 < 0 || t.size(1) == d1) && t.size(2) == d2, arg, kName,
                  " forward_decode: ", argument, " has shape ", t.shape().str(), ", expected (", d0 < 0 ? std::string("*") : std::to_string(d0),
                  "+, ", d1 < 0 ? std::string("*") : std::to_string(d1), ", ", d2, ")");
  const auto e = static_cast<int64_t>(t.element_size());
  const bool ok = t.stride(2) == 1 && reinterpret_cast<uintptr_t>(t.data()) % align_bytes == 0 &&
                  (t.stride(0) * e) % align_bytes == 0 && (t.stride(1) * e) % align_bytes == 0;
  PAGEDATTN_CHECK(ok, arg, kName, " forward_decode: ", argument, " (strides ", t.strides().str(),
                  ") needs a unit stride on its last dim and ", align_bytes, "-byte aligned rows");
}

class CudaMlaImpl final : public mla::MLACommonImpl {
 public:
  explicit CudaMlaImpl(const MLAImplParams& params) : MLACommonImpl(params) {
    const MLADimensions& d = params_.dims;
    PAGEDATTN_CHECK(d.kv_lora_rank == md::kValue && d.latent_head_size() == md::kLatent, "params.dims", kName,
                    ": ", d.to_string(), " is not supported: the decode kernel needs kv_lora_rank 512 and "
                    "qk_rope_head_dim 64 (latent rows of 576)");
    PAGEDATTN_CHECK(params_.dtype == DType::f16 || params_.dtype == DType::bf16, "params.dtype", kName, ": dtype ",
                    dtype_name(params_.dtype), " is not supported: expected float16 or bfloat16");
    cache_dtype_ = kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype);
  }

  // fp8 e4m3 output: MLACommonImpl stages the decode (cuBLAS) and prefill (mla_prefill.cu, merge)
  // rows in the activation dtype and quantizes them in one device pass that reads output_scale on
  // the device (mla_device_ops.cu; an invalid scale writes NaN).
  bool fused_output_quant_supported(const QuantKey& key) const override {
    return key.kind == QuantKey::Kind::fp8_e4m3_per_tensor_static;
  }

 protected:
  void check_decode(const LayerScales& scales, const TensorView& kv_cache, const MLAMetadata& metadata,
                    const TensorView& lse) const override {
    const auto* m = dynamic_cast<const CudaMlaMetadata*>(&metadata);
    PAGEDATTN_CHECK(m != nullptr, "metadata", kName, " forward_decode: metadata was not built by a ", kName, " builder");
    PAGEDATTN_CHECK(m->stamp.current(), "metadata", kName,
                    " forward_decode: the plan is stale (its builder has built a newer one since, or is gone): a "
                    "plan is valid until the builder's next build()");
    if (m->num_decodes == 0) return;
    const int b = m->num_decode_tokens;
    const int h = params_.num_heads;
    PAGEDATTN_CHECK(m->num_heads == h, "metadata", kName, " forward_decode: the plan was built for ", m->num_heads,
                    " heads, the layer has ", h);
    check_rows(kv_cache, "kv_cache", -1, -1, md::kLatent, cache_dtype_, 16);
    PAGEDATTN_CHECK(kv_cache.size(1) % 16 == 0, "kv_cache", kName, " forward_decode: block_size = ", kv_cache.size(1),
                    " must be a multiple of 16");
    if (lse.defined()) {
      PAGEDATTN_CHECK(lse.device() == Device::cuda && lse.dtype() == DType::f32 && lse.ndim() == 2 &&
                          lse.size(0) == h && lse.size(1) >= b,
                      "lse", kName, " forward_decode: lse ", lse.describe(), ": expected f32 (", h, ", >= ", b, ") on cuda");
    }
    const float k_scale = is_fp8(cache_dtype_) ? scales.k_scale : 1.f;
    PAGEDATTN_CHECK(std::isfinite(k_scale) && k_scale > 0.f, "scales.k_scale", kName, " forward_decode: k_scale = ",
                    k_scale, " must be finite and > 0");
  }

  void forward_decode(const LayerScales& scales, const TensorView& q_latent, const TensorView& kv_cache,
                      const MLAMetadata& metadata, const TensorView& o_latent, const TensorView& lse) override {
    check_decode(scales, kv_cache, metadata, lse);
    metadata.cache_footprint.check_fits(kv_cache.size(0), kv_cache.size(1), kName, "forward_decode");
    const auto* m = static_cast<const CudaMlaMetadata*>(&metadata);
    if (m->num_decodes == 0) return;
    const int b = m->num_decode_tokens;
    const int h = params_.num_heads;
    check_rows(q_latent, "q_latent", b, h, md::kLatent, params_.dtype, 16);
    check_rows(o_latent, "o_latent", b, h, md::kValue, params_.dtype, 8);
    const TensorView& bt = m->decode.block_table;
    md::DecodeParams p{};
    p.q = q_latent.data();
    p.q_token_stride = q_latent.stride(0);
    p.q_head_stride = q_latent.stride(1);
    p.cache = kv_cache.data();
    p.block_stride = kv_cache.stride(0);
    p.token_stride = kv_cache.stride(1);
    p.num_blocks = kv_cache.size(0);
    p.block_table = bt.data_as<const int32_t>();
    p.bt_stride = bt.stride(0);
    p.block_size = static_cast<int32_t>(kv_cache.size(1));
    p.num_heads = h;
    p.out = o_latent.data();
    p.o_token_stride = o_latent.stride(0);
    p.o_head_stride = o_latent.stride(1);
    p.lse = lse.defined() ? lse.data_as<float>() : nullptr;
    p.lse_head_stride = lse.defined() ? lse.stride(0) : 0;
    p.lse_token_stride = lse.defined() ? lse.stride(1) : 0;
    p.segments = m->segments;
    p.part_begin = m->part_begin;
    p.requests = m->requests;
    p.partial_out = m->partial_out;
    p.partial_lse = m->partial_lse;
    p.num_requests = m->num_decodes;
    p.tokens_per_request = m->tokens_per_request;
    const float k_scale = is_fp8(cache_dtype_) ? scales.k_scale : 1.f;
    p.scale_log2 = params_.scale * k_scale * 1.4426950408889634f;
    p.out_scale = k_scale;
    md::launch_decode(p, params_.dtype, cache_dtype_, m->decode_kernel, m->num_parts, m->combine,
                      current_cuda_stream());
  }

 private:
  DType cache_dtype_ = DType::bf16;
};

class CudaMlaBackend final : public MLABackend {
 public:
  std::string_view name() const override { return kName; }

  std::unique_ptr<MLAAttentionImpl> make_mla_impl(const MLAImplParams& params) const override {
    return std::make_unique<CudaMlaImpl>(params);
  }

  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(
      const KVCacheSpec& spec, const BuilderConfig& config, Device device) const override {
    PAGEDATTN_CHECK(spec.kind == KVCacheSpecKind::mla, "spec", kName, " make_builder: spec kind is not mla");
    PAGEDATTN_CHECK(spec.block_size > 0 && spec.block_size % 16 == 0, "spec.block_size", kName,
                    " make_builder: block_size = ", spec.block_size, " must be a positive multiple of 16");
    return std::make_unique<CudaMlaMetadataBuilder>(spec, config, device);
  }

  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override { return {MultipleOf{16}}; }

  std::vector<std::string> validate_configuration(const SelectorConfig& config) const override {
    std::vector<std::string> reasons;
    mla::add_mla_common_reasons(kName, config, reasons, /*fp8_output_supported=*/true);
    if (!config.use_mla) return reasons;
    auto add = [&reasons](auto&&... parts) { reasons.push_back(detail::concat(parts...)); };
    if (config.device != Device::cuda) {
      add("device = ", device_name(config.device), ": ", kName, " runs on cuda devices only.");
    } else if (cuda_device_count() == 0) {
      add("device = cuda but no CUDA device is visible (cuda_device_count() == 0).");
    } else if (const std::string problem = kernel_image_problem(); !problem.empty()) {
      add(problem);
    }
    if (config.dtype != DType::f16 && config.dtype != DType::bf16) {
      add("dtype = ", dtype_name(config.dtype), " is not supported: ", kName, " takes float16 or bfloat16 activations.");
    }
    const MLADimensions& d = config.mla_dimensions;
    if (!d.empty() ? (d.kv_lora_rank != md::kValue || d.latent_head_size() != md::kLatent)
                   : config.head_size != md::kLatent) {
      add(!d.empty() ? d.to_string() : detail::concat("head_size = ", config.head_size),
          " is not supported: the ", kName, " decode kernel needs kv_lora_rank = 512 and qk_rope_head_dim = 64 "
          "(latent rows of 576).");
    }
    bool known = false;
    for (const char* s : kKvCacheDtypes) known = known || config.kv_cache_dtype == s;
    if (!known) {
      add("kv_cache_dtype = \"", config.kv_cache_dtype, "\" is not supported: ", kName,
          " accepts auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16.");
    } else if ((config.kv_cache_dtype == "bfloat16" && config.dtype != DType::bf16) ||
               (config.kv_cache_dtype == "float16" && config.dtype != DType::f16)) {
      add("kv_cache_dtype = \"", config.kv_cache_dtype, "\" with dtype = ", dtype_name(config.dtype),
          ": a 16-bit ", kName, " cache must hold the activation dtype (or use auto / fp8).");
    }
    if (config.block_size <= 0 || config.block_size % 16 != 0) {
      add("block_size = ", config.block_size, " is not supported: ", kName, " needs a positive multiple of 16.");
    }
    return reasons;
  }

  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.devices = {Device::cuda};
    caps.dtypes = {DType::f16, DType::bf16};
    caps.kv_cache_dtypes.assign(std::begin(kKvCacheDtypes), std::end(kKvCacheDtypes));
    caps.head_sizes = {md::kLatent};
    caps.attn_types = {AttentionType::decoder};
    caps.features = {"mla", "lse", "fp8_output", "split_kv", "batch_invariant"};
    return caps;
  }
};

}  // namespace
}  // namespace cuda

const AttentionBackend& cuda_mla_backend() {
  static const cuda::CudaMlaBackend backend;
  return backend;
}

}  // namespace pagedattn

#endif  // PAGEDATTN_HAS_CUDA
