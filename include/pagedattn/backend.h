// The backend interface (vLLM abstract.py + utils.py AttentionMetadataBuilder).
//
//   AttentionBackend        a registered implementation: capabilities, cache shape, factories
//   AttentionMetadataBuilder "plan": once per step per KV-cache group, host work, no kernels
//   AttentionMetadata       the plan: immutable, shared by every layer of the group
//   AttentionImpl           "run": one per layer; writes the cache, attends. No allocation, no
//                           host sync, no host reads the plan did not pin (graph capturable).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/attention_type.h"
#include "pagedattn/dtype.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

// The dimensions of an MLA (multi-head latent attention, DeepSeek-V2/V3) layer, as vLLM's
// MLADimensions. The latent cache holds kv_lora_rank + qk_rope_head_dim numbers per token.
struct MLADimensions {
  int kv_lora_rank = 0;       // L (512 for DeepSeek-V3)
  int qk_nope_head_dim = 0;   // P (128)
  int qk_rope_head_dim = 0;   // R (64)
  int v_head_dim = 0;         // V (128)
  int latent_head_size() const { return kv_lora_rank + qk_rope_head_dim; }  // cache row: 576
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }   // prefill q/k: 192
  bool empty() const { return kv_lora_rank == 0; }
  std::string to_string() const;  // "MLADimensions(kv_lora_rank=512, qk_nope_head_dim=128, ...)"
  bool operator==(const MLADimensions&) const = default;
};

class MLABackend;  // mla.h

// What the selector checks a backend against (vLLM's selector arguments + the layer features).
struct SelectorConfig {
  int head_size = 128;
  DType dtype = DType::bf16;           // activation dtype
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  bool use_mla = false;
  bool has_sink = false;
  bool use_sparse = false;
  AttentionType attn_type = AttentionType::decoder;
  Device device = Device::cpu;
  // Layer features (a backend that lacks one says so):
  int head_size_v = 0;                 // 0 = head_size
  bool use_alibi = false;
  bool use_sliding_window = false;
  bool use_logits_soft_cap = false;
  bool fp8_output = false;             // output quantized with output_scale
  // MLA layers (use_mla = true): head_size is mla_dimensions.latent_head_size() and num_heads the
  // layer's query heads (MLA decode kernels tile the heads of the one latent KV head).
  MLADimensions mla_dimensions;
  int num_heads = 0;                   // 0 = not given (standard layers)
};

// The decode-context-parallel group a layer runs in (vLLM: get_dcp_group() and
// cp_kv_cache_interleave_size; pagedattn/dcp.h): world_size N >= 1 ranks, this one's rank,
// interleave I (tokens [k I, (k + 1) I) live on rank k % N; I divides the block size).
struct DcpConfig {
  int world_size = 1;
  int rank = 0;
  int interleave = 1;
  // Error naming the field ("dcp.world_size", "dcp.rank", "dcp.interleave").
  void validate(int block_size) const;
  bool operator==(const DcpConfig&) const = default;
};

// The layer parameters an impl is made from (vLLM AttentionImpl.__init__ + sinks, dtype).
struct AttentionImplParams {
  int num_heads = 0;
  int head_size = 0;
  int head_size_v = 0;                 // 0 = head_size
  float scale = 1.f;
  int num_kv_heads = 0;                // 0 = num_heads
  std::vector<float> alibi_slopes;     // empty or num_heads
  std::optional<int> sliding_window;   // W: a query at p sees keys in [p-(W-1), p]
  std::string kv_cache_dtype = "auto";
  std::optional<float> logits_soft_cap;
  AttentionType attn_type = AttentionType::decoder;
  std::optional<std::string> kv_sharing_target_layer_name;
  std::vector<float> sinks;            // empty or num_heads (one logit per query head)
  DType dtype = DType::bf16;           // activation dtype (q, k, v, output)
  Device device = Device::cpu;
  int block_size = 16;
  DcpConfig dcp;                       // vLLM's impl.dcp_world_size / dcp_rank

  int value_head_size() const { return head_size_v > 0 ? head_size_v : head_size; }
  int kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
};

// Per-layer quantization scales (vLLM layer._q_scale/_k_scale/_v_scale). fp8 cache:
// stored = saturate(x / k_scale); read = fp8 * k_scale. Per-head scales, when given, are
// f32 (num_kv_heads,) on the layer's device and replace the per-tensor ones.
struct LayerScales {
  float q_scale = 1.f;
  float k_scale = 1.f;
  float v_scale = 1.f;
  TensorView k_scale_per_head;
  TensorView v_scale_per_head;
};

