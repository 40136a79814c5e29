// The Attention layer (vLLM attention/layer.py): picks its backend, owns its impl, reports its
// cache spec; forward writes the cache (unless it shares another layer's) then attends.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
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
};

class Attention {
 public:
  explicit Attention(AttentionLayerParams params);

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

  // query (T, Hq, D), key/value (T, Hkv, D / Dv) or empty for a kv-sharing layer and for a
  // cross layer whose encoder K/V are already cached; output (T, Hq, Dv); output_lse (Hq, T).
  void forward(const TensorView& query, const TensorView& key, const TensorView& value,
               const TensorView& kv_cache, const AttentionMetadata& metadata,
               const TensorView& output, const TensorView& output_lse = {},
               const TensorView& output_scale = {});

 private:
  AttentionLayerParams params_;
  const AttentionBackend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  LayerScales scales_;
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

// vLLM get_per_layer_parameters: window_left, logits_soft_cap, sm_scale per layer name.
std::map<std::string, PerLayerParameters> get_per_layer_parameters(
    const std::vector<const Attention*>& layers);

}  // namespace pagedattn
