// AttentionLayerParams::calculate_kv_scales (vLLM's calculate_kv_scales): the first batch a layer
// writes into its fp8 cache sets k_scale / v_scale = amax / fp8 max (448 e4m3, 57344 e5m2) over
// the rows it writes (a padding row is not measured), later batches never change them, and the
// layer then computes exactly what a layer given those scales computes. Also: the all-zero batch
// (the scale waits), the no-op on a 16-bit cache, and the rejected combinations (kv sharing,
// per-head scales, non-finite keys / values) with the cache byte-identical after each.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

constexpr int kNumBlocks = 12;
constexpr int kBlockSize = 16;
constexpr int kHq = 4, kHkv = 2, kD = 32;
// Request r owns block kBlocks[r]; every step fits in it.
constexpr int kBlocks[] = {3, 7};

AttentionLayerParams layer_params(const char* backend, const char* kv_cache_dtype, DType dtype,
                                  bool calculate) {
  AttentionLayerParams p;
  p.num_heads = kHq;
  p.num_kv_heads = kHkv;
  p.head_size = kD;
  p.dtype = dtype;
  p.kv_cache_dtype = kv_cache_dtype;
  p.block_size = kBlockSize;
  p.backend = backend;
  p.prefix = "model.layers.2.self_attn.attn";
  p.calculate_kv_scales = calculate;
  return p;
}

// Fills t with uniform(-amplitude, amplitude) (amplitude 0: zeros).
void fill(const Tensor& t, float amplitude, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    store_f32(t.data(), t.dtype(), i, amplitude == 0.f ? 0.f : amplitude * dist(rng));
  }
}

// One step: request r has num_computed[r] cached tokens and query_lens[r] new ones, plus one
// padding row at the end (slot -1, num_actual_tokens excludes it) holding `padding` in key/value.
// skipped_token >= 0: that token's slot is -1 too (not cached) and its key/value hold `padding`.
struct Step {
  Tensor query, key, value;
  int num_tokens = 0;  // actual tokens (the padding row not counted)
  OwnedCommonAttentionMetadata common;
};

Step make_step(DType dtype, std::vector<int> num_computed, std::vector<int> query_lens,
               float k_amplitude, float v_amplitude, std::mt19937& rng, float padding = 1000.f,
               int skipped_token = -1) {
  Step s;
  CommonAttentionMetadataArgs args;
  args.query_start_loc.push_back(0);
  for (size_t r = 0; r < query_lens.size(); ++r) {
    for (int i = 0; i < query_lens[r]; ++i) {
      args.slot_mapping.push_back(int64_t{kBlocks[r]} * kBlockSize + num_computed[r] + i);
    }
    args.query_start_loc.push_back(args.query_start_loc.back() + query_lens[r]);
    args.seq_lens.push_back(num_computed[r] + query_lens[r]);
    args.block_table.push_back(kBlocks[r]);
  }
  args.max_num_blocks_per_req = 1;
  if (skipped_token >= 0) args.slot_mapping.at(skipped_token) = -1;
  s.num_tokens = args.query_start_loc.back();
  args.num_tokens_padded = s.num_tokens + 1;
  s.common = make_common_attention_metadata(args, Device::cpu, kNumBlocks, kBlockSize);
  const int rows = s.num_tokens + 1;
  s.query = Tensor(Shape{rows, kHq, kD}, dtype);
  s.key = Tensor(Shape{rows, kHkv, kD}, dtype);
  s.value = Tensor(Shape{rows, kHkv, kD}, dtype);
  fill(s.query, 1.f, rng);
  fill(s.key, k_amplitude, rng);
  fill(s.value, v_amplitude, rng);
  for (const Tensor* t : {&s.key, &s.value}) {
    for (int64_t i = int64_t{s.num_tokens} * kHkv * kD; i < t->numel(); ++i) {
      store_f32(t->data(), dtype, i, i % 2 ? padding : -padding);
    }
    for (int64_t i = 0; skipped_token >= 0 && i < kHkv * kD; ++i) {
      store_f32(t->data(), dtype, skipped_token * kHkv * kD + i, padding);
    }
  }
  return s;
}