// Construction limits of a builder: its device workspace is sized from these once; a batch
// beyond them is an Error, never a resize.
struct BuilderConfig {
  int num_heads = 0;                   // query heads of the layers in the group
  int num_kv_heads = 0;
  int head_size = 0;
  int head_size_v = 0;
  int max_num_seqs = 256;
  int max_num_batched_tokens = 8192;
  int max_model_len = 8192;
  // Layer features the plan may depend on (shared by the group; see infer_global_hyperparameters).
  std::optional<int> sliding_window;
  bool use_alibi = false;
  AttentionType attn_type = AttentionType::decoder;
  int num_sms = 0;                     // 0 = ask the device (CPU: number of threads)
  // Batch-invariant mode (pagedattn/batch_invariance.h; also env PAGEDATTN_BATCH_INVARIANT=1):
  // every plan of the builder is a function of each request alone, so a request's output rows
  // are bitwise identical whatever else is in the batch. No cascade; fixed split-KV sizes.
  bool batch_invariant = false;
  // Speculative decoding (vLLM's speculative_config.num_speculative_tokens, k >= 0, 1 + k <=
  // max_num_batched_tokens, else make_builder throws naming it): a request of 2 to 1 + k query
  // tokens (the last sampled token plus k drafts to verify) is a decode. The standard builders
  // (CPU, CUDA, REFERENCE) then report reorder_batch_threshold() = 1 + k and plan such requests
  // as decodes (CPU: split-KV and the direct decode kernel; CUDA: the 16-row decode path while
  // (1 + k) x GQA group <= 16, else one prefill-path item per kv head, which reads the keys once
  // and measured faster); the rows attend causally among themselves. MLA builders report
  // max(1, 1 + k) and run such requests in their absorbed decode (MLADecodeMetadata, mla.h).
  int num_speculative_tokens = 0;
  // MLA groups only (spec.kind == mla): the layer dimensions and the activation dtype (the
  // builder owns the step's MLA workspaces), and the chunked-prefill workspace in tokens
  // (0 = vLLM's rule, see mla.h). num_heads above is the layers' query heads.
  MLADimensions mla_dimensions;
  DType mla_dtype = DType::bf16;
  int64_t mla_chunked_prefill_workspace_tokens = 0;
};

// The standard builders' reorder_batch_threshold(): 1 + num_speculative_tokens when speculative
// decoding is on, else 0 (no reorder needed).
inline int speculative_decode_threshold(const BuilderConfig& config) {
  return config.num_speculative_tokens > 0 ? 1 + config.num_speculative_tokens : 0;
}

// Which build() of a builder made a plan whose data lives in buffers the builder reuses (the
// CUDA backends' device plan arrays and split-KV partials). The builder bumps `source` at every
// build() (before it writes those buffers) and when it is destroyed, so current() is false from
// then on. Plans that own their data (CPU, CPU_MLA, REFERENCE, REFERENCE_MLA) leave it empty:
// always current.
struct PlanStamp {
  std::shared_ptr<const std::atomic<uint64_t>> source;
  uint64_t generation = 0;
  bool current() const {
    return source == nullptr || source->load(std::memory_order_acquire) == generation;
  }
};

// Base of every backend's plan (the "metadata"). Backends derive from it; impls downcast their
// own type. Rules for using plans (DESIGN.md §1):
//   host plans (CPU, CPU_MLA, REFERENCE, REFERENCE_MLA): a plan owns its arrays and shares only
//     its builder's run-buffer pool, so it stays valid after the builder's later build() calls
//     and after the builder is destroyed; any number of threads may run forward at the same
//     time, on different plans of one builder or on one plan (each forward leases its own
//     scratch; a set is allocated only while forwards overlap). Writing the KV cache from
//     several threads at once is the caller's business, as for any shared tensor.
//   CUDA plans (CUDA, CUDA_MLA): the plan lives in the builder's device workspace, so it is
//     valid until the builder's next build() (or its destruction): every entry point that reads
//     a plan (do_kv_cache_update, forward, the MLA prefill runners) throws Error naming
//     "metadata" for an older one (stamp.current() is false). Runs are stream-ordered: use one
//     builder per stream, and build the next step's plan after enqueuing this step's layers
//     (a plan's device arrays are overwritten by the next build's copies on the stream).
struct AttentionMetadata {
  virtual ~AttentionMetadata() = default;
  int num_actual_tokens = 0;
  int num_reqs = 0;
  bool use_cascade = false;
  int common_prefix_len = 0;
  bool batch_invariant = false;  // planned in batch-invariant mode (pagedattn/batch_invariance.h)
  TensorView slot_mapping;  // what reshape_and_cache uses this step
  PlanStamp stamp;          // empty for host plans (see above)
  // The largest block id and slot the step touches (kv_cache_footprint, at build()): every
  // entry point checks it against the kv_cache it is given before its first write.
  KVCacheFootprint cache_footprint;
};

