// Bindings: dtypes, MultipleOf, is_quantized_kv_cache, KV-cache layout and spec, devices.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::python {

using namespace nb::literals;

void bind_core(nb::module_& m) {
  m.def("is_quantized_kv_cache", &is_quantized_kv_cache, "kv_cache_dtype"_a,
        "True when `kv_cache_dtype` is not \"auto\" (exactly vLLM's definition).");

  m.def(
      "validate_kv_cache_dtype",
      [](const std::string& kv_cache_dtype) { validate_kv_cache_dtype(kv_cache_dtype); },
      "kv_cache_dtype"_a,
      "Raises pagedattn.Error unless `kv_cache_dtype` is one of \"auto\", \"fp8\", \"fp8_e4m3\", "
      "\"fp8_e5m2\", \"bfloat16\", \"float16\", \"float32\".");

  m.def(
      "kv_cache_storage_dtype",
      [](const std::string& kv_cache_dtype, nb::handle model_dtype) {
        return std::string(framework_dtype_name(
            kv_cache_storage_dtype(kv_cache_dtype, dtype_arg(model_dtype, "model_dtype"))));
      },
      "kv_cache_dtype"_a, "model_dtype"_a,
      "Storage dtype of a cache as a NumPy/PyTorch dtype name: \"auto\" -> the model dtype, "
      "\"fp8\" -> \"float8_e4m3fn\", ...");

  m.def(
      "canonical_dtype",
      [](nb::handle dtype) { return std::string(framework_dtype_name(dtype_arg(dtype, "dtype"))); },
      "dtype"_a,
      "The NumPy/PyTorch spelling (\"float32\", \"float16\", \"bfloat16\", \"float8_e4m3fn\", "
      "...) of a dtype given as a string, a NumPy/ml_dtypes dtype or a torch.dtype.");

  nb::class_<MultipleOf>(m, "MultipleOf",
                         "A kernel block size constraint: any positive multiple of `base` "
                         "(vLLM's MultipleOf).")
      .def(nb::init<>())
      .def("__init__", [](MultipleOf* self, int base) { new (self) MultipleOf{base}; }, "base"_a)
      .def_rw("base", &MultipleOf::base)
      .def("__eq__", [](const MultipleOf& a, const MultipleOf& b) { return a == b; })
      .def("__eq__", [](const MultipleOf&, nb::handle) { return false; })
      .def("__hash__", [](const MultipleOf& a) { return std::hash<int>()(a.base); })
      .def("__repr__", [](const MultipleOf& a) { return "MultipleOf(" + std::to_string(a.base) + ")"; });

  m.def(
      "get_kv_cache_layout", []() { return std::string(kv_cache_layout_name(get_kv_cache_layout())); },
      "The KV-cache layout in force: \"NHD\" or \"HND\" (set_kv_cache_layout override, else env "
      "PAGEDATTN_KV_CACHE_LAYOUT, else \"NHD\").");
  m.def(
      "set_kv_cache_layout",
      [](std::optional<std::string> layout) {
        if (layout) {
          set_kv_cache_layout(parse_kv_cache_layout(*layout));
        } else {
          set_kv_cache_layout(std::nullopt);
        }
      },
      "layout"_a.none(),
      "Overrides the KV-cache layout (\"NHD\" or \"HND\"); None clears the override. Affects "
      "caches and backends created afterwards.");

  m.def("cuda_device_count", &cuda_device_count,
        "Number of CUDA devices visible (0 when built without CUDA or without a device).");
  m.def("built_with_cuda", &built_with_cuda, "True when the CUDA backend was compiled in.");
  m.def(
      "synchronize_cuda", []() {
        nb::gil_scoped_release release;
        synchronize_cuda();
      },
      "Blocks until pagedattn's current CUDA stream is idle (no-op without CUDA).");
  m.def(
      "set_current_cuda_stream",
      [](uintptr_t stream) { set_current_cuda_stream(reinterpret_cast<void*>(stream)); }, "stream"_a,
      "Sets the CUDA stream (a cudaStream_t as an integer, e.g. torch.cuda.current_stream()."
      "cuda_stream; 0 = the legacy default stream) pagedattn launches on from this thread.");
  m.def(
      "current_cuda_stream", []() { return reinterpret_cast<uintptr_t>(current_cuda_stream()); },
      "The CUDA stream pagedattn launches on from this thread, as an integer.");

  nb::class_<KVCacheSpec>(m, "KVCacheSpec",
                          "How much cache a layer needs (vLLM's KVCacheSpec): kind, block_size, "
                          "num_kv_heads, head_size, head_size_v, dtype and the kind's parameter.")
      .def_prop_ro("kind", [](const KVCacheSpec& s) { return std::string(kv_cache_spec_kind_name(s.kind)); })
      .def_ro("block_size", &KVCacheSpec::block_size)
      .def_ro("num_kv_heads", &KVCacheSpec::num_kv_heads)
      .def_ro("head_size", &KVCacheSpec::head_size)
      .def_prop_ro("head_size_v", &KVCacheSpec::value_head_size)
      .def_prop_ro("dtype", [](const KVCacheSpec& s) { return std::string(framework_dtype_name(s.dtype)); })
      .def_ro("sliding_window", &KVCacheSpec::sliding_window)
      .def_ro("attention_chunk_size", &KVCacheSpec::attention_chunk_size)
      .def_prop_ro("page_size_bytes", &KVCacheSpec::page_size_bytes,
                   "Bytes of one block of this layer's cache.")
      .def("max_num_blocks_per_request", &KVCacheSpec::max_num_blocks_per_request,
           "max_model_len"_a, "max_num_batched_tokens"_a, "max_encoder_len"_a = 0,
           "Most blocks one request can hold at once.")
      .def("max_memory_usage_bytes", &KVCacheSpec::max_memory_usage_bytes, "max_model_len"_a,
           "max_num_batched_tokens"_a, "max_encoder_len"_a = 0)
      .def("__eq__", [](const KVCacheSpec& a, const KVCacheSpec& b) { return a == b; })
      .def("__eq__", [](const KVCacheSpec&, nb::handle) { return false; })
      .def("__repr__", [](const KVCacheSpec& s) { return "KVCacheSpec(" + s.describe() + ")"; });
}

}  // namespace pagedattn::python
