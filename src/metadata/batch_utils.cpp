// Batch utilities of vLLM's vllm/v1/attention/backends/utils.py (and the FlashAttention backend's
// cascade heuristic), reimplemented on host integers with the same results:
//   split_decodes_and_prefills, reorder_batch_to_split_decodes_and_prefills,
//   use_cascade_attention, common_prefix_len, infer_global_hyperparameters.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "metadata/host_read.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {

using metadata_detail::cdiv;
using metadata_detail::read_i32;

// ---- split_decodes_and_prefills ---------------------------------------------------------------
// Current vLLM (utils.py, 2025-26) has a fourth parameter, treat_short_extends_as_decodes
// (default true), which our signature fixes to its default; everything else follows it line by
// line. One difference: vLLM indexes query_lens[0] of an empty batch (and fails) when
// require_uniform && decode_threshold > 1; an empty batch here is (0, 0, 0, 0).
DecodePrefillSplit split_decodes_and_prefills(const CommonAttentionMetadata& common,
                                              int decode_threshold, bool require_uniform) {
  constexpr const char* kFn = "split_decodes_and_prefills: ";
  const int num_reqs = common.num_reqs;
  const int num_tokens = common.num_actual_tokens;
  const TensorView& qsl = common.query_start_loc_cpu;  // (num_reqs + 1,) i32 host
  PAGEDATTN_CHECK(num_reqs >= 0, "num_reqs", kFn, "num_reqs = ", num_reqs, " must be >= 0");
  PAGEDATTN_CHECK(qsl.defined() && qsl.dtype() == DType::i32 && qsl.ndim() == 1 &&
                      qsl.device() == Device::cpu && qsl.size(0) >= int64_t{num_reqs} + 1 &&
                      (qsl.size(0) == 0 || qsl.data() != nullptr),
                  "query_start_loc_cpu", kFn, "query_start_loc_cpu (", qsl.describe(),
                  "): expected an int32 cpu tensor with num_reqs + 1 = ", int64_t{num_reqs} + 1,
                  " entries");

  if (num_reqs == 0) return {0, 0, 0, 0};
  if (common.max_query_len <= decode_threshold && (!require_uniform || decode_threshold <= 1)) {
    return {num_reqs, 0, num_tokens, 0};
  }
  // The contents are not validated here (only the shape above): lengths are computed in int64
  // and a decreasing query_start_loc is an Error, not an int overflow.
  auto query_len = [&](int r) {
    const int64_t q = int64_t{read_i32(qsl, r + 1)} - read_i32(qsl, r);
    PAGEDATTN_CHECK(q >= 0, "query_start_loc_cpu", kFn, "query_start_loc_cpu[", r + 1, "] = ",
                    read_i32(qsl, r + 1), " is smaller than query_start_loc_cpu[", r, "] = ",
                    read_i32(qsl, r), ": query_start_loc must be non-decreasing");
    return q;
  };
  const int64_t first_len = query_len(0);
  if (first_len > decode_threshold) {
    return {0, num_reqs, 0, num_tokens};  // the first request is not a decode: no decodes
  }
  if (require_uniform) {
    // A padded uniform batch (full CUDA graphs): zero-length padding requests count as decodes.
    bool uniform = true;
    for (int r = 0; r < num_reqs && uniform; ++r) {
      const int64_t q = query_len(r);
      uniform = q == first_len || q == 0;
    }
    if (uniform) return {num_reqs, 0, num_tokens, 0};
  }
  int first_prefill = -1;
  for (int r = 0; r < num_reqs; ++r) {
    const int64_t q = query_len(r);
    const bool is_prefill = require_uniform ? q != first_len : q > decode_threshold;
    if (is_prefill) {
      first_prefill = r;
      break;
    }
  }
  if (first_prefill < 0) return {num_reqs, 0, num_tokens, 0};
  const int num_decode_tokens = read_i32(qsl, first_prefill);
  PAGEDATTN_CHECK(num_decode_tokens >= 0 && num_decode_tokens <= num_tokens, "query_start_loc_cpu", kFn,
                  "query_start_loc_cpu[", first_prefill, "] = ", num_decode_tokens,
                  " is outside [0, num_actual_tokens = ", num_tokens, "]");
  return {first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens};
}

