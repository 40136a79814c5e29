// StaticForwardContext (vLLM's static forward context: the model's layers by name, and the
// kv-sharing checks of validate_kv_sharing_target), ForwardContext (vLLM's forward context:
// per-step metadata and caches by layer name) and get_per_layer_parameters (vLLM utils.py: the
// plan-time hyperparameters of every layer).
#include <charconv>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {
namespace {

// vLLM extract_layer_index: the one all-digit component of a dotted name ("model.layers.3.attn"
// -> 3); nullopt when there is none or more than one (then "earlier" is only creation order).
std::optional<long> layer_index(std::string_view name) {
  std::optional<long> index;
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('.', start);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(start, end - start);
    long value = 0;
    const auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (!part.empty() && ec == std::errc() && ptr == part.data() + part.size() && part[0] != '-') {
      if (index) return std::nullopt;
      index = value;
    }
    start = end + 1;
  }
  return index;
}

const char* layer_class(const StaticForwardContext::Layer& layer) {
  return layer.use_mla ? "MLAAttention" : "Attention";
}

// "block_size 16 vs 32, num_kv_heads 2 vs 4": the fields of two specs that differ.
std::string spec_differences(const KVCacheSpec& a, const KVCacheSpec& b) {
  std::string out;
  const auto add = [&](const char* field, const auto& x, const auto& y) {
    if (x == y) return;
    out += detail::concat(out.empty() ? "" : ", ", field, " ", x, " vs ", y);
  };
  add("kind", kv_cache_spec_kind_name(a.kind), kv_cache_spec_kind_name(b.kind));
  add("block_size", a.block_size, b.block_size);
  add("num_kv_heads", a.num_kv_heads, b.num_kv_heads);
  add("head_size", a.head_size, b.head_size);
  if (a.head_size_v != b.head_size_v) {
    add("head_size_v", a.value_head_size(), b.value_head_size());
  }
  add("dtype", dtype_name(a.dtype), dtype_name(b.dtype));
  add("sliding_window", a.sliding_window, b.sliding_window);
  add("attention_chunk_size", a.attention_chunk_size, b.attention_chunk_size);
  return out;
}

std::string registered_names(const std::vector<StaticForwardContext::Layer>& layers) {
  if (layers.empty()) return "none";
  constexpr size_t kShown = 8;
  std::string out;
  for (size_t i = 0; i < layers.size() && i < kShown; ++i) {
    out += detail::concat(i == 0 ? "'" : ", '", layers[i].name, "'");
  }
  if (layers.size() > kShown) out += detail::concat(" and ", layers.size() - kShown, " more");
  return out;
}

}  // namespace

// ---- StaticForwardContext ---------------------------------------------------------------------

const StaticForwardContext::Layer* StaticForwardContext::find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &layers_[it->second];
}

void StaticForwardContext::check(const Layer& layer) const {
  const char* cls = layer_class(layer);
  const std::string& name = layer.name;
  PAGEDATTN_CHECK(!name.empty(), "prefix", cls,
                  ": prefix is empty: a layer registered in a StaticForwardContext needs a unique "
                  "name (e.g. \"model.layers.0.self_attn.attn\")");
  PAGEDATTN_CHECK(find(name) == nullptr, "prefix", cls, " '", name, "': prefix '", name,
                  "' is already the name of a layer in this StaticForwardContext (duplicate layer "
                  "name)");
  if (!layer.kv_sharing_target_layer_name) return;
  const std::string& target_name = *layer.kv_sharing_target_layer_name;
  const char* arg = "kv_sharing_target_layer_name";
  const std::string head = detail::concat(cls, " '", name, "': kv_sharing_target_layer_name = '",
                                          target_name, "' ");
  const Layer* target = find(target_name);
  if (target == nullptr) {
    const std::optional<long> own = layer_index(name), theirs = layer_index(target_name);
    if (own && theirs && *theirs >= *own) {
      throw Error(arg, detail::concat(head, "must name an earlier layer: layer index ", *theirs,
                                      " of '", target_name, "' is not below ", *own, " of '", name,
                                      "' and no layer of that name was created before '", name,
                                      "'"));
    }
    throw Error(arg, detail::concat(head, "is not a layer created before '", name,
                                    "' in this StaticForwardContext (layers so far: ",
                                    registered_names(layers_), ")"));
  }
  if (target->kv_sharing_target_layer_name) {
    throw Error(arg, detail::concat(head, "names a layer that itself reads the cache of '",
                                    *target->kv_sharing_target_layer_name,
                                    "': share that layer's cache instead (name '",
                                    *target->kv_sharing_target_layer_name, "')"));
  }
  const auto mismatch = [&](const std::string& what) {
    throw Error(arg, detail::concat(head, "cannot be shared: ", what,
                                    " (KV sharing needs the same attention type, layer kind, "
                                    "device and KV-cache spec)"));
  };
  if (target->use_mla != layer.use_mla) {
    mismatch(detail::concat("'", target_name, "' is ", target->use_mla ? "an MLA" : "a standard",
                            " layer (", layer_class(*target), ") and '", name, "' is ",
                            layer.use_mla ? "an MLA" : "a standard", " layer (", cls, ")"));
  }
  if (target->attn_type != layer.attn_type) {
    mismatch(detail::concat("'", target_name, "' has attn_type=",
                            attention_type_name(target->attn_type), " and '", name,
                            "' has attn_type=", attention_type_name(layer.attn_type)));
  }
  if (target->device != layer.device) {
    mismatch(detail::concat("'", target_name, "' is on ", device_name(target->device), " and '",
                            name, "' on ", device_name(layer.device)));
  }
  if (!target->kv_cache_spec || !layer.kv_cache_spec) {
    mismatch(detail::concat("'", !target->kv_cache_spec ? target_name : name,
                            "' has no KV cache"));
  }
  if (!(*target->kv_cache_spec == *layer.kv_cache_spec)) {
    mismatch(detail::concat("the KV-cache specs differ ('", target_name, "' vs '", name, "': ",
                            spec_differences(*target->kv_cache_spec, *layer.kv_cache_spec), ")"));
  }
}

void StaticForwardContext::add(Layer layer) {
  check(layer);
  index_.emplace(layer.name, layers_.size());
  layers_.push_back(std::move(layer));
}

// ---- ForwardContext ---------------------------------------------------------------------------

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
