// The Attention layer (vLLM attention/layer.py): picks its backend, owns its impl, reports its
// cache spec; forward writes the cache (unless it shares another layer's) then attends.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

struct AttentionLayerParams {
  int num_heads = 0;
  int head_size = 0;
  // Unset = vLLM's defaults (scale head_size^-0.5, num_kv_heads = num_heads); a given value must
  // be valid: scale finite and > 0, num_kv_heads > 0 (0 is an Error naming it, as in Python).
  // After construction, params() holds the resolved values (both set).
  std::optional<float> scale;
  std::optional<int> num_kv_heads;
  std::vector<float> alibi_slopes;
  std::optional<int> sliding_window;
  std::optional<float> logits_soft_cap;
  AttentionType attn_type = AttentionType::decoder;
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  std::vector<float> sinks;
  std::optional<std::string> kv_sharing_target_layer_name;
  std::string prefix;                        // layer name, e.g. "model.layers.0.self_attn.attn"
  DType dtype = DType::bf16;
  Device device = Device::cpu;
  std::string backend;                       // "" = select; else force this backend by name
  int head_size_v = 0;                       // 0 = head_size
  std::optional<int> attention_chunk_size;   // chunked local attention (llama4)
  // vLLM's calculate_kv_scales: measure per-tensor k_scale / v_scale from the first batch the
  // layer writes into its cache, scale = amax(|x|) / fp8 max (448 e4m3, 57344 e5m2), over the
  // keys / values that batch stores (rows whose slot is not -1), before they are written; then
  // never again. So that batch fills the fp8 range without saturating. Details:
  //  - only an fp8 cache uses scales: with any other cache (and for encoder / encoder_only
  //    layers, which keep none) the option is accepted and does nothing, as in vLLM, where it
  //    is allowed for every cache dtype;
  //  - an all-zero batch (amax 0, or amax / max underflowing to 0) would give scale 0: that
  //    scale keeps its value (1.0 by default) and is measured from the next batch whose amax
  //    is nonzero. k_scale and v_scale are measured independently (kv_scales_pending());
  //  - a NaN or infinity among the measured keys / values is an Error naming key / value (the
  //    cache and the scales are untouched);
  //  - per-tensor only (as vLLM): a forward that would measure while scales().k_scale_per_head
  //    or v_scale_per_head is set is an Error naming calculate_kv_scales (per-head scales
  //    replace the per-tensor ones, so the measurement would be ignored);
  //  - a layer with kv_sharing_target_layer_name is rejected at construction (it reads a cache
  //    written with its target's scales: give it those);
  //  - on CUDA the amax is a kernel over the device tensors, and that one forward allocates 8
  //    bytes and waits for the stream once (the scales are host floats; vLLM's calc_kv_scales
  //    calls .item()): run it outside CUDA-graph capture. Every later forward is unchanged.
  bool calculate_kv_scales = false;
  // The layer's forwards will be given output_scale (fused fp8 e4m3 output, vLLM's fusion of
  // attention with a static per-tensor fp8 quantization): the selector then takes only a backend
  // whose impl supports it (SelectorConfig::fp8_output; a forced backend without it is an Error).
  // A layer without it may still pass output_scale to a backend that supports it.
  bool fp8_output = false;
  // The decode-context-parallel group the layer runs in (pagedattn/dcp.h); checked at construction.
  DcpConfig dcp;
};

// vLLM's static forward context (compilation_config.static_forward_context): the attention layers
// of one model by name, in creation order. A layer constructed with one (Attention and
// MLAAttention take it as their second argument) registers itself there, and a layer with
// kv_sharing_target_layer_name is checked against the layers created BEFORE it, as vLLM's
// validate_kv_sharing_target: the target exists and was created earlier (a later or unknown name
// is an Error), reads its own cache (no chains), and has the same attention type, the same kind
// (MLA or standard), the same device and the same KV-cache spec (kind, block_size, num_kv_heads,
// head sizes, storage dtype, sliding window, chunk size). Every failure is an Error naming
// kv_sharing_target_layer_name, both layers and what differs; a second layer of the same name is
// an Error naming prefix. A layer that shares a cache must be created with the context that holds
// its target. A rejected layer leaves the context unchanged. The context keeps a description of
// each layer, not the layer: layers may move or be destroyed. Not thread-safe (create a model's
// layers on one thread, as vLLM does).
class StaticForwardContext {
 public:
  struct Layer {
    std::string name;                      // the layer's prefix
    bool use_mla = false;                  // MLAAttention
    AttentionType attn_type = AttentionType::decoder;
    Device device = Device::cpu;
    std::optional<KVCacheSpec> kv_cache_spec;  // none for encoder / encoder_only layers
    std::optional<std::string> kv_sharing_target_layer_name;
  };

