// merge_attn_states on the host against an fp64 formula computed here, on random inputs with
// +inf / -inf LSEs, both-empty rows, prefill_tokens_with_context, strided and aliased views;
// plus every bad argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backends/ops_test_util.h"
#include "pagedattn/ops.h"

namespace pagedattn {
namespace {

using testing_ops::expect_error;
using testing_ops::random_tensor;

constexpr float kInf = std::numeric_limits<float>::infinity();

double tolerance(DType dt) {
  switch (dt) {
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    default: return 8e-3;
  }
}

struct MergeCase {
  DType dtype;
  int num_tokens;
  int num_heads;
  int head_size;
  int64_t prefill_tokens_with_context;
};

// Random LSEs in [-6, 6] with some +inf (FA2's empty row), -inf, and rows where both are empty.
Tensor random_lse(int num_heads, int num_tokens, std::mt19937& rng, int salt) {
  Tensor lse = random_tensor(Shape{num_heads, num_tokens}, DType::f32, rng, -6.f, 6.f);
  float* p = lse.data_as<float>();
  for (int h = 0; h < num_heads; ++h) {
    for (int t = 0; t < num_tokens; ++t) {
      const int k = (h * 7 + t * 3 + salt) % 11;
      if (k == 0) p[h * num_tokens + t] = kInf;
      if (k == 1) p[h * num_tokens + t] = -kInf;
    }
  }
  return lse;
}

double read_lse64(const Tensor& lse, int h, int t, int num_tokens) {
  const double v = lse.data_as<float>()[h * num_tokens + t];
  return v == std::numeric_limits<double>::infinity() ? -v : v;
}

void PrintTo(const MergeCase& c, std::ostream* os) {
  *os << dtype_name(c.dtype) << " T=" << c.num_tokens << " H=" << c.num_heads
      << " D=" << c.head_size << " prefill_tokens_with_context=" << c.prefill_tokens_with_context;
}

class MergeAttnStatesTest : public ::testing::TestWithParam<MergeCase> {};

TEST_P(MergeAttnStatesTest, MatchesFp64Formula) {
  const MergeCase c = GetParam();
  std::mt19937 rng(42 + c.num_tokens * 13 + c.head_size + static_cast<int>(c.dtype));
  const int T = c.num_tokens, H = c.num_heads, D = c.head_size;
  Tensor prefix = random_tensor(Shape{T, H, D}, c.dtype, rng);
  Tensor suffix = random_tensor(Shape{T, H, D}, c.dtype, rng);
  Tensor prefix_lse = random_lse(H, T, rng, 0);
  Tensor suffix_lse = random_lse(H, T, rng, 5);
  // Force a few rows where both are empty (one +inf, one -inf) and where both are +inf.
  if (T > 2 && H > 1) {
    prefix_lse.data_as<float>()[0 * T + 1] = kInf;
    suffix_lse.data_as<float>()[0 * T + 1] = -kInf;
    prefix_lse.data_as<float>()[1 * T + 2] = kInf;
    suffix_lse.data_as<float>()[1 * T + 2] = kInf;
  }
  Tensor out(Shape{T, H, D}, c.dtype);
  out.fill_bytes(0xFF);  // NaN in every float dtype: every element must be written
  Tensor out_lse(Shape{H, T}, DType::f32);
  out_lse.fill_bytes(0xFF);

  merge_attn_states(out, prefix, prefix_lse, suffix, suffix_lse, out_lse,
                    c.prefill_tokens_with_context);

  double err2 = 0, ref2 = 0;
  int both_empty = 0, suffix_copies = 0;
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      const double lp = read_lse64(prefix_lse, h, t, T), ls = read_lse64(suffix_lse, h, t, T);
      const float got_lse = out_lse.data_as<float>()[h * T + t];
      const bool copy_suffix =
          c.prefill_tokens_with_context >= 0 && t >= c.prefill_tokens_with_context;
      const int64_t base = (static_cast<int64_t>(t) * H + h) * D;
      if (copy_suffix || std::max(lp, ls) == -std::numeric_limits<double>::infinity()) {
        const Tensor& src = copy_suffix ? suffix : prefix;
        copy_suffix ? ++suffix_copies : ++both_empty;
        for (int i = 0; i < D; ++i) {
          ASSERT_EQ(load_f32(out.data(), c.dtype, base + i), load_f32(src.data(), c.dtype, base + i))
              << "t=" << t << " h=" << h << " must be a copy";
        }
        if (copy_suffix) {
          EXPECT_EQ(static_cast<double>(got_lse), ls) << "t=" << t << " h=" << h;
        } else {
          EXPECT_EQ(got_lse, -kInf) << "t=" << t << " h=" << h;
        }
        continue;
      }
      // fp64 formula.
      const double m = std::max(lp, ls);
      const double wp = std::exp(lp - m), ws = std::exp(ls - m);
      const double want_lse = std::log(wp + ws) + m;
      EXPECT_NEAR(got_lse, want_lse, 1e-5 * std::max(1.0, std::fabs(want_lse)))
          << "t=" << t << " h=" << h;
      for (int i = 0; i < D; ++i) {
        const double p = load_f64(prefix.data(), c.dtype, base + i);
        const double s = load_f64(suffix.data(), c.dtype, base + i);
        const double want = (wp * p + ws * s) / (wp + ws);
        const double got = load_f64(out.data(), c.dtype, base + i);
        ASSERT_TRUE(std::isfinite(got)) << "unwritten or non-finite output at t=" << t;
        err2 += (got - want) * (got - want);
        ref2 += want * want;
      }
    }
  }
  EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-300)), tolerance(c.dtype));
  if (T > 2 && H > 1 && (c.prefill_tokens_with_context < 0 || c.prefill_tokens_with_context > 2)) {
    EXPECT_GE(both_empty, 2);
  }
  if (c.prefill_tokens_with_context >= 0) {
    EXPECT_EQ(suffix_copies, (T - c.prefill_tokens_with_context) * H);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, MergeAttnStatesTest,
    ::testing::Values(MergeCase{DType::f32, 17, 4, 64, -1}, MergeCase{DType::f32, 9, 3, 80, 5},
                      MergeCase{DType::f16, 13, 8, 128, -1}, MergeCase{DType::f16, 6, 2, 16, 0},
                      MergeCase{DType::bf16, 21, 5, 96, 14}, MergeCase{DType::bf16, 1, 1, 8, -1},
                      MergeCase{DType::bf16, 4, 2, 32, 4},
                      // >= 2^16 elements: the multi-threaded host path.
                      MergeCase{DType::f32, 70, 8, 128, -1}, MergeCase{DType::bf16, 64, 8, 128, 40}),
    [](const ::testing::TestParamInfo<MergeCase>& info) {
      const MergeCase& c = info.param;
      return std::string(dtype_name(c.dtype)) + "_T" + std::to_string(c.num_tokens) + "_H" +
             std::to_string(c.num_heads) + "_D" + std::to_string(c.head_size) + "_ptwc" +
             (c.prefill_tokens_with_context < 0 ? std::string("none")
                                                : std::to_string(c.prefill_tokens_with_context));
    });

