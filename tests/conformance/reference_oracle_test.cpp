// The REFERENCE backend checked against an INDEPENDENT naive implementation written here from
// the DESIGN.md §4 formulas (contiguous K/V per request, no paging, no cascade, plain vectors),
// and anchored by hand-worked tiny vectors whose expected values are computed in the comments.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "conformance/harness.h"

namespace pagedattn::conformance {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- the independent oracle ------------------------------------------------------------------

// What the cache holds for an activation value x of kv head g, read back as a number
// (DESIGN §4: stored = convert(x / scale) for fp8, read = fp8 * scale; other dtypes convert).
double cached_value(const CaseInputs& in, double x, bool is_key, int g) {
  const std::string& kv = in.c.kv_cache_dtype;
  const float xf = static_cast<float>(x);
  if (kv == "auto") return x;
  if (kv == "float32") return xf;
  if (kv == "float16") return f16_bits_to_f32(f32_to_f16_bits(xf));
  if (kv == "bfloat16") return bf16_bits_to_f32(f32_to_bf16_bits(xf));
  const std::vector<float>& per_head = is_key ? in.k_scale_per_head : in.v_scale_per_head;
  const float scale =
      per_head.empty() ? (is_key ? in.k_scale : in.v_scale) : per_head[static_cast<size_t>(g)];
  const float scaled = xf / scale;
  const double stored = kv == "fp8_e5m2" ? fp8_e5m2_bits_to_f32(f32_to_fp8_e5m2_bits(scaled))
                                         : fp8_e4m3_bits_to_f32(f32_to_fp8_e4m3_bits(scaled));
  return stored * static_cast<double>(scale);
}

double at(const Tensor& t, int64_t row, int64_t head, int64_t d) {
  const TensorView& v = t.view();
  return load_f64(v.data(), v.dtype(), row * v.stride(0) + head * v.stride(1) + d * v.stride(2));
}

struct OracleResult {
  std::vector<double> output;  // (num_actual_tokens, Hq, Dv)
  std::vector<double> lse;     // (Hq, num_actual_tokens)
};

// causal_decoder = false: a decoder step whose CommonAttentionMetadata says causal = false
// (vLLM honours it): every cached key is visible, a window is symmetric as for encoders.
OracleResult naive_attention(const CaseInputs& in, bool causal_decoder = true) {
  const ConformanceCase& c = in.c;
  const int hq = c.num_heads, hkv = c.num_kv_heads, d = c.head_size, dv = c.value_head_size();
  const int64_t tokens = in.num_actual_tokens;
  OracleResult res;
  res.output.assign(static_cast<size_t>(tokens * hq * dv), 0.0);
  res.lse.assign(static_cast<size_t>(hq * tokens), 0.0);
  for (int r = 0; r < in.num_reqs(); ++r) {
    const int q_len = in.query_len(r);
    const int q0 = in.query_start_loc[r];
    // Contiguous keys/values of request r: K[j][g][i], V[j][g][i], j = key position.
    int n_keys = 0;
    std::vector<double> K, V;
    const auto push = [&](const Tensor& keys, const Tensor& values, int64_t row) {
      for (int g = 0; g < hkv; ++g)
        for (int i = 0; i < d; ++i) K.push_back(cached_value(in, at(keys, row, g, i), true, g));
      for (int g = 0; g < hkv; ++g)
        for (int i = 0; i < dv; ++i) V.push_back(cached_value(in, at(values, row, g, i), false, g));
      ++n_keys;
    };
    switch (c.attn_type) {
      case AttentionType::decoder:
        for (int p = 0; p < c.batch[r].context_len; ++p)
          push(in.context_key, in.context_value, in.context_start[r] + p);
        for (int i = 0; i < q_len; ++i) push(in.key, in.value, q0 + i);
        break;
      case AttentionType::encoder_decoder:
        for (int p = 0; p < c.batch[r].context_len; ++p)
          push(in.context_key, in.context_value, in.context_start[r] + p);
        break;
      default:  // encoder, encoder_only: the current tokens
        for (int i = 0; i < q_len; ++i) {
          // No cache: the keys are the activations themselves.
          for (int g = 0; g < hkv; ++g)
            for (int x = 0; x < d; ++x) K.push_back(at(in.key, q0 + i, g, x));
          for (int g = 0; g < hkv; ++g)
            for (int x = 0; x < dv; ++x) V.push_back(at(in.value, q0 + i, g, x));
          ++n_keys;
        }
    }
    for (int i = 0; i < q_len; ++i) {
      const int64_t t = q0 + i;
      const int64_t p = c.attn_type == AttentionType::decoder ? n_keys - q_len + i : i;
      for (int h = 0; h < hq; ++h) {
        const int g = h / (hq / hkv);
        std::vector<double> logits;
        std::vector<int> keys;
        for (int j = 0; j < n_keys; ++j) {
          bool visible = true;
          if (c.attn_type == AttentionType::decoder && causal_decoder) {
            visible = j <= p && (!c.sliding_window || j >= p - (*c.sliding_window - 1));
          } else if (c.attn_type != AttentionType::encoder_decoder && c.sliding_window) {
            visible = std::abs(j - p) <= *c.sliding_window - 1;
          }
          if (!visible) continue;
          double dot = 0;
          for (int x = 0; x < d; ++x)
            dot += at(in.query, t, h, x) * K[(static_cast<size_t>(j) * hkv + g) * d + x];
          double s = in.scale * (c.quant_query ? static_cast<double>(in.q_scale) : 1.0) * dot;  // q = q8 * q_scale
          if (c.soft_cap) s = *c.soft_cap * std::tanh(s / *c.soft_cap);
          if (c.alibi)
            s -= in.alibi_slopes[static_cast<size_t>(h)] * std::abs(static_cast<double>(p - j));
          logits.push_back(s);
          keys.push_back(j);
        }
        double m = c.sinks ? in.sinks[static_cast<size_t>(h)] : -kInf;
        for (double s : logits) m = std::max(m, s);
        double* out = &res.output[static_cast<size_t>((t * hq + h) * dv)];
        double& lse = res.lse[static_cast<size_t>(h * tokens + t)];
        if (m == -kInf) {
          lse = -kInf;
          continue;
        }
        double denom = c.sinks ? std::exp(in.sinks[static_cast<size_t>(h)] - m) : 0.0;
        for (size_t k = 0; k < logits.size(); ++k) {
          const double w = std::exp(logits[k] - m);
          denom += w;
          for (int x = 0; x < dv; ++x)
            out[x] += w * V[(static_cast<size_t>(keys[k]) * hkv + g) * dv + x];
        }
        for (int x = 0; x < dv; ++x) out[x] /= denom;
        lse = m + std::log(denom);
      }
    }
  }
  return res;
}

// Relative rounding bound of a store into `dtype` (half an ulp), a little widened.
double rounding_bound(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 1e-7;
    case DType::f16:
      return 0.5 * std::exp2(-10) * 1.05;
    case DType::bf16:
      return 0.5 * std::exp2(-7) * 1.05;
    default:
      return 0.5 * std::exp2(-3) * 1.05;  // fp8 e4m3
  }
}