class AttentionMetadataBuilder {
 public:
  virtual ~AttentionMetadataBuilder() = default;
  // Plans one step. common_prefix_len (>= 0): tokens every request shares; a builder that
  // supports cascade takes the cascade path when it is > 0 and allowed (see each backend).
  // fast_build (vLLM: "prioritize speed of building over speed at execution", for plans used by
  // a few layers or steps, e.g. speculative drafting): every builder then skips the cascade
  // decision (common_prefix_len is checked >= 0 and otherwise ignored) and any search for a
  // split-KV partition (fixed defaults: no split, items in batch order). The plan computes the
  // same attention; only its speed may differ.
  virtual std::shared_ptr<const AttentionMetadata> build(int common_prefix_len,
                                                         const CommonAttentionMetadata& common,
                                                         bool fast_build = false) = 0;
  virtual std::shared_ptr<const AttentionMetadata> build_for_cudagraph_capture(
      const CommonAttentionMetadata& common) {
    return build(0, common);
  }
  // vLLM build_for_drafting: the plan of one draft step of a speculative (drafting) model, which
  // builds a plan at every draft step, so it must be cheap. draft_index (>= 0, else Error naming
  // it): which draft step of a chain (or level of a token tree) this is. As vLLM's default:
  // build(0, common, fast_build = true) -- no cascade decision, no split-KV search.
  virtual std::shared_ptr<const AttentionMetadata> build_for_drafting(
      const CommonAttentionMetadata& common, int draft_index);
  virtual bool can_run_in_cudagraph(const CommonAttentionMetadata& /*common*/) const { return false; }
  virtual CudaGraphSupport cudagraph_support() const { return CudaGraphSupport::never; }
  // Default: the FlashAttention heuristic (pagedattn::use_cascade_attention) when the backend
  // supports cascade, false otherwise.
  virtual bool use_cascade_attention(int common_prefix_len, std::span<const int32_t> query_lens,
                                     int num_query_heads, int num_kv_heads, bool use_alibi,
                                     bool use_sliding_window, bool use_local_attention,
                                     int num_sms) const;
  virtual bool supports_cascade() const { return false; }
  // Requests with at most this many query tokens count as decodes and go first
  // (reorder_batch_to_split_decodes_and_prefills); 0 = the builder needs no reorder (every
  // request of 1 token is a decode). Standard builders: 0, or 1 + num_speculative_tokens when
  // that is > 0 (BuilderConfig); MLA builders: 1.
  virtual int reorder_batch_threshold() const { return 0; }
  // Returns the permutation to apply (order[i] = old index now at i) or nullopt when none.
  virtual std::optional<BatchReorder> reorder_batch(std::span<const int32_t> num_scheduled_tokens) const;
  // Bytes of device (or host, for CPU) workspace: allocated at construction, plus (host
  // backends) one run-buffer set per extra level of overlap among concurrent forwards.
  virtual size_t workspace_bytes() const { return 0; }
  const KVCacheSpec& kv_cache_spec() const { return spec_; }

 protected:
  explicit AttentionMetadataBuilder(KVCacheSpec spec) : spec_(std::move(spec)) {}
  KVCacheSpec spec_;
};

