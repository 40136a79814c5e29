// Internal: the parts every MLA backend shares (vLLM's MLACommonMetadataBuilder / MLACommonImpl).
//
//   MLAWorkspace              the step buffers, allocated once by the builder for its limits
//   MLACommonMetadataBuilder  the plan: decode/prefill split (decodes first, threshold 1 or 1 + k), the
//                             prefill request arrays, the chunked-context plan (mla.h), device
//                             copies; a backend adds its decode plan in plan_decode()
//   MLACommonImpl             the run: cache write, absorbed decode around the backend's latent
//                             attention (forward_decode), up-projected prefill through the
//                             selected MLAPrefillBackend, chunk loop and LSE merge
//   batched_gemm / copy_3d /  the device primitives the run needs (CPU in mla_primitives.cpp,
//   quantize_e4m3_3d          CUDA in src/backends/cuda/mla/mla_device_ops.cu)
//
// The REFERENCE_MLA backend does NOT use MLACommonImpl: it is the independent fp64 oracle of the
// un-absorbed formula. It does use MLACommonMetadataBuilder (the plan is what it reads).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>

#include "../run_buffer_pool.h"
#include "pagedattn/backend.h"
#include "pagedattn/mla.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

// Step buffers of one MLA forward (dims from BuilderConfig; T = max_num_batched_tokens,
// S = max_decode_tokens() = min(T, max_num_seqs x reorder threshold), W = chunked-prefill
// workspace tokens, rows = max(T, W)). All on the
// builder's device, activation dtype unless noted. kv_up / k_full hold one up-projected context
// chunk: with H = 128 and vLLM's default W = 64Ki that is several GiB, so large-H deployments
// should pass a smaller BuilderConfig::mla_chunked_prefill_workspace_tokens.
struct MLAStepBuffers {
  // decode (at most S decode tokens)
  Tensor q_latent;      // (S, H, L + R)
  Tensor o_latent;      // (S, H, L)
  Tensor decode_lse;    // (H, S) f32
  // prefill
  Tensor gather;        // (W, L + R)          context chunk gathered from the cache
  Tensor kv_up;         // (rows, H, P + V)    kv_c · [W_UK | W_UV]ᵀ per head
  Tensor k_full;        // (rows, H, P + R)    [k_nope, k_pe broadcast]
  Tensor suffix_out;    // (T, H, V)           new-token attention (fp8 output: the staged decode
                        //                     rows, then without context the prefill rows)
  Tensor chunk_out;     // (T, H, V)           one context chunk (fp8 output: the final merge's
                        //                     staged rows, free once the chunks are merged)
  Tensor context_out;   // (T, H, V)           context chunks merged so far
  Tensor suffix_lse, chunk_lse, context_lse, merged_lse;  // (H, T) f32
  // batch-invariant builders only (batched_gemm_fixed_rows), zeroed at allocation:
  Tensor gemm_a_stage;  // (kFixedGemmRows * max(H * P, H * L),)
  Tensor gemm_c_stage;  // (kFixedGemmRows * max(H * L, H * (P + V)),)
  size_t bytes() const;
};

// The step buffers of one MLA layer group, owned by the builder and shared (shared_ptr) with its
// plans. How forwards get a set:
//   cpu   a lease from host_buffers (run_buffer_pool.h): concurrent forwards (plans of one
//         builder, or one plan, on several threads) each get their own set; a second set is
//         allocated only while forwards really overlap.
//   cuda  the one device_buffers set: kernels run in stream order and a plan is only valid until
//         the builder's next build() (PlanStamp), so host-side leases would protect nothing.
struct MLAWorkspace {
  Device device = Device::cpu;
  DType dtype = DType::bf16;
  MLADimensions dims;
  int num_heads = 0;
  int64_t max_tokens = 0, max_seqs = 0, workspace_tokens = 0;
  host::RunBufferPool<MLAStepBuffers> host_buffers;  // device == cpu
  std::unique_ptr<MLAStepBuffers> device_buffers;    // device == cuda
  size_t bytes() const {
    return host_buffers.bytes() + (device_buffers ? device_buffers->bytes() : 0);
  }
};