// max |x| over the first `rows` rows of x (the rows the step writes).
float amax_of(const Tensor& x, int rows) {
  float m = 0.f;
  for (int64_t i = 0; i < int64_t{rows} * kHkv * kD; ++i) {
    m = std::max(m, std::fabs(load_f32(x.data(), x.dtype(), i)));
  }
  return m;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

// A layer with its zeroed cache and its builder; run() plans and runs one step.
struct LayerUnderTest {
  explicit LayerUnderTest(const AttentionLayerParams& p)
      : layer(p), cache(layer.allocate_kv_cache(kNumBlocks)),
        builder(layer.backend().make_builder(layer.kv_cache_spec(),
                                             layer.builder_config(4, 64, 64), Device::cpu)) {
    cache.fill_bytes(0);
  }
  Tensor run(const Step& s) {
    std::shared_ptr<const AttentionMetadata> md = builder->build(0, s.common.common);
    Tensor out(Shape{s.num_tokens + 1, kHq, kD}, layer.params().dtype);
    out.fill_bytes(0);
    layer.forward(s.query, s.key, s.value, cache, *md, out);
    return out;
  }
  Attention layer;
  Tensor cache;
  std::unique_ptr<AttentionMetadataBuilder> builder;
};

struct ScalesCase {
  const char* backend;
  const char* kv_cache_dtype;
  DType dtype;
  float fp8_max;
  const char* name;
};

class CalculateKvScales : public ::testing::TestWithParam<ScalesCase> {};

TEST_P(CalculateKvScales, FirstBatchSetsAmaxOverFp8MaxThenNeverChanges) {
  const ScalesCase c = GetParam();
  std::mt19937 rng(4711 + static_cast<int>(c.dtype));
  LayerUnderTest measuring(layer_params(c.backend, c.kv_cache_dtype, c.dtype, true));
  EXPECT_TRUE(measuring.layer.kv_scales_pending());
  EXPECT_EQ(measuring.layer.scales().k_scale, 1.f);

  // Step 1: two prefills (5 and 3 tokens) + a padding row of +-1000 that must not be measured.
  const Step first = make_step(c.dtype, {0, 0}, {5, 3}, 3.f, 0.6f, rng);
  const Tensor out1 = measuring.run(first);
  const float want_k = amax_of(first.key, first.num_tokens) / c.fp8_max;
  const float want_v = amax_of(first.value, first.num_tokens) / c.fp8_max;
  EXPECT_EQ(measuring.layer.scales().k_scale, want_k);
  EXPECT_EQ(measuring.layer.scales().v_scale, want_v);
  EXPECT_NE(want_k, want_v);
  EXPECT_FALSE(measuring.layer.kv_scales_pending());

  // The batch fills the fp8 range: its largest |key| is stored as the format's max.
  const KVCacheViews halves = split_kv_cache(measuring.cache, kD, kD);
  const DType cache_dtype = measuring.layer.kv_cache_storage_dtype();
  float stored_max = 0.f;
  for (int slot = 0; slot < 5; ++slot) {
    for (int h = 0; h < kHkv; ++h) {
      for (int64_t e = 0; e < kD; ++e) {
        const int64_t idx[] = {kBlocks[0], slot, h, e};
        stored_max = std::max(
            stored_max, std::fabs(load_f32(halves.key_cache.element_ptr(idx), cache_dtype, 0)));
      }
    }
  }
  for (int slot = 0; slot < 3; ++slot) {
    for (int h = 0; h < kHkv; ++h) {
      for (int64_t e = 0; e < kD; ++e) {
        const int64_t idx[] = {kBlocks[1], slot, h, e};
        stored_max = std::max(
            stored_max, std::fabs(load_f32(halves.key_cache.element_ptr(idx), cache_dtype, 0)));
      }
    }
  }
  EXPECT_EQ(stored_max, c.fp8_max);

  // A layer given those scales explicitly computes the same bits (cache and output).
  LayerUnderTest given(layer_params(c.backend, c.kv_cache_dtype, c.dtype, false));
  given.layer.scales().k_scale = want_k;
  given.layer.scales().v_scale = want_v;
  const Tensor given_out1 = given.run(first);
  EXPECT_EQ(bytes_of(measuring.cache), bytes_of(given.cache));
  EXPECT_EQ(bytes_of(out1), bytes_of(given_out1));

  // Step 2: a decode per request with 8x larger keys/values: the scales stay.
  const Step second = make_step(c.dtype, {5, 3}, {1, 1}, 24.f, 4.8f, rng);
  ASSERT_GT(amax_of(second.key, second.num_tokens) / c.fp8_max, want_k);
  const Tensor out2 = measuring.run(second);
  EXPECT_EQ(measuring.layer.scales().k_scale, want_k);
  EXPECT_EQ(measuring.layer.scales().v_scale, want_v);
  const Tensor given_out2 = given.run(second);
  EXPECT_EQ(bytes_of(measuring.cache), bytes_of(given.cache));
  EXPECT_EQ(bytes_of(out2), bytes_of(given_out2));
}

INSTANTIATE_TEST_SUITE_P(
    Backends, CalculateKvScales,
    ::testing::Values(ScalesCase{"CPU", "fp8_e4m3", DType::bf16, 448.f, "cpu_e4m3_bf16"},
                      ScalesCase{"REFERENCE", "fp8_e4m3", DType::f32, 448.f, "reference_e4m3_f32"},
                      ScalesCase{"CPU", "fp8_e5m2", DType::f16, 57344.f, "cpu_e5m2_f16"},
                      ScalesCase{"REFERENCE", "fp8_e5m2", DType::bf16, 57344.f,
                                 "reference_e5m2_bf16"},
                      ScalesCase{"CPU", "fp8", DType::f32, 448.f, "cpu_fp8_alias_f32"}),
    [](const ::testing::TestParamInfo<ScalesCase>& info) { return std::string(info.param.name); });

// amax 0 (or an amax whose quotient underflows to 0) keeps the scale and measures it later; k
// and v are measured independently.
TEST(CalculateKvScalesZeroBatch, ScaleWaitsForTheFirstNonzeroBatch) {
  for (const char* backend : {"CPU", "REFERENCE"}) {
    SCOPED_TRACE(backend);
    std::mt19937 rng(99);
    LayerUnderTest lut(layer_params(backend, "fp8_e4m3", DType::f32, true));
    // Step 1: keys and values all zero.
    lut.run(make_step(DType::f32, {0, 0}, {2, 1}, 0.f, 0.f, rng));
    EXPECT_EQ(lut.layer.scales().k_scale, 1.f);
    EXPECT_EQ(lut.layer.scales().v_scale, 1.f);
    EXPECT_TRUE(lut.layer.kv_scales_pending());
    // Step 2: keys of at most 1e-44 (amax / 448 underflows to 0), values random.
    Step second = make_step(DType::f32, {2, 1}, {1, 1}, 0.f, 2.f, rng);
    for (int64_t i = 0; i < int64_t{second.num_tokens} * kHkv * kD; ++i) {
      second.key.data_as<float>()[i] = i % 3 ? 1e-44f : -1e-44f;
    }
    ASSERT_EQ(1e-44f / 448.f, 0.f);
    lut.run(second);
    const float want_v = amax_of(second.value, second.num_tokens) / 448.f;
    EXPECT_EQ(lut.layer.scales().k_scale, 1.f);
    EXPECT_EQ(lut.layer.scales().v_scale, want_v);
    EXPECT_TRUE(lut.layer.kv_scales_pending());  // k still waits
    // Step 3: nonzero keys set k_scale; larger values leave v_scale.
    const Step third = make_step(DType::f32, {3, 2}, {2, 1}, 1.5f, 20.f, rng);
    lut.run(third);
    EXPECT_EQ(lut.layer.scales().k_scale, amax_of(third.key, third.num_tokens) / 448.f);
    EXPECT_EQ(lut.layer.scales().v_scale, want_v);
    EXPECT_FALSE(lut.layer.kv_scales_pending());
  }
}

// A 16-bit cache ignores scales: the option is accepted (as vLLM) and changes nothing.
TEST(CalculateKvScalesNoOp, SixteenBitCacheKeepsScalesAndBits) {
  std::mt19937 rng(7);
  LayerUnderTest with(layer_params("CPU", "auto", DType::bf16, true));
  LayerUnderTest without(layer_params("CPU", "auto", DType::bf16, false));
  EXPECT_FALSE(with.layer.kv_scales_pending());
  const Step s = make_step(DType::bf16, {0, 0}, {4, 2}, 5.f, 5.f, rng);
  const Tensor out_with = with.run(s);
  const Tensor out_without = without.run(s);
  EXPECT_EQ(with.layer.scales().k_scale, 1.f);
  EXPECT_EQ(with.layer.scales().v_scale, 1.f);
  EXPECT_EQ(bytes_of(out_with), bytes_of(out_without));
  EXPECT_EQ(bytes_of(with.cache), bytes_of(without.cache));
}

// ---- rejected combinations: Error naming the argument; nothing written, nothing measured -------

TEST(CalculateKvScalesErrors, KvSharingLayerIsRejectedAtConstruction) {
  StaticForwardContext ctx;
  AttentionLayerParams target = layer_params("CPU", "fp8_e4m3", DType::f32, false);
  target.prefix = "model.layers.0.attn";
  Attention target_layer(target, &ctx);
  AttentionLayerParams sharing = layer_params("CPU", "fp8_e4m3", DType::f32, true);
  sharing.prefix = "model.layers.1.attn";
  sharing.kv_sharing_target_layer_name = "model.layers.0.attn";
  try {
    Attention layer(sharing, &ctx);
    ADD_FAILURE() << "expected an Error naming calculate_kv_scales";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "calculate_kv_scales") << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("calculate_kv_scales = true"), std::string::npos) << what;
    EXPECT_NE(what.find("kv_sharing_target_layer_name = 'model.layers.0.attn'"), std::string::npos)
        << what;
    EXPECT_NE(what.find("model.layers.1.attn"), std::string::npos) << what;
  }
  EXPECT_EQ(ctx.layers().size(), 1u);
}

