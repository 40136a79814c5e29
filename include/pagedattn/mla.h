// MLA: multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), as vLLM's MLA subsystem
// (attention/backends/abstract.py MLAAttentionImpl, v1/attention/backends/mla/common.py and
// mla/prefill/base.py).
//
// Names (one layer, H query heads):
//   L = kv_lora_rank (512), R = qk_rope_head_dim (64), P = qk_nope_head_dim (128),
//   V = v_head_dim (128), latent row = L + R (576), prefill q/k head = P + R (192).
//   kv_b_proj weight (H*(P+V), L) (a Linear's (out, in)): row h*(P+V) + i, i < P is W_UK[h][i],
//   i >= P is W_UV[h][i-P]; both map a latent kv_c (L) to one head's k_nope (P) / v (V).
//
// Data flow of MLAAttention::forward (tokens ordered decodes first, reorder threshold 1, or 1 + k
// with k speculative tokens: MLADecodeMetadata):
//   concat_and_cache_mla(kv_c_normed, k_pe) -> latent cache (num_blocks, block_size, L + R)
//   decode tokens (absorbed, attention as MQA over the latent cache):
//     q_latent[t,h] = [q_nope[t,h] · W_UK[h] (L), q_pe[t,h] (R)]          (T_d, H, L + R)
//     o_latent[t,h] = softmax(scale · q_latent·cacheᵀ) · cache[:, :L]     (T_d, H, L)
//     out[t,h]      = o_latent[t,h] · W_UV[h]ᵀ                            (T_d, H, V)
//   prefill tokens (up-projected, MHA with P+R keys and V values):
//     k_nope, v = kv_c · W_UK/W_UVᵀ per head; k = [k_nope, k_pe broadcast over heads]
//     new tokens: causal attention over the request's new tokens (LSE kept when it has context)
//     context: chunks of the cached context (chunked-context plan below) are gathered from the
//     cache (dequantized), up-projected, attended non-causally, and merged by LSE.
// Both paths compute the same function (the absorbed form is a reassociation of the products).
// With an fp8 cache, decodes read every key from the cache (quantized, the current token too)
// while prefill new tokens use kv_c_normed / k_pe as given, exactly as vLLM.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

// ---- cache ---------------------------------------------------------------------------------
// vLLM MLAAttentionSpec: one KV head of head size L + R, page = block_size * (L + R) * elem bytes.
// kv_cache_dtype "auto" stores the activation dtype; "fp8"/"fp8_e4m3"/"fp8_e5m2" store one fp8
// byte per element with the layer's per-tensor k_scale (stored = saturate(x / k_scale)).
KVCacheSpec mla_attention_spec(int block_size, const MLADimensions& dims, DType activation_dtype,
                               std::string_view kv_cache_dtype = "auto");

// vLLM concat_and_cache_mla: kv_c (N, L) and k_pe (N, R) (or (N, 1, R)) into kv_cache
// (num_blocks, block_size, L + R) at slot_mapping (i64, length N' <= N; -1 skipped): elements
// [0, L) = kv_c, [L, L + R) = k_pe. fp8 caches store saturate(x / scale). Every argument is
// checked before any byte is written; a bad one throws Error naming it (cache untouched).
void concat_and_cache_mla(const TensorView& kv_c, const TensorView& k_pe, const TensorView& kv_cache,
                          const TensorView& slot_mapping, std::string_view kv_cache_dtype,
                          float scale = 1.f);

