// The "CUDA" MLA prefill backend (vLLM MLAPrefillBackend): the up-projected MHA part of MLA
// prefill on the GPU (kernel: mla_prefill.cu).
//   run_prefill_new_tokens:    causal over each prefill's new tokens (prefill query_start_loc
//                              for queries and keys), LSE when asked;
//   run_prefill_context_chunk: non-causal over context chunk c (keys / values rows
//                              cu_seq_lens[c][i] .. cu_seq_lens[c][i+1]); an empty chunk gives
//                              out 0, LSE -inf.
// Every argument is checked on the host (shape, dtype, device, strides, alignment); the ragged
// offsets are read by the kernel from the plan's device arrays (no sync, no allocation).
// Output in the activation dtype only (its own kernel, not the standard attention kernels'
// output store): supports_quant_output stays false, and a layer with fused fp8 output has
// MLACommonImpl stage these rows and quantize them in one pass (mla_common_impl.cpp).
#if PAGEDATTN_HAS_CUDA

#include <string>
#include <vector>

#include "backends/cuda/mla/mla_cuda_backend.h"
#include "backends/cuda/mla/mla_prefill.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace cuda {
namespace {

namespace mp = mla_prefill;
constexpr std::string_view kName = "CUDA";

void check_3d(const TensorView& t, std::string_view argument, std::string_view entry, int64_t rows, int64_t heads,
              int64_t dim, DType dtype, int align) {
  const std::string arg(argument);
  PAGEDATTN_CHECK(t.defined() && t.ndim() == 3, arg, "CUDA MLA prefill ", entry, ": ", argument, " ",
                  t.defined() ? t.describe() : std::string("(undefined)"), ": expected 3-D (", rows, ", ", heads, ", ", dim, ")");
  PAGEDATTN_CHECK(t.device() == Device::cuda, arg, "CUDA MLA prefill ", entry, ": ", argument, " is on ",
                  device_name(t.device()), ", expected cuda");
  PAGEDATTN_CHECK(t.dtype() == dtype, arg, "CUDA MLA prefill ", entry, ": ", argument, " is ", dtype_name(t.dtype()),
                  ", expected ", dtype_name(dtype));
  PAGEDATTN_CHECK((rows < 0 || t.size(0) >= rows) && t.size(1) == heads && t.size(2) == dim, arg, "CUDA MLA prefill ",
                  entry, ": ", argument, " has shape ", t.shape().str(), ", expected (",
                  rows < 0 ? std::string("*") : std::to_string(rows) + "+", ", ", heads, ", ", dim, ")");
  const auto e = static_cast<int64_t>(t.element_size());
  const bool ok = t.stride(2) == 1 && reinterpret_cast<uintptr_t>(t.data()) % align == 0 &&
                  (t.stride(0) * e) % align == 0 && (t.stride(1) * e) % align == 0;
  PAGEDATTN_CHECK(ok, arg, "CUDA MLA prefill ", entry, ": ", argument, " (strides ", t.strides().str(),
                  ") needs a unit stride on its last dim and ", align, "-byte aligned rows");
}

void check_lse(const TensorView& lse, std::string_view entry, int64_t heads, int64_t tokens) {
  PAGEDATTN_CHECK(lse.defined() && lse.ndim() == 2 && lse.device() == Device::cuda && lse.dtype() == DType::f32 &&
                      lse.size(0) == heads && lse.size(1) >= tokens,
                  "lse", "CUDA MLA prefill ", entry, ": lse ", lse.defined() ? lse.describe() : std::string("(undefined)"),
                  ": expected f32 (", heads, ", >= ", tokens, ") on cuda");
}

class CudaMlaPrefill final : public MLAPrefillBackend {
 public:
  explicit CudaMlaPrefill(const MLAPrefillParams& params) : MLAPrefillBackend(params) {}
  std::string_view get_name() const override { return kName; }

