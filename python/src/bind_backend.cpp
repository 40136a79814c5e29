// Bindings: backends (AttentionBackend), the selector, metadata builders and their plans.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <span>
#include <string>
#include <variant>
#include <vector>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::python {

using namespace nb::literals;

namespace {

nb::tuple to_tuple(const Shape& shape) {
  nb::list items;
  for (int64_t d : shape) items.append(d);
  return nb::tuple(items);
}

nb::list block_sizes_list(const std::vector<KernelBlockSize>& sizes) {
  nb::list out;
  for (const KernelBlockSize& s : sizes) {
    if (const int* n = std::get_if<int>(&s)) {
      out.append(*n);
    } else {
      out.append(nb::cast(std::get<MultipleOf>(s)));
    }
  }
  return out;
}

SelectorConfig selector_config(int head_size, nb::handle dtype, const std::string& kv_cache_dtype,
                               int block_size, bool use_mla, bool has_sink, bool use_sparse,
                               const std::string& attn_type, nb::handle device) {
  SelectorConfig c;
  c.head_size = head_size;
  c.dtype = dtype_arg(dtype, "dtype");
  c.kv_cache_dtype = kv_cache_dtype;
  c.block_size = block_size;
  c.use_mla = use_mla;
  c.has_sink = has_sink;
  c.use_sparse = use_sparse;
  c.attn_type = parse_attention_type(attn_type);
  c.device = device_arg(device, "device");
  return c;
}

struct PyBuilder {
  std::unique_ptr<AttentionMetadataBuilder> builder;
  Device device = Device::cpu;
};

}  // namespace

AttentionMetadataBuilder& builder_arg(nb::handle builder) {
  PyBuilder* b = nullptr;
  PAGEDATTN_CHECK(nb::try_cast(builder, b) && b != nullptr && b->builder != nullptr, "builder", "builder is a ",
                  nb::type_name(builder.type()).c_str(),
                  ": expected an AttentionMetadataBuilder (backend.make_builder / layer.metadata_builder())");
  return *b->builder;
}

namespace {

nb::object reorder_result(const std::optional<BatchReorder>& r) {
  if (!r) return nb::none();
  nb::list order;
  for (int i : r->order) order.append(i);
  return nb::make_tuple(order, r->modified);
}

}  // namespace