// vLLM gather_and_maybe_dequant_cache: for request r < batch_size, cache rows of token positions
// [seq_starts[r], seq_starts[r] + (cu_seq_lens[r+1] - cu_seq_lens[r])) read through block_table
// row r, dequantized (fp8 * scale) and written to dst rows [cu_seq_lens[r], cu_seq_lens[r+1]).
// src_cache (num_blocks, block_size, L + R); dst (>= cu_seq_lens[batch_size], L + R) f32/f16/bf16;
// block_table (>= batch_size, max_blocks) i32; cu_seq_lens (batch_size + 1) i32; seq_starts
// (batch_size) i32 or undefined (= 0). On the GPU the block and offset values are not read on the
// host: out-of-range block ids are skipped (the rows are left as they were), never read.
void gather_and_maybe_dequant_cache(const TensorView& src_cache, const TensorView& dst,
                                    const TensorView& block_table, const TensorView& cu_seq_lens,
                                    int batch_size, std::string_view kv_cache_dtype,
                                    float scale = 1.f, const TensorView& seq_starts = {});

// ---- plan ----------------------------------------------------------------------------------
// vLLM's chunked-prefill workspace rule (MLACommonMetadataBuilder):
//   min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024) tokens,
// never below max_num_seqs * block_size (so every prefill gets at least one page per chunk).
int64_t mla_chunked_prefill_workspace_tokens(int64_t max_model_len, int64_t max_num_seqs,
                                             int block_size);

// The context chunks of the prefill requests (vLLM ChunkedContextMetadata). With W workspace
// tokens and n prefills that have context:
//   max_context_chunk = round_down(W / n, block_size); num_chunks = cdiv(max context, that);
//   chunk c of prefill i covers context positions [c * max_context_chunk,
//   min(context_len_i, (c + 1) * max_context_chunk)) (empty when past its context).
struct MLAChunkedContextMetadata {
  int num_chunks = 0;
  int max_context_chunk = 0;                // tokens per prefill per chunk, multiple of block_size
  int64_t workspace_tokens = 0;             // rows of the gather workspace
  std::vector<int32_t> chunk_starts;        // (num_chunks, num_prefills) row-major
  std::vector<int32_t> chunk_seq_lens;      // (num_chunks, num_prefills)
  std::vector<int32_t> cu_seq_lens;         // (num_chunks, num_prefills + 1)
  std::vector<int32_t> chunk_total_tokens;  // (num_chunks,) = cu_seq_lens[c][num_prefills]
  std::vector<int32_t> max_seq_lens;        // (num_chunks,) longest chunk of a prefill
  // The same on the cache's device (CPU: views of the vectors above), i32:
  TensorView chunk_starts_device;           // (num_chunks, num_prefills)
  TensorView cu_seq_lens_device;            // (num_chunks, num_prefills + 1)
};

// The prefill requests of a step (the requests after the decodes; padding requests of query_len 0
// left out), request-relative.
struct MLAPrefillMetadata {
  int num_prefills = 0;
  int num_prefill_tokens = 0;
  int max_query_len = 0;
  int max_seq_len = 0;
  int token_offset = 0;                     // = num_decode_tokens
  std::vector<int32_t> query_start_loc;     // (num_prefills + 1,) starting at 0
  std::vector<int32_t> seq_lens;            // (num_prefills,)
  std::vector<int32_t> context_lens;        // (num_prefills,) seq_len - query_len
  // On the cache's device, i32: query_start_loc (num_prefills + 1), seq_lens and context_lens
  // (num_prefills), block_table (num_prefills, max_blocks) = rows of the step's block table.
  TensorView query_start_loc_device, seq_lens_device, context_lens_device, block_table;
  std::shared_ptr<Tensor> block_table_storage;  // block_table's rows when padding sat among them
  std::optional<MLAChunkedContextMetadata> chunked_context;  // none when no prefill has context
  PlanStamp stamp;                          // the plan's (CUDA: its device arrays' build)
};