struct Errors {
  double output = 0, lse = 0;
  int64_t lse_inf_mismatches = 0;
};

// ||reference - oracle|| / ||oracle||; fp8 outputs are compared after scaling back.
Errors errors_against_oracle(const CaseInputs& in, const BackendOutputs& ref,
                             const OracleResult& oracle) {
  const ConformanceCase& c = in.c;
  const int hq = c.num_heads, dv = c.value_head_size();
  const double out_scale = c.fp8_output ? in.output_scale : 1.0;
  double diff2 = 0, norm2 = 0;
  for (int64_t t = 0; t < in.num_actual_tokens; ++t)
    for (int h = 0; h < hq; ++h)
      for (int x = 0; x < dv; ++x) {
        const double expected = oracle.output[static_cast<size_t>((t * hq + h) * dv + x)];
        const double got = at(ref.output, t, h, x) * out_scale;
        diff2 += (got - expected) * (got - expected);
        norm2 += expected * expected;
      }
  Errors e;
  e.output = norm2 > 0 ? std::sqrt(diff2 / norm2) : std::sqrt(diff2);
  if (c.return_lse) {
    double ldiff2 = 0, lnorm2 = 0;
    for (int h = 0; h < hq; ++h)
      for (int64_t t = 0; t < in.num_actual_tokens; ++t) {
        const double expected = oracle.lse[static_cast<size_t>(h * in.num_actual_tokens + t)];
        const double got = load_f64(ref.output_lse.data(), DType::f32, h * in.num_tokens + t);
        if (std::isinf(expected) || std::isinf(got)) {
          e.lse_inf_mismatches += expected != got;
          continue;
        }
        ldiff2 += (got - expected) * (got - expected);
        lnorm2 += expected * expected;
      }
    e.lse = lnorm2 > 0 ? std::sqrt(ldiff2 / lnorm2) : std::sqrt(ldiff2);
  }
  return e;
}

