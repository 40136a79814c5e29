// REFERENCE attention: the fp64 oracle (DESIGN.md §4–§6). Naive on purpose: obviously correct,
// every feature, no tiling.
//
// What it computes, for every token t < num_actual_tokens of request r and query head h:
//   kv head      g = h / (num_heads / num_kv_heads)                          (MHA / GQA / MQA)
//   positions    decoder:          query i of r at p = seq_len - query_len + i; keys 0..seq_len-1
//                                  from the paged cache: position k lives in block
//                                  block_table[r][k / block_size], offset k % block_size
//                encoder(_only):   query i at p = i; keys = the current tokens' key/value inputs
//                                  (rows query_start_loc[r] + j), no cache
//                encoder_decoder:  keys = all seq_len (encoder) positions of r's cache
//   visibility   decoder causal:   k <= p, and k >= p - (W-1) with a window W
//                non-causal (encoder, encoder_only, decoder with common.causal == false):
//                                  every key, |k - p| <= W-1 with a window
//                encoder_decoder:  every key (no window, no ALiBi: rejected at construction)
//   logit order  s = scale * (q . k)                    (q is read as is: never quantized)
//                s = c * tanh(s / c)                    with a soft-cap c
//                s = s - slope_h * |p - k|              ALiBi, canonical form
//                masked keys drop out; the sink logit (one per query head) joins the softmax
//                denominator only (it has no value row)
//   output       o = sum_k e^{s_k - m} v_k / (e^{sink - m} + sum_k e^{s_k - m})
//                LSE = m + log(e^{sink - m} + sum_k e^{s_k - m})   (natural log, with the sink)
//                no visible key, no sink: o = 0, LSE = -inf; a sink only: o = 0, LSE = sink;
//                a NaN logit of a visible key: m = NaN, so o and LSE NaN (even when every
//                visible logit is NaN)
//   cascade      (metadata.use_cascade) the keys are split at P = common_prefix_len: a prefix
//                pass over [0, P) read through request 0's block table (the shared blocks) and
//                carrying the sink, a suffix pass over [P, seq_len) through r's own table, each
//                with the same mask and logits, merged by LSE exactly as merge_attn_states does.
//                Mathematically equal to the one-pass result; the tests check it.
//   fp8 KV       key = fp8 * k_scale, value = fp8 * v_scale (per kv head when LayerScales has
//                per-head scales); other cache dtypes are read as stored. encoder /
//                encoder_only keep no cache: their keys/values are the activations as given
//                and kv_cache_dtype does not apply to them (do_kv_cache_update does nothing,
//                as in vLLM).
//
// Evaluation: per (token, head) row, two passes over the visible keys — the first finds the
// max logit m, the second sums e^{s-m} and e^{s-m}·v — all in double; no allocation in forward
// (the row's query and accumulator live in fixed arrays of kMaxHeadSize doubles).
//
// Precision points: inputs and cache entries are widened exactly to double; every product, sum,
// exp, log and tanh is double. The only rounding is the final store, ONCE from the double:
// double -> float with round-to-odd, then the library's round-to-nearest-even float -> f16 /
// bf16 / fp8 conversion, which together equal a single correct rounding of the double (the
// targets have at most 11 significant bits, far fewer than float's 24 - 2). f32 outputs and the
// LSE are a plain double -> float rounding. fp8 output: saturate_e4m3(o / output_scale[0]).
//
// Tiling: none. Memory traffic: every visible key row is read twice and every visible value row
// once per (token, query head) row — O(T · Hq · S · (2D + Dv)) element loads for S visible keys,
// no reuse across heads or tokens. No performance floor applies: a verification tool, not a
// kernel. Rows are independent and split across OpenMP threads (results do not depend on it).
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "backends/host_backend_common.h"
#include "backends/reference/reference_internal.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/ops.h"

namespace pagedattn::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// double -> float, rounding to odd: truncate toward zero, then set the last bit when inexact.
float round_to_odd_f32(double x) {
  float f = static_cast<float>(x);  // round to nearest even
  if (static_cast<double>(f) == x || std::isnan(x)) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.f);  // truncate
  uint32_t bits = std::bit_cast<uint32_t>(f);
  bits |= 1u;
  return std::bit_cast<float>(bits);
}

// Stores a double into element `index` of a buffer of `dtype`, rounding once (see the header).
void store_rounded(void* data, DType dtype, int64_t index, double value) {
  if (dtype == DType::f32) {
    static_cast<float*>(data)[index] = static_cast<float>(value);
  } else {
    store_f32(data, dtype, index, round_to_odd_f32(value));
  }
}