  // Throws the Error described above when `layer` cannot be added; changes nothing.
  void check(const Layer& layer) const;
  // check(), then appends `layer`.
  void add(Layer layer);
  // The layer called `name`, or nullptr.
  const Layer* find(std::string_view name) const;
  // Registered layers in creation order.
  const std::vector<Layer>& layers() const { return layers_; }

 private:
  std::vector<Layer> layers_;
  std::unordered_map<std::string, size_t> index_;
};

class Attention {
 public:
  // static_forward_context: where the layer registers itself and finds its
  // kv_sharing_target_layer_name (required for a sharing layer); nullptr = not registered.
  explicit Attention(AttentionLayerParams params,
                     StaticForwardContext* static_forward_context = nullptr);

  const AttentionBackend& backend() const { return *backend_; }
  AttentionImpl& impl() { return *impl_; }
  const AttentionLayerParams& params() const { return params_; }
  const std::string& name() const { return params_.prefix; }
  // encoder / encoder_only layers have no cache: kv_cache_spec() and allocate_kv_cache() throw
  // Error naming "attn_type" for them (skip them with uses_kv_cache(params().attn_type)).
  // A layer sharing another's cache reports the same spec as its target; allocate none for it.
  KVCacheSpec kv_cache_spec() const;
  DType kv_cache_storage_dtype() const;
  SelectorConfig selector_config() const;
  BuilderConfig builder_config(int max_num_seqs, int max_num_batched_tokens, int max_model_len) const;
  // Allocates this layer's cache in the backend's shape and stride order on params().device.
  Tensor allocate_kv_cache(int64_t num_blocks) const;

  LayerScales& scales() { return scales_; }
  const LayerScales& scales() const { return scales_; }
  // calculate_kv_scales: whether k_scale / v_scale still wait for their measurement (false once
  // both are measured, and always false without the option or without an fp8 cache).
  bool kv_scales_pending() const { return k_scale_pending_ || v_scale_pending_; }

  // query (T, Hq, D), key/value (T, Hkv, D / Dv) or empty for a kv-sharing layer and for a
  // cross layer whose encoder K/V are already cached; output (T, Hq, Dv); output_lse (Hq, T).
  // The query is in the layer dtype, or fp8_e4m3 quantized with scales().q_scale (q = q8 *
  // q_scale) when impl().supports_quant_query_input() (an fp8 cache on CUDA or REFERENCE): the
  // caller quantizes it (vLLM's layer does, with its query_quant; see README, Deviations).
  void forward(const TensorView& query, const TensorView& key, const TensorView& value,
               const TensorView& kv_cache, const AttentionMetadata& metadata,
               const TensorView& output, const TensorView& output_lse = {},
               const TensorView& output_scale = {});

 private:
  AttentionLayerParams params_;
  const AttentionBackend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  LayerScales scales_;
  // calculate_kv_scales: true until that scale is measured (see AttentionLayerParams).
  bool k_scale_pending_ = false;
  bool v_scale_pending_ = false;
  Tensor kv_amax_result_;  // CUDA: i32 (2,) the amax kernel writes (the measuring forward's)

  // The scales to write this step's keys / values with: scales_ with each pending scale
  // measured from them (unchanged where amax is 0), and which ones were measured. Throws before
  // any write; changes nothing.
  struct MeasuredKVScales {
    LayerScales scales;
    bool k_measured = false;
    bool v_measured = false;
  };
  MeasuredKVScales measure_kv_scales(const TensorView& key, const TensorView& value,
                                     const AttentionMetadata& metadata);
};

// Maps layer names to the step's metadata and to their caches (vLLM's forward context). A layer
// that shares a cache looks up its target's cache.
struct ForwardContext {
  std::unordered_map<std::string, std::shared_ptr<const AttentionMetadata>> attn_metadata;
  std::unordered_map<std::string, TensorView> kv_caches;

  const AttentionMetadata& metadata_for(const Attention& layer) const;  // Error if missing
  const TensorView& kv_cache_for(const Attention& layer) const;         // target's when sharing
  void forward(Attention& layer, const TensorView& query, const TensorView& key,
               const TensorView& value, const TensorView& output,
               const TensorView& output_lse = {}) const;
};

// vLLM get_per_layer_parameters: window_left, logits_soft_cap, sm_scale per layer name (names
// must be unique; infer_global_hyperparameters in metadata.h checks that they agree).
std::map<std::string, PerLayerParameters> get_per_layer_parameters(
    const std::vector<const Attention*>& layers);

}  // namespace pagedattn
