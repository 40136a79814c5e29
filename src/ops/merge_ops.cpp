// merge_attn_states: combine two partial attention results (e.g. cascade prefix + suffix, or the
// context chunks of a chunked prefill) by their log-sum-exps.
//
// What it computes, per token t and head h (lp = prefix_lse[h, t], ls = suffix_lse[h, t],
// natural log; an LSE of +inf is read as -inf, as vLLM does: FA2 writes +inf for empty rows):
//   t >= prefill_tokens_with_context (when >= 0):  out = suffix_output, lse = ls
//   lp = ls = -inf (both empty):                     out = prefix_output, lse = -inf
//   (a NaN LSE, from a NaN logit, gives NaN out and lse, whichever side it is on)
//   otherwise: wp = e^{lp-m}, ws = e^{ls-m}
//              out = (wp * prefix_output + ws * suffix_output) / (wp + ws), lse = log(wp + ws) + m
// Shapes: output / prefix_output / suffix_output (T, H, D), any strides, one dtype (f32/f16/bf16);
// LSEs f32 (H, T), any strides.
// Host path: one pass, OpenMP over tokens when large; traffic = 3 * T*H*D elements + 3 * H*T
// LSEs; compute trivial, so the floor is the copy bandwidth.
// Precision: math in f32 with max-subtraction; one rounding at the store. The output may alias
// prefix_output or suffix_output element for element (every element is read before it is written).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "ops/cuda_ops.h"
#include "ops/ops_checks.h"
#include "pagedattn/error.h"
#include "pagedattn/ops.h"

namespace pagedattn {
namespace {

using ops_detail::check_activation_dtype;
using ops_detail::check_rank;
using ops_detail::check_same_device;

constexpr std::string_view kOp = "merge_attn_states";

void check_lse(const TensorView& lse, std::string_view argument, int64_t num_heads,
               int64_t num_tokens, Device device, int device_index) {
  check_rank(kOp, lse, argument, 2, "(num_heads, num_tokens) float32");
  PAGEDATTN_CHECK(lse.dtype() == DType::f32, std::string(argument), kOp, ": ", argument, " is ",
                  dtype_name(lse.dtype()), ", expected float32");
  PAGEDATTN_CHECK(lse.size(0) == num_heads && lse.size(1) == num_tokens, std::string(argument),
                  kOp, ": ", argument, " has shape ", lse.shape().str(), ", expected (", num_heads,
                  ", ", num_tokens, ") = (num_heads, num_tokens) of output");
  check_same_device(kOp, lse, argument, device, device_index);
}

float read_lse(const TensorView& lse, int64_t h, int64_t t) {
  const float v = lse.data_as<const float>()[h * lse.stride(0) + t * lse.stride(1)];
  return v == std::numeric_limits<float>::infinity() ? -std::numeric_limits<float>::infinity() : v;
}

void merge_host(const TensorView& output, const TensorView& prefix_output,
                const TensorView& prefix_lse, const TensorView& suffix_output,
                const TensorView& suffix_lse, const TensorView& output_lse,
                int64_t prefill_tokens_with_context) {
  const int64_t num_tokens = output.size(0);
  const int64_t num_heads = output.size(1);
  const int64_t head_size = output.size(2);
  const DType dtype = output.dtype();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // (T, H, D) element offset of (t, h, i) in a view.
  const auto offset = [](const TensorView& v, int64_t t, int64_t h, int64_t i) {
    return t * v.stride(0) + h * v.stride(1) + i * v.stride(2);
  };
#pragma omp parallel for schedule(static) if (num_tokens * num_heads * head_size >= (int64_t{1} << 16))
  for (int64_t t = 0; t < num_tokens; ++t) {
    const bool suffix_only = prefill_tokens_with_context >= 0 && t >= prefill_tokens_with_context;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float lp = read_lse(prefix_lse, h, t);
      const float ls = read_lse(suffix_lse, h, t);
      float out_lse;
      if (suffix_only) {
        for (int64_t i = 0; i < head_size; ++i) {
          store_f32(output.data(), dtype, offset(output, t, h, i),
                    load_f32(suffix_output.data(), dtype, offset(suffix_output, t, h, i)));
        }
        out_lse = ls;
      } else {
        const float m = std::max(lp, ls);  // NaN when lp is; ls = NaN: wp, ws NaN below
        if (lp == neg_inf && ls == neg_inf) {  // both partial results are empty (not NaN)
          for (int64_t i = 0; i < head_size; ++i) {
            store_f32(output.data(), dtype, offset(output, t, h, i),
                      load_f32(prefix_output.data(), dtype, offset(prefix_output, t, h, i)));
          }
          out_lse = neg_inf;
        } else {
          const float wp = std::exp(lp - m);
          const float ws = std::exp(ls - m);
          const float sum = wp + ws;
          const float p_scale = wp / sum;
          const float s_scale = ws / sum;
          for (int64_t i = 0; i < head_size; ++i) {
            const float p = load_f32(prefix_output.data(), dtype, offset(prefix_output, t, h, i));
            const float s = load_f32(suffix_output.data(), dtype, offset(suffix_output, t, h, i));
            store_f32(output.data(), dtype, offset(output, t, h, i), p * p_scale + s * s_scale);
          }
          out_lse = std::log(sum) + m;
        }
      }
      if (output_lse.defined()) {
        output_lse.data_as<float>()[h * output_lse.stride(0) + t * output_lse.stride(1)] = out_lse;
      }
    }
  }
}

}  // namespace