// Where a row's keys and values come from (one kv head).
struct KeyValueSource {
  // Paged: (num_blocks, block_size, Hkv, D[v]) views; the key at position k is in block
  // block_row[k / block_size] at offset k % block_size.
  const TensorView* key_cache = nullptr;
  const TensorView* value_cache = nullptr;
  const int32_t* block_row = nullptr;
  int block_size = 0;
  // Current tokens (encoder types): (T, Hkv, D[v]) views; position k is row first_row + k.
  const TensorView* key_rows = nullptr;
  const TensorView* value_rows = nullptr;
  int64_t first_row = 0;

  int kv_head = 0;
  double key_dequant = 1.0;  // fp8: k_scale (per tensor or per head); else 1
  double value_dequant = 1.0;

  // Element offset (in elements from data()) of position k, head kv_head, dim 0.
  int64_t offset(const TensorView& t, int64_t k) const {
    if (block_row != nullptr) {
      const int64_t block = block_row[k / block_size];
      return block * t.stride(0) + (k % block_size) * t.stride(1) + kv_head * t.stride(2);
    }
    return (first_row + k) * t.stride(0) + kv_head * t.stride(1);
  }
  const TensorView& keys() const { return block_row != nullptr ? *key_cache : *key_rows; }
  const TensorView& values() const { return block_row != nullptr ? *value_cache : *value_rows; }
};

// The per-row constants of the logit and mask.
struct RowParams {
  const double* query = nullptr;  // (D,) widened query row
  int head_size = 0;
  int head_size_v = 0;
  double scale = 1.0;
  std::optional<double> soft_cap;
  double alibi_slope = 0.0;  // 0 = no ALiBi
  bool causal = false;
  bool positional = true;  // false for cross-attention (no positions: no mask)
  std::optional<int> window;
  int64_t query_pos = 0;
};

bool visible(const RowParams& row, int64_t k) {
  if (!row.positional) return true;
  if (row.causal) {
    if (k > row.query_pos) return false;
    return !row.window || k >= row.query_pos - (*row.window - 1);
  }
  return !row.window || std::llabs(k - row.query_pos) <= *row.window - 1;
}

double logit(const RowParams& row, const KeyValueSource& src, int64_t k) {
  const TensorView& keys = src.keys();
  const int64_t base = src.offset(keys, k);
  const int64_t dim_stride = keys.stride(-1);
  double dot = 0.0;
  for (int d = 0; d < row.head_size; ++d) {
    dot += row.query[d] *
           (load_f64(keys.data(), keys.dtype(), base + d * dim_stride) * src.key_dequant);
  }
  double s = row.scale * dot;
  if (row.soft_cap) s = *row.soft_cap * std::tanh(s / *row.soft_cap);
  if (row.alibi_slope != 0.0) {
    s -= row.alibi_slope * static_cast<double>(std::llabs(row.query_pos - k));
  }
  return s;
}

// Softmax over the visible keys of [k_begin, k_end) (+ the sink when given): writes the
// normalized output (Dv,) into `out` and returns the LSE (natural log).
double attend(const RowParams& row, const KeyValueSource& src, int64_t k_begin, int64_t k_end,
              std::optional<double> sink, double* out) {
  double m = sink ? *sink : kNegInf;
  for (int64_t k = k_begin; k < k_end; ++k) {
    if (!visible(row, k)) continue;
    // A NaN logit makes m NaN, and so the row and its LSE (std::max(m, NaN) would keep m: a row
    // whose visible logits are all NaN read as "nothing visible", 0 and LSE -inf).
    const double s = logit(row, src, k);
    if (std::isnan(s) || s > m) m = s;  // once NaN, stays NaN
  }
  std::fill(out, out + row.head_size_v, 0.0);
  if (m == kNegInf) return kNegInf;  // nothing visible, no sink
  double denom = sink ? std::exp(*sink - m) : 0.0;
  const TensorView& values = src.values();
  const int64_t dim_stride = values.stride(-1);
  for (int64_t k = k_begin; k < k_end; ++k) {
    if (!visible(row, k)) continue;
    const double w = std::exp(logit(row, src, k) - m);
    denom += w;
    const int64_t base = src.offset(values, k);
    for (int d = 0; d < row.head_size_v; ++d) {
      out[d] +=
          w * (load_f64(values.data(), values.dtype(), base + d * dim_stride) * src.value_dequant);
    }
  }
  for (int d = 0; d < row.head_size_v; ++d) out[d] /= denom;
  return m + std::log(denom);
}

