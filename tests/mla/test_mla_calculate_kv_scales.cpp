// MLAAttention's calculate_kv_scales (include/pagedattn/mla.h): the first batch written into an
// fp8 latent cache sets k_scale = amax(|kv_c_normed|, |k_pe|) / fp8 max over the rows it stores;
// then it never changes. An all-zero batch waits; non-finite values, kv sharing and per-head
// scales are Errors, and a rejected forward leaves the cache and the scale unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/ops_test_util.h"
#include "conformance/mla_harness.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

using testing_ops::expect_error;

constexpr int kL = 64, kR = 16, kHeads = 4;  // small_mla_layer_params'

MLAAttentionLayerParams small_params(const std::string& backend, const std::string& kv_cache_dtype,
                                     const std::string& prefix = "layers.0.mla") {
  MLAAttentionLayerParams p = conformance::mla::small_mla_layer_params(backend, DType::bf16);
  p.kv_cache_dtype = kv_cache_dtype;
  p.prefix = prefix;
  p.calculate_kv_scales = true;
  return p;
}

Tensor random_bf16(Shape shape, float amplitude, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(0.05f, 1.f);
  Tensor t(shape, DType::bf16);
  for (int64_t i = 0; i < t.numel(); ++i) {
    store_f32(t.data(), DType::bf16, i, (i % 2 ? -1.f : 1.f) * amplitude * dist(rng));
  }
  return t;
}

float amax(const Tensor& t) {
  float m = 0.f;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(load_f32(t.data(), t.dtype(), i)));
  return m;
}

// A decode and a 2-token prefill over a 4-block cache (slots 4, 32, 33).
struct Step {
  Step(const std::string& backend, const std::string& kv_cache_dtype, float amplitude, uint32_t seed)
      : rng(seed),
        layer(small_params(backend, kv_cache_dtype)),
        cache(layer.allocate_kv_cache(4)),
        q(random_bf16(Shape{3, kHeads, 32 + kR}, 1.f, rng)),
        kv(random_bf16(Shape{3, kL}, amplitude, rng)),
        pe(random_bf16(Shape{3, kR}, amplitude * 1.5f, rng)),
        out(Shape{3, kHeads, 32}, DType::bf16) {
    layer.process_weights_after_loading(random_bf16(Shape{kHeads * 64, kL}, 0.1f, rng));
    cache.fill_bytes(0);
    common = std::make_unique<OwnedCommonAttentionMetadata>(conformance::mla::small_mla_step_metadata());
    builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(2, 8, 64), Device::cpu);
    plan = builder->build(0, common->common);
  }
  void forward() { layer.forward(q, kv, pe, cache, *plan, out); }
  // The cache row of slot s, decoded (times nothing: the stored fp8 values).
  float stored(int64_t slot, int col) const {
    const int64_t row = (slot / 16) * 16 + slot % 16;
    return load_f32(cache.data(), cache.dtype(), row * (kL + kR) + col);
  }
  std::vector<uint8_t> bytes() const {
    const auto* p = static_cast<const uint8_t*>(cache.data());
    return {p, p + cache.nbytes()};
  }
  std::mt19937 rng;
  MLAAttention layer;
  Tensor cache, q, kv, pe, out;
  std::unique_ptr<OwnedCommonAttentionMetadata> common;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  std::shared_ptr<const AttentionMetadata> plan;
};