// ---- reorder_batch_to_split_decodes_and_prefills ----------------------------------------------
// The swap loop of the vLLM version documented in reference/vllm-v1-attention-backends-utils.txt:
// decodes (<= decode_threshold tokens) found past position num_decodes, taken from the back, are
// swapped with the prefills closest to the front. (Newer vLLM sorts into four regions -- decode,
// short extend, long extend, prefill -- using num_computed_tokens; this is the two-region form.)
BatchReorder reorder_batch_to_split_decodes_and_prefills(std::span<const int32_t> num_scheduled_tokens,
                                                         int decode_threshold) {
  const int num_reqs = static_cast<int>(num_scheduled_tokens.size());
  for (int i = 0; i < num_reqs; ++i) {
    PAGEDATTN_CHECK(num_scheduled_tokens[static_cast<size_t>(i)] >= 0, "num_scheduled_tokens",
                    "reorder_batch_to_split_decodes_and_prefills: num_scheduled_tokens[", i, "] = ",
                    num_scheduled_tokens[static_cast<size_t>(i)], " must be >= 0");
  }
  std::vector<int> decodes;
  std::vector<int> prefills;
  for (int i = 0; i < num_reqs; ++i) {
    (num_scheduled_tokens[static_cast<size_t>(i)] <= decode_threshold ? decodes : prefills).push_back(i);
  }
  BatchReorder result;
  result.order.resize(static_cast<size_t>(num_reqs));
  for (int i = 0; i < num_reqs; ++i) result.order[static_cast<size_t>(i)] = i;

  const int num_decodes = static_cast<int>(decodes.size());
  const int num_prefills = static_cast<int>(prefills.size());
  for (int i = 1; i <= std::min(num_decodes, num_prefills); ++i) {
    const int decode_idx = decodes[static_cast<size_t>(num_decodes - i)];
    if (decode_idx < num_decodes) break;
    std::swap(result.order[static_cast<size_t>(prefills[static_cast<size_t>(i - 1)])],
              result.order[static_cast<size_t>(decode_idx)]);
    result.modified = true;
  }
  return result;
}