void bind_backend(nb::module_& m) {
  nb::class_<PyBackend>(m, "AttentionBackend",
                        "A registered attention backend (vLLM's AttentionBackend): its name, "
                        "cache shape and stride order, kernel block sizes and the reasons it "
                        "does or does not fit a configuration. Get one from get_attn_backend(), "
                        "list_backends() or Attention.backend.")
      .def_prop_ro("name", [](const PyBackend& b) { return std::string(b.backend->name()); })
      .def(
          "get_name", [](const PyBackend& b) { return std::string(b.backend->name()); },
          "The backend's name (as vLLM's AttentionBackend.get_name()).")
      .def(
          "get_kv_cache_shape",
          [](const PyBackend& b, int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
             const std::string& cache_dtype_str) {
            return to_tuple(
                b.backend->kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str));
          },
          "num_blocks"_a, "block_size"_a, "num_kv_heads"_a, "head_size"_a,
          "cache_dtype_str"_a = "auto",
          "Logical shape of a KV cache, e.g. (2, num_blocks, block_size, num_kv_heads, head_size).")
      .def(
          "get_kv_cache_stride_order",
          [](const PyBackend& b) {
            nb::list items;
            for (int d : b.backend->kv_cache_stride_order()) items.append(d);
            return nb::tuple(items);
          },
          "Physical order of the logical cache dims: allocate shape[order] contiguous, then "
          "permute back (identity for NHD, (0, 1, 3, 2, 4) for HND).")
      .def(
          "get_supported_kernel_block_sizes",
          [](const PyBackend& b) { return block_sizes_list(b.backend->supported_kernel_block_sizes()); },
          "Kernel block sizes: ints and MultipleOf(base) entries.")
      .def(
          "supports_block_size",
          [](const PyBackend& b, int block_size) {
            return block_size_supported(b.backend->supported_kernel_block_sizes(), block_size);
          },
          "block_size"_a)
      .def_prop_ro("accept_output_buffer",
                   [](const PyBackend& b) { return b.backend->accept_output_buffer(); })
      .def(
          "validate_configuration",
          [](const PyBackend& b, int head_size, nb::handle dtype, const std::string& kv_cache_dtype,
             int block_size, bool use_mla, bool has_sink, bool use_sparse,
             const std::string& attn_type, nb::handle device, int head_size_v, bool use_alibi,
             bool use_sliding_window, bool use_logits_soft_cap, bool fp8_output,
             std::optional<MLADimensions> mla_dimensions, int num_heads) {
            SelectorConfig c = selector_config(head_size, dtype, kv_cache_dtype, block_size, use_mla,
                                               has_sink, use_sparse, attn_type, device);
            c.head_size_v = head_size_v;
            c.use_alibi = use_alibi;
            c.use_sliding_window = use_sliding_window;
            c.use_logits_soft_cap = use_logits_soft_cap;
            c.fp8_output = fp8_output;
            if (mla_dimensions) c.mla_dimensions = *mla_dimensions;
            c.num_heads = num_heads;
            return b.backend->validate_configuration(c);
          },
          "head_size"_a, "dtype"_a, "kv_cache_dtype"_a = "auto", "block_size"_a = 16,
          "use_mla"_a = false, "has_sink"_a = false, "use_sparse"_a = false,
          "attn_type"_a = "decoder", "device"_a = "cpu", "head_size_v"_a = 0,
          "use_alibi"_a = false, "use_sliding_window"_a = false,
          "use_logits_soft_cap"_a = false, "fp8_output"_a = false,
          "mla_dimensions"_a.none() = nb::none(), "num_heads"_a = 0,
          "Reasons this backend cannot run the configuration (full sentences); empty = usable. "
          "MLA layers: use_mla=True, head_size = kv_lora_rank + qk_rope_head_dim, and "
          "mla_dimensions (an MLADimensions) / num_heads when known.")
      .def(
          "capabilities",
          [](const PyBackend& b) {
            BackendCapabilities c = b.backend->capabilities();
            nb::dict d;
            nb::list devices, dtypes, attn_types;
            for (Device x : c.devices) devices.append(std::string(device_name(x)));
            for (DType x : c.dtypes) dtypes.append(std::string(framework_dtype_name(x)));
            for (AttentionType x : c.attn_types) attn_types.append(std::string(attention_type_name(x)));
            d["devices"] = devices;
            d["dtypes"] = dtypes;
            d["kv_cache_dtypes"] = nb::cast(c.kv_cache_dtypes);
            d["head_sizes"] = nb::cast(c.head_sizes);
            d["attn_types"] = attn_types;
            d["features"] = nb::cast(c.features);
            return d;
          },
          "A summary of what the backend supports (validate_configuration is the authority).")
      .def("__eq__", [](const PyBackend& a, const PyBackend& b) { return a.backend == b.backend; })
      .def("__eq__", [](const PyBackend&, nb::handle) { return false; })
      .def("__hash__", [](const PyBackend& b) { return std::hash<const void*>()(b.backend); })
      .def("__repr__", [](const PyBackend& b) {
        return "<pagedattn.AttentionBackend " + std::string(b.backend->name()) + ">";
      });

  m.def(
      "get_attn_backend",
      [](int head_size, nb::handle dtype, std::optional<std::string> kv_cache_dtype, int block_size,
         bool use_mla, bool has_sink, bool use_sparse, const std::string& attn_type,
         nb::handle device) {
        SelectorConfig c = selector_config(head_size, dtype, kv_cache_dtype.value_or("auto"),
                                           block_size, use_mla, has_sink, use_sparse, attn_type,
                                           device);
        return PyBackend{&get_attn_backend(c)};
      },
      "head_size"_a, "dtype"_a, "kv_cache_dtype"_a.none(), "block_size"_a, "use_mla"_a = false,
      "has_sink"_a = false, "use_sparse"_a = false, "attn_type"_a = "decoder",
      "device"_a = "cpu",
      "Selects the highest-priority registered backend that can run this configuration "
      "(vLLM's get_attn_backend). Env PAGEDATTN_BACKEND=NAME forces one. Raises "
      "pagedattn.Error listing every backend with its reasons when none fits.\n\n"
      "dtype: activation dtype (\"bfloat16\", \"float16\", \"float32\", or a NumPy/torch dtype); "
      "kv_cache_dtype: \"auto\" (None = \"auto\"), \"fp8\", \"fp8_e4m3\", \"fp8_e5m2\", ...; "
      "attn_type: \"decoder\", \"encoder\", \"encoder_only\", \"encoder_decoder\"; device: "
      "\"cpu\" or \"cuda\".");
  m.def(
      "list_backends",
      []() {
        std::vector<PyBackend> out;
        for (const AttentionBackend* b : registered_backends()) out.push_back(PyBackend{b});
        return out;
      },
      "Every registered backend, highest priority first (the REFERENCE oracle last).");
  m.def(
      "find_backend",
      [](const std::string& name) -> std::optional<PyBackend> {
        const AttentionBackend* b = find_backend(name);
        if (b == nullptr) return std::nullopt;
        return PyBackend{b};
      },
      "name"_a, "The backend called `name` (case-insensitive), or None.");

  nb::class_<PyAttentionMetadata>(m, "AttentionMetadata",
                                  "A backend's plan for one step (immutable; shared by every "
                                  "layer of the KV-cache group). Made by "
                                  "AttentionMetadataBuilder.build().")
      .def_prop_ro("num_actual_tokens", [](const PyAttentionMetadata& p) { return p.metadata->num_actual_tokens; })
      .def_prop_ro("num_reqs", [](const PyAttentionMetadata& p) { return p.metadata->num_reqs; })
      .def_prop_ro("use_cascade", [](const PyAttentionMetadata& p) { return p.metadata->use_cascade; })
      .def_prop_ro("common_prefix_len", [](const PyAttentionMetadata& p) { return p.metadata->common_prefix_len; })
      .def_prop_ro("batch_invariant", [](const PyAttentionMetadata& p) { return p.metadata->batch_invariant; })
      .def_prop_ro("device", [](const PyAttentionMetadata& p) { return std::string(device_name(p.device)); })
      .def("__repr__", [](const PyAttentionMetadata& p) {
        return "<pagedattn.AttentionMetadata num_reqs=" + std::to_string(p.metadata->num_reqs) +
               " num_actual_tokens=" + std::to_string(p.metadata->num_actual_tokens) +
               " use_cascade=" + (p.metadata->use_cascade ? "True" : "False") + ">";
      });

  nb::class_<PyBuilder>(m, "AttentionMetadataBuilder",
                        "Turns a step's CommonAttentionMetadata into a backend's plan (vLLM's "
                        "AttentionMetadataBuilder). One per KV-cache group; made by "
                        "Attention.metadata_builder().")
      .def(
          "build",
          [](PyBuilder& b, PyCommonAttentionMetadata& common, int common_prefix_len, bool fast_build) {
            const CommonAttentionMetadata& c = common.on(b.device);
            std::shared_ptr<const AttentionMetadata> md;
            {
              nb::gil_scoped_release release;
              md = b.builder->build(common_prefix_len, c, fast_build);
            }
            return wrap_metadata(std::move(md), b.device);
          },
          "common"_a, "common_prefix_len"_a = 0, "fast_build"_a = false, nb::keep_alive<0, 1>(),
          nb::keep_alive<0, 2>(),
          "Plans one step: splits decodes/prefills, partitions the KV, decides cascade. "
          "common_prefix_len: tokens every request shares (0 = none); fast_build: favour build "
          "speed over run speed (vLLM's flag): no cascade decision and no split-KV search, the "
          "same attention results.")
      .def(
          "build_for_drafting",
          [](PyBuilder& b, PyCommonAttentionMetadata& common, int draft_index) {
            const CommonAttentionMetadata& c = common.on(b.device);
            std::shared_ptr<const AttentionMetadata> md;
            {
              nb::gil_scoped_release release;
              md = b.builder->build_for_drafting(c, draft_index);
            }
            return wrap_metadata(std::move(md), b.device);
          },
          "common"_a, "draft_index"_a, nb::keep_alive<0, 1>(), nb::keep_alive<0, 2>(),
          "The plan of one draft step of a speculative (drafting) model (vLLM's "
          "build_for_drafting): build(common, common_prefix_len=0, fast_build=True), cheap "
          "enough to run at every draft step. draft_index (>= 0): the draft step of a chain, or "
          "the level of a token tree.")
      .def(
          "build_for_cudagraph_capture",
          [](PyBuilder& b, PyCommonAttentionMetadata& common) {
            const CommonAttentionMetadata& c = common.on(b.device);
            std::shared_ptr<const AttentionMetadata> md;
            {
              nb::gil_scoped_release release;
              md = b.builder->build_for_cudagraph_capture(c);
            }
            return wrap_metadata(std::move(md), b.device);
          },
          "common"_a, nb::keep_alive<0, 1>(), nb::keep_alive<0, 2>())
      .def(
          "can_run_in_cudagraph",
          [](PyBuilder& b, PyCommonAttentionMetadata& common) {
            return b.builder->can_run_in_cudagraph(common.on(b.device));
          },
          "common"_a)
      .def_prop_ro("cudagraph_support", [](const PyBuilder& b) {
        return std::string(cudagraph_support_name(b.builder->cudagraph_support()));
      })
      .def_prop_ro("reorder_batch_threshold",
                   [](const PyBuilder& b) { return b.builder->reorder_batch_threshold(); })
      .def(
          "reorder_batch",
          [](const PyBuilder& b, const std::vector<int32_t>& num_scheduled_tokens) {
            return reorder_result(b.builder->reorder_batch(num_scheduled_tokens));
          },
          "num_scheduled_tokens"_a,
          "(order, modified) to apply before building (order[i] = original index now at i), or "
          "None when this builder needs no reorder.")
      .def_prop_ro("supports_cascade", [](const PyBuilder& b) { return b.builder->supports_cascade(); })
      .def(
          "use_cascade_attention",
          [](const PyBuilder& b, int common_prefix_len, const std::vector<int32_t>& query_lens,
             int num_query_heads, int num_kv_heads, bool use_alibi, bool use_sliding_window,
             bool use_local_attention, int num_sms) {
            return b.builder->use_cascade_attention(common_prefix_len, query_lens, num_query_heads,
                                                    num_kv_heads, use_alibi, use_sliding_window,
                                                    use_local_attention, num_sms);
          },
          "common_prefix_len"_a, "query_lens"_a, "num_query_heads"_a, "num_kv_heads"_a,
          "use_alibi"_a, "use_sliding_window"_a, "use_local_attention"_a, "num_sms"_a)
      .def_prop_ro("workspace_bytes", [](const PyBuilder& b) { return b.builder->workspace_bytes(); })
      .def_prop_ro("kv_cache_spec", [](const PyBuilder& b) { return b.builder->kv_cache_spec(); })
      .def_prop_ro("device", [](const PyBuilder& b) { return std::string(device_name(b.device)); });
}

// Made here so that PyBuilder stays private to this file.
nb::object make_builder_object(const AttentionBackend& backend, const KVCacheSpec& spec,
                               const BuilderConfig& config, Device device) {
  PyBuilder b;
  b.device = device;
  b.builder = backend.make_builder(spec, config, device);
  return nb::cast(std::move(b));
}

}  // namespace pagedattn::python