TEST(MLACalculateKvScales, FirstBatchSetsAmaxOverFp8MaxThenNeverChanges) {
  for (const char* backend : {"REFERENCE_MLA", "CPU_MLA"}) {
    for (const char* kv : {"fp8_e4m3", "fp8_e5m2"}) {
      SCOPED_TRACE(std::string(backend) + " " + kv);
      Step s(backend, kv, 3.f, 7);
      EXPECT_TRUE(s.layer.kv_scales_pending());
      const float range = fp8_max_finite(s.layer.kv_cache_storage_dtype());
      const float want = std::max(amax(s.kv), amax(s.pe)) / range;
      s.forward();
      EXPECT_FALSE(s.layer.kv_scales_pending());
      EXPECT_EQ(s.layer.scales().k_scale, want);
      // The batch fills the fp8 range: its largest element is stored as the format's max.
      float stored_max = 0.f;
      for (const int64_t slot : {4, 32, 33}) {
        for (int c = 0; c < kL + kR; ++c) stored_max = std::max(stored_max, std::fabs(s.stored(slot, c)));
      }
      EXPECT_EQ(stored_max, range);
      // Later batches (larger values) keep the scale.
      s.kv = random_bf16(Shape{3, kL}, 50.f, s.rng);
      s.forward();
      EXPECT_EQ(s.layer.scales().k_scale, want);
    }
  }
}

TEST(MLACalculateKvScales, ZeroBatchWaitsAndSixteenBitCacheIsANoOp) {
  Step zero("REFERENCE_MLA", "fp8_e4m3", 1.f, 8);
  zero.kv.fill_bytes(0);
  zero.pe.fill_bytes(0);
  zero.forward();
  EXPECT_TRUE(zero.layer.kv_scales_pending());
  EXPECT_EQ(zero.layer.scales().k_scale, 1.f);
  zero.kv = random_bf16(Shape{3, kL}, 2.f, zero.rng);
  zero.forward();
  EXPECT_FALSE(zero.layer.kv_scales_pending());
  EXPECT_EQ(zero.layer.scales().k_scale, amax(zero.kv) / 448.f);

  Step plain("REFERENCE_MLA", "auto", 1.f, 9);
  EXPECT_FALSE(plain.layer.kv_scales_pending());
  plain.forward();
  EXPECT_EQ(plain.layer.scales().k_scale, 1.f);
}

TEST(MLACalculateKvScales, RejectedForwardsLeaveCacheAndScale) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const auto& [argument, value] : {std::pair<std::string, float>{"k_pe", nan},
                                        std::pair<std::string, float>{"kv_c_normed", inf}}) {
    Step s("REFERENCE_MLA", "fp8_e4m3", 1.f, 10);
    Tensor& t = argument == "k_pe" ? s.pe : s.kv;
    store_f32(t.data(), DType::bf16, 5, value);
    const std::vector<uint8_t> before = s.bytes();
    expect_error([&] { s.forward(); }, argument, "calculate_kv_scales");
    EXPECT_TRUE(before == s.bytes()) << "a rejected forward wrote the cache";
    EXPECT_TRUE(s.layer.kv_scales_pending());
    EXPECT_EQ(s.layer.scales().k_scale, 1.f);
  }
  // Per-head scales replace the per-tensor one: measuring under them is an Error.
  Step s("REFERENCE_MLA", "fp8_e4m3", 1.f, 11);
  Tensor per_head(Shape{1}, DType::f32);
  per_head.data_as<float>()[0] = 0.5f;
  s.layer.scales().k_scale_per_head = per_head.view();
  const std::vector<uint8_t> before = s.bytes();
  expect_error([&] { s.forward(); }, "calculate_kv_scales", "k_scale_per_head");
  EXPECT_TRUE(before == s.bytes());
}

TEST(MLACalculateKvScales, KvSharingLayerIsRejectedAtConstruction) {
  StaticForwardContext model;
  MLAAttentionLayerParams target = small_params("REFERENCE_MLA", "fp8_e4m3", "layers.0.mla");
  target.calculate_kv_scales = false;
  const MLAAttention first(target, &model);
  MLAAttentionLayerParams sharer = small_params("REFERENCE_MLA", "fp8_e4m3", "layers.1.mla");
  sharer.kv_sharing_target_layer_name = "layers.0.mla";
  expect_error([&] { const MLAAttention second(sharer, &model); }, "calculate_kv_scales", "layers.0.mla");
}

}  // namespace
}  // namespace pagedattn