// ---- use_cascade_attention --------------------------------------------------------------------
// vLLM's FlashAttention backend heuristic, same thresholds and the same rough CTA cost model
// (q/kv tile 128) comparing one cascade pass over the shared prefix with flash-decoding.
bool use_cascade_attention(int common_prefix_len, std::span<const int32_t> query_lens,
                           int num_query_heads, int num_kv_heads, bool use_alibi,
                           bool use_sliding_window, bool use_local_attention, int num_sms,
                           int dcp_world_size) {
  constexpr const char* kFn = "use_cascade_attention: ";
  PAGEDATTN_CHECK(common_prefix_len >= 0, "common_prefix_len", kFn, "common_prefix_len = ",
                  common_prefix_len, " must be >= 0");
  PAGEDATTN_CHECK(num_query_heads > 0, "num_query_heads", kFn, "num_query_heads = ",
                  num_query_heads, " must be > 0");
  PAGEDATTN_CHECK(num_kv_heads > 0, "num_kv_heads", kFn, "num_kv_heads = ", num_kv_heads,
                  " must be > 0");
  PAGEDATTN_CHECK(num_sms > 0, "num_sms", kFn, "num_sms = ", num_sms, " must be > 0");
  PAGEDATTN_CHECK(dcp_world_size >= 1, "dcp_world_size", kFn, "dcp_world_size = ", dcp_world_size,
                  " must be >= 1");

  if (common_prefix_len < 256) return false;  // too short a prefix to be worth it
  if (use_alibi || use_sliding_window || use_local_attention) return false;  // unsupported variants
  const int64_t num_reqs = static_cast<int64_t>(query_lens.size());
  if (num_reqs < 8) return false;  // too few queries
  if (dcp_world_size > 1) return false;  // disabled with decode context parallelism

  const int64_t num_queries_per_kv = num_query_heads / num_kv_heads;
  const bool all_single_token =
      std::all_of(query_lens.begin(), query_lens.end(), [](int32_t q) { return q == 1; });
  const bool use_flash_decoding =
      num_queries_per_kv > 1 && !use_sliding_window && !use_alibi && all_single_token;
  if (!use_flash_decoding) return true;  // cascade saves bandwidth; the normal path cannot split KV

  const int64_t num_tokens = num_reqs;
  constexpr int64_t kQTile = 128;
  constexpr int64_t kKvTile = 128;
  const int64_t num_prefix_tiles = cdiv(common_prefix_len, kKvTile);
  const int64_t cascade_ctas = int64_t{num_query_heads} * cdiv(num_tokens, kQTile);
  const int64_t cascade_waves = cdiv(cascade_ctas, num_sms);
  const int64_t cascade_time = cascade_waves * num_prefix_tiles;
  const int64_t flash_decoding_ctas =
      num_reqs * num_kv_heads * cdiv(num_queries_per_kv, kQTile) * num_prefix_tiles;
  const int64_t flash_decoding_time = cdiv(flash_decoding_ctas, num_sms);
  return cascade_time < flash_decoding_time;
}

// ---- common_prefix_len ------------------------------------------------------------------------
// vLLM's KV-cache manager counts the blocks referenced by every running request; here the same
// quantity comes from the block table: the leading columns (among those every request uses,
// cdiv(seq_len, block_size)) whose block id is equal in the first num_reqs rows. The model
// runner then caps it by the smallest num_computed_tokens (the prefix kernel is unmasked, so it
// must not contain any query's own token) and rounds down to a multiple of block_size.
// A one-request batch gets its own computed part (rounded down), as the same formula gives;
// vLLM then rejects cascade for it (fewer than 8 requests).
int common_prefix_len(const CommonAttentionMetadata& common, int block_size) {
  constexpr const char* kFn = "common_prefix_len: ";
  PAGEDATTN_CHECK(block_size > 0, "block_size", kFn, "block_size = ", block_size, " must be > 0");
  const int num_reqs = common.num_reqs;
  PAGEDATTN_CHECK(num_reqs >= 0, "num_reqs", kFn, "num_reqs = ", num_reqs, " must be >= 0");
  if (num_reqs == 0) return 0;
  for (const auto& [view, name] : {std::pair{&common.seq_lens_cpu, "seq_lens_cpu"},
                                   std::pair{&common.num_computed_tokens_cpu, "num_computed_tokens_cpu"}}) {
    PAGEDATTN_CHECK(view->defined() && view->dtype() == DType::i32 && view->ndim() == 1 &&
                        view->device() == Device::cpu && view->size(0) >= num_reqs &&
                        view->data() != nullptr,
                    name, kFn, name, " (", view->describe(),
                    "): expected an int32 cpu tensor with num_reqs = ", num_reqs, " entries");
  }
  const TensorView& table = common.block_table_tensor;  // (>= num_reqs, cols) i32
  PAGEDATTN_CHECK(table.defined() && table.dtype() == DType::i32 && table.ndim() == 2 &&
                      table.size(0) >= num_reqs && (table.numel() == 0 || table.data() != nullptr),
                  "block_table_tensor", kFn, "block_table_tensor (", table.describe(),
                  "): expected an int32 tensor with at least num_reqs = ", num_reqs, " rows");

  int64_t used_cols = table.size(1);
  int64_t min_computed = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < num_reqs; ++r) {
    const int32_t s = read_i32(common.seq_lens_cpu, r);
    PAGEDATTN_CHECK(s >= 0, "seq_lens_cpu", kFn, "seq_lens_cpu[", r, "] = ", s, " must be >= 0");
    used_cols = std::min(used_cols, cdiv(s, block_size));
    min_computed = std::min<int64_t>(min_computed, read_i32(common.num_computed_tokens_cpu, r));
  }
  if (used_cols <= 0 || min_computed <= 0) return 0;

  // The rows to compare: read in place on the host, or copy the first rows back from a device
  // (a synchronizing copy: this is plan-time host work, like vLLM's KV-cache-manager query).
  TensorView rows = table.narrow(0, 0, num_reqs).narrow(1, 0, used_cols);
  Tensor host_copy;
  if (rows.device() != Device::cpu) {
    PAGEDATTN_CHECK(table.stride(1) == 1, "block_table_tensor", kFn,
                    "block_table_tensor (", table.describe(),
                    ") must have unit column stride to be read back from the device");
    // Copy whole rows (a contiguous range when the row stride equals the width).
    TensorView full_rows = table.narrow(0, 0, num_reqs);
    PAGEDATTN_CHECK(full_rows.is_contiguous(), "block_table_tensor", kFn, "block_table_tensor (",
                    table.describe(), ") must be contiguous to be read back from the device");
    host_copy = Tensor(full_rows.shape(), DType::i32);
    host_copy.copy_from(full_rows);
    rows = host_copy.view().narrow(1, 0, used_cols);
  }
  int64_t shared_cols = 0;
  for (; shared_cols < used_cols; ++shared_cols) {
    const int32_t id0 = read_i32(rows, 0, shared_cols);
    bool same = true;
    for (int r = 1; r < num_reqs && same; ++r) same = read_i32(rows, r, shared_cols) == id0;
    if (!same) break;
  }
  int64_t prefix = shared_cols * block_size;
  prefix = std::min(prefix, min_computed);
  prefix = prefix / block_size * block_size;
  return static_cast<int>(prefix);
}