void merge_attn_states(const TensorView& output, const TensorView& prefix_output,
                       const TensorView& prefix_lse, const TensorView& suffix_output,
                       const TensorView& suffix_lse, const TensorView& output_lse,
                       int64_t prefill_tokens_with_context) {
  check_rank(kOp, output, "output", 3, "(num_tokens, num_heads, head_size)");
  check_activation_dtype(kOp, output, "output");
  const Shape& shape = output.shape();
  const Device device = output.device();
  const int device_index = output.device_index();
  const auto check_partial_output = [&](const TensorView& view, std::string_view name) {
    check_rank(kOp, view, name, 3, "(num_tokens, num_heads, head_size)");
    PAGEDATTN_CHECK(view.dtype() == output.dtype(), std::string(name), kOp, ": ", name, " is ",
                    dtype_name(view.dtype()), ", expected the dtype of output (",
                    dtype_name(output.dtype()), ")");
    PAGEDATTN_CHECK(view.shape() == shape, std::string(name), kOp, ": ", name, " has shape ",
                    view.shape().str(), ", expected ", shape.str(), " (the shape of output)");
    check_same_device(kOp, view, name, device, device_index);
  };
  check_partial_output(prefix_output, "prefix_output");
  check_partial_output(suffix_output, "suffix_output");
  const int64_t num_tokens = shape[0];
  const int64_t num_heads = shape[1];
  check_lse(prefix_lse, "prefix_lse", num_heads, num_tokens, device, device_index);
  check_lse(suffix_lse, "suffix_lse", num_heads, num_tokens, device, device_index);
  if (output_lse.defined()) {
    check_lse(output_lse, "output_lse", num_heads, num_tokens, device, device_index);
  }
  PAGEDATTN_CHECK(prefill_tokens_with_context >= -1 && prefill_tokens_with_context <= num_tokens,
                  "prefill_tokens_with_context", kOp, ": prefill_tokens_with_context = ",
                  prefill_tokens_with_context, ", expected -1 (merge every token) or a value in [0, ",
                  num_tokens, "] (num_tokens)");
  const bool has_elements = shape.numel() > 0;
  PAGEDATTN_CHECK(!has_elements || (output.data() && prefix_output.data() && suffix_output.data()),
                  "output", kOp, ": output, prefix_output and suffix_output must have data");
  const bool has_rows = num_tokens * num_heads > 0;
  PAGEDATTN_CHECK(!has_rows || (prefix_lse.data() && suffix_lse.data()), "prefix_lse", kOp,
                  ": prefix_lse and suffix_lse must have data");
  PAGEDATTN_CHECK(!has_rows || !output_lse.defined() || output_lse.data(), "output_lse", kOp,
                  ": output_lse has no data");

  if (device == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    detail::cuda_merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                                   output_lse, prefill_tokens_with_context);
    return;
#else
    throw Error("output", detail::concat(kOp, ": output is on cuda but pagedattn was built without CUDA"));
#endif
  }
  if (num_tokens == 0 || num_heads == 0) return;
  merge_host(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
             prefill_tokens_with_context);
}

}  // namespace pagedattn