// The decode requests of a step: the first requests, of 1 to reorder_batch_threshold() query
// tokens each (more than 1 only with speculative decoding, BuilderConfig::num_speculative_tokens:
// the last sampled token and the drafts to verify, attended in the absorbed form like single-token
// decodes, causally among themselves). Their tokens are the step's first num_decode_tokens.
struct MLADecodeMetadata {
  int num_decodes = 0;                      // requests
  int num_decode_tokens = 0;                // their tokens
  int max_seq_len = 0;
  std::vector<int32_t> seq_lens;            // (num_decodes,)
  std::vector<int32_t> query_start_loc;     // (num_decodes + 1,) from 0: request i's tokens
  // Per decode token, in token order (num_decode_tokens,): the keys it attends, [0, its value):
  // token j of a request of q tokens and seq_len s sees s - q + 1 + j.
  std::vector<int32_t> token_seq_lens;
  // On the cache's device, i32, one entry / row per decode REQUEST (a speculative decode's tokens
  // share their request's row): seq_lens (num_decodes), block_table (num_decodes, max_blocks):
  // the step's block-table rows of the decodes, a view of them, or, when padding requests
  // (query_len 0) sat among them, a gathered copy in block_table_storage (held by the plan; CUDA:
  // the builder's persistent rows).
  TensorView seq_lens_device, block_table;
  std::shared_ptr<Tensor> block_table_storage;
};

struct MLAWorkspace;  // the builder's step buffers (src/backends/mla), shared with its plans

// The plan of one step for every MLA layer of a group. MLA backends derive from it to add their
// decode plan (split-KV partition, scheduler metadata). Validity and concurrency rules: see
// AttentionMetadata (backend.h).
struct MLAMetadata : AttentionMetadata {
  int num_decodes = 0, num_decode_tokens = 0, num_prefills = 0, num_prefill_tokens = 0;
  MLADecodeMetadata decode;                 // meaningful when num_decodes > 0
  std::optional<MLAPrefillMetadata> prefill;
  // The builder's step buffers: held by every plan it built (usable after the builder is gone).
  std::shared_ptr<MLAWorkspace> workspace;
};

// ---- prefill backends (vLLM v1/attention/backends/mla/prefill/base.py) ---------------------
struct DeviceCapability {
  int major = 0, minor = 0;                 // CPU: 0.0
  std::string to_string() const;
};
// The capability of the current device of `device` (CPU: 0.0).
DeviceCapability device_capability(Device device);

struct MLAPrefillSelectorConfig {
  DType dtype = DType::bf16;                // activation dtype
  MLADimensions mla_dimensions;
  Device device = Device::cpu;
};

struct MLAPrefillParams {
  int num_heads = 0;
  float scale = 1.f;
  int kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  DType dtype = DType::bf16;
  Device device = Device::cpu;
};

// One prefill runner (an instance of vLLM's MLAPrefillBackend), owned by an MLA impl. Stateful
// (prepare_metadata, then runs that read it): one caller at a time; the MLA impls take a lock
// around their prefill part, so concurrent forwards of one layer take turns there.
class MLAPrefillBackend {
 public:
  explicit MLAPrefillBackend(MLAPrefillParams params) : params_(params) {}
  virtual ~MLAPrefillBackend() = default;
  virtual std::string_view get_name() const = 0;
  // Whether run_prefill_new_tokens writes quantized output itself (none does today: MLACommonImpl
  // then writes the prefill rows to a staging buffer and quantizes them in one pass).
  virtual bool supports_quant_output(const QuantKey& /*quant_key*/) const { return false; }
  // Called before the layers of a step run (the plan's prefill part, kept by pointer).
  virtual void prepare_metadata(const MLAPrefillMetadata& prefill_metadata) {
    prefill_metadata_ = &prefill_metadata;
  }
  // Causal attention of every prefill over its new tokens (prefill query_start_loc):
  // q, k (Tp, H, P + R), v (Tp, H, V) in the activation dtype, token/head strides free, last dim
  // contiguous; out (Tp, H, V); lse (H, Tp) f32 natural log, written iff return_softmax_lse.
  // output_scale (f32 (1,)) only when supports_quant_output.
  virtual void run_prefill_new_tokens(const TensorView& q, const TensorView& k, const TensorView& v,
                                      bool return_softmax_lse, const TensorView& out,
                                      const TensorView& lse = {},
                                      const TensorView& output_scale = {}) = 0;
  // Non-causal attention of every prefill's queries over context chunk chunk_idx: k/v rows
  // [cu_seq_lens[c][i], cu_seq_lens[c][i+1]) belong to prefill i (an empty chunk gives out 0 and
  // lse -inf). Writes out (Tp, H, V) and lse (H, Tp) and returns them (vLLM's (out, lse)).
  virtual std::pair<TensorView, TensorView> run_prefill_context_chunk(
      int chunk_idx, const TensorView& q, const TensorView& k, const TensorView& v,
      const TensorView& out, const TensorView& lse) = 0;
  const MLAPrefillParams& params() const { return params_; }

