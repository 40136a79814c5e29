// Bindings: MLA (multi-head latent attention, include/pagedattn/mla.h; vLLM's MLAAttention, its
// ops and the MLA prefill-backend selector). The Python class pagedattn.MLAAttention subclasses
// _MLAAttention: it adds the defaults, the documentation, kv_b_proj handling and the allocation
// of outputs in the caller's framework, then calls _forward.
//
// Library errors name C++ parameters where the Python one differs: kv_b_proj_weight ->
// kv_b_proj, metadata -> attn_metadata (the Python keywords, as vLLM spells them).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::python {

using namespace nb::literals;

namespace {

// A registered MLA prefill backend class (static lifetime in the registry).
struct PyMLAPrefillBackend {
  const MLAPrefillBackendClass* backend = nullptr;
};

template <typename F>
auto with_mla_argument_names(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.argument() == "kv_b_proj_weight") throw Error("kv_b_proj", e.what());
    if (e.argument() == "metadata") throw Error("attn_metadata", e.what());
    throw;
  }
}

DeviceCapability capability_arg(nb::handle obj, Device device) {
  if (!obj.is_valid() || obj.is_none()) return device_capability(device);
  // A (major, minor) pair: vLLM's DeviceCapability is a NamedTuple of the two.
  std::vector<int> values;
  if (!nb::try_cast(obj, values) || values.size() != 2) {
    throw Error("device_capability",
                detail::concat("device_capability = ", nb::cast<std::string>(nb::repr(obj)),
                               ": expected a (major, minor) pair such as (9, 0)"));
  }
  return DeviceCapability{values[0], values[1]};
}

MLAPrefillSelectorConfig prefill_selector_config(nb::handle dtype, const MLADimensions& dims,
                                                 nb::handle device) {
  MLAPrefillSelectorConfig c;
  c.dtype = dtype_arg(dtype, "dtype");
  c.mla_dimensions = dims;
  c.device = device_arg(device, "device");
  return c;
}

nb::tuple capability_tuple(const DeviceCapability& c) { return nb::make_tuple(c.major, c.minor); }

}  // namespace

nb::object wrap_metadata(std::shared_ptr<const AttentionMetadata> metadata, Device device) {
  if (dynamic_cast<const MLAMetadata*>(metadata.get()) != nullptr) {
    PyMLAAttentionMetadata m;
    m.metadata = std::move(metadata);
    m.device = device;
    return nb::cast(std::move(m));
  }
  return nb::cast(PyAttentionMetadata{std::move(metadata), device});
}

