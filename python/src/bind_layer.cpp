// Bindings: the Attention layer (vLLM attention/layer.py). The Python class
// pagedattn.Attention subclasses this one: it adds the defaults, the documentation and the
// allocation of outputs in the caller's framework, then calls _forward. Also the rest of
// layer.h: StaticForwardContext, the lookups of ForwardContext (pagedattn.ForwardContext holds
// the Python objects and asks these for every lookup, so the rules and errors are C++'s) and
// get_per_layer_parameters.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::python {

using namespace nb::literals;

namespace {

// The layer name whose cache `layer` reads (its own, or its kv-sharing target's).
const std::string& cache_owner(const Attention& layer) {
  return layer.params().kv_sharing_target_layer_name ? *layer.params().kv_sharing_target_layer_name
                                                     : layer.name();
}

nb::object dict_item(const nb::dict& d, const std::string& key) {
  nb::str k(key.c_str(), key.size());
  return d.contains(k) ? nb::borrow(d[k]) : nb::none();
}

}  // namespace

void bind_layer(nb::module_& m) {
  using Registered = StaticForwardContext::Layer;
  nb::class_<Registered>(m, "RegisteredLayer",
                         "What a StaticForwardContext knows of one layer (read-only).")
      .def_ro("name", &Registered::name)
      .def_ro("use_mla", &Registered::use_mla)
      .def_prop_ro("attn_type", [](const Registered& l) { return std::string(attention_type_name(l.attn_type)); })
      .def_prop_ro("device", [](const Registered& l) { return std::string(device_name(l.device)); })
      .def_ro("kv_cache_spec", &Registered::kv_cache_spec)
      .def_ro("kv_sharing_target_layer_name", &Registered::kv_sharing_target_layer_name)
      .def("__repr__", [](const Registered& l) {
        return "<pagedattn.RegisteredLayer '" + l.name + "' " + (l.use_mla ? "MLAAttention" : "Attention") +
               " " + std::string(attention_type_name(l.attn_type)) + ">";
      });

  nb::class_<StaticForwardContext>(
      m, "StaticForwardContext",
      "The attention layers of one model by name, in creation order (vLLM's static forward "
      "context). A layer created with static_forward_context=ctx registers itself (a duplicate "
      "name is an error) and, when it has kv_sharing_target_layer_name, is checked against the "
      "layers created before it: the target exists and is earlier, reads its own cache, and has "
      "the same attention type, layer kind (MLA or not), device and KV-cache spec. A layer that "
      "shares a cache needs one.")
      .def(nb::init<>())
      .def("__len__", [](const StaticForwardContext& c) { return c.layers().size(); })
      .def("__contains__", [](const StaticForwardContext& c, const std::string& name) {
        return c.find(name) != nullptr;
      })
      .def(
          "__getitem__",
          [](const StaticForwardContext& c, const std::string& name) {
            const Registered* l = c.find(name);
            if (l == nullptr) throw nb::key_error(name.c_str());
            return *l;
          },
          "name"_a)
      .def_prop_ro(
          "layer_names",
          [](const StaticForwardContext& c) {
            std::vector<std::string> names;
            for (const Registered& l : c.layers()) names.push_back(l.name);
            return names;
          },
          "Names of the registered layers, in creation order.");

  m.def(
      "_forward_context_metadata_for",
      [](const nb::dict& attn_metadata, const Attention& layer) {
        ForwardContext context;
        nb::object item = dict_item(attn_metadata, layer.name());
        if (!item.is_none()) {
          context.attn_metadata[layer.name()] = nb::cast<const PyAttentionMetadata&>(item).metadata;
        }
        (void)context.metadata_for(layer);  // the C++ rules and errors
        return item;
      },
      "attn_metadata"_a, "layer"_a);
  m.def(
      "_forward_context_kv_cache_for",
      [](const nb::dict& kv_caches, const Attention& layer) {
        ForwardContext context;
        const std::string& owner = cache_owner(layer);
        nb::object item = dict_item(kv_caches, owner);
        // Only the name matters to the lookup; the cache itself is checked by forward.
        if (!item.is_none()) context.kv_caches[owner] = TensorView{};
        (void)context.kv_cache_for(layer);
        return item;
      },
      "kv_caches"_a, "layer"_a);
  m.def(
      "get_per_layer_parameters",
      [](const std::vector<const Attention*>& layers) { return get_per_layer_parameters(layers); },
      "layers"_a,
      "window_left, logits_soft_cap and sm_scale of each layer, by layer name (vLLM's "
      "get_per_layer_parameters): a dict of PerLayerParameters. Names must be unique.");

  nb::class_<Attention>(m, "_Attention", "Native part of pagedattn.Attention.")
      .def(
          "__init__",
          [](Attention* self, int num_heads, int head_size, std::optional<float> scale,
             std::optional<int> num_kv_heads, std::optional<std::vector<float>> alibi_slopes,
             std::optional<int> sliding_window, std::optional<float> logits_soft_cap,
             const std::string& attn_type, const std::string& kv_cache_dtype, int block_size,
             std::optional<std::vector<float>> sinks,
             std::optional<std::string> kv_sharing_target_layer_name, const std::string& prefix,
             nb::handle dtype, nb::handle device, std::optional<std::string> backend,
             std::optional<int> head_size_v, std::optional<int> attention_chunk_size,
             StaticForwardContext* static_forward_context, bool calculate_kv_scales, bool fp8_output,
             int dcp_world_size, int dcp_rank, int cp_kv_cache_interleave_size) {
            AttentionLayerParams p;
            p.num_heads = num_heads;
            p.head_size = head_size;
            p.scale = scale;                // None = head_size ** -0.5; 0 is an Error
            p.num_kv_heads = num_kv_heads;  // None = num_heads; 0 is an Error
            p.alibi_slopes = alibi_slopes.value_or(std::vector<float>{});
            p.sliding_window = sliding_window;
            p.logits_soft_cap = logits_soft_cap;
            p.attn_type = parse_attention_type(attn_type);
            p.kv_cache_dtype = kv_cache_dtype;
            p.block_size = block_size;
            p.sinks = sinks.value_or(std::vector<float>{});
            p.kv_sharing_target_layer_name = kv_sharing_target_layer_name;
            p.prefix = prefix;
            p.dtype = dtype_arg(dtype, "dtype");
            p.device = device_arg(device, "device");
            p.backend = backend.value_or("");
            p.head_size_v = head_size_v.value_or(0);
            p.attention_chunk_size = attention_chunk_size;
            p.calculate_kv_scales = calculate_kv_scales;
            p.fp8_output = fp8_output;
            p.dcp = DcpConfig{dcp_world_size, dcp_rank, cp_kv_cache_interleave_size};
            try {
              new (self) Attention(std::move(p), static_forward_context);
            } catch (const Error& e) {
              rethrow_with_dcp_keyword_names(e);
            }
          },
          "num_heads"_a, "head_size"_a, "scale"_a.none(), "num_kv_heads"_a.none(),
          "alibi_slopes"_a.none(), "sliding_window"_a.none(), "logits_soft_cap"_a.none(),
          "attn_type"_a, "kv_cache_dtype"_a, "block_size"_a, "sinks"_a.none(),
          "kv_sharing_target_layer_name"_a.none(), "prefix"_a, "dtype"_a, "device"_a,
          "backend"_a.none(), "head_size_v"_a.none(), "attention_chunk_size"_a.none(),
          "static_forward_context"_a.none(), "calculate_kv_scales"_a, "fp8_output"_a,
          "dcp_world_size"_a = 1, "dcp_rank"_a = 0, "cp_kv_cache_interleave_size"_a = 1)
      .def_prop_ro("backend", [](const Attention& a) { return PyBackend{&a.backend()}; },
                   "The AttentionBackend this layer runs on.")
      .def_prop_ro("kv_cache_spec", &Attention::kv_cache_spec,
                   "The KVCacheSpec of this layer's cache (vLLM's get_kv_cache_spec()).")
      .def_prop_ro(
          "kv_cache_storage_dtype",
          [](const Attention& a) { return std::string(framework_dtype_name(a.kv_cache_storage_dtype())); },
          "Element type of the cache (\"bfloat16\", \"float8_e4m3fn\", ...).")
      .def(
          "_allocate_kv_cache",
          [](const Attention& a, int64_t num_blocks) {
            Tensor cache = a.allocate_kv_cache(num_blocks);
            cache.fill_bytes(0);  // as vLLM (torch.zeros): unwritten slots read as 0, not garbage
            std::string dtype = framework_dtype_name(cache.dtype());
            return std::make_pair(export_tensor(std::move(cache)), dtype);
          },
          "num_blocks"_a)
      .def(
          "metadata_builder",
          [](const Attention& a, int max_num_seqs, int max_num_batched_tokens, int max_model_len,
             bool batch_invariant, int num_speculative_tokens) {
            const AttentionLayerParams& p = a.params();
            // Layers without a cache (encoder, encoder_only) still plan through a builder; as
            // vLLM's EncoderOnlyAttentionSpec, theirs is a full-attention spec of the layer.
            const KVCacheSpec spec =
                uses_kv_cache(p.attn_type)
                    ? a.kv_cache_spec()
                    : KVCacheSpec::full_attention(p.block_size, *p.num_kv_heads,
                                                  p.head_size, p.dtype, p.head_size_v);
            BuilderConfig config = a.builder_config(max_num_seqs, max_num_batched_tokens, max_model_len);
            config.batch_invariant = batch_invariant;
            config.num_speculative_tokens = num_speculative_tokens;
            return make_builder_object(a.backend(), spec, config, a.params().device);
          },
          "max_num_seqs"_a = 256, "max_num_batched_tokens"_a = 8192, "max_model_len"_a = 8192,
          nb::kw_only(), "batch_invariant"_a = false, "num_speculative_tokens"_a = 0,
          "A metadata builder for this layer's KV-cache group (vLLM's "
          "get_builder_cls()(kv_cache_spec, layer_names, vllm_config, device)). Its workspace is "
          "sized once from the limits: a batch beyond them is an error, never a resize. "
          "batch_invariant: plans whose output bits for a request do not depend on the rest of the "
          "batch (BuilderConfig::batch_invariant; env PAGEDATTN_BATCH_INVARIANT=1 turns it on for "
          "every builder). num_speculative_tokens (vLLM's speculative_config): k > 0 makes a "
          "request of up to 1 + k tokens a decode (reorder_batch_threshold = 1 + k), planned as one "
          "(README: speculative decoding).")
      .def(
          "_forward",
          [](Attention& a, nb::handle query, nb::handle key, nb::handle value, nb::handle kv_cache,
             const PyAttentionMetadata& attn_metadata, nb::handle output, nb::handle output_lse,
             nb::handle output_scale) {
            TensorArgs args;
            TensorView q = args.get(query, "query");
            TensorView k = args.get(key, "key", false, true);
            TensorView v = args.get(value, "value", false, true);
            TensorView cache = args.get(kv_cache, "kv_cache", true, true);
            TensorView out = args.get(output, "output", true);
            TensorView lse = args.get(output_lse, "output_lse", true, true);
            TensorView oscale = args.get(output_scale, "output_scale", false, true);
            nb::gil_scoped_release release;
            a.forward(q, k, v, cache, *attn_metadata.metadata, out, lse, oscale);
          },
          "query"_a, "key"_a.none(), "value"_a.none(), "kv_cache"_a.none(), "attn_metadata"_a,
          "output"_a, "output_lse"_a.none(), "output_scale"_a.none())
      .def_prop_rw(
          "q_scale", [](const Attention& a) { return a.scales().q_scale; },
          [](Attention& a, float s) { a.scales().q_scale = s; },
          "Query scale: an fp8_e4m3 query holds q / q_scale (see supports_quant_query_input).")
      .def_prop_ro(
          "supports_quant_query_input",
          [](Attention& a) { return a.impl().supports_quant_query_input(); },
          "Whether forward accepts an fp8_e4m3 query quantized with q_scale (an fp8 cache on "
          "CUDA or REFERENCE; vLLM's impl.supports_quant_query_input()).")
      .def_prop_ro(
          "can_return_lse_for_decode", [](Attention& a) { return a.impl().can_return_lse_for_decode(); },
          "Whether the impl can return the LSE of its decode rows (vLLM's impl.can_return_lse_for_decode).")
      .def_prop_ro(
          "need_to_return_lse_for_decode",
          [](Attention& a) { return a.impl().need_to_return_lse_for_decode(); },
          "dcp_world_size > 1 and can_return_lse_for_decode: the ranks' decode LSEs are merged "
          "(vLLM's impl.need_to_return_lse_for_decode).")
      .def_prop_ro("dcp", [](const Attention& a) { return a.params().dcp; },
                   "The layer's decode-context-parallel group (DcpConfig).")
      .def_prop_ro("dcp_world_size", [](const Attention& a) { return a.params().dcp.world_size; })
      .def_prop_ro("dcp_rank", [](const Attention& a) { return a.params().dcp.rank; })
      .def_prop_ro("cp_kv_cache_interleave_size", [](const Attention& a) { return a.params().dcp.interleave; })
      .def_prop_rw(
          "k_scale", [](const Attention& a) { return a.scales().k_scale; },
          [](Attention& a, float s) { a.scales().k_scale = s; },
          "Per-tensor key scale of an fp8 cache: stored = saturate(k / k_scale).")
      .def_prop_rw(
          "v_scale", [](const Attention& a) { return a.scales().v_scale; },
          [](Attention& a, float s) { a.scales().v_scale = s; },
          "Per-tensor value scale of an fp8 cache: stored = saturate(v / v_scale).")
      .def_prop_ro("kv_scales_pending", &Attention::kv_scales_pending,
                   "True while calculate_kv_scales still has k_scale / v_scale to measure from "
                   "a batch (an all-zero one leaves its scale waiting).")
      .def_prop_ro("num_heads", [](const Attention& a) { return a.params().num_heads; })
      .def_prop_ro("head_size", [](const Attention& a) { return a.params().head_size; })
      .def_prop_ro("head_size_v", [](const Attention& a) {
        return a.params().head_size_v > 0 ? a.params().head_size_v : a.params().head_size;
      })
      // Both resolved at construction (unset = num_heads / head_size ** -0.5).
      .def_prop_ro("num_kv_heads", [](const Attention& a) { return *a.params().num_kv_heads; })
      .def_prop_ro("scale", [](const Attention& a) { return *a.params().scale; })
      .def_prop_ro("attn_type", [](const Attention& a) { return std::string(attention_type_name(a.params().attn_type)); })
      .def_prop_ro("kv_cache_dtype", [](const Attention& a) { return a.params().kv_cache_dtype; })
      .def_prop_ro("block_size", [](const Attention& a) { return a.params().block_size; })
      .def_prop_ro("sliding_window", [](const Attention& a) { return a.params().sliding_window; })
      .def_prop_ro("logits_soft_cap", [](const Attention& a) { return a.params().logits_soft_cap; })
      .def_prop_ro("alibi_slopes", [](const Attention& a) -> std::optional<std::vector<float>> {
        if (a.params().alibi_slopes.empty()) return std::nullopt;
        return a.params().alibi_slopes;
      })
      .def_prop_ro("sinks", [](const Attention& a) -> std::optional<std::vector<float>> {
        if (a.params().sinks.empty()) return std::nullopt;
        return a.params().sinks;
      })
      .def_prop_ro("kv_sharing_target_layer_name",
                   [](const Attention& a) { return a.params().kv_sharing_target_layer_name; })
      .def_prop_ro("layer_name", [](const Attention& a) { return a.params().prefix; })
      .def_prop_ro("dtype", [](const Attention& a) { return std::string(framework_dtype_name(a.params().dtype)); })
      .def_prop_ro("device", [](const Attention& a) { return std::string(device_name(a.params().device)); });
}

}  // namespace pagedattn::python
