// Model presets. Shapes are read from each model's Hugging Face config.json (fields quoted in
// the comments); head_dim = hidden_size / num_attention_heads where the config has no head_dim.
// The preset dtype is the serving dtype (bf16) for every model.
#include "presets.h"

#include <cmath>

#include "cli_common.h"

namespace pagedattn::cli {

std::string_view layer_kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::full: return "full";
    case LayerKind::sliding_window: return "sliding window";
    case LayerKind::chunked_local: return "chunked local";
    case LayerKind::mla: return "mla";
  }
  return "?";
}

std::string LayerShape::describe() const {
  std::string s(layer_kind_name(kind));
  if (kind == LayerKind::sliding_window) {
    s += ' ';
    s += std::to_string(sliding_window);
  }
  if (kind == LayerKind::chunked_local) {
    s += ' ';
    s += std::to_string(attention_chunk_size);
  }
  if (logits_soft_cap) {
    s += " soft-cap ";
    s += format_sig(*logits_soft_cap, 3);
  }
  if (has_sinks) s += " sinks";
  return s;
}

std::vector<LayerShape> ModelPreset::layers(int num_layers_override) const {
  int n = num_layers_override > 0 ? num_layers_override : num_layers;
  std::vector<LayerShape> out;
  out.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) out.push_back(layer(i));
  return out;
}

std::string ModelPreset::summary(int num_layers_override) const {
  std::vector<LayerShape> all = layers(num_layers_override);
  std::vector<std::pair<std::string, int>> counts;  // in order of first appearance
  for (const LayerShape& l : all) {
    std::string d = l.describe();
    bool found = false;
    for (auto& c : counts) {
      if (c.first == d) {
        ++c.second;
        found = true;
      }
    }
    if (!found) counts.emplace_back(d, 1);
  }
  std::vector<std::string> parts;
  for (const auto& c : counts) parts.push_back(std::to_string(c.second) + " " + c.first);
  const LayerShape& l0 = all.front();
  std::string heads = l0.kind == LayerKind::mla
                          ? std::to_string(l0.num_heads) + " q heads, latent " +
                                std::to_string(l0.kv_lora_rank) + "+" + std::to_string(l0.qk_rope_head_dim)
                          : std::to_string(l0.num_heads) + " q / " + std::to_string(l0.num_kv_heads) +
                                " kv heads, d " + std::to_string(l0.head_size);
  return std::to_string(all.size()) + " layers (" + join(parts, ", ") + "), " + heads;
}