// ---- random cases over every feature ----------------------------------------------------------

ConformanceCase base_case() {
  ConformanceCase c;
  c.head_size = 24;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.block_size = 4;
  c.return_lse = true;
  c.batch = {{0, 4}, {9, 1}, {6, 0}, {13, 5}, {3, 1}};
  return c;
}

std::vector<std::pair<std::string, ConformanceCase>> oracle_cases() {
  std::vector<std::pair<std::string, ConformanceCase>> cases;
  const auto add = [&cases](std::string name, auto edit) {
    ConformanceCase c = base_case();
    edit(c);
    cases.emplace_back(std::move(name), std::move(c));
  };
  add("causal_with_context", [](ConformanceCase&) {});
  add("normal_inputs_hnd", [](ConformanceCase& c) {
    c.distribution = Distribution::normal;
    c.layout = KVCacheLayout::HND;
  });
  add("gqa", [](ConformanceCase& c) {
    c.num_heads = 6;
    c.num_kv_heads = 2;
  });
  add("mqa_block1", [](ConformanceCase& c) {
    c.num_kv_heads = 1;
    c.block_size = 1;
  });
  add("window_decoder", [](ConformanceCase& c) { c.sliding_window = 3; });
  add("window_1", [](ConformanceCase& c) { c.sliding_window = 1; });
  add("soft_cap", [](ConformanceCase& c) { c.soft_cap = 0.7f; });
  add("alibi", [](ConformanceCase& c) { c.alibi = true; });
  add("sinks", [](ConformanceCase& c) { c.sinks = true; });
  add("everything_decoder", [](ConformanceCase& c) {
    c.sinks = true;
    c.alibi = true;
    c.soft_cap = 1.5f;
    c.sliding_window = 5;
    c.num_heads = 4;
    c.num_kv_heads = 2;
  });
  add("fp8_e4m3", [](ConformanceCase& c) { c.kv_cache_dtype = "fp8_e4m3"; });
  add("fp8_alias", [](ConformanceCase& c) { c.kv_cache_dtype = "fp8"; });
  add("fp8_e5m2_per_head", [](ConformanceCase& c) {
    c.kv_cache_dtype = "fp8_e5m2";
    c.per_head_kv_scales = true;
    c.num_kv_heads = 2;
  });
  add("kv_bfloat16", [](ConformanceCase& c) { c.kv_cache_dtype = "bfloat16"; });
  add("head_size_v_smaller", [](ConformanceCase& c) { c.head_size_v = 10; });
  add("head_size_v_larger", [](ConformanceCase& c) { c.head_size_v = 40; });
  add("fp8_output", [](ConformanceCase& c) { c.fp8_output = true; });
  add("quant_query_soft_cap_alibi", [](ConformanceCase& c) {  // q = q8 * q_scale before the cap
    c.kv_cache_dtype = "fp8_e4m3";
    c.quant_query = true;
    c.soft_cap = 1.f;
    c.alibi = true;
  });
  add("padded_tokens", [](ConformanceCase& c) { c.pad_tokens = 4; });
  add("empty_queries", [](ConformanceCase& c) { c.batch = {{0, 0}, {5, 0}, {7, 2}, {0, 0}}; });
  add("no_query_tokens", [](ConformanceCase& c) { c.batch = {{5, 0}, {0, 0}}; });
  add("no_query_tokens_padded", [](ConformanceCase& c) {
    c.batch = {{5, 0}};
    c.pad_tokens = 2;
  });
  add("encoder_only", [](ConformanceCase& c) {
    c.attn_type = AttentionType::encoder_only;
    c.batch = {{0, 6}, {0, 1}, {0, 0}, {0, 11}};
  });
  add("encoder_only_window_alibi", [](ConformanceCase& c) {
    c.attn_type = AttentionType::encoder_only;
    c.batch = {{0, 9}, {0, 3}};
    c.sliding_window = 3;
    c.alibi = true;
  });
  add("encoder_sinks_gqa", [](ConformanceCase& c) {
    c.attn_type = AttentionType::encoder;
    c.batch = {{0, 7}, {0, 2}};
    c.sinks = true;
    c.num_kv_heads = 2;
  });
  add("cross", [](ConformanceCase& c) {
    c.attn_type = AttentionType::encoder_decoder;
    c.batch = {{11, 1}, {6, 3}, {0, 0}, {9, 9}};
  });
  add("cross_sinks_soft_cap_fp8", [](ConformanceCase& c) {
    c.attn_type = AttentionType::encoder_decoder;
    c.batch = {{11, 2}, {4, 1}};
    c.sinks = true;
    c.soft_cap = 2.f;
    c.kv_cache_dtype = "fp8_e4m3";
  });
  add("cascade", [](ConformanceCase& c) {
    c.batch = {{9, 2}, {12, 1}, {8, 3}, {16, 1}};
    c.cascade_prefix = 8;
  });
  add("cascade_sinks_soft_cap_gqa", [](ConformanceCase& c) {
    c.batch = {{9, 2}, {12, 1}, {8, 0}, {16, 6}};
    c.cascade_prefix = 8;
    c.sinks = true;
    c.soft_cap = 1.f;
    c.num_kv_heads = 2;
  });
  add("f16", [](ConformanceCase& c) {
    c.dtype = DType::f16;
    c.sinks = true;
  });
  add("bf16_fp8", [](ConformanceCase& c) {
    c.dtype = DType::bf16;
    c.kv_cache_dtype = "fp8_e4m3";
  });
  add("bf16_encoder_only", [](ConformanceCase& c) {
    c.dtype = DType::bf16;
    c.attn_type = AttentionType::encoder_only;
    c.batch = {{0, 8}, {0, 3}};
  });
  return cases;
}

