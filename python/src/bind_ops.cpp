// Bindings: the standalone ops (vLLM _custom_ops): reshape_and_cache_flash, reshape_and_cache,
// merge_attn_states. The Python wrappers (pagedattn/_ops.py) normalize scale arguments.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::python {

using namespace nb::literals;

void bind_ops(nb::module_& m) {
  m.def(
      "_reshape_and_cache_flash",
      [](nb::handle key, nb::handle value, nb::handle key_cache, nb::handle value_cache,
         nb::handle slot_mapping, const std::string& kv_cache_dtype, float k_scale, float v_scale,
         nb::handle k_scale_per_head, nb::handle v_scale_per_head) {
        TensorArgs args;
        TensorView k = args.get(key, "key");
        TensorView v = args.get(value, "value");
        TensorView kc = args.get(key_cache, "key_cache", true);
        TensorView vc = args.get(value_cache, "value_cache", true);
        TensorView slots = args.get(slot_mapping, "slot_mapping");
        LayerScales scales;
        scales.k_scale = k_scale;
        scales.v_scale = v_scale;
        scales.k_scale_per_head = args.get(k_scale_per_head, "k_scale", false, true);
        scales.v_scale_per_head = args.get(v_scale_per_head, "v_scale", false, true);
        nb::gil_scoped_release release;
        reshape_and_cache_flash(k, v, kc, vc, slots, kv_cache_dtype, scales);
      },
      "key"_a, "value"_a, "key_cache"_a, "value_cache"_a, "slot_mapping"_a, "kv_cache_dtype"_a,
      "k_scale"_a, "v_scale"_a, "k_scale_per_head"_a.none(), "v_scale_per_head"_a.none());

  m.def(
      "_reshape_and_cache",
      [](nb::handle key, nb::handle value, nb::handle kv_cache, nb::handle slot_mapping,
         const std::string& kv_cache_dtype, float k_scale, float v_scale) {
        TensorArgs args;
        TensorView k = args.get(key, "key");
        TensorView v = args.get(value, "value");
        TensorView cache = args.get(kv_cache, "kv_cache", true);
        TensorView slots = args.get(slot_mapping, "slot_mapping");
        nb::gil_scoped_release release;
        reshape_and_cache(k, v, cache, slots, kv_cache_dtype, k_scale, v_scale);
      },
      "key"_a, "value"_a, "kv_cache"_a, "slot_mapping"_a, "kv_cache_dtype"_a, "k_scale"_a,
      "v_scale"_a);

  m.def(
      "_merge_attn_states",
      [](nb::handle output, nb::handle prefix_output, nb::handle prefix_lse,
         nb::handle suffix_output, nb::handle suffix_lse, nb::handle output_lse,
         int64_t prefill_tokens_with_context) {
        TensorArgs args;
        TensorView out = args.get(output, "output", true);
        TensorView po = args.get(prefix_output, "prefix_output");
        TensorView pl = args.get(prefix_lse, "prefix_lse");
        TensorView so = args.get(suffix_output, "suffix_output");
        TensorView sl = args.get(suffix_lse, "suffix_lse");
        TensorView ol = args.get(output_lse, "output_lse", true, true);
        nb::gil_scoped_release release;
        merge_attn_states(out, po, pl, so, sl, ol, prefill_tokens_with_context);
      },
      "output"_a, "prefix_output"_a, "prefix_lse"_a, "suffix_output"_a, "suffix_lse"_a,
      "output_lse"_a.none(), "prefill_tokens_with_context"_a);
}

}  // namespace pagedattn::python