  void run_prefill_new_tokens(const TensorView& q, const TensorView& k, const TensorView& v, bool return_softmax_lse,
                              const TensorView& out, const TensorView& lse, const TensorView& output_scale) override {
    constexpr std::string_view entry = "run_prefill_new_tokens";
    const MLAPrefillMetadata& pm = metadata(entry);
    PAGEDATTN_CHECK(!output_scale.defined(), "output_scale", "CUDA MLA prefill ", entry,
                    ": output_scale given but this backend has no quantized output");
    const int64_t tp = pm.num_prefill_tokens;
    check_args(entry, q, k, v, out, tp, tp);
    if (return_softmax_lse) check_lse(lse, entry, params_.num_heads, tp);
    mp::PrefillParams p = make_params(q, k, v, out, return_softmax_lse ? lse : TensorView{});
    p.q_cu = pm.query_start_loc_device.data_as<const int32_t>();
    p.kv_cu = p.q_cu;
    p.causal = 1;
    mp::launch_prefill(p, params_.dtype, pm.max_query_len, current_cuda_stream());
  }

  std::pair<TensorView, TensorView> run_prefill_context_chunk(int chunk_idx, const TensorView& q, const TensorView& k,
                                                              const TensorView& v, const TensorView& out,
                                                              const TensorView& lse) override {
    constexpr std::string_view entry = "run_prefill_context_chunk";
    const MLAPrefillMetadata& pm = metadata(entry);
    PAGEDATTN_CHECK(pm.chunked_context.has_value(), "chunk_idx", "CUDA MLA prefill ", entry,
                    ": the plan has no context chunks (no prefill has context)");
    const MLAChunkedContextMetadata& cc = *pm.chunked_context;
    PAGEDATTN_CHECK(chunk_idx >= 0 && chunk_idx < cc.num_chunks, "chunk_idx", "CUDA MLA prefill ", entry,
                    ": chunk_idx = ", chunk_idx, ", expected 0 <= chunk_idx < ", cc.num_chunks);
    const int64_t tp = pm.num_prefill_tokens;
    const int64_t chunk_rows = cc.chunk_total_tokens[static_cast<size_t>(chunk_idx)];
    check_args(entry, q, k, v, out, tp, chunk_rows);
    check_lse(lse, entry, params_.num_heads, tp);
    const TensorView cu = cc.cu_seq_lens_device.select(0, chunk_idx);
    PAGEDATTN_CHECK(cu.stride(0) == 1 && cu.dtype() == DType::i32 && cu.device() == Device::cuda, "metadata",
                    "CUDA MLA prefill ", entry, ": cu_seq_lens_device must be contiguous i32 on cuda");
    mp::PrefillParams p = make_params(q, k, v, out, lse);
    p.q_cu = pm.query_start_loc_device.data_as<const int32_t>();
    p.kv_cu = cu.data_as<const int32_t>();
    p.causal = 0;
    mp::launch_prefill(p, params_.dtype, pm.max_query_len, current_cuda_stream());
    return {out, lse};
  }

 private:
  const MLAPrefillMetadata& metadata(std::string_view entry) const {
    PAGEDATTN_CHECK(prefill_metadata_ != nullptr, "metadata", "CUDA MLA prefill ", entry,
                    ": prepare_metadata was not called for this step");
    PAGEDATTN_CHECK(prefill_metadata_->query_start_loc_device.device() == Device::cuda, "metadata", "CUDA MLA prefill ",
                    entry, ": the plan's query_start_loc_device is not on cuda");
    // The plan's device arrays belong to its builder, which overwrites them at its next build().
    PAGEDATTN_CHECK(prefill_metadata_->stamp.current(), "metadata", "CUDA MLA prefill ", entry,
                    ": the plan is stale (its builder has built a newer one since, or is gone): a plan is "
                    "valid until the builder's next build()");
    return *prefill_metadata_;
  }

