// Bindings: CommonAttentionMetadata and the batch utilities of vLLM's backends/utils.py.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::python {

using namespace nb::literals;

namespace {

using HostI32 = nb::ndarray<const int32_t, nb::device::cpu, nb::c_contig>;
using HostI64 = nb::ndarray<const int64_t, nb::device::cpu, nb::c_contig>;

std::vector<int32_t> to_vector(const HostI32& a) { return {a.data(), a.data() + a.size()}; }

// Errors from the library name the C++ fields (seq_lens_cpu, block_table_tensor, ...); the
// Python caller passed query_start_loc, seq_lens, block_table, num_computed_tokens.
template <typename F>
auto with_python_argument_names(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    static const std::pair<const char*, const char*> renames[] = {
        {"query_start_loc_cpu", "query_start_loc"},
        {"seq_lens_cpu", "seq_lens"},
        {"num_computed_tokens_cpu", "num_computed_tokens"},
        {"block_table_tensor", "block_table"},
    };
    for (const auto& [field, argument] : renames) {
      if (e.argument() == field) throw Error(argument, e.what());
    }
    throw;
  }
}

}  // namespace

PyCommonAttentionMetadata::PyCommonAttentionMetadata(CommonAttentionMetadataArgs args,
                                                     std::vector<int32_t> num_computed_tokens,
                                                     int max_query_len, int max_seq_len,
                                                     int num_actual_tokens)
    : args_(std::move(args)),
      num_computed_tokens_(std::move(num_computed_tokens)),
      max_query_len_(max_query_len),
      max_seq_len_(max_seq_len),
      num_actual_tokens_(num_actual_tokens) {
  by_device_[Device::cpu] = make(Device::cpu);
}

std::unique_ptr<OwnedCommonAttentionMetadata> PyCommonAttentionMetadata::make(Device device) const {
  return with_python_argument_names([&] { return make_checked(device); });
}

std::unique_ptr<OwnedCommonAttentionMetadata> PyCommonAttentionMetadata::make_checked(
    Device device) const {
  auto owned = std::make_unique<OwnedCommonAttentionMetadata>(
      make_common_attention_metadata(args_, device));
  // Fields the caller gave explicitly replace the derived ones, then everything is checked
  // together, so an inconsistent value is reported by validate() naming the field.
  CommonAttentionMetadata& c = owned->common;
  bool overridden = false;
  if (!num_computed_tokens_.empty()) {
    const int64_t n = owned->num_computed_tokens_cpu.numel();
    PAGEDATTN_CHECK(static_cast<int64_t>(num_computed_tokens_.size()) == n, "num_computed_tokens",
                    "num_computed_tokens has ", num_computed_tokens_.size(),
                    " entries: expected one per request (", n, ")");
    std::memcpy(owned->num_computed_tokens_cpu.data(), num_computed_tokens_.data(),
                num_computed_tokens_.size() * sizeof(int32_t));
    overridden = true;
  }
  if (max_query_len_ >= 0) { c.max_query_len = max_query_len_; overridden = true; }
  if (max_seq_len_ >= 0) { c.max_seq_len = max_seq_len_; overridden = true; }
  if (num_actual_tokens_ >= 0) { c.num_actual_tokens = num_actual_tokens_; overridden = true; }
  if (overridden) c.validate();
  return owned;
}

const CommonAttentionMetadata& PyCommonAttentionMetadata::on(Device device) {
  auto it = by_device_.find(device);
  if (it == by_device_.end()) it = by_device_.emplace(device, make(device)).first;
  return it->second->common;
}