 protected:
  MLAPrefillParams params_;
  const MLAPrefillMetadata* prefill_metadata_ = nullptr;
};

// What vLLM keeps as MLAPrefillBackend classmethods: a registered prefill backend's name,
// capabilities and reasons, and its factory.
class MLAPrefillBackendClass {
 public:
  virtual ~MLAPrefillBackendClass() = default;
  virtual std::string_view get_name() const = 0;
  virtual Device device() const = 0;
  virtual std::vector<DType> supported_dtypes() const { return {DType::f16, DType::bf16}; }
  // Empty = any dimensions.
  virtual std::vector<MLADimensions> supported_mla_dimensions() const { return {}; }
  virtual bool supports_compute_capability(const DeviceCapability& /*capability*/) const {
    return true;
  }
  bool supports_dtype(DType dtype) const;
  virtual bool is_available() const { return true; }
  // vLLM's checks (compute capability, dtype, availability, dimensions) plus the device; a
  // backend appends its own. Empty = usable.
  virtual std::vector<std::string> validate_configuration(
      const DeviceCapability& device_capability, const MLAPrefillSelectorConfig& config) const;
  virtual std::unique_ptr<MLAPrefillBackend> create(const MLAPrefillParams& params) const = 0;
};

// Registered prefill backends, highest priority first (CUDA, CPU, REFERENCE last).
const std::vector<const MLAPrefillBackendClass*>& registered_mla_prefill_backends();
const MLAPrefillBackendClass* find_mla_prefill_backend(std::string_view name);
struct MLAPrefillBackendReport {
  const MLAPrefillBackendClass* backend = nullptr;
  std::vector<std::string> reasons;  // empty = usable
  bool usable() const { return reasons.empty(); }
};
std::vector<MLAPrefillBackendReport> explain_mla_prefill_backends(
    const DeviceCapability& capability, const MLAPrefillSelectorConfig& config);
// First usable one; `forced` (or env PAGEDATTN_MLA_PREFILL_BACKEND when empty) names one. Errors
// list every backend with its reasons, as get_attn_backend.
const MLAPrefillBackendClass& get_mla_prefill_backend(const DeviceCapability& capability,
                                                      const MLAPrefillSelectorConfig& config,
                                                      std::string_view forced = "");

// ---- decode backends (vLLM MLAAttentionImpl) -----------------------------------------------
struct MLAImplParams {
  int num_heads = 0;
  float scale = 0.f;                        // softmax scale of q·k (qk_head_dim^-0.5 * mscale^2)
  MLADimensions dims;
  std::optional<int> q_lora_rank;           // recorded (q projection is the caller's)
  std::string kv_cache_dtype = "auto";
  std::optional<std::string> kv_sharing_target_layer_name;
  DType dtype = DType::bf16;                // activation dtype (q, kv_c, k_pe, weights, output)
  Device device = Device::cpu;
  int block_size = 64;
  std::string prefill_backend;              // "" = get_mla_prefill_backend; else forced by name
  DcpConfig dcp;                            // vLLM's impl.dcp_world_size / dcp_rank
};