// merge_attn_states semantics, in double: +inf counts as -inf; both -inf -> prefix copied.
double merge(const double* prefix_out, double prefix_lse, const double* suffix_out,
             double suffix_lse, int head_size_v, double* out) {
  if (prefix_lse == std::numeric_limits<double>::infinity()) prefix_lse = kNegInf;
  if (suffix_lse == std::numeric_limits<double>::infinity()) suffix_lse = kNegInf;
  if (prefix_lse == kNegInf && suffix_lse == kNegInf) {
    std::copy(prefix_out, prefix_out + head_size_v, out);
    return kNegInf;
  }
  const double m = std::max(prefix_lse, suffix_lse);
  const double wp = std::exp(prefix_lse - m);
  const double ws = std::exp(suffix_lse - m);
  for (int d = 0; d < head_size_v; ++d)
    out[d] = (wp * prefix_out[d] + ws * suffix_out[d]) / (wp + ws);
  return m + std::log(wp + ws);
}

double kv_scale(const TensorView& per_head, float per_tensor, int kv_head) {
  if (per_head.defined())
    return load_f64(per_head.data(), per_head.dtype(), kv_head * per_head.stride(0));
  return per_tensor;
}

}  // namespace

ReferenceAttentionImpl::ReferenceAttentionImpl(AttentionImplParams params)
    : AttentionImpl(std::move(params)) {
  check_impl_params(params_);
  cache_dtype_ = kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype);
}

bool ReferenceAttentionImpl::supports_quant_query_input() const {
  return is_fp8(cache_dtype_) && uses_kv_cache(params_.attn_type);
}

bool ReferenceAttentionImpl::fused_output_quant_supported(const QuantKey& key) const {
  return key.kind == QuantKey::Kind::fp8_e4m3_per_tensor_static;
}

const ReferenceAttentionMetadata& ReferenceAttentionImpl::checked_metadata(
    const AttentionMetadata& metadata, std::string_view entry) const {
  const auto* md = dynamic_cast<const ReferenceAttentionMetadata*>(&metadata);
  PAGEDATTN_CHECK(md != nullptr, "metadata", "REFERENCE ", entry,
                  ": metadata was not built by the REFERENCE backend's builder");
  PAGEDATTN_CHECK(md->attn_type == params_.attn_type, "metadata", "REFERENCE ", entry,
                  ": metadata was built for attn_type = ", attention_type_name(md->attn_type),
                  " but this layer has attn_type = ", attention_type_name(params_.attn_type));
  return *md;
}

void ReferenceAttentionImpl::check_kv_cache(const TensorView& kv_cache,
                                            const ReferenceAttentionMetadata& md,
                                            std::string_view entry) const {
  host::check_standard_kv_cache(params_, cache_dtype_, kv_cache, md, "REFERENCE", entry);
}

void ReferenceAttentionImpl::check_scales(const LayerScales& scales, std::string_view entry) const {
  host::check_layer_scales(params_, cache_dtype_, scales, "REFERENCE", entry);
}

// ---- cache write ------------------------------------------------------------------------------

void ReferenceAttentionImpl::do_kv_cache_update(const LayerScales& scales, const TensorView& key,
                                                const TensorView& value, const TensorView& kv_cache,
                                                const AttentionMetadata& metadata) {
  const char* entry = "do_kv_cache_update";
  const ReferenceAttentionMetadata& md = checked_metadata(metadata, entry);
  host::write_step_kv_cache(params_, scales, key, value, kv_cache, md.slot_mapping, "REFERENCE",
                            [&] {
                              check_kv_cache(kv_cache, md, entry);
                              check_scales(scales, entry);
                            });
}

// ---- attention --------------------------------------------------------------------------------