TEST(ReferenceOracle, RandomCasesOverEveryFeature) {
  uint64_t seed = 1000;
  for (const auto& [name, c] : oracle_cases()) {
    for (int repeat = 0; repeat < 2; ++repeat) {
      SCOPED_TRACE(name + " " + c.describe() + " seed " + std::to_string(seed));
      const CaseInputs in = make_inputs(c, seed++);
      const BackendOutputs ref = run_backend(reference(), Device::cpu, in);
      EXPECT_EQ(ref.used_cascade, c.cascade_prefix > 0);
      const OracleResult oracle = naive_attention(in);
      const Errors e = errors_against_oracle(in, ref, oracle);
      const double bound = rounding_bound(c.fp8_output ? DType::fp8_e4m3 : c.dtype);
      EXPECT_LE(e.output, bound);
      EXPECT_LE(e.lse, 1e-7);
      EXPECT_EQ(e.lse_inf_mismatches, 0);
      // The padded rows and the rows past num_actual_tokens are not written (poison stays).
      for (int64_t t = in.num_actual_tokens; t < in.num_tokens; ++t) {
        EXPECT_TRUE(std::isnan(at(ref.output, t, 0, 0))) << "row " << t;
      }
    }
  }
}

// The cascade path (prefix pass over the shared blocks + suffix pass, merged by LSE) equals the
// one-pass path on the same inputs, with and without sinks.
TEST(ReferenceOracle, CascadeEqualsNoCascade) {
  for (bool sinks : {false, true}) {
    ConformanceCase c = base_case();
    c.batch = {{12, 3}, {20, 1}, {12, 0}, {13, 8}};
    c.cascade_prefix = 12;
    c.sinks = sinks;
    c.num_kv_heads = 2;
    const CaseInputs in = make_inputs(c, 77 + sinks);
    const BackendOutputs cascade = run_backend(reference(), Device::cpu, in);
    const BackendOutputs plain = run_backend(reference(), Device::cpu, in, RunOptions{0});
    ASSERT_TRUE(cascade.used_cascade);
    ASSERT_FALSE(plain.used_cascade);
    const ConformanceResult r = compare(in, cascade, plain);
    EXPECT_LE(r.output_rel_error, 1e-7) << r.describe();
    EXPECT_LE(r.lse_rel_error, 1e-7) << r.describe();
    EXPECT_TRUE(r.all_written);
  }
}