class AttentionImpl {
 public:
  virtual ~AttentionImpl() = default;
  // Writes key/value (num_tokens >= slot_mapping's live entries) into the cache at
  // metadata.slot_mapping. Layers that share another layer's cache never call this.
  virtual void do_kv_cache_update(const LayerScales& scales, const TensorView& key,
                                  const TensorView& value, const TensorView& kv_cache,
                                  const AttentionMetadata& metadata) = 0;
  // Every check forward() makes, with no side effect. The layer calls it before
  // do_kv_cache_update, so a call that forward would reject leaves the cache byte-identical;
  // forward() runs it too (a direct caller gets the same errors).
  virtual void check_forward(const LayerScales& scales, const TensorView& query,
                             const TensorView& key, const TensorView& value,
                             const TensorView& kv_cache, const AttentionMetadata& metadata,
                             const TensorView& output, const TensorView& output_scale = {},
                             const TensorView& output_lse = {}) const = 0;
  // Attends. query (T, Hq, D); key/value (T, Hkv, D / Dv) — read only by the no-cache types
  // (encoder, encoder_only); kv_cache as in kv_cache.h; output (T, Hq, Dv) in the activation
  // dtype, or fp8_e4m3 when output_scale (f32 (1,)) is given; output_lse (Hq, T) f32 natural log
  // when defined. Every one of the first num_actual_tokens rows of output is written.
  virtual void forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
                       const TensorView& value, const TensorView& kv_cache,
                       const AttentionMetadata& metadata, const TensorView& output,
                       const TensorView& output_scale = {}, const TensorView& output_lse = {}) = 0;

  virtual bool can_return_lse_for_decode() const { return true; }
  // vLLM: dcp_world_size > 1 and can_return_lse_for_decode (the ranks' decode LSEs are merged).
  bool need_to_return_lse_for_decode() const { return params_.dcp.world_size > 1 && can_return_lse_for_decode(); }
  virtual bool supports_quant_query_input() const { return false; }
  virtual bool fused_output_quant_supported(const QuantKey& /*key*/) const { return false; }
  virtual void process_weights_after_loading(DType /*act_dtype*/) {}
  const AttentionImplParams& params() const { return params_; }

 protected:
  explicit AttentionImpl(AttentionImplParams params) : params_(std::move(params)) {}
  // check_forward's query dtype rule, one for every impl: the activation dtype, or fp8_e4m3 where
  // supports_quant_query_input() with scales.q_scale positive and finite (Error naming query /
  // scales.q_scale, `who` first).
  void check_query_dtype(const LayerScales& scales, const TensorView& query, std::string_view who) const;
  AttentionImplParams params_;
};

// What a backend can do, for reports (`pagedattn backends`). validate_configuration is the
// authority; this is the summary.
struct BackendCapabilities {
  std::vector<Device> devices;
  std::vector<DType> dtypes;
  std::vector<std::string> kv_cache_dtypes;
  std::vector<int> head_sizes;         // empty = any
  std::vector<AttentionType> attn_types;
  std::vector<std::string> features;   // "alibi", "sliding_window", "soft_cap", "sinks", "lse",
                                       // "cascade", "fp8_output", "quant_query" (an e4m3
                                       // query with q_scale), "head_size_v", "mla", ...
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string_view name() const = 0;
  virtual std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const = 0;
  // The metadata builder of one KV-cache group. A chunked_local_attention spec (a layer with
  // attention_chunk_size) gets the local-attention builder around this backend's own builder, as
  // vLLM's ChunkedLocalAttention builder: each step it plans ordinary causal attention over the
  // batch's virtual batches (make_local_attention_virtual_batches), so queries see only their
  // chunk; it never takes the cascade path and never runs in CUDA graphs. Errors name
  // "spec.attention_chunk_size" (not a multiple of block_size), "spec" (an MLA backend). Every
  // other spec goes to make_backend_builder unchanged.
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const KVCacheSpec& spec,
                                                         const BuilderConfig& config,
                                                         Device device) const;
  // Logical shape of a cache (see kv_cache.h). Default: (2, num_blocks, block_size, num_kv_heads,
  // head_size); "auto"/any dtype string does not change the shape.
  virtual Shape kv_cache_shape(int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                               std::string_view cache_dtype = "auto") const;
  // Physical order of the logical dims. Default: standard_kv_cache_stride_order(get_kv_cache_layout()).
  virtual std::vector<int> kv_cache_stride_order() const;
  virtual std::vector<KernelBlockSize> supported_kernel_block_sizes() const = 0;
  virtual bool accept_output_buffer() const { return true; }
  // Empty = usable. Each reason is a full sentence naming the value and what is supported.
  virtual std::vector<std::string> validate_configuration(const SelectorConfig& config) const = 0;
  virtual BackendCapabilities capabilities() const = 0;
  // MLA backends (mla.h) return themselves; standard backends nullptr.
  virtual const MLABackend* as_mla() const { return nullptr; }
  // Allocates a cache for this backend: kv_cache_shape in kv_cache_stride_order.
  Tensor allocate_kv_cache(int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                           DType storage_dtype, Device device) const;

 protected:
  // The backend's own builder: what make_builder returns for every spec but chunked local
  // attention, and what the local-attention builder wraps (then with a full_attention spec of the
  // same geometry and limits sized for the virtual batches).
  virtual std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(
      const KVCacheSpec& spec, const BuilderConfig& config, Device device) const = 0;
};

}  // namespace pagedattn