void ReferenceAttentionImpl::check_forward(const LayerScales& scales, const TensorView& query,
                                           const TensorView& key, const TensorView& value,
                                           const TensorView& kv_cache,
                                           const AttentionMetadata& metadata,
                                           const TensorView& output, const TensorView& output_scale,
                                           const TensorView& output_lse) const {
  const char* entry = "forward";
  const ReferenceAttentionMetadata& md = checked_metadata(metadata, entry);
  const int num_heads = params_.num_heads;
  const int num_kv_heads = params_.kv_heads();
  const int head_size = params_.head_size;
  const int head_size_v = params_.value_head_size();
  const int64_t num_tokens = md.num_actual_tokens;
  const bool cached = uses_kv_cache(params_.attn_type);

  const DType activation[] = {params_.dtype};
  check_defined(query, "query");
  check_device(query, "query", Device::cpu);
  check_query_dtype(scales, query, "REFERENCE");  // e4m3 = q / q_scale where supported
  check_ndim(query, "query", 3);
  PAGEDATTN_CHECK(
      query.size(0) >= num_tokens && query.size(1) == num_heads && query.size(2) == head_size,
      "query", "REFERENCE forward: query has shape ", query.shape().str(),
      ": expected (>= ", num_tokens, ", ", num_heads, ", ", head_size, ")");
  check_defined(output, "output");
  check_device(output, "output", Device::cpu);
  check_ndim(output, "output", 3);
  const DType fp8_out[] = {DType::fp8_e4m3};
  check_dtype(output, "output",
              output_scale.defined() ? std::span<const DType>(fp8_out)
                                     : std::span<const DType>(activation));
  PAGEDATTN_CHECK(
      output.size(0) >= num_tokens && output.size(1) == num_heads && output.size(2) == head_size_v,
      "output", "REFERENCE forward: output has shape ", output.shape().str(),
      ": expected (>= ", num_tokens, ", ", num_heads, ", ", head_size_v, ")");
  if (output_scale.defined()) {
    const DType f32[] = {DType::f32};
    check_device(output_scale, "output_scale", Device::cpu);
    check_dtype(output_scale, "output_scale", f32);
    check_shape(output_scale, "output_scale", Shape{1});
    const double output_divisor = load_f64(output_scale.data(), DType::f32, 0);
    PAGEDATTN_CHECK(std::isfinite(output_divisor) && output_divisor > 0.0, "output_scale",
                    "REFERENCE forward: output_scale[0] = ", output_divisor,
                    " must be a positive finite number");
  }
  if (output_lse.defined()) {
    const DType f32[] = {DType::f32};
    check_device(output_lse, "output_lse", Device::cpu);
    check_dtype(output_lse, "output_lse", f32);
    check_ndim(output_lse, "output_lse", 2);
    PAGEDATTN_CHECK(output_lse.size(0) == num_heads && output_lse.size(1) >= num_tokens,
                    "output_lse", "REFERENCE forward: output_lse has shape ",
                    output_lse.shape().str(), ": expected (", num_heads, ", >= ", num_tokens, ")");
  }
  check_scales(scales, entry);
  if (cached) {
    check_kv_cache(kv_cache, md, entry);  // block ids and slots included (O(1))
  } else {
    for (const auto& [t, arg, dim] :
         {std::tuple{&key, "key", head_size}, std::tuple{&value, "value", head_size_v}}) {
      check_defined(*t, arg);
      check_device(*t, arg, Device::cpu);
      check_dtype(*t, arg, activation);
      check_ndim(*t, arg, 3);
      PAGEDATTN_CHECK(t->size(0) >= num_tokens && t->size(1) == num_kv_heads && t->size(2) == dim,
                      arg, "REFERENCE forward: ", arg, " has shape ", t->shape().str(),
                      ": expected (>= ", num_tokens, ", ", num_kv_heads, ", ", dim, ")");
    }
  }
  PAGEDATTN_CHECK(md.query_start_loc.back() == num_tokens, "metadata",
                  "REFERENCE forward: metadata query_start_loc ends at ", md.query_start_loc.back(),
                  " but num_actual_tokens = ", num_tokens);
}