namespace mla {

// ---- device primitives (dispatch on the tensors' device) -----------------------------------
// One operand of a batched matrix product: element (b, i, j) at
// data + b*batch_stride + i*row_stride + j*col_stride (elements of dtype).
struct MatrixRef {
  const void* data = nullptr;
  DType dtype = DType::bf16;
  int64_t batch_stride = 0, row_stride = 0, col_stride = 1;
};
struct MutableMatrixRef {
  void* data = nullptr;
  DType dtype = DType::bf16;
  int64_t batch_stride = 0, row_stride = 0;  // columns contiguous
};
// C[b] (m, n) = A[b] (m, k) · B[b] (k, n) for b < batch; f32 accumulation, each C element
// rounded once to C's dtype. Operands f32/f16/bf16. CUDA: one of each operand's row/col stride
// is 1; enqueued on the current stream.
void batched_gemm(Device device, int batch, int m, int n, int k, const MatrixRef& a,
                  const MatrixRef& b, const MutableMatrixRef& c);
// The same product in launches of exactly kFixedGemmRows rows each (batch-invariant plans): the
// GEMM under it (cuBLAS chooses its algorithm, and so each row's summation order, from the shape)
// always sees one shape, so a row's result does not depend on how many rows share the call.
//   m >= R: row chunks [i R, (i + 1) R), and for a tail the last R rows [m - R, m) once more (those
//           rows are recomputed with the same bits);
//   m < R:  A's m rows are copied into a_stage as (R, batch, k), the product goes to c_stage
//           (R, batch, n) and its first m rows to C (the other staged rows hold zeros or stale
//           values, which reach no other row).
// a_stage / c_stage: contiguous, >= R * batch * k elements of a.dtype / R * batch * n of c.dtype,
// on `device` (device_index for the views). A's innermost stride must be 1 when m < R.
inline constexpr int kFixedGemmRows = 64;
void batched_gemm_fixed_rows(Device device, int batch, int m, int n, int k, const MatrixRef& a,
                             const MatrixRef& b, const MutableMatrixRef& c, const Tensor& a_stage,
                             const Tensor& c_stage);
// dst (d0, d1, d2) = src (d0, d1, d2), converting dtype (f32/f16/bf16); any strides, stride 0
// allowed in src (broadcast). The innermost dim of both is contiguous.
void copy_3d(const TensorView& src, const TensorView& dst);
// The fp8 output pass (fused output quantization of the rows MLACommonImpl stages):
// dst (d0, d1, d2) fp8_e4m3 = saturate_e4m3(src / scale[0]) with src f32/f16/bf16 (one IEEE f32
// division, then round to nearest even, saturating at +-448; NaN stays NaN). scale: f32 (1,) on
// the tensors' device, read there (CUDA: by the kernel, so a captured graph replays with the
// scale of the moment); one that is not a positive finite number writes NaN (e4m3 0x7F) in every
// element, as the attention kernels' output store (output_store.cuh). Innermost dims contiguous.
void quantize_e4m3_3d(const TensorView& src, const TensorView& dst, const TensorView& scale);
#if PAGEDATTN_HAS_CUDA
// CUDA implementations (src/backends/cuda/mla/mla_device_ops.cu), called by the three above.
void cuda_batched_gemm(int batch, int m, int n, int k, const MatrixRef& a, const MatrixRef& b,
                       const MutableMatrixRef& c);
void cuda_copy_3d(const TensorView& src, const TensorView& dst);
void cuda_quantize_e4m3_3d(const TensorView& src, const TensorView& dst, const TensorView& scale);
#endif

// ---- plan -----------------------------------------------------------------------------------
// The MLA builders' reorder_batch_threshold(): decodes first, always: 1, or 1 + k with k
// speculative tokens (those requests are decodes too).
inline int mla_decode_threshold(const BuilderConfig& config) {
  return std::max(1, speculative_decode_threshold(config));
}

class MLACommonMetadataBuilder : public AttentionMetadataBuilder {
 public:
  MLACommonMetadataBuilder(KVCacheSpec spec, const BuilderConfig& config, Device device);
  ~MLACommonMetadataBuilder() override;
  // Requires the batch ordered decodes first (reorder_batch; Error naming "common" otherwise).
  // No cascade path (common_prefix_len is checked >= 0 and ignored); fast_build goes to
  // plan_decode. Batch-invariant builders (config().batch_invariant, resolved at construction
  // with batch_invariant_mode) cut every prefill's context in chunks of min_context_chunk()
  // tokens whatever the batch; their plan_decode must depend on each request alone.
  std::shared_ptr<const AttentionMetadata> build(int common_prefix_len,
                                                 const CommonAttentionMetadata& common,
                                                 bool fast_build = false) override;
  int reorder_batch_threshold() const override { return mla_decode_threshold(config_); }
  // The most decode tokens a step can hold (the decode buffers' rows):
  // min(max_num_batched_tokens, max_num_seqs * reorder_batch_threshold()).
  int64_t max_decode_tokens() const;
  size_t workspace_bytes() const override;
  const BuilderConfig& config() const { return config_; }
  Device device() const { return device_; }
  // The context chunk each prefill gets when the batch holds max_num_seqs prefills with context
  // (whole pages, at least one): the chunk of every batch-invariant plan.
  int64_t min_context_chunk() const;

 protected:
  // The backend's metadata type (derived from MLAMetadata) and its decode plan. plan_decode runs
  // after the common fields are filled, only when num_decodes > 0; fast_build (build's flag):
  // no split-KV search, fixed defaults.
  virtual std::shared_ptr<MLAMetadata> make_metadata() const;
  virtual void plan_decode(MLAMetadata& metadata, const CommonAttentionMetadata& common,
                           bool fast_build);