TEST(MergeAttnStates, EqualLseAveragesAndLseGrowsByLog2) {
  Tensor prefix(Shape{1, 1, 2}, DType::f32), suffix(Shape{1, 1, 2}, DType::f32);
  prefix.data_as<float>()[0] = 1.f;
  prefix.data_as<float>()[1] = -3.f;
  suffix.data_as<float>()[0] = 3.f;
  suffix.data_as<float>()[1] = 5.f;
  Tensor lse(Shape{1, 1}, DType::f32);
  lse.data_as<float>()[0] = 0.75f;
  Tensor out(Shape{1, 1, 2}, DType::f32), out_lse(Shape{1, 1}, DType::f32);
  merge_attn_states(out, prefix, lse, suffix, lse, out_lse);
  EXPECT_FLOAT_EQ(out.data_as<float>()[0], 2.f);
  EXPECT_FLOAT_EQ(out.data_as<float>()[1], 1.f);
  EXPECT_FLOAT_EQ(out_lse.data_as<float>()[0], 0.75f + std::log(2.f));
}

TEST(MergeAttnStates, StridedViewsInPlaceAndNoOutputLse) {
  // prefix/suffix are the two halves of a (T, H, 2*D) buffer; the output aliases the prefix.
  std::mt19937 rng(8);
  const int T = 5, H = 3, D = 16;
  Tensor both = random_tensor(Shape{T, H, 2 * D}, DType::f32, rng);
  Tensor reference_prefix(Shape{T, H, D}, DType::f32), reference_suffix(Shape{T, H, D}, DType::f32);
  reference_prefix.copy_from(both.view().narrow(2, 0, D));
  reference_suffix.copy_from(both.view().narrow(2, D, D));
  Tensor plse = random_lse(H, T, rng, 3), slse = random_lse(H, T, rng, 4);
  // LSE views with transposed strides: (H, T) over a (T, H) buffer.
  Tensor plse_t(Shape{T, H}, DType::f32), slse_t(Shape{T, H}, DType::f32);
  for (int h = 0; h < H; ++h) {
    for (int t = 0; t < T; ++t) {
      plse_t.data_as<float>()[t * H + h] = plse.data_as<float>()[h * T + t];
      slse_t.data_as<float>()[t * H + h] = slse.data_as<float>()[h * T + t];
    }
  }
  const int perm[] = {1, 0};
  const TensorView prefix_view = both.view().narrow(2, 0, D);
  merge_attn_states(prefix_view, prefix_view, plse_t.view().permute(perm),
                    both.view().narrow(2, D, D), slse_t.view().permute(perm));
  Tensor expected(Shape{T, H, D}, DType::f32);
  merge_attn_states(expected, reference_prefix, plse, reference_suffix, slse);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < D; ++i) {
        ASSERT_EQ(both.data_as<float>()[(t * H + h) * 2 * D + i],
                  expected.data_as<float>()[(t * H + h) * D + i]);
      }
    }
  }
}