namespace {

LayerShape dense(LayerKind kind, int num_heads, int num_kv_heads, int head_size) {
  LayerShape l;
  l.kind = kind;
  l.num_heads = num_heads;
  l.num_kv_heads = num_kv_heads;
  l.head_size = head_size;
  return l;
}

std::vector<ModelPreset> make_presets() {
  std::vector<ModelPreset> presets;

  {  // tiny: a synthetic 4-layer model, the fast default. GQA 8/2, d 64, one full layer and one
     // sliding-window layer (window 128) alternating, so both kinds of KV-cache group are run.
    ModelPreset p;
    p.name = "tiny";
    p.source = "(synthetic)";
    p.num_layers = 4;
    LayerShape full = dense(LayerKind::full, 8, 2, 64);
    LayerShape window = dense(LayerKind::sliding_window, 8, 2, 64);
    window.sliding_window = 128;
    p.pattern = {full, window};
    p.max_model_len = 4096;
    presets.push_back(p);
  }
  {  // meta-llama/Meta-Llama-3-8B config.json: "num_hidden_layers": 32, "num_attention_heads": 32,
     // "num_key_value_heads": 8, "hidden_size": 4096 (head_dim 128), "max_position_embeddings": 8192.
    ModelPreset p;
    p.name = "llama3-8b";
    p.source = "meta-llama/Meta-Llama-3-8B";
    p.num_layers = 32;
    p.pattern = {dense(LayerKind::full, 32, 8, 128)};
    p.max_model_len = 8192;
    presets.push_back(p);
  }
  {  // Qwen/Qwen2.5-7B config.json: "num_hidden_layers": 28, "num_attention_heads": 28,
     // "num_key_value_heads": 4, "hidden_size": 3584 (head_dim 128), "use_sliding_window": false,
     // "max_position_embeddings": 131072.
    ModelPreset p;
    p.name = "qwen2.5-7b";
    p.source = "Qwen/Qwen2.5-7B";
    p.num_layers = 28;
    p.pattern = {dense(LayerKind::full, 28, 4, 128)};
    p.max_model_len = 131072;
    presets.push_back(p);
  }
  {  // google/gemma-2-9b config.json: "num_hidden_layers": 42, "num_attention_heads": 16,
     // "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096,
     // "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256 (scale 256^-0.5),
     // "max_position_embeddings": 8192. Even layers slide, odd layers are global
     // (transformers Gemma2Attention: sliding_window if not layer_idx % 2).
    ModelPreset p;
    p.name = "gemma2-9b";
    p.source = "google/gemma-2-9b";
    p.num_layers = 42;
    LayerShape window = dense(LayerKind::sliding_window, 16, 8, 256);
    window.sliding_window = 4096;
    window.logits_soft_cap = 50.f;
    window.scale = 1.f / std::sqrt(256.f);
    LayerShape global = dense(LayerKind::full, 16, 8, 256);
    global.logits_soft_cap = 50.f;
    global.scale = 1.f / std::sqrt(256.f);
    p.pattern = {window, global};
    p.max_model_len = 8192;
    presets.push_back(p);
  }
  {  // openai/gpt-oss-20b config.json: "num_hidden_layers": 24, "num_attention_heads": 64,
     // "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "layer_types":
     // ["sliding_attention", "full_attention", ...] (alternating, sliding first),
     // "max_position_embeddings": 131072; every layer has learned attention sinks
     // (self_attn.sinks, one per query head).
    ModelPreset p;
    p.name = "gpt-oss-20b";
    p.source = "openai/gpt-oss-20b";
    p.num_layers = 24;
    LayerShape window = dense(LayerKind::sliding_window, 64, 8, 64);
    window.sliding_window = 128;
    window.has_sinks = true;
    LayerShape full = dense(LayerKind::full, 64, 8, 64);
    full.has_sinks = true;
    p.pattern = {window, full};
    p.max_model_len = 131072;
    presets.push_back(p);
  }
  {  // meta-llama/Llama-4-Scout-17B-16E config.json, text_config: "num_hidden_layers": 48,
     // "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
     // "attention_chunk_size": 8192, "max_position_embeddings": 10485760; no_rope_layers default
     // (transformers Llama4TextConfig): layer i uses RoPE unless (i + 1) % 4 == 0. RoPE layers
     // use chunked local attention, the NoPE layers (3, 7, ...) are global (vLLM llama4.py).
    ModelPreset p;
    p.name = "llama4-scout";
    p.source = "meta-llama/Llama-4-Scout-17B-16E";
    p.num_layers = 48;
    LayerShape local = dense(LayerKind::chunked_local, 40, 8, 128);
    local.attention_chunk_size = 8192;
    LayerShape global = dense(LayerKind::full, 40, 8, 128);
    p.pattern = {local, local, local, global};
    p.max_model_len = 10485760;
    presets.push_back(p);
  }
  {  // mistralai/Mistral-7B-v0.1 config.json: "num_hidden_layers": 32, "num_attention_heads": 32,
     // "num_key_value_heads": 8, "hidden_size": 4096 (head_dim 128), "sliding_window": 4096,
     // "max_position_embeddings": 32768.
    ModelPreset p;
    p.name = "mistral-7b";
    p.source = "mistralai/Mistral-7B-v0.1";
    p.num_layers = 32;
    LayerShape window = dense(LayerKind::sliding_window, 32, 8, 128);
    window.sliding_window = 4096;
    p.pattern = {window};
    p.max_model_len = 32768;
    presets.push_back(p);
  }
  {  // deepseek-ai/DeepSeek-V3 config.json: "num_hidden_layers": 61, "num_attention_heads": 128,
     // "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
     // "max_position_embeddings": 163840. MLA: one latent KV head of 512 + 64.
    ModelPreset p;
    p.name = "deepseek-v3";
    p.source = "deepseek-ai/DeepSeek-V3";
    p.num_layers = 61;
    LayerShape mla;
    mla.kind = LayerKind::mla;
    mla.num_heads = 128;
    mla.num_kv_heads = 1;
    mla.kv_lora_rank = 512;
    mla.qk_rope_head_dim = 64;
    mla.qk_nope_head_dim = 128;
    mla.v_head_dim = 128;
    mla.head_size = 512 + 64;
    mla.head_size_v = 512;
    // Softmax scale as vLLM's DeepseekV2Attention: qk_head_dim^-0.5 times mscale^2, YaRN's
    // mscale = 0.1 * mscale_all_dim * ln(factor) + 1 with rope_scaling factor 40 and
    // mscale_all_dim 1.0 (config.json): 192^-0.5 * 1.3689^2 = 0.13524.
    const float mscale = 0.1f * 1.0f * std::log(40.f) + 1.f;
    mla.scale = mscale * mscale / std::sqrt(128.f + 64.f);
    p.pattern = {mla};
    p.max_model_len = 163840;
    presets.push_back(p);
  }
  return presets;
}

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = make_presets();
  return presets;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : model_presets()) names.push_back(p.name);
  return names;
}

const ModelPreset& find_preset(std::string_view name) {
  for (const auto& p : model_presets()) {
    if (p.name == name) return p;
  }
  throw UsageError("--preset: unknown model preset '" + std::string(name) +
                   "': expected one of " + join(preset_names(), ", "));
}

}  // namespace pagedattn::cli