void bind_mla(nb::module_& m) {
  // ---- dimensions, spec, workspace rule ------------------------------------------------------
  nb::class_<MLADimensions>(m, "MLADimensions",
                            "The dimensions of an MLA layer (vLLM's MLADimensions): kv_lora_rank "
                            "L, qk_nope_head_dim P, qk_rope_head_dim R, v_head_dim V. The latent "
                            "cache holds L + R numbers per token; prefill q/k heads are P + R.")
      .def(
          "__init__",
          [](MLADimensions* self, int kv_lora_rank, int qk_nope_head_dim, int qk_rope_head_dim,
             int v_head_dim) {
            new (self) MLADimensions{kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim};
          },
          "kv_lora_rank"_a, "qk_nope_head_dim"_a, "qk_rope_head_dim"_a, "v_head_dim"_a)
      .def_rw("kv_lora_rank", &MLADimensions::kv_lora_rank)
      .def_rw("qk_nope_head_dim", &MLADimensions::qk_nope_head_dim)
      .def_rw("qk_rope_head_dim", &MLADimensions::qk_rope_head_dim)
      .def_rw("v_head_dim", &MLADimensions::v_head_dim)
      .def_prop_ro("latent_head_size", &MLADimensions::latent_head_size,
                   "kv_lora_rank + qk_rope_head_dim: elements of one latent cache row.")
      .def_prop_ro("qk_head_dim", &MLADimensions::qk_head_dim,
                   "qk_nope_head_dim + qk_rope_head_dim: the prefill query/key head size.")
      .def("__eq__", [](const MLADimensions& a, const MLADimensions& b) { return a == b; })
      .def("__eq__", [](const MLADimensions&, nb::handle) { return false; })
      .def("__hash__",
           [](const MLADimensions& d) {
             return std::hash<int64_t>()((int64_t{d.kv_lora_rank} << 36) ^
                                         (int64_t{d.qk_nope_head_dim} << 24) ^
                                         (int64_t{d.qk_rope_head_dim} << 12) ^ d.v_head_dim);
           })
      .def("__repr__", &MLADimensions::to_string);

  m.def(
      "mla_attention_spec",
      [](int block_size, const MLADimensions& mla_dimensions, nb::handle dtype,
         const std::string& kv_cache_dtype) {
        return mla_attention_spec(block_size, mla_dimensions, dtype_arg(dtype, "dtype"),
                                  kv_cache_dtype);
      },
      "block_size"_a, "mla_dimensions"_a, "dtype"_a, "kv_cache_dtype"_a = "auto",
      "The KVCacheSpec of an MLA layer (vLLM's MLAAttentionSpec): kind \"mla\", one KV head of "
      "head size kv_lora_rank + qk_rope_head_dim, page = block_size * (L + R) * element bytes of "
      "the storage dtype (\"auto\" = the activation dtype `dtype`, \"fp8\" = one byte).");

  m.def("mla_chunked_prefill_workspace_tokens", &mla_chunked_prefill_workspace_tokens,
        "max_model_len"_a, "max_num_seqs"_a, "block_size"_a,
        "vLLM's chunked-prefill workspace rule: min(max(8 * max_model_len, 4 * max_num_seqs * "
        "block_size), 64 * 1024) tokens, never below max_num_seqs * block_size.");

  // ---- ops ----------------------------------------------------------------------------------
  m.def(
      "_concat_and_cache_mla",
      [](nb::handle kv_c, nb::handle k_pe, nb::handle kv_cache, nb::handle slot_mapping,
         const std::string& kv_cache_dtype, float scale) {
        TensorArgs args;
        TensorView kv = args.get(kv_c, "kv_c");
        TensorView pe = args.get(k_pe, "k_pe");
        TensorView cache = args.get(kv_cache, "kv_cache", true);
        TensorView slots = args.get(slot_mapping, "slot_mapping");
        nb::gil_scoped_release release;
        concat_and_cache_mla(kv, pe, cache, slots, kv_cache_dtype, scale);
      },
      "kv_c"_a, "k_pe"_a, "kv_cache"_a, "slot_mapping"_a, "kv_cache_dtype"_a, "scale"_a);

  m.def(
      "_gather_and_maybe_dequant_cache",
      [](nb::handle src_cache, nb::handle dst, nb::handle block_table, nb::handle cu_seq_lens,
         int batch_size, const std::string& kv_cache_dtype, float scale, nb::handle seq_starts) {
        TensorArgs args;
        TensorView src = args.get(src_cache, "src_cache");
        TensorView out = args.get(dst, "dst", true);
        TensorView table = args.get(block_table, "block_table");
        TensorView cu = args.get(cu_seq_lens, "cu_seq_lens");
        TensorView starts = args.get(seq_starts, "seq_starts", false, true);
        nb::gil_scoped_release release;
        gather_and_maybe_dequant_cache(src, out, table, cu, batch_size, kv_cache_dtype, scale, starts);
      },
      "src_cache"_a, "dst"_a, "block_table"_a, "cu_seq_lens"_a, "batch_size"_a,
      "kv_cache_dtype"_a, "scale"_a, "seq_starts"_a.none());

  // ---- prefill backends and their selector --------------------------------------------------
  m.def(
      "device_capability",
      [](nb::handle device) { return capability_tuple(device_capability(device_arg(device, "device"))); },
      "device"_a = "cpu",
      "(major, minor) compute capability of the current device of `device` ((0, 0) on the CPU).");

  nb::class_<PyMLAPrefillBackend>(
      m, "MLAPrefillBackend",
      "A registered MLA prefill backend (vLLM's MLAPrefillBackend class): its name, device, "
      "dtypes and dimensions, and the reasons it does or does not fit a configuration. Get one "
      "from list_mla_prefill_backends(), find_mla_prefill_backend() or "
      "get_mla_prefill_backend(); MLAAttention(prefill_backend=NAME) forces one.")
      .def_prop_ro("name", [](const PyMLAPrefillBackend& b) { return std::string(b.backend->get_name()); })
      .def(
          "get_name", [](const PyMLAPrefillBackend& b) { return std::string(b.backend->get_name()); },
          "The backend's name (vLLM's MLAPrefillBackend.get_name()).")
      .def_prop_ro("device", [](const PyMLAPrefillBackend& b) { return std::string(device_name(b.backend->device())); })
      .def_prop_ro(
          "supported_dtypes",
          [](const PyMLAPrefillBackend& b) {
            std::vector<std::string> out;
            for (DType d : b.backend->supported_dtypes()) out.emplace_back(framework_dtype_name(d));
            return out;
          },
          "Activation dtypes (\"float16\", \"bfloat16\", ...).")
      .def_prop_ro(
          "supported_mla_dimensions",
          [](const PyMLAPrefillBackend& b) { return b.backend->supported_mla_dimensions(); },
          "The MLADimensions it runs; empty = any.")
      .def(
          "supports_dtype",
          [](const PyMLAPrefillBackend& b, nb::handle dtype) {
            return b.backend->supports_dtype(dtype_arg(dtype, "dtype"));
          },
          "dtype"_a)
      .def(
          "supports_compute_capability",
          [](const PyMLAPrefillBackend& b, nb::handle device_capability) {
            return b.backend->supports_compute_capability(capability_arg(device_capability, Device::cpu));
          },
          "device_capability"_a)
      .def("is_available", [](const PyMLAPrefillBackend& b) { return b.backend->is_available(); })
      .def(
          "validate_configuration",
          [](const PyMLAPrefillBackend& b, nb::handle dtype, const MLADimensions& mla_dimensions,
             nb::handle device, nb::handle device_capability) {
            MLAPrefillSelectorConfig c = prefill_selector_config(dtype, mla_dimensions, device);
            return b.backend->validate_configuration(capability_arg(device_capability, c.device), c);
          },
          "dtype"_a, "mla_dimensions"_a, "device"_a = "cpu", "device_capability"_a.none() = nb::none(),
          "Reasons this prefill backend cannot run the configuration (full sentences; vLLM's "
          "compute capability, dtype, availability and dimensions checks, plus the device); "
          "empty = usable. device_capability: (major, minor); None = that of `device`.")
      .def("__eq__", [](const PyMLAPrefillBackend& a, const PyMLAPrefillBackend& b) { return a.backend == b.backend; })
      .def("__eq__", [](const PyMLAPrefillBackend&, nb::handle) { return false; })
      .def("__hash__", [](const PyMLAPrefillBackend& b) { return std::hash<const void*>()(b.backend); })
      .def("__repr__", [](const PyMLAPrefillBackend& b) {
        return "<pagedattn.MLAPrefillBackend " + std::string(b.backend->get_name()) + ">";
      });

  m.def(
      "list_mla_prefill_backends",
      []() {
        std::vector<PyMLAPrefillBackend> out;
        for (const MLAPrefillBackendClass* b : registered_mla_prefill_backends()) out.push_back({b});
        return out;
      },
      "Every registered MLA prefill backend, highest priority first (REFERENCE, the fp64 "
      "oracle, last).");
  m.def(
      "find_mla_prefill_backend",
      [](const std::string& name) -> std::optional<PyMLAPrefillBackend> {
        const MLAPrefillBackendClass* b = find_mla_prefill_backend(name);
        if (b == nullptr) return std::nullopt;
        return PyMLAPrefillBackend{b};
      },
      "name"_a, "The MLA prefill backend called `name` (case-insensitive), or None.");
  m.def(
      "explain_mla_prefill_backends",
      [](nb::handle dtype, const MLADimensions& mla_dimensions, nb::handle device,
         nb::handle device_capability) {
        MLAPrefillSelectorConfig c = prefill_selector_config(dtype, mla_dimensions, device);
        std::vector<std::pair<PyMLAPrefillBackend, std::vector<std::string>>> out;
        for (MLAPrefillBackendReport& r :
             explain_mla_prefill_backends(capability_arg(device_capability, c.device), c)) {
          out.emplace_back(PyMLAPrefillBackend{r.backend}, std::move(r.reasons));
        }
        return out;
      },
      "dtype"_a, "mla_dimensions"_a, "device"_a = "cpu", "device_capability"_a.none() = nb::none(),
      "[(backend, reasons)] for every registered MLA prefill backend in priority order; empty "
      "reasons = usable.");
  m.def(
      "get_mla_prefill_backend",
      [](nb::handle dtype, const MLADimensions& mla_dimensions, nb::handle device,
         nb::handle device_capability, std::optional<std::string> backend) {
        MLAPrefillSelectorConfig c = prefill_selector_config(dtype, mla_dimensions, device);
        return PyMLAPrefillBackend{&get_mla_prefill_backend(capability_arg(device_capability, c.device),
                                                            c, backend.value_or(""))};
      },
      "dtype"_a, "mla_dimensions"_a, "device"_a = "cpu", "device_capability"_a.none() = nb::none(),
      "backend"_a.none() = nb::none(),
      "The highest-priority MLA prefill backend that runs this configuration (vLLM's MLA "
      "prefill selector). `backend` (or env PAGEDATTN_MLA_PREFILL_BACKEND) forces one by name. "
      "Raises pagedattn.Error listing every prefill backend with its reasons when none fits.");

  // ---- metadata -----------------------------------------------------------------------------
  nb::class_<PyMLAAttentionMetadata, PyAttentionMetadata>(
      m, "MLAAttentionMetadata",
      "An MLA backend's plan for one step (vLLM's MLACommonMetadata): the AttentionMetadata "
      "fields plus the decode/prefill split (decodes first) and the chunked-context plan.")
      .def_prop_ro("num_decodes", [](const PyMLAAttentionMetadata& p) { return p.mla().num_decodes; })
      .def_prop_ro("num_decode_tokens", [](const PyMLAAttentionMetadata& p) { return p.mla().num_decode_tokens; })
      .def_prop_ro("num_prefills", [](const PyMLAAttentionMetadata& p) { return p.mla().num_prefills; })
      .def_prop_ro("num_prefill_tokens", [](const PyMLAAttentionMetadata& p) { return p.mla().num_prefill_tokens; })
      .def_prop_ro(
          "num_context_chunks",
          [](const PyMLAAttentionMetadata& p) {
            const MLAMetadata& md = p.mla();
            return md.prefill && md.prefill->chunked_context ? md.prefill->chunked_context->num_chunks : 0;
          },
          "Chunks the prefills' cached context is processed in (0 when no prefill has context).")
      .def_prop_ro(
          "max_context_chunk",
          [](const PyMLAAttentionMetadata& p) {
            const MLAMetadata& md = p.mla();
            return md.prefill && md.prefill->chunked_context ? md.prefill->chunked_context->max_context_chunk : 0;
          },
          "Context tokens per prefill per chunk (a multiple of block_size; 0 without context).")
      .def("__repr__", [](const PyMLAAttentionMetadata& p) {
        const MLAMetadata& md = p.mla();
        return "<pagedattn.MLAAttentionMetadata num_reqs=" + std::to_string(md.num_reqs) +
               " num_actual_tokens=" + std::to_string(md.num_actual_tokens) +
               " num_decodes=" + std::to_string(md.num_decodes) +
               " num_prefills=" + std::to_string(md.num_prefills) + ">";
      });

  // ---- layer --------------------------------------------------------------------------------
  nb::class_<MLAAttention>(m, "_MLAAttention", "Native part of pagedattn.MLAAttention.")
      .def(
          "__init__",
          [](MLAAttention* self, int num_heads, std::optional<float> scale, int qk_nope_head_dim,
             int qk_rope_head_dim, int v_head_dim, std::optional<int> q_lora_rank, int kv_lora_rank,
             const std::string& kv_cache_dtype, int block_size,
             std::optional<std::string> kv_sharing_target_layer_name, const std::string& prefix,
             nb::handle dtype, nb::handle device, std::optional<std::string> backend,
             std::optional<std::string> prefill_backend,
             StaticForwardContext* static_forward_context, bool fp8_output, bool calculate_kv_scales,
             int dcp_world_size, int dcp_rank, int cp_kv_cache_interleave_size) {
            MLAAttentionLayerParams p;
            p.num_heads = num_heads;
            p.scale = scale;  // None = qk_head_dim ** -0.5; 0 is an Error (MLAAttention)
            p.q_lora_rank = q_lora_rank;
            p.kv_lora_rank = kv_lora_rank;
            p.qk_nope_head_dim = qk_nope_head_dim;
            p.qk_rope_head_dim = qk_rope_head_dim;
            p.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim;
            p.v_head_dim = v_head_dim;
            p.kv_cache_dtype = kv_cache_dtype;
            p.block_size = block_size;
            p.kv_sharing_target_layer_name = kv_sharing_target_layer_name;
            p.prefix = prefix;
            p.dtype = dtype_arg(dtype, "dtype");
            p.device = device_arg(device, "device");
            p.backend = backend.value_or("");
            p.prefill_backend = prefill_backend.value_or("");
            p.fp8_output = fp8_output;
            p.calculate_kv_scales = calculate_kv_scales;
            p.dcp = DcpConfig{dcp_world_size, dcp_rank, cp_kv_cache_interleave_size};
            try {
              new (self) MLAAttention(std::move(p), static_forward_context);
            } catch (const Error& e) {
              rethrow_with_dcp_keyword_names(e);
            }
          },
          "num_heads"_a, "scale"_a.none(), "qk_nope_head_dim"_a, "qk_rope_head_dim"_a,
          "v_head_dim"_a, "q_lora_rank"_a.none(), "kv_lora_rank"_a, "kv_cache_dtype"_a,
          "block_size"_a, "kv_sharing_target_layer_name"_a.none(), "prefix"_a, "dtype"_a,
          "device"_a, "backend"_a.none(), "prefill_backend"_a.none(),
          "static_forward_context"_a.none(), "fp8_output"_a = false, "calculate_kv_scales"_a = false,
          "dcp_world_size"_a = 1, "dcp_rank"_a = 0, "cp_kv_cache_interleave_size"_a = 1)
      .def_prop_ro("backend", [](const MLAAttention& a) { return PyBackend{&a.backend()}; },
                   "The MLA AttentionBackend this layer runs on.")
      .def_prop_ro(
          "prefill_backend",
          [](MLAAttention& a) { return std::string(a.impl().prefill_backend_name()); },
          "Name of the MLA prefill backend its prefill tokens run on.")
      .def_prop_ro("kv_cache_spec", &MLAAttention::kv_cache_spec,
                   "The KVCacheSpec of this layer's latent cache (vLLM's MLAAttentionSpec).")
      .def_prop_ro(
          "kv_cache_storage_dtype",
          [](const MLAAttention& a) { return std::string(framework_dtype_name(a.kv_cache_storage_dtype())); },
          "Element type of the cache (\"bfloat16\", \"float8_e4m3fn\", ...).")
      .def(
          "_allocate_kv_cache",
          [](const MLAAttention& a, int64_t num_blocks) {
            Tensor cache = a.allocate_kv_cache(num_blocks);
            cache.fill_bytes(0);  // as vLLM (torch.zeros)
            std::string dtype = framework_dtype_name(cache.dtype());
            return std::make_pair(export_tensor(std::move(cache)), dtype);
          },
          "num_blocks"_a)
      .def(
          "_metadata_builder",
          [](const MLAAttention& a, int max_num_seqs, int max_num_batched_tokens, int max_model_len,
             int64_t chunked_prefill_workspace_tokens, bool batch_invariant, int num_speculative_tokens) {
            BuilderConfig config = a.builder_config(max_num_seqs, max_num_batched_tokens, max_model_len,
                                                    chunked_prefill_workspace_tokens);
            config.batch_invariant = batch_invariant;
            config.num_speculative_tokens = num_speculative_tokens;
            return make_builder_object(a.backend(), a.kv_cache_spec(), config, a.params().device);
          },
          "max_num_seqs"_a, "max_num_batched_tokens"_a, "max_model_len"_a,
          "chunked_prefill_workspace_tokens"_a, "batch_invariant"_a, "num_speculative_tokens"_a)
      .def(
          "_process_weights_after_loading",
          [](MLAAttention& a, nb::handle kv_b_proj) {
            TensorArgs args;
            TensorView w = args.get(kv_b_proj, "kv_b_proj");
            nb::gil_scoped_release release;
            with_mla_argument_names([&] { a.process_weights_after_loading(w); });
          },
          "kv_b_proj"_a)
      .def(
          "_forward",
          [](MLAAttention& a, nb::handle q, nb::handle kv_c_normed, nb::handle k_pe,
             nb::handle kv_cache, const PyAttentionMetadata& attn_metadata, nb::handle output,
             nb::handle output_lse, nb::handle output_scale) {
            TensorArgs args;
            TensorView qv = args.get(q, "q");
            TensorView kv = args.get(kv_c_normed, "kv_c_normed");
            TensorView pe = args.get(k_pe, "k_pe");
            TensorView cache = args.get(kv_cache, "kv_cache", true);
            TensorView out = args.get(output, "output", true);
            TensorView lse = args.get(output_lse, "output_lse", true, true);
            TensorView oscale = args.get(output_scale, "output_scale", false, true);
            nb::gil_scoped_release release;
            with_mla_argument_names(
                [&] { a.forward(qv, kv, pe, cache, *attn_metadata.metadata, out, lse, oscale); });
          },
          "q"_a, "kv_c_normed"_a, "k_pe"_a, "kv_cache"_a, "attn_metadata"_a, "output"_a,
          "output_lse"_a.none(), "output_scale"_a.none() = nb::none())
      .def_prop_rw(
          "k_scale", [](const MLAAttention& a) { return a.scales().k_scale; },
          [](MLAAttention& a, float s) {
            PAGEDATTN_CHECK(std::isfinite(s) && s > 0.f, "k_scale", "MLAAttention '", a.name(),
                            "': k_scale = ", s, " must be a finite value > 0");
            a.scales().k_scale = s;
          },
          "Per-tensor scale of an fp8 latent cache: stored = saturate(x / k_scale), read = "
          "fp8 * k_scale.")
      .def_prop_ro("kv_scales_pending", &MLAAttention::kv_scales_pending,
                   "calculate_kv_scales: whether k_scale still waits for its measurement.")
      .def_prop_ro(
          "can_return_lse_for_decode", [](MLAAttention& a) { return a.impl().can_return_lse_for_decode(); },
          "Whether the impl can return the LSE of its decode rows (vLLM's impl.can_return_lse_for_decode).")
      .def_prop_ro(
          "need_to_return_lse_for_decode",
          [](MLAAttention& a) { return a.impl().need_to_return_lse_for_decode(); },
          "dcp_world_size > 1 and can_return_lse_for_decode: the ranks' decode LSEs are merged "
          "(vLLM's impl.need_to_return_lse_for_decode).")
      .def_prop_ro("dcp", [](const MLAAttention& a) { return a.params().dcp; },
                   "The layer's decode-context-parallel group (DcpConfig).")
      .def_prop_ro("dcp_world_size", [](const MLAAttention& a) { return a.params().dcp.world_size; })
      .def_prop_ro("dcp_rank", [](const MLAAttention& a) { return a.params().dcp.rank; })
      .def_prop_ro("cp_kv_cache_interleave_size", [](const MLAAttention& a) { return a.params().dcp.interleave; })
      .def_prop_ro("num_heads", [](const MLAAttention& a) { return a.params().num_heads; })
      .def_prop_ro("scale", [](const MLAAttention& a) { return *a.params().scale; })
      .def_prop_ro("qk_nope_head_dim", [](const MLAAttention& a) { return a.params().qk_nope_head_dim; })
      .def_prop_ro("qk_rope_head_dim", [](const MLAAttention& a) { return a.params().qk_rope_head_dim; })
      .def_prop_ro("qk_head_dim", [](const MLAAttention& a) { return a.params().qk_head_dim; })
      .def_prop_ro("v_head_dim", [](const MLAAttention& a) { return a.params().v_head_dim; })
      .def_prop_ro("q_lora_rank", [](const MLAAttention& a) { return a.params().q_lora_rank; })
      .def_prop_ro("kv_lora_rank", [](const MLAAttention& a) { return a.params().kv_lora_rank; })
      .def_prop_ro("mla_dimensions", [](const MLAAttention& a) { return a.params().dims(); })
      .def_prop_ro("head_size", [](const MLAAttention& a) { return a.params().dims().latent_head_size(); },
                   "kv_lora_rank + qk_rope_head_dim: the latent cache row (vLLM's head_size).")
      .def_prop_ro("num_kv_heads", [](const MLAAttention&) { return 1; })
      .def_prop_ro("kv_cache_dtype", [](const MLAAttention& a) { return a.params().kv_cache_dtype; })
      .def_prop_ro("block_size", [](const MLAAttention& a) { return a.params().block_size; })
      .def_prop_ro("kv_sharing_target_layer_name",
                   [](const MLAAttention& a) { return a.params().kv_sharing_target_layer_name; })
      .def_prop_ro("layer_name", [](const MLAAttention& a) { return a.params().prefix; })
      .def_prop_ro("dtype", [](const MLAAttention& a) { return std::string(framework_dtype_name(a.params().dtype)); })
      .def_prop_ro("device", [](const MLAAttention& a) { return std::string(device_name(a.params().device)); });
}

}  // namespace pagedattn::python