// A decoder step with common.causal = false: no causal mask, symmetric window.
TEST(ReferenceOracle, NonCausalDecoderStep) {
  for (std::optional<int> window : {std::optional<int>(), std::optional<int>(4)}) {
    ConformanceCase c = base_case();
    c.sliding_window = window;
    c.sinks = true;
    const CaseInputs in = make_inputs(c, 99);
    RunOptions options;
    options.causal = false;
    const BackendOutputs ref = run_backend(reference(), Device::cpu, in, options);
    const Errors e = errors_against_oracle(in, ref, naive_attention(in, false));
    EXPECT_LE(e.output, rounding_bound(c.dtype));
    EXPECT_LE(e.lse, 1e-7);
    // And it differs from the causal result (the mask matters on these inputs).
    const Errors causal = errors_against_oracle(in, ref, naive_attention(in, true));
    EXPECT_GT(causal.output, 1e-2);
  }
}

// ---- hand-worked vectors --------------------------------------------------------------------
//
// One request, no context, two tokens (f32, D = 2, one head, scale 1):
//   q0 = q1 = [1, 0]   k0 = [1, 0]   k1 = [0, 1]   v0 = [1, 2]   v1 = [3, 4]
// Causal: token 0 (position 0) sees k0 only:  s = 1        -> out = v0 = [1, 2], LSE = 1.
// Token 1 (position 1) sees k0, k1:            s = [1, 0]
//   p = [e/(e+1), 1/(e+1)] = [0.7310585786300049, 0.2689414213699951]
//   out = [(e+3)/(e+1), (2e+4)/(e+1)] = [1.5378828427399902, 2.5378828427399900]
//   LSE = ln(e+1) = 1.3132616875182228

Tensor f32_tensor(Shape shape, std::vector<float> values) {
  Tensor t(shape, DType::f32, Device::cpu);
  EXPECT_EQ(t.numel(), static_cast<int64_t>(values.size()));
  std::copy(values.begin(), values.end(), t.data_as<float>());
  return t;
}

struct Tiny {
  ConformanceCase c;
  Tiny() {
    c.head_size = 2;
    c.num_heads = 1;
    c.num_kv_heads = 1;
    c.block_size = 1;  // each token in its own (shuffled) block
    c.return_lse = true;
    c.batch = {{0, 2}};
  }
  // Inputs for the two-token request with the values above (overridable).
  CaseInputs inputs(std::vector<float> q = {1, 0, 1, 0}, std::vector<float> v = {1, 2, 3, 4},
                    std::vector<float> k = {1, 0, 0, 1}) const {
    CaseInputs in = make_inputs(c, 3);
    const int64_t t = in.num_tokens;
    in.scale = 1.f;
    in.query = f32_tensor(Shape{t, c.num_heads, 2}, std::move(q));
    if (c.attn_type == AttentionType::encoder_decoder) {
      in.context_key = f32_tensor(Shape{2, 1, 2}, std::move(k));
      in.context_value = f32_tensor(Shape{2, 1, c.value_head_size()}, std::move(v));
    } else {
      in.key = f32_tensor(Shape{t, 1, 2}, std::move(k));
      in.value = f32_tensor(Shape{t, 1, c.value_head_size()}, std::move(v));
    }
    return in;
  }
};

double out_at(const BackendOutputs& o, int64_t t, int64_t h, int64_t d) {
  return at(o.output, t, h, d);
}
double lse_at(const BackendOutputs& o, const CaseInputs& in, int64_t h, int64_t t) {
  return load_f64(o.output_lse.data(), DType::f32, h * in.num_tokens + t);
}

constexpr double kTol = 1e-6;

TEST(ReferenceHandWorked, TwoKeysCausal) {
  Tiny tiny;
  const CaseInputs in = tiny.inputs();
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 0, 0, 0), 1.0, kTol);
  EXPECT_NEAR(out_at(o, 0, 0, 1), 2.0, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 0), 1.0, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 1.5378828427399902, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 1), 2.5378828427399900, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 1), 1.3132616875182228, kTol);
}