class CalculateKvScalesRejected : public ::testing::Test {
 protected:
  void SetUp() override {
    lut = std::make_unique<LayerUnderTest>(layer_params("CPU", "fp8_e4m3", DType::f32, true));
    fill(lut->cache, 1.f, rng);  // fp8 bytes of +-448 range: a changed byte shows
    before = bytes_of(lut->cache);
    step = make_step(DType::f32, {0, 0}, {3, 2}, 2.f, 1.f, rng);
  }

  void expect_rejected(const std::string& argument, const std::vector<std::string>& phrases) {
    try {
      lut->run(step);
      ADD_FAILURE() << "expected an Error naming '" << argument << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      for (const std::string& phrase : phrases) {
        EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos)
            << "'" << phrase << "' not in: " << e.what();
      }
    }
    EXPECT_EQ(bytes_of(lut->cache), before) << "cache modified by a rejected forward";
    EXPECT_EQ(lut->layer.scales().k_scale, 1.f);
    EXPECT_EQ(lut->layer.scales().v_scale, 1.f);
    EXPECT_TRUE(lut->layer.kv_scales_pending());
  }

  // After the rejection, the same layer measures the clean step.
  void expect_recovers(const Step& clean) {
    lut->run(clean);
    EXPECT_EQ(lut->layer.scales().k_scale, amax_of(clean.key, clean.num_tokens) / 448.f);
    EXPECT_EQ(lut->layer.scales().v_scale, amax_of(clean.value, clean.num_tokens) / 448.f);
    EXPECT_FALSE(lut->layer.kv_scales_pending());
  }

  std::mt19937 rng{1234};
  std::unique_ptr<LayerUnderTest> lut;
  std::vector<uint8_t> before;
  Step step;
};

