// ForwardContext (vLLM's forward context: per-step metadata and caches by layer name) and
// get_per_layer_parameters (vLLM utils.py: the plan-time hyperparameters of every layer).
#include <map>
#include <string>

#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {

const AttentionMetadata& ForwardContext::metadata_for(const Attention& layer) const {
  const auto it = attn_metadata.find(layer.name());
  PAGEDATTN_CHECK(it != attn_metadata.end() && it->second != nullptr, "attn_metadata",
                  "ForwardContext: no attention metadata for layer '", layer.name(),
                  "' (build it with the layer's group builder and store it under the layer name)");
  return *it->second;
}

const TensorView& ForwardContext::kv_cache_for(const Attention& layer) const {
  const std::string& owner = layer.params().kv_sharing_target_layer_name.has_value()
                                 ? *layer.params().kv_sharing_target_layer_name
                                 : layer.name();
  const auto it = kv_caches.find(owner);
  if (owner == layer.name()) {
    PAGEDATTN_CHECK(it != kv_caches.end(), "kv_caches", "ForwardContext: no KV cache for layer '",
                    layer.name(), "'");
  } else {
    PAGEDATTN_CHECK(it != kv_caches.end(), "kv_caches", "ForwardContext: no KV cache for layer '",
                    owner, "', whose cache layer '", layer.name(),
                    "' shares (kv_sharing_target_layer_name)");
  }
  return it->second;
}

void ForwardContext::forward(Attention& layer, const TensorView& query, const TensorView& key,
                             const TensorView& value, const TensorView& output,
                             const TensorView& output_lse) const {
  const AttentionMetadata& metadata = metadata_for(layer);
  if (uses_kv_cache(layer.params().attn_type)) {
    layer.forward(query, key, value, kv_cache_for(layer), metadata, output, output_lse);
  } else {
    // encoder / encoder_only layers have no cache; one stored under their name is ignored.
    layer.forward(query, key, value, TensorView{}, metadata, output, output_lse);
  }
}

std::map<std::string, PerLayerParameters> get_per_layer_parameters(
    const std::vector<const Attention*>& layers) {
  std::map<std::string, PerLayerParameters> per_layer;
  for (size_t i = 0; i < layers.size(); ++i) {
    const Attention* layer = layers[i];
    PAGEDATTN_CHECK(layer != nullptr, "layers", "get_per_layer_parameters: layers[", i,
                    "] is null");
    const AttentionLayerParams& p = layer->params();
    PerLayerParameters params;
    params.window_left = p.sliding_window ? *p.sliding_window - 1 : -1;
    params.logits_soft_cap = p.logits_soft_cap;
    params.sm_scale = *p.scale;  // the constructor resolved an unset scale to head_size^-0.5
    const bool inserted = per_layer.emplace(layer->name(), params).second;
    PAGEDATTN_CHECK(inserted, "layers", "get_per_layer_parameters: layers[", i,
                    "] is named '", layer->name(), "' like an earlier layer (names must be unique)");
  }
  return per_layer;
}

}  // namespace pagedattn