void ReferenceAttentionImpl::forward(const LayerScales& scales, const TensorView& query,
                                     const TensorView& key, const TensorView& value,
                                     const TensorView& kv_cache, const AttentionMetadata& metadata,
                                     const TensorView& output, const TensorView& output_scale,
                                     const TensorView& output_lse) {
  // -- every check before anything is read or written --
  check_forward(scales, query, key, value, kv_cache, metadata, output, output_scale, output_lse);
  const auto& md = static_cast<const ReferenceAttentionMetadata&>(metadata);
  const int num_heads = params_.num_heads;
  const int num_kv_heads = params_.kv_heads();
  const int head_size = params_.head_size;
  const int head_size_v = params_.value_head_size();
  const int64_t num_tokens = md.num_actual_tokens;
  const AttentionType type = params_.attn_type;
  const bool cached = uses_kv_cache(type);
  const double output_divisor =
      output_scale.defined() ? load_f64(output_scale.data(), DType::f32, 0) : 1.0;
  const double q_factor = query.dtype() == DType::fp8_e4m3 ? static_cast<double>(scales.q_scale) : 1.0;
  const KVCacheViews views = cached ? split_kv_cache(kv_cache, head_size, head_size_v) : KVCacheViews{};

  // -- compute: one independent row per (token, query head) --
  const int queries_per_kv = num_heads / num_kv_heads;
  const bool fp8_cache = is_fp8(cache_dtype_);
  const int64_t num_rows = num_tokens * num_heads;
  // Threads only pay off for big steps (small ones would spend more on waking the team).
  const int64_t approx_loads = num_rows * std::max<int64_t>(md.max_seq_len, md.max_query_len) *
                               (2 * head_size + head_size_v);
  const bool parallel = approx_loads >= (int64_t{1} << 22);
#pragma omp parallel for schedule(dynamic, 4) if (parallel)
  for (int64_t row_index = 0; row_index < num_rows; ++row_index) {
    const int64_t t = row_index / num_heads;
    const int h = static_cast<int>(row_index % num_heads);
    // Request of token t: the last r with query_start_loc[r] <= t (requests may be empty).
    const auto it = std::upper_bound(md.query_start_loc.begin(), md.query_start_loc.end(),
                                     static_cast<int32_t>(t));
    const int r = static_cast<int>(it - md.query_start_loc.begin()) - 1;
    const int64_t i = t - md.query_start_loc[r];
    const int64_t query_len = md.query_len(r);
    const int64_t seq_len = md.seq_lens[r];

    std::array<double, kMaxHeadSize> q{};
    for (int d = 0; d < head_size; ++d) {
      q[d] = q_factor * load_f64(query.data(), query.dtype(),
                                 t * query.stride(0) + h * query.stride(1) + d * query.stride(2));
    }
    RowParams row;
    row.query = q.data();
    row.head_size = head_size;
    row.head_size_v = head_size_v;
    row.scale = params_.scale;
    if (params_.logits_soft_cap) row.soft_cap = *params_.logits_soft_cap;
    if (!params_.alibi_slopes.empty()) row.alibi_slope = params_.alibi_slopes[h];
    row.window = params_.sliding_window;
    row.causal = md.causal;
    row.positional = type != AttentionType::encoder_decoder;
    row.query_pos = cached ? seq_len - query_len + i : i;
    std::optional<double> sink;
    if (!params_.sinks.empty()) sink = params_.sinks[h];

    KeyValueSource src;
    src.kv_head = h / queries_per_kv;
    if (fp8_cache && cached) {  // encoder types read their activations: no dequantization
      src.key_dequant = kv_scale(scales.k_scale_per_head, scales.k_scale, src.kv_head);
      src.value_dequant = kv_scale(scales.v_scale_per_head, scales.v_scale, src.kv_head);
    }
    int64_t num_keys = seq_len;
    if (cached) {
      src.key_cache = &views.key_cache;
      src.value_cache = &views.value_cache;
      src.block_row = md.block_row(r);
      src.block_size = md.block_size;
    } else {
      src.key_rows = &key;
      src.value_rows = &value;
      src.first_row = md.query_start_loc[r];
      num_keys = query_len;  // == seq_len (checked by the builder)
    }

    std::array<double, kMaxHeadSize> result{};
    double lse;
    if (md.use_cascade) {
      const int64_t prefix_len = md.common_prefix_len;
      KeyValueSource prefix_src = src;
      prefix_src.block_row = md.block_row(0);  // the shared prefix blocks
      std::array<double, kMaxHeadSize> prefix_out{};
      std::array<double, kMaxHeadSize> suffix_out{};
      const double prefix_lse = attend(row, prefix_src, 0, prefix_len, sink, prefix_out.data());
      const double suffix_lse =
          attend(row, src, prefix_len, num_keys, std::nullopt, suffix_out.data());
      lse = merge(prefix_out.data(), prefix_lse, suffix_out.data(), suffix_lse, head_size_v,
                  result.data());
    } else {
      lse = attend(row, src, 0, num_keys, sink, result.data());
    }

    const int64_t out_base = t * output.stride(0) + h * output.stride(1);
    for (int d = 0; d < head_size_v; ++d) {
      store_rounded(output.data(), output.dtype(), out_base + d * output.stride(2),
                    result[d] / output_divisor);
    }
    if (output_lse.defined()) {
      output_lse.data_as<float>()[h * output_lse.stride(0) + t * output_lse.stride(1)] =
          static_cast<float>(lse);
    }
  }
}

}  // namespace pagedattn::reference