TEST_F(CalculateKvScalesRejected, PerHeadScales) {
  Tensor per_head(Shape{kHkv}, DType::f32);
  per_head.data_as<float>()[0] = 0.25f;
  per_head.data_as<float>()[1] = 0.5f;
  lut->layer.scales().k_scale_per_head = per_head;
  expect_rejected("calculate_kv_scales",
                  {"model.layers.2.self_attn.attn", "calculate_kv_scales = true",
                   "k_scale_per_head is set"});
  lut->layer.scales().k_scale_per_head = TensorView{};
  lut->layer.scales().v_scale_per_head = per_head;
  expect_rejected("calculate_kv_scales", {"calculate_kv_scales = true", "v_scale_per_head is set"});
  lut->layer.scales().v_scale_per_head = TensorView{};
  expect_recovers(step);
}

TEST_F(CalculateKvScalesRejected, NonFiniteKey) {
  const Step clean = make_step(DType::f32, {0, 0}, {3, 2}, 2.f, 1.f, rng);
  step.key.data_as<float>()[kHkv * kD + 5] = std::numeric_limits<float>::infinity();
  expect_rejected("key", {"model.layers.2.self_attn.attn", "calculate_kv_scales",
                          "amax |key| = inf"});
  step.key.data_as<float>()[kHkv * kD + 5] = -std::numeric_limits<float>::quiet_NaN();
  expect_rejected("key", {"amax |key| = nan"});
  expect_recovers(clean);
}

TEST_F(CalculateKvScalesRejected, NonFiniteValue) {
  const Step clean = make_step(DType::f32, {0, 0}, {3, 2}, 2.f, 1.f, rng);
  step.value.data_as<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  expect_rejected("value", {"calculate_kv_scales", "amax |value| = nan"});
  expect_recovers(clean);
}

// Rows that are not written (slot -1: a padding row past num_actual_tokens, and token 1, a real
// token the caller does not cache) are not measured: an infinity there is no error.
TEST_F(CalculateKvScalesRejected, UnwrittenRowsAreNotMeasured) {
  const float inf = std::numeric_limits<float>::infinity();
  const Step s = make_step(DType::f32, {0, 0}, {3, 2}, 2.f, 1.f, rng, inf, /*skipped_token=*/1);
  lut->run(s);
  float k_amax = 0.f, v_amax = 0.f;
  for (int t = 0; t < s.num_tokens; ++t) {
    if (t == 1) continue;
    for (int64_t i = int64_t{t} * kHkv * kD; i < int64_t{t + 1} * kHkv * kD; ++i) {
      k_amax = std::max(k_amax, std::fabs(s.key.data_as<float>()[i]));
      v_amax = std::max(v_amax, std::fabs(s.value.data_as<float>()[i]));
    }
  }
  EXPECT_EQ(lut->layer.scales().k_scale, k_amax / 448.f);
  EXPECT_EQ(lut->layer.scales().v_scale, v_amax / 448.f);
  EXPECT_FALSE(lut->layer.kv_scales_pending());
}

}  // namespace
}  // namespace pagedattn