TEST(MergeAttnStates, RejectsBadArguments) {
  std::mt19937 rng(3);
  const int T = 4, H = 2, D = 8;
  Tensor out = random_tensor(Shape{T, H, D}, DType::bf16, rng);
  Tensor prefix = random_tensor(Shape{T, H, D}, DType::bf16, rng);
  Tensor suffix = random_tensor(Shape{T, H, D}, DType::bf16, rng);
  Tensor plse = random_tensor(Shape{H, T}, DType::f32, rng);
  Tensor slse = random_tensor(Shape{H, T}, DType::f32, rng);
  Tensor olse = random_tensor(Shape{H, T}, DType::f32, rng);
  const auto before = testing_ops::snapshot(out);
  const auto run = [&](const TensorView& o, const TensorView& p, const TensorView& pl,
                       const TensorView& s, const TensorView& sl, const TensorView& ol,
                       int64_t ptwc) { merge_attn_states(o, p, pl, s, sl, ol, ptwc); };

  Tensor out_i32(Shape{T, H, D}, DType::i32);
  expect_error([&] { run(out_i32, prefix, plse, suffix, slse, olse, -1); }, "output");
  expect_error([&] { run(out.view().select(0, 0), prefix, plse, suffix, slse, olse, -1); }, "output");
  Tensor prefix_f16 = random_tensor(Shape{T, H, D}, DType::f16, rng);
  expect_error([&] { run(out, prefix_f16, plse, suffix, slse, olse, -1); }, "prefix_output");
  expect_error([&] { run(out, prefix, plse, suffix.view().narrow(2, 0, 4), slse, olse, -1); },
               "suffix_output");
  Tensor lse_f16(Shape{H, T}, DType::f16);
  lse_f16.fill_bytes(0);
  expect_error([&] { run(out, prefix, lse_f16, suffix, slse, olse, -1); }, "prefix_lse");
  Tensor lse_th = random_tensor(Shape{T, H}, DType::f32, rng);
  expect_error([&] { run(out, prefix, plse, suffix, lse_th, olse, -1); }, "suffix_lse");
  expect_error([&] { run(out, prefix, plse, suffix, slse, lse_th, -1); }, "output_lse");
  expect_error([&] { run(out, prefix, plse, suffix, slse, olse, T + 1); },
               "prefill_tokens_with_context");
  expect_error([&] { run(out, prefix, plse, suffix, slse, olse, -2); },
               "prefill_tokens_with_context");
  const TensorView cuda_prefix(prefix.data(), prefix.dtype(), prefix.shape(), Device::cuda);
  expect_error([&] { run(out, cuda_prefix, plse, suffix, slse, olse, -1); }, "prefix_output");
  EXPECT_TRUE(testing_ops::bytes_equal(out, before)) << "output written by a rejected call";
  EXPECT_NO_THROW(run(out, prefix, plse, suffix, slse, olse, T));
}

}  // namespace
}  // namespace pagedattn