  BuilderConfig config_;
  Device device_;
  std::shared_ptr<MLAWorkspace> workspace_;
  // CUDA: bumped by every build() before it writes the device arrays, and by the destructor
  // (PlanStamp); plans built earlier then fail their check instead of reading overwritten data.
  std::shared_ptr<std::atomic<uint64_t>> generation_ = std::make_shared<std::atomic<uint64_t>>(0);

 private:
  struct DeviceArrays;  // device copies of the plan arrays (staged, owned here)
  std::unique_ptr<DeviceArrays> arrays_;
};

// ---- run ------------------------------------------------------------------------------------
class MLACommonImpl : public MLAAttentionImpl {
 public:
  // Picks the prefill backend (get_mla_prefill_backend on params.device; forced by
  // params.prefill_backend) and creates it.
  explicit MLACommonImpl(MLAImplParams params);
  void process_weights_after_loading(const TensorView& kv_b_proj_weight) override;
  void do_kv_cache_update(const LayerScales& scales, const TensorView& kv_c_normed,
                          const TensorView& k_pe, const TensorView& kv_cache,
                          const AttentionMetadata& metadata) override;
  // output_scale (fp8 e4m3 output) only when the derived impl's fused_output_quant_supported
  // (MLAAttentionImpl's default: false); see mla_common_impl.cpp for which writes are staged.
  void forward(const LayerScales& scales, const TensorView& q, const TensorView& kv_c_normed,
               const TensorView& k_pe, const TensorView& kv_cache, const AttentionMetadata& metadata,
               const TensorView& output, const TensorView& output_scale = {},
               const TensorView& output_lse = {}) override;
  void check_forward(const LayerScales& scales, const TensorView& q, const TensorView& kv_c_normed,
                     const TensorView& k_pe, const TensorView& kv_cache,
                     const AttentionMetadata& metadata, const TensorView& output,
                     const TensorView& output_scale = {},
                     const TensorView& output_lse = {}) const override;
  std::string_view prefill_backend_name() const override;

 protected:
  // The backend's latent attention for the decode tokens (1 to reorder_batch_threshold() per
  // decode request):
  //   q_latent (Td, H, L + R), kv_cache (num_blocks, block_size, L + R) (fp8 read = x * k_scale),
  //   keys = whole cache rows, values = rows[:L], scale = params().scale, keys
  //   [0, token_seq_lens[t]) of decode token t, through its request's block_table row
  //   (metadata.decode: request i's tokens are query_start_loc[i] .. [i + 1]);
  //   writes o_latent (Td, H, L) and, when defined, lse (H, Td) f32 natural log.
  //   Layouts: q_latent / o_latent are the workspace's rows, (Td, H, D):(H*D, D, 1); lse is a
  //   view of the caller's output_lse columns [0, Td), so its row stride is output_lse.stride(0)
  //   (not Td): index it as lse.stride(0) * h + lse.stride(1) * t.
  virtual void forward_decode(const LayerScales& scales, const TensorView& q_latent,
                              const TensorView& kv_cache, const MLAMetadata& metadata,
                              const TensorView& o_latent, const TensorView& lse) = 0;
  // The backend's own checks of the caller's arguments forward_decode reads (the cache's layout
  // and alignment, the plan's type, lse): run by check_forward before the cache is written, and
  // by forward_decode itself. q_latent / o_latent are the workspace's and need none.
  virtual void check_decode(const LayerScales& scales, const TensorView& kv_cache,
                            const MLAMetadata& metadata, const TensorView& lse) const = 0;

  Tensor w_uk_;  // (H, P, L): q_latent[t, h, :L] = q[t, h, :P] · w_uk_[h]
  Tensor w_uv_;  // (H, L, V): out[t, h] = o_latent[t, h] · w_uv_[h]
  Tensor w_kv_;  // (L, H * (P + V)): kv_up[t] = kv_c[t] · w_kv_ (prefill up-projection)
  std::unique_ptr<MLAPrefillBackend> prefill_;
  const MLAPrefillBackendClass* prefill_class_ = nullptr;
  // Held around the prefill part of forward: prefill_ keeps the step's prefill metadata between
  // prepare_metadata and its runs (vLLM's interface), so concurrent forwards take turns there.
  std::mutex prefill_mutex_;
};

// The impl parameters every MLA impl checks the same way (num_heads, dims, scale, block_size):
// Error naming the argument, `who` first.
void check_mla_impl_params(std::string_view who, const MLAImplParams& params);

// Shared validate_configuration part of the MLA backends: use_mla must be true (when it is false
// that is the only reason given, and the caller returns at once), head_size must
// equal mla_dimensions.latent_head_size() when the dims are given, and the standard-layer
// features (alibi, sliding window, soft cap, sinks, sparse, non-decoder types) are rejected, each
// with its own reason; fp8_output too unless the backend's impl supports it
// (fp8_output_supported: its fused_output_quant_supported is true; REFERENCE_MLA, CUDA_MLA).
void add_mla_common_reasons(std::string_view backend_name, const SelectorConfig& config,
                            std::vector<std::string>& reasons, bool fp8_output_supported = false);

}  // namespace mla
}  // namespace pagedattn