// A sink logit 0 adds e^0 = 1 to the denominator only.
//   token 0: out = e/(e+1) v0 = [0.7310585786300049, 1.4621171572600098], LSE = ln(e+1)
//   token 1: out = (e v0 + v1)/(e+2) = [(e+3)/(e+2), (2e+4)/(e+2)] = [1.2119415576170856, 2],
//            LSE = ln(e+2) = 1.5514447139320509
TEST(ReferenceHandWorked, SinkJoinsTheDenominatorOnly) {
  Tiny tiny;
  tiny.c.sinks = true;
  CaseInputs in = tiny.inputs();
  in.sinks = {0.f};
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 0, 0, 0), 0.7310585786300049, kTol);
  EXPECT_NEAR(out_at(o, 0, 0, 1), 1.4621171572600098, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 0), 1.3132616875182228, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 1.2119415576170856, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 1), 2.0, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 1), 1.5514447139320509, kTol);
}

// Soft-cap c = 1: s = tanh(s): token 1 logits [tanh 1, 0] = [0.7615941559557649, 0];
//   out = [(e^t + 3)/(e^t + 1), (2e^t + 4)/(e^t + 1)] = [1.6366005156109475, 2.6366005156109473]
//   LSE = ln(e^t + 1) = 1.14476013474948; token 0: LSE = tanh 1.
TEST(ReferenceHandWorked, SoftCap) {
  Tiny tiny;
  tiny.c.soft_cap = 1.f;
  const CaseInputs in = tiny.inputs();
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(lse_at(o, in, 0, 0), 0.7615941559557649, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 1.6366005156109475, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 1), 2.6366005156109473, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 1), 1.14476013474948, kTol);
}

// ALiBi slope 0.5: token 1 at position 1: s = [1 - 0.5*|1-0|, 0 - 0] = [0.5, 0];
//   out = [(e^.5 + 3)/(e^.5 + 1), (2e^.5 + 4)/(e^.5 + 1)] = [1.7550813375962908, 2.755081337596291]
//   LSE = ln(e^.5 + 1) = 0.9740769841801067; token 0: distance 0, LSE = 1.
TEST(ReferenceHandWorked, AlibiCanonicalForm) {
  Tiny tiny;
  tiny.c.alibi = true;
  CaseInputs in = tiny.inputs();
  in.alibi_slopes = {0.5f};
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(lse_at(o, in, 0, 0), 1.0, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 1.7550813375962908, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 1), 2.755081337596291, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 1), 0.9740769841801067, kTol);
}

// Window W = 1: each token sees only itself: token 1 -> v1 = [3, 4], LSE = q1.k1 = 0.
TEST(ReferenceHandWorked, WindowOfOne) {
  Tiny tiny;
  tiny.c.sliding_window = 1;
  const CaseInputs in = tiny.inputs();
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 0, 0, 0), 1.0, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 3.0, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 1), 4.0, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 1), 0.0, kTol);
}

// encoder_only is non-causal: token 0 (q0 = [1, 0]) sees both keys: the token-1 numbers above;
// token 1 with q1 = [0, 1]: s = [0, 1] -> out = [(1 + 3e)/(1+e), (2 + 4e)/(1+e)]
//   = [2.46211715726001, 3.4621171572600096], LSE = ln(1+e).
TEST(ReferenceHandWorked, EncoderOnlyIsNonCausal) {
  Tiny tiny;
  tiny.c.attn_type = AttentionType::encoder_only;
  const CaseInputs in = tiny.inputs({1, 0, 0, 1});
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 0, 0, 0), 1.5378828427399902, kTol);
  EXPECT_NEAR(out_at(o, 0, 0, 1), 2.5378828427399900, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 2.46211715726001, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 1), 3.4621171572600096, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 1), 1.3132616875182228, kTol);
}

// GQA: two query heads share the one KV head; head 1 has q = [0, 1] on token 1.
TEST(ReferenceHandWorked, GqaHeadsShareTheKvHead) {
  Tiny tiny;
  tiny.c.num_heads = 2;
  const CaseInputs in = tiny.inputs({1, 0, 1, 0, /*token 1:*/ 1, 0, 0, 1});
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 1.5378828427399902, kTol);
  EXPECT_NEAR(out_at(o, 1, 1, 0), 2.46211715726001, kTol);
  EXPECT_NEAR(out_at(o, 1, 1, 1), 3.4621171572600096, kTol);
  EXPECT_NEAR(lse_at(o, in, 1, 1), 1.3132616875182228, kTol);
}