  void check_args(std::string_view entry, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, int64_t q_rows, int64_t kv_rows) const {
    const int64_t h = params_.num_heads;
    PAGEDATTN_CHECK(params_.qk_nope_head_dim + params_.qk_rope_head_dim == mp::kQkDim && params_.v_head_dim == mp::kVDim,
                    "params", "CUDA MLA prefill ", entry, ": qk head ", params_.qk_nope_head_dim + params_.qk_rope_head_dim,
                    " / v head ", params_.v_head_dim, " not supported: expected 192 / 128");
    check_3d(q, "q", entry, q_rows, h, mp::kQkDim, params_.dtype, 16);
    check_3d(k, "k", entry, kv_rows, h, mp::kQkDim, params_.dtype, 16);
    check_3d(v, "v", entry, kv_rows, h, mp::kVDim, params_.dtype, 16);
    check_3d(out, "out", entry, q_rows, h, mp::kVDim, params_.dtype, 4);
  }

  mp::PrefillParams make_params(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& lse) const {
    const MLAPrefillMetadata& pm = *prefill_metadata_;
    mp::PrefillParams p{};
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = out.data();
    p.q_ts = q.stride(0);
    p.q_hs = q.stride(1);
    p.k_ts = k.stride(0);
    p.k_hs = k.stride(1);
    p.v_ts = v.stride(0);
    p.v_hs = v.stride(1);
    p.o_ts = out.stride(0);
    p.o_hs = out.stride(1);
    p.lse = lse.defined() ? lse.data_as<float>() : nullptr;
    p.lse_hs = lse.defined() ? lse.stride(0) : 0;
    p.lse_ts = lse.defined() ? lse.stride(1) : 0;
    p.num_seqs = pm.num_prefills;
    p.num_heads = params_.num_heads;
    p.scale_log2 = params_.scale * 1.4426950408889634f;
    return p;
  }
};

class CudaMlaPrefillClass final : public MLAPrefillBackendClass {
 public:
  std::string_view get_name() const override { return kName; }
  Device device() const override { return Device::cuda; }
  bool supports_compute_capability(const DeviceCapability& c) const override { return c.major >= 8; }
  bool is_available() const override { return cuda_device_count() > 0; }
  std::vector<std::string> validate_configuration(const DeviceCapability& capability,
                                                  const MLAPrefillSelectorConfig& config) const override {
    std::vector<std::string> reasons = MLAPrefillBackendClass::validate_configuration(capability, config);
    const MLADimensions& d = config.mla_dimensions;
    if (d.qk_head_dim() != mp::kQkDim || d.v_head_dim != mp::kVDim) {
      reasons.push_back(detail::concat("Model does not have supported MLA dimensions (got ", d.to_string(),
                                       "; the CUDA prefill kernel needs qk_nope_head_dim + qk_rope_head_dim = 192 "
                                       "and v_head_dim = 128)."));
    }
    return reasons;
  }
  std::unique_ptr<MLAPrefillBackend> create(const MLAPrefillParams& params) const override {
    PAGEDATTN_CHECK(params.device == Device::cuda, "params.device", "CUDA MLA prefill: device = ",
                    device_name(params.device), ", expected cuda");
    PAGEDATTN_CHECK(params.dtype == DType::f16 || params.dtype == DType::bf16, "params.dtype",
                    "CUDA MLA prefill: dtype ", dtype_name(params.dtype), " not supported: expected float16 or bfloat16");
    PAGEDATTN_CHECK(params.qk_nope_head_dim + params.qk_rope_head_dim == mp::kQkDim && params.v_head_dim == mp::kVDim,
                    "params", "CUDA MLA prefill: qk head ", params.qk_nope_head_dim + params.qk_rope_head_dim,
                    " / v head ", params.v_head_dim, " not supported: expected 192 / 128");
    return std::make_unique<CudaMlaPrefill>(params);
  }
};

}  // namespace
}  // namespace cuda

const MLAPrefillBackendClass& cuda_mla_prefill_backend() {
  static const cuda::CudaMlaPrefillClass backend;
  return backend;
}

}  // namespace pagedattn

#endif  // PAGEDATTN_HAS_CUDA