class MLAAttentionImpl {
 public:
  virtual ~MLAAttentionImpl() = default;
  // kv_b_proj weight (H*(P+V), L) in the activation dtype on the impl's device, contiguous rows;
  // split once into the impl's W_UK / W_UV (the caller's tensor is not kept).
  virtual void process_weights_after_loading(const TensorView& kv_b_proj_weight) = 0;
  // Writes kv_c_normed (T, L) and k_pe (T, R) or (T, 1, R) at metadata.slot_mapping.
  virtual void do_kv_cache_update(const LayerScales& scales, const TensorView& kv_c_normed,
                                  const TensorView& k_pe, const TensorView& kv_cache,
                                  const AttentionMetadata& metadata) = 0;
  // q (T, H, P + R); kv_c_normed (T, L) and k_pe (T, R) / (T, 1, R) of this step's tokens (read by
  // prefill; the cache already holds them); output (T, H, V) or (T, H * V) in the activation
  // dtype, or fp8_e4m3 holding saturate_e4m3(o / output_scale[0]) when output_scale (f32 (1,) on
  // the impl's device; only impls with fused_output_quant_supported) is given, every one of the
  // first num_actual_tokens rows written; output_lse (H, T) f32 natural log of every row when
  // defined. The argument order is AttentionImpl's (output_scale before output_lse).
  virtual void forward(const LayerScales& scales, const TensorView& q, const TensorView& kv_c_normed,
                       const TensorView& k_pe, const TensorView& kv_cache,
                       const AttentionMetadata& metadata, const TensorView& output,
                       const TensorView& output_scale = {}, const TensorView& output_lse = {}) = 0;
  // Every check forward() makes, with no side effect: the layer calls it before
  // do_kv_cache_update, so a call forward would reject leaves the cache byte-identical.
  virtual void check_forward(const LayerScales& scales, const TensorView& q,
                             const TensorView& kv_c_normed, const TensorView& k_pe,
                             const TensorView& kv_cache, const AttentionMetadata& metadata,
                             const TensorView& output, const TensorView& output_scale = {},
                             const TensorView& output_lse = {}) const = 0;
  // Whether forward accepts output_scale (fused fp8 output quantization, as AttentionImpl).
  virtual bool fused_output_quant_supported(const QuantKey& /*key*/) const { return false; }
  virtual bool can_return_lse_for_decode() const { return true; }
  bool need_to_return_lse_for_decode() const { return params_.dcp.world_size > 1 && can_return_lse_for_decode(); }
  // The prefill backend this impl runs its prefill tokens with.
  virtual std::string_view prefill_backend_name() const = 0;
  const MLAImplParams& params() const { return params_; }

 protected:
  explicit MLAAttentionImpl(MLAImplParams params) : params_(std::move(params)) {}
  MLAImplParams params_;
};

// An MLA backend: registered with the standard ones (the selector walks one list); accepts only
// use_mla = true, and makes MLAAttentionImpl instead of AttentionImpl.
class MLABackend : public AttentionBackend {
 public:
  // Always throws Error naming "params": an MLA backend's impl comes from make_mla_impl.
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const final;
  virtual std::unique_ptr<MLAAttentionImpl> make_mla_impl(const MLAImplParams& params) const = 0;
  // (num_blocks, block_size, head_size) with num_kv_heads == 1 (Error naming it otherwise).
  Shape kv_cache_shape(int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                       std::string_view cache_dtype = "auto") const override;
  std::vector<int> kv_cache_stride_order() const override { return {0, 1, 2}; }
  const MLABackend* as_mla() const final { return this; }
};