// ---- infer_global_hyperparameters -------------------------------------------------------------
namespace {

std::string format_float(float x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(x));
  return buf;
}

std::string format_soft_cap(const std::optional<float>& cap) {
  return cap ? format_float(*cap) : std::string("none");
}

}  // namespace

PerLayerParameters infer_global_hyperparameters(const std::map<std::string, PerLayerParameters>& per_layer) {
  constexpr const char* kFn = "infer_global_hyperparameters: ";
  PAGEDATTN_CHECK(!per_layer.empty(), "per_layer", kFn,
                  "per_layer is empty: no attention layers were found in the model");
  const std::string& first_name = per_layer.begin()->first;
  const PerLayerParameters& global = per_layer.begin()->second;
  for (auto it = std::next(per_layer.begin()); it != per_layer.end(); ++it) {
    const std::string& name = it->first;
    const PerLayerParameters& params = it->second;
    auto fail = [&](const char* field, const std::string& value, const std::string& expected) {
      throw Error("per_layer",
                  detail::concat(kFn, "layer '", name, "' has ", field, " = ", value, " but layer '",
                                 first_name, "' has ", field, " = ", expected,
                                 ": every layer must share window_left, logits_soft_cap and sm_scale"));
    };
    if (params.window_left != global.window_left) {
      fail("window_left", std::to_string(params.window_left), std::to_string(global.window_left));
    }
    if (params.logits_soft_cap != global.logits_soft_cap) {
      fail("logits_soft_cap", format_soft_cap(params.logits_soft_cap),
           format_soft_cap(global.logits_soft_cap));
    }
    if (params.sm_scale != global.sm_scale) {
      fail("sm_scale", format_float(params.sm_scale), format_float(global.sm_scale));
    }
  }
  return global;
}

}  // namespace pagedattn