void bind_metadata(nb::module_& m) {
  using Common = PyCommonAttentionMetadata;
  auto host_view = [](const Common& c, const TensorView& v) {
    return host_array(v, nb::find(&c), /*read_only=*/true);
  };

  nb::class_<Common>(m, "CommonAttentionMetadata",
                     "Per-step batch metadata shared by every layer and backend (vLLM's "
                     "CommonAttentionMetadata). Use pagedattn.CommonAttentionMetadata(...).")
      .def(
          "__init__",
          [](Common* self, const HostI32& query_start_loc, const HostI32& seq_lens,
             const HostI32& block_table, const HostI64& slot_mapping,
             std::optional<HostI32> num_computed_tokens, int max_query_len, int max_seq_len,
             int num_actual_tokens, bool causal) {
            PAGEDATTN_CHECK(query_start_loc.ndim() == 1, "query_start_loc", "query_start_loc has ",
                            query_start_loc.ndim(), " dimensions: expected 1 (num_reqs + 1,)");
            PAGEDATTN_CHECK(seq_lens.ndim() == 1, "seq_lens", "seq_lens has ", seq_lens.ndim(),
                            " dimensions: expected 1 (num_reqs,)");
            PAGEDATTN_CHECK(block_table.ndim() == 2, "block_table", "block_table has ",
                            block_table.ndim(),
                            " dimensions: expected 2 (num_reqs, max_num_blocks_per_req)");
            PAGEDATTN_CHECK(slot_mapping.ndim() == 1, "slot_mapping", "slot_mapping has ",
                            slot_mapping.ndim(), " dimensions: expected 1 (num_tokens,)");
            CommonAttentionMetadataArgs args;
            args.query_start_loc = to_vector(query_start_loc);
            args.seq_lens = to_vector(seq_lens);
            args.block_table = to_vector(block_table);
            args.max_num_blocks_per_req = static_cast<int>(block_table.shape(1));
            args.slot_mapping.assign(slot_mapping.data(), slot_mapping.data() + slot_mapping.size());
            args.causal = causal;
            std::vector<int32_t> computed;
            if (num_computed_tokens) {
              PAGEDATTN_CHECK(num_computed_tokens->ndim() == 1, "num_computed_tokens",
                              "num_computed_tokens has ", num_computed_tokens->ndim(),
                              " dimensions: expected 1 (num_reqs,)");
              computed = to_vector(*num_computed_tokens);
            }
            new (self) Common(std::move(args), std::move(computed), max_query_len, max_seq_len,
                              num_actual_tokens);
          },
          "query_start_loc"_a, "seq_lens"_a, "block_table"_a, "slot_mapping"_a,
          "num_computed_tokens"_a.none(), "max_query_len"_a, "max_seq_len"_a,
          "num_actual_tokens"_a, "causal"_a)
      .def_prop_ro("query_start_loc", [=](const Common& c) { return host_view(c, c.host().common.query_start_loc); })
      .def_prop_ro("seq_lens", [=](const Common& c) { return host_view(c, c.host().common.seq_lens); })
      .def_prop_ro("block_table_tensor", [=](const Common& c) { return host_view(c, c.host().common.block_table_tensor); })
      .def_prop_ro("slot_mapping", [=](const Common& c) { return host_view(c, c.host().common.slot_mapping); })
      .def_prop_ro("query_start_loc_cpu", [=](const Common& c) { return host_view(c, c.host().common.query_start_loc_cpu); })
      .def_prop_ro("seq_lens_cpu", [=](const Common& c) { return host_view(c, c.host().common.seq_lens_cpu); })
      .def_prop_ro("num_computed_tokens_cpu", [=](const Common& c) { return host_view(c, c.host().common.num_computed_tokens_cpu); })
      .def_prop_ro("num_reqs", [](const Common& c) { return c.host().common.num_reqs; })
      .def_prop_ro("num_actual_tokens", [](const Common& c) { return c.host().common.num_actual_tokens; })
      .def_prop_ro("max_query_len", [](const Common& c) { return c.host().common.max_query_len; })
      .def_prop_ro("max_seq_len", [](const Common& c) { return c.host().common.max_seq_len; })
      .def_prop_ro("causal", [](const Common& c) { return c.host().common.causal; })
      .def(
          "validate",
          [](const Common& c, int64_t num_blocks, int block_size) {
            with_python_argument_names([&] { c.host().common.validate(num_blocks, block_size); });
          },
          "num_blocks"_a = -1, "block_size"_a = 0,
          "Raises pagedattn.Error (a ValueError) naming the field and the request on any "
          "inconsistency. With num_blocks and block_size, also checks that every block id a "
          "request uses is in [0, num_blocks) and every slot in [0, num_blocks * block_size) "
          "or -1.")
      .def("__repr__", [](const Common& c) {
        const CommonAttentionMetadata& h = c.host().common;
        return "<pagedattn.CommonAttentionMetadata num_reqs=" + std::to_string(h.num_reqs) +
               " num_actual_tokens=" + std::to_string(h.num_actual_tokens) +
               " max_query_len=" + std::to_string(h.max_query_len) +
               " max_seq_len=" + std::to_string(h.max_seq_len) + ">";
      });

  m.def(
      "split_decodes_and_prefills",
      [](Common& common, int decode_threshold, bool require_uniform) {
        DecodePrefillSplit s =
            split_decodes_and_prefills(common.host().common, decode_threshold, require_uniform);
        return std::make_tuple(s.num_decodes, s.num_prefills, s.num_decode_tokens, s.num_prefill_tokens);
      },
      "common_attn_metadata"_a, "decode_threshold"_a = 1, "require_uniform"_a = false,
      "Assuming a reordered batch (decodes first), returns (num_decodes, num_prefills, "
      "num_decode_tokens, num_prefill_tokens). A request is a decode when its query length is "
      "<= decode_threshold; require_uniform: only a batch whose query lengths all equal the "
      "first one's (0 = padding) counts as decodes.");

  m.def(
      "common_prefix_len",
      [](Common& common, int block_size) { return common_prefix_len(common.host().common, block_size); },
      "common_attn_metadata"_a, "block_size"_a,
      "Tokens of the prefix whose blocks every request shares (leading equal block-table "
      "columns, capped by the smallest num_computed_tokens, a multiple of block_size).");

  m.def(
      "reorder_batch_to_split_decodes_and_prefills",
      [](const std::vector<int32_t>& num_scheduled_tokens, int decode_threshold) {
        BatchReorder r = reorder_batch_to_split_decodes_and_prefills(num_scheduled_tokens, decode_threshold);
        nb::list order;
        for (int i : r.order) order.append(i);
        return std::make_pair(order, r.modified);
      },
      "num_scheduled_tokens"_a, "decode_threshold"_a = 1,
      "Moves requests with <= decode_threshold scheduled tokens to the front with vLLM's "
      "swaps. Returns (order, modified): order[i] is the original index of the request now at "
      "position i; modified is False when no swap was needed.");

  m.def(
      "_make_local_attention_virtual_batches",
      [](int attn_chunk_size, const std::vector<int32_t>& query_start_loc,
         const std::vector<int32_t>& seq_lens, const HostI32& block_table, int block_size) {
        PAGEDATTN_CHECK(block_table.ndim() == 2, "block_table", "block_table has ",
                        block_table.ndim(), " dimensions: expected 2 (num_reqs, max_num_blocks_per_req)");
        std::span<const int32_t> table(block_table.data(), block_table.size());
        LocalAttentionVirtualBatches v = make_local_attention_virtual_batches(
            attn_chunk_size, query_start_loc, seq_lens, table, static_cast<int>(block_table.shape(1)),
            block_size);
        const size_t n = static_cast<size_t>(v.num_virtual_batches);
        return nb::make_tuple(
            numpy_from_vector(std::move(v.seqlens_q_local), {n}),
            numpy_from_vector(std::move(v.cu_seqlens_q_local), {n + 1}),
            numpy_from_vector(std::move(v.seqlens_k_local), {n}),
            numpy_from_vector(std::move(v.block_table_local),
                              {n, static_cast<size_t>(v.pages_per_local_batch)}));
      },
      "attn_chunk_size"_a, "query_start_loc"_a, "seq_lens"_a, "block_table"_a, "block_size"_a);

  nb::class_<PerLayerParameters>(m, "PerLayerParameters",
                                 "The plan-time hyperparameters of one layer (vLLM's "
                                 "PerLayerParameters): window_left (sliding_window - 1, or -1), "
                                 "logits_soft_cap (None = off) and sm_scale.")
      .def(
          "__init__",
          [](PerLayerParameters* self, int window_left, std::optional<float> logits_soft_cap,
             float sm_scale) {
            new (self) PerLayerParameters{window_left, logits_soft_cap, sm_scale};
          },
          "window_left"_a = -1, "logits_soft_cap"_a.none() = nb::none(), "sm_scale"_a = 1.f)
      .def_rw("window_left", &PerLayerParameters::window_left)
      .def_rw("logits_soft_cap", &PerLayerParameters::logits_soft_cap)
      .def_rw("sm_scale", &PerLayerParameters::sm_scale)
      .def("__eq__", [](const PerLayerParameters& a, const PerLayerParameters& b) { return a == b; })
      .def("__eq__", [](const PerLayerParameters&, nb::handle) { return false; })
      .def("__repr__", [](const PerLayerParameters& p) {
        return detail::concat("PerLayerParameters(window_left=", p.window_left, ", logits_soft_cap=",
                              p.logits_soft_cap ? detail::concat(*p.logits_soft_cap) : std::string("None"),
                              ", sm_scale=", p.sm_scale, ")");
      });
  m.def("infer_global_hyperparameters", &infer_global_hyperparameters, "per_layer"_a,
        "The hyperparameters every layer shares (vLLM's infer_global_hyperparameters): per_layer "
        "is a dict name -> PerLayerParameters (get_per_layer_parameters). Raises pagedattn.Error "
        "naming the first layer that differs from the first one, or when it is empty.");

  m.def("use_cascade_attention",
        [](int common_prefix_len, const std::vector<int32_t>& query_lens, int num_query_heads,
           int num_kv_heads, bool use_alibi, bool use_sliding_window, bool use_local_attention,
           int num_sms, int dcp_world_size) {
          return use_cascade_attention(common_prefix_len, query_lens, num_query_heads, num_kv_heads,
                                       use_alibi, use_sliding_window, use_local_attention, num_sms,
                                       dcp_world_size);
        },
        "common_prefix_len"_a, "query_lens"_a, "num_query_heads"_a, "num_kv_heads"_a,
        "use_alibi"_a, "use_sliding_window"_a, "use_local_attention"_a, "num_sms"_a,
        "dcp_world_size"_a = 1,
        "FlashAttention's cascade heuristic: True only when the shared prefix is >= 256 tokens, "
        "there are >= 8 requests, no ALiBi / sliding window / local attention, dcp_world_size "
        "== 1, and the CTA cost model favours cascade over flash-decoding on num_sms SMs.");
}

}  // namespace pagedattn::python