// fp8 e4m3 cache, k_scale 0.5, v_scale 2: k0 = [0.7, 0] is stored as e4m3(1.4) = 1.375 and read
// as 1.375 * 0.5 = 0.6875; values 1..4 are stored as 0.5..2 (exact) and read back exactly.
//   token 1: s = [0.6875, 0] -> out0 = (e^.6875 + 3)/(e^.6875 + 1) = 1.669178882506372,
//   out1 = out0 + 1, LSE = ln(e^.6875 + 1) = 1.0948510472537265.
TEST(ReferenceHandWorked, Fp8CacheDequantizes) {
  Tiny tiny;
  tiny.c.kv_cache_dtype = "fp8_e4m3";
  CaseInputs in = tiny.inputs();
  in.key = f32_tensor(Shape{2, 1, 2}, {0.7f, 0, 0, 1});
  in.k_scale = 0.5f;
  in.v_scale = 2.f;
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 1.669178882506372, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 1), 2.669178882506372, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 1), 1.0948510472537265, kTol);
}

// head_size_v = 3 != head_size = 2: v0 = [1, 2, 5], v1 = [3, 4, 6];
//   token 1 out2 = (5e + 6)/(e + 1) = 5.268941421369995.
TEST(ReferenceHandWorked, ValueHeadSizeDiffers) {
  Tiny tiny;
  tiny.c.head_size_v = 3;
  const CaseInputs in = tiny.inputs({1, 0, 1, 0}, {1, 2, 5, 3, 4, 6});
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 1, 0, 0), 1.5378828427399902, kTol);
  EXPECT_NEAR(out_at(o, 1, 0, 2), 5.268941421369995, kTol);
  EXPECT_NEAR(out_at(o, 0, 0, 2), 5.0, kTol);
}

// fp8 output with output_scale 0.25: token 1 -> [1.53788/0.25, 2.53788/0.25] = [6.1515, 10.1515]
// -> nearest e4m3 [6, 10]; token 0 -> [4, 8]. With output_scale 1/512 the 787.4 saturates to 448.
TEST(ReferenceHandWorked, Fp8OutputRoundsAndSaturates) {
  Tiny tiny;
  tiny.c.fp8_output = true;
  CaseInputs in = tiny.inputs();
  in.output_scale = 0.25f;
  BackendOutputs o = run_backend(reference(), Device::cpu, in);
  ASSERT_EQ(o.output.dtype(), DType::fp8_e4m3);
  EXPECT_EQ(out_at(o, 1, 0, 0), 6.0);
  EXPECT_EQ(out_at(o, 1, 0, 1), 10.0);
  EXPECT_EQ(out_at(o, 0, 0, 0), 4.0);
  EXPECT_EQ(out_at(o, 0, 0, 1), 8.0);
  in.output_scale = 1.f / 512.f;
  o = run_backend(reference(), Device::cpu, in);
  EXPECT_EQ(out_at(o, 1, 0, 0), 448.0);
}

// Cross-attention: one decoder query [1, 0] over the two cached encoder tokens (non-causal):
// the token-1 numbers of TwoKeysCausal.
TEST(ReferenceHandWorked, CrossAttentionSeesEveryEncoderToken) {
  Tiny tiny;
  tiny.c.attn_type = AttentionType::encoder_decoder;
  tiny.c.batch = {{2, 1}};
  const CaseInputs in = tiny.inputs({1, 0});
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 0, 0, 0), 1.5378828427399902, kTol);
  EXPECT_NEAR(out_at(o, 0, 0, 1), 2.5378828427399900, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 0), 1.3132616875182228, kTol);
}

// Decoder with context: the same two tokens, token 0 already cached (context 1, query 1): the
// query is token 1 at position 1 and sees both.
TEST(ReferenceHandWorked, DecodeOverCachedContext) {
  Tiny tiny;
  tiny.c.batch = {{1, 1}};
  CaseInputs in = tiny.inputs({1, 0}, {3, 4}, {0, 1});
  in.context_key = f32_tensor(Shape{1, 1, 2}, {1, 0});
  in.context_value = f32_tensor(Shape{1, 1, 2}, {1, 2});
  const BackendOutputs o = run_backend(reference(), Device::cpu, in);
  EXPECT_NEAR(out_at(o, 0, 0, 0), 1.5378828427399902, kTol);
  EXPECT_NEAR(out_at(o, 0, 0, 1), 2.5378828427399900, kTol);
  EXPECT_NEAR(lse_at(o, in, 0, 0), 1.3132616875182228, kTol);
}

}  // namespace
}  // namespace pagedattn::conformance
