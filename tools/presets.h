// Model presets: the attention shapes of real models (no weights), for `pagedattn run` and
// `pagedattn bench`. Each preset cites the config.json it was read from (presets.cpp).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/dtype.h"

namespace pagedattn::cli {

enum class LayerKind {
  full,            // causal attention over the whole context
  sliding_window,  // causal, a query at p sees keys in [p-(W-1), p]
  chunked_local,   // causal within fixed chunks of attention_chunk_size tokens (llama4 iRoPE)
  mla,             // multi-head latent attention (DeepSeek)
};
std::string_view layer_kind_name(LayerKind kind);

struct LayerShape {
  LayerKind kind = LayerKind::full;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  int head_size_v = 0;                 // 0 = head_size
  float scale = 0.f;                   // 0 = head_size^-0.5
  int sliding_window = 0;              // kind == sliding_window
  int attention_chunk_size = 0;        // kind == chunked_local
  std::optional<float> logits_soft_cap;
  bool has_sinks = false;              // one learned logit per query head (gpt-oss)
  // MLA (kind == mla): the latent cache holds kv_lora_rank + qk_rope_head_dim per token.
  int kv_lora_rank = 0;
  int qk_rope_head_dim = 0;
  int qk_nope_head_dim = 0;
  int v_head_dim = 0;

  int value_head_size() const { return head_size_v > 0 ? head_size_v : head_size; }
  // What the selector is asked with (MLA: kv_lora_rank + qk_rope_head_dim, as vLLM).
  int selector_head_size() const { return kind == LayerKind::mla ? kv_lora_rank + qk_rope_head_dim : head_size; }
  // "full", "sliding window 4096", "chunked local 8192", with " soft-cap 50", " sinks".
  std::string describe() const;
};

struct ModelPreset {
  std::string name;
  std::string source;        // Hugging Face repository of the config.json the shapes come from
  int num_layers = 0;
  std::vector<LayerShape> pattern;  // layer i has pattern[i % pattern.size()]
  int max_model_len = 0;     // config max_position_embeddings
  DType dtype = DType::bf16; // config torch_dtype

  LayerShape layer(int index) const { return pattern[static_cast<size_t>(index) % pattern.size()]; }
  std::vector<LayerShape> layers(int num_layers_override = 0) const;
  // "32 layers: 32 full" / "42 layers: 21 sliding window 4096 soft-cap 50, 21 full soft-cap 50"
  std::string summary(int num_layers_override = 0) const;
};

const std::vector<ModelPreset>& model_presets();
// Throws UsageError listing the known names.
const ModelPreset& find_preset(std::string_view name);
std::vector<std::string> preset_names();

}  // namespace pagedattn::cli