// ---- layer (vLLM MLAAttention) --------------------------------------------------------------
struct MLAAttentionLayerParams {
  int num_heads = 0;
  std::optional<float> scale;               // unset = qk_head_dim^-0.5; else finite and > 0
                                            // (0 is an Error); resolved after construction
  std::optional<int> q_lora_rank;
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int qk_head_dim = 0;                      // must be qk_nope_head_dim + qk_rope_head_dim
  int v_head_dim = 0;
  std::string kv_cache_dtype = "auto";
  int block_size = 64;
  std::optional<std::string> kv_sharing_target_layer_name;
  std::string prefix;                       // layer name
  DType dtype = DType::bf16;
  Device device = Device::cpu;
  std::string backend;                      // "" = select; else force this MLA backend
  std::string prefill_backend;              // "" = select; else force this prefill backend
  // calculate_kv_scales (as Attention's, layer.h): the first batch written into an fp8 cache sets
  // k_scale = amax(|kv_c_normed|, |k_pe|) / fp8 max over the rows it stores, the one scale of the
  // latent cache rows (v_scale is not used by MLA); an all-zero batch leaves it pending; a NaN /
  // inf there is an Error (cache and scale untouched); an Error with kv sharing (at construction)
  // and with per-head scales; on CUDA that forward syncs once (outside graph capture).
  bool calculate_kv_scales = false;
  // The layer's forwards will be given output_scale (fused fp8 e4m3 output, vLLM's fusion of
  // attention with a static per-tensor fp8 quantization): the selector then takes only a backend
  // whose impl supports it (SelectorConfig::fp8_output: REFERENCE_MLA, CUDA_MLA; a forced backend
  // without it is an Error). A layer without it may still pass output_scale to a backend that
  // supports it.
  bool fp8_output = false;
  DcpConfig dcp;                            // the decode-context-parallel group (pagedattn/dcp.h)

  MLADimensions dims() const {
    return {kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim};
  }
};

class StaticForwardContext;  // layer.h

class MLAAttention {
 public:
  // static_forward_context: where the layer registers itself and finds its
  // kv_sharing_target_layer_name (required for a sharing layer; see layer.h); nullptr = not
  // registered.
  explicit MLAAttention(MLAAttentionLayerParams params,
                        StaticForwardContext* static_forward_context = nullptr);

  const AttentionBackend& backend() const { return *backend_; }
  MLAAttentionImpl& impl() { return *impl_; }
  const MLAAttentionLayerParams& params() const { return params_; }
  const std::string& name() const { return params_.prefix; }
  KVCacheSpec kv_cache_spec() const;
  DType kv_cache_storage_dtype() const;
  SelectorConfig selector_config() const;
  // chunked_prefill_workspace_tokens 0 = mla_chunked_prefill_workspace_tokens(...).
  BuilderConfig builder_config(int max_num_seqs, int max_num_batched_tokens, int max_model_len,
                               int64_t chunked_prefill_workspace_tokens = 0) const;
  Tensor allocate_kv_cache(int64_t num_blocks) const;
  LayerScales& scales() { return scales_; }
  const LayerScales& scales() const { return scales_; }
  // calculate_kv_scales: whether k_scale still waits for its measurement.
  bool kv_scales_pending() const { return k_scale_pending_; }

  // kv_b_proj weight (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank); see
  // MLAAttentionImpl. Must be called once before forward.
  void process_weights_after_loading(const TensorView& kv_b_proj_weight);
  // Checks the activations, writes the cache (unless sharing), attends (see MLAAttentionImpl).
  // output in the layer dtype, or fp8_e4m3 when output_scale (f32 (1,) on the layer's device) is
  // given (then the impl must support fused output quantization; argument order as Attention).
  // Every argument is checked before the cache write: a rejected call leaves it byte-identical.
  void forward(const TensorView& q, const TensorView& kv_c_normed, const TensorView& k_pe,
               const TensorView& kv_cache, const AttentionMetadata& metadata,
               const TensorView& output, const TensorView& output_lse = {},
               const TensorView& output_scale = {});

 private:
  MLAAttentionLayerParams params_;
  const AttentionBackend* backend_ = nullptr;
  std::unique_ptr<MLAAttentionImpl> impl_;
  LayerScales scales_;
  bool weights_loaded_ = false;
  bool k_scale_pending_ = false;  // calculate_kv_scales: true until k_scale is measured
  std::optional<float> measure_k_scale(const TensorView& kv_c_normed, const TensorView& k_pe,
                                       const AttentionMetadata& metadata);
  Tensor kv_amax_result_;         // CUDA: i32 (2,) the amax kernel writes (the measuring forward's)
};

}  // namespace pagedattn
