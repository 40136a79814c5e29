// `pagedattn backends`: every registered backend with its capabilities, and for a configuration
// (flags, or each layer kind of a preset) the selector's own reasons.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <memory>
#include <ostream>

#include "cli_common.h"
#include "commands.h"
#include "option_limits.h"
#include "option_parsing.h"
#include "pagedattn/pagedattn.h"
#include "presets.h"

namespace pagedattn::cli {

namespace {

struct BackendsFlags {
  int head_size = 128;
  int head_size_v = 0;
  std::string dtype = "bfloat16";
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  std::string attn_type = "decoder";
  std::string device = "cpu";
  bool mla = false;
  bool sinks = false;
  bool alibi = false;
  bool sparse = false;
  int window = 0;
  double soft_cap = 0;
  bool fp8_output = false;
  std::string preset;
};

template <typename T, typename F>
std::string list(const std::vector<T>& items, F&& name, const std::string& empty = "any") {
  if (items.empty()) return empty;
  std::vector<std::string> parts;
  for (const T& item : items) parts.emplace_back(name(item));
  return join(parts, ", ");
}

// "any", "64, 128", or "16 to 512, step 16" for a long arithmetic progression.
std::string describe_head_sizes(const std::vector<int>& sizes) {
  if (sizes.empty()) return "any";
  bool progression = sizes.size() >= 4;
  for (size_t i = 2; progression && i < sizes.size(); ++i) {
    progression = sizes[i] - sizes[i - 1] == sizes[1] - sizes[0];
  }
  if (progression) {
    return std::to_string(sizes.front()) + " to " + std::to_string(sizes.back()) + ", step " +
           std::to_string(sizes[1] - sizes[0]);
  }
  return list(sizes, [](int h) { return std::to_string(h); });
}

std::string describe(const SelectorConfig& c) {
  std::string s = "head_size=" + std::to_string(c.head_size);
  if (c.head_size_v > 0) s += ", head_size_v=" + std::to_string(c.head_size_v);
  s += ", dtype=" + std::string(dtype_name(c.dtype)) + ", kv_cache_dtype=" + c.kv_cache_dtype +
       ", block_size=" + std::to_string(c.block_size) + ", attn_type=" + std::string(attention_type_name(c.attn_type)) +
       ", device=" + std::string(device_name(c.device));
  if (c.use_mla) s += ", mla";
  if (c.has_sink) s += ", sinks";
  if (c.use_sparse) s += ", sparse";
  if (c.use_alibi) s += ", alibi";
  if (c.use_sliding_window) s += ", sliding window";
  if (c.use_logits_soft_cap) s += ", soft-cap";
  if (c.fp8_output) s += ", fp8 output";
  return s;
}

void print_capabilities(std::ostream& os) {
  TextTable t({"#", "backend", "devices", "dtypes", "KV-cache dtypes", "head sizes", "block sizes",
               "attention types", "features"});
  int priority = 1;
  for (const AttentionBackend* b : registered_backends()) {
    BackendCapabilities caps = b->capabilities();
    t.add_row({std::to_string(priority++), std::string(b->name()),
               list(caps.devices, [](Device d) { return std::string(device_name(d)); }),
               list(caps.dtypes, [](DType d) { return std::string(dtype_name(d)); }),
               list(caps.kv_cache_dtypes, [](const std::string& s) { return s; }),
               describe_head_sizes(caps.head_sizes),
               describe_block_sizes(b->supported_kernel_block_sizes()),
               list(caps.attn_types, [](AttentionType a) { return std::string(attention_type_name(a)); }),
               list(caps.features, [](const std::string& s) { return s; }, "none")});
  }
  t.print(os);
}

// One table row per backend: usable or its reasons. Returns the selected backend's name ("").
std::string print_reasons(const SelectorConfig& config, std::ostream& os) {
  TextTable t({"backend", "usable", "reasons"});
  std::string selected;
  for (const BackendReport& r : explain_backends(config)) {
    if (r.usable() && selected.empty()) selected = std::string(r.backend->name());
    t.add_row({std::string(r.backend->name()), r.usable() ? "yes" : "no", join(r.reasons, " ")});
  }
  t.print(os);
  return selected;
}

SelectorConfig layer_config(const LayerShape& shape, const SelectorConfig& base) {
  SelectorConfig c = base;
  c.head_size = shape.selector_head_size();
  c.head_size_v = shape.kind == LayerKind::mla ? 0 : shape.head_size_v;
  c.use_mla = shape.kind == LayerKind::mla;
  if (c.use_mla) {
    c.mla_dimensions = {shape.kv_lora_rank, shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim};
    c.num_heads = shape.num_heads;
  }
  c.has_sink = shape.has_sinks;
  c.use_alibi = false;
  c.use_sliding_window = shape.kind == LayerKind::sliding_window;
  c.use_logits_soft_cap = shape.logits_soft_cap.has_value();
  c.attn_type = AttentionType::decoder;
  return c;
}

}  // namespace

Command add_backends_command(CLI::App& parent) {
  auto f = std::make_shared<BackendsFlags>();
  CLI::App* app = parent.add_subcommand(
      "backends",
      "Every registered backend in priority order with its capabilities, then, for one configuration "
      "(the flags below) or for every layer kind of --preset, whether each backend can run it and, if "
      "not, why (the backends' own validate_configuration reasons, as the selector sees them). Exit 3 "
      "when no backend can run the configuration.");
  app->add_option("--head-size", f->head_size, "head size")->capture_default_str()->check(integer_option(1, kMaxHeadSize));
  app->add_option("--head-size-v", f->head_size_v, "value head size (0 = head size)")
      ->check(integer_option(0, kMaxHeadSize));
  app->add_option("--dtype", f->dtype, "activation dtype")->capture_default_str();
  app->add_option("--kv-cache-dtype", f->kv_cache_dtype, "KV-cache dtype string")->capture_default_str();
  app->add_option("--block-size", f->block_size, "KV-cache block size")
      ->capture_default_str()
      ->check(integer_option(1, kMaxBlockSize));
  app->add_option("--attn-type", f->attn_type, "decoder, encoder, encoder_only, encoder_decoder")->capture_default_str();
  app->add_option("--device", f->device, "cpu or cuda")->capture_default_str();
  app->add_flag("--mla", f->mla, "multi-head latent attention");
  app->add_flag("--sinks", f->sinks, "attention sinks");
  app->add_flag("--alibi", f->alibi, "ALiBi slopes");
  app->add_flag("--sparse", f->sparse, "sparse attention");
  app->add_option("--window", f->window, "sliding window of N tokens")->check(integer_option(1, kMaxTokens));
  app->add_option("--soft-cap", f->soft_cap, "logits soft-cap value")->check(number_option(0, kMaxSoftCap, true));
  app->add_flag("--fp8-output", f->fp8_output, "fused fp8 output quantization");
  app->add_option("--preset", f->preset, "explain every layer kind of this model preset instead");

  CommandAction action = [f, app](Streams& io) -> int {
    SelectorConfig c;
    check_range("--head-size", f->head_size, 1, kMaxHeadSize);
    check_range("--head-size-v", f->head_size_v, 0, kMaxHeadSize);
    check_range("--block-size", f->block_size, 1, kMaxBlockSize);
    if (app->count("--window") > 0) check_range("--window", f->window, 1, kMaxTokens);
    if (app->count("--soft-cap") > 0) check_range("--soft-cap", f->soft_cap, 0.0, kMaxSoftCap, true);
    c.head_size = f->head_size;
    c.head_size_v = f->head_size_v;
    c.dtype = parse_activation_dtype_flag(f->dtype, "--dtype");
    check_kv_cache_dtype_flag(f->kv_cache_dtype, "--kv-cache-dtype");
    c.kv_cache_dtype = f->kv_cache_dtype;
    c.block_size = f->block_size;
    c.attn_type = parse_attn_type_flag(f->attn_type, "--attn-type");
    c.device = parse_device_flag(f->device, "--device");
    c.use_mla = f->mla;
    c.has_sink = f->sinks;
    c.use_alibi = f->alibi;
    c.use_sparse = f->sparse;
    c.use_sliding_window = app->count("--window") > 0;
    c.use_logits_soft_cap = app->count("--soft-cap") > 0;
    c.fp8_output = f->fp8_output;

    std::ostream& os = io.out;
    os << "Registered attention backends (priority order; the selector takes the first usable one):\n\n";
    print_capabilities(os);
    if (f->preset.empty()) {
      os << "\nFor " << describe(c) << ":\n\n";
      std::string selected = print_reasons(c, os);
      os << "\nselected: " << (selected.empty() ? "none (no backend can run this configuration)" : selected) << "\n";
      return selected.empty() ? kExitUnsupported : kExitOk;
    }
    const ModelPreset& preset = find_preset(f->preset);
    std::vector<std::string> seen;
    bool all_usable = true;
    for (const LayerShape& shape : preset.layers()) {
      std::string kind = shape.describe();
      if (std::find(seen.begin(), seen.end(), kind) != seen.end()) continue;
      seen.push_back(kind);
      SelectorConfig lc = layer_config(shape, c);
      os << "\n" << preset.name << " layers: " << kind << " (" << describe(lc) << "):\n\n";
      std::string selected = print_reasons(lc, os);
      os << "\nselected: " << (selected.empty() ? "none" : selected) << "\n";
      all_usable = all_usable && !selected.empty();
    }
    return all_usable ? kExitOk : kExitUnsupported;
  };
  return Command{app, action};
}

}  // namespace pagedattn::cli
