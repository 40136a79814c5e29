// Workload generator (length distribution specs, seeding, arrivals) and the work model that the
// reports divide by (bytes and FLOPs against brute-force counts).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "cli_common.h"
#include "presets.h"
#include "work_model.h"
#include "workload.h"

namespace pagedattn::cli {
namespace {

TEST(LengthDistribution, ParsesEverySpecForm) {
  LengthDistribution f = LengthDistribution::parse("128", "--x");
  EXPECT_EQ(f.kind, LengthDistribution::Kind::fixed);
  EXPECT_EQ(f.fixed, 128);
  EXPECT_EQ(LengthDistribution::parse("fixed:7", "--x").fixed, 7);
  LengthDistribution u = LengthDistribution::parse("uniform:3:9", "--x");
  EXPECT_EQ(u.kind, LengthDistribution::Kind::uniform);
  EXPECT_EQ(u.min, 3);
  EXPECT_EQ(u.max, 9);
  LengthDistribution l = LengthDistribution::parse("lognormal:100:50:400", "--x");
  EXPECT_EQ(l.kind, LengthDistribution::Kind::lognormal);
  EXPECT_DOUBLE_EQ(l.mean, 100);
  EXPECT_DOUBLE_EQ(l.stdev, 50);
  EXPECT_EQ(l.max, 400);
  EXPECT_EQ(l.max_value(), 400);
}

TEST(LengthDistribution, RejectsBadSpecsNamingTheFlag) {
  for (const char* bad : {"-5", "0", "abc", "uniform:5", "uniform:9:3", "uniform:0:3", "lognormal:10",
                          "lognormal:10:-1", "lognormal:0.5:1", "lognormal:100:10:50", "1.5", "fixed:",
                          "poisson:3", ""}) {
    try {
      LengthDistribution::parse(bad, "--prompt-len");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const UsageError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--prompt-len: '", 0), 0u) << e.what();
    }
  }
}

TEST(LengthDistribution, RejectsLognormalParametersThatOverflow) {
  // Found by fuzz/fuzz_cli: a huge mean overflowed the default MAX = ceil(8 * MEAN) converted to
  // int, and a huge stdev made sigma^2 infinite, so that every sample was NaN converted to int
  // (both undefined behaviour). Both are now usage errors; large but sane values still parse.
  for (const char* bad : {"lognormal:1e300:1", "lognormal:300000000:1", "lognormal:5:1e300"}) {
    try {
      LengthDistribution::parse(bad, "--prompt-len");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const UsageError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--prompt-len: '", 0), 0u) << e.what();
    }
  }
  std::mt19937_64 rng(1);
  const LengthDistribution wide = LengthDistribution::parse("lognormal:5:1e100:64", "--x");
  const LengthDistribution big = LengthDistribution::parse("lognormal:60000000:1", "--x");
  EXPECT_EQ(big.max_value(), 480000000);
  for (int i = 0; i < 100; ++i) {
    const int v = wide.sample(rng);
    ASSERT_GE(v, 1);
    ASSERT_LE(v, 64);
  }
}

TEST(LengthDistribution, SamplesStayInRangeAndMatchTheMean) {
  std::mt19937_64 rng(42);
  LengthDistribution u = LengthDistribution::parse("uniform:10:20", "--x");
  std::set<int> seen;
  for (int i = 0; i < 2000; ++i) {
    int v = u.sample(rng);
    ASSERT_GE(v, 10);
    ASSERT_LE(v, 20);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 11u);
  LengthDistribution l = LengthDistribution::parse("lognormal:200:80:100000", "--x");
  double sum = 0, sq = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    int v = l.sample(rng);
    ASSERT_GE(v, 1);
    sum += v;
    sq += double(v) * v;
  }
  double mean = sum / n, stdev = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 200, 5);
  EXPECT_NEAR(stdev, 80, 6);
}

TEST(Workload, IsDeterministicPerSeedAndAddsTheSystemPrompt) {
  WorkloadConfig w;
  w.num_requests = 20;
  w.prompt_len = LengthDistribution::parse("uniform:1:100", "--prompt-len");
  w.output_len = LengthDistribution::parse("uniform:1:10", "--output-len");
  w.system_prompt_len = 32;
  w.seed = 7;
  auto a = generate_workload(w), b = generate_workload(w);
  w.seed = 8;
  auto c = generate_workload(w);
  ASSERT_EQ(a.size(), 20u);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt_len, b[i].prompt_len);
    EXPECT_EQ(a[i].output_len, b[i].output_len);
    EXPECT_EQ(a[i].arrival_step, 0);
    EXPECT_GE(a[i].prompt_len, 33);
    EXPECT_LE(a[i].prompt_len, 132);
    EXPECT_EQ(a[i].shared_prefix_len, 32);
    differs = differs || a[i].prompt_len != c[i].prompt_len;
  }
  EXPECT_TRUE(differs) << "another seed should give another workload";
}

TEST(Workload, ArrivalRateSpacesRequestsOut) {
  WorkloadConfig w;
  w.num_requests = 400;
  w.prompt_len = LengthDistribution::parse("8", "--prompt-len");
  w.output_len = LengthDistribution::parse("8", "--output-len");
  w.arrival_rate = 0.5;  // one request every 2 steps on average
  auto r = generate_workload(w);
  for (size_t i = 1; i < r.size(); ++i) EXPECT_GE(r[i].arrival_step, r[i - 1].arrival_step);
  EXPECT_NEAR(r.back().arrival_step / 399.0, 2.0, 0.3);
  w.arrival_rate = -1;
  EXPECT_THROW(generate_workload(w), UsageError);
  w.arrival_rate = 0;
  w.num_requests = 0;
  EXPECT_THROW(generate_workload(w), UsageError);
}

// Brute force: visit every (query, key) pair.
AttentionWork brute_force(const LayerShape& l, DType dtype, DType kv, const std::vector<int32_t>& q,
                          const std::vector<int32_t>& s) {
  AttentionWork w;
  for (size_t r = 0; r < q.size(); ++r) {
    std::set<int> keys;
    double pairs = 0;
    for (int p = s[r] - q[r]; p < s[r]; ++p) {
      for (int k = 0; k <= p; ++k) {
        bool visible = true;
        if (l.kind == LayerKind::sliding_window) visible = k > p - l.sliding_window;
        if (l.kind == LayerKind::chunked_local) visible = k / l.attention_chunk_size == p / l.attention_chunk_size;
        if (visible) {
          ++pairs;
          keys.insert(k);
        }
      }
    }
    double d = l.head_size, dv = l.value_head_size();
    w.bytes += keys.size() * double(l.num_kv_heads) * (d + dv) * dtype_size(kv) +
               q[r] * double(l.num_heads) * (d + dv) * dtype_size(dtype);
    w.flops += 2 * (d + dv) * l.num_heads * pairs;
  }
  return w;
}

TEST(WorkModel, CountsVisibleKeysAndBytesLikeABruteForce) {
  std::vector<int32_t> q = {1, 7, 40, 1, 100}, s = {1, 90, 40, 300, 230};
  LayerShape full;
  full.num_heads = 8;
  full.num_kv_heads = 2;
  full.head_size = 64;
  LayerShape window = full;
  window.kind = LayerKind::sliding_window;
  window.sliding_window = 32;
  LayerShape chunked = full;
  chunked.kind = LayerKind::chunked_local;
  chunked.attention_chunk_size = 64;
  LayerShape wide_v = full;
  wide_v.head_size_v = 128;
  for (const LayerShape& l : {full, window, chunked, wide_v}) {
    for (DType kv : {DType::bf16, DType::fp8_e4m3}) {
      SCOPED_TRACE(l.describe());
      AttentionWork got = attention_work(l, DType::bf16, kv, q, s);
      AttentionWork want = brute_force(l, DType::bf16, kv, q, s);
      EXPECT_DOUBLE_EQ(got.flops, want.flops);
      EXPECT_DOUBLE_EQ(got.bytes, want.bytes);
      EXPECT_GT(got.flops, 0);
    }
  }
}

TEST(Presets, EveryPresetHasConsistentShapes) {
  ASSERT_GE(model_presets().size(), 8u);
  for (const ModelPreset& p : model_presets()) {
    SCOPED_TRACE(p.name);
    EXPECT_FALSE(p.source.empty());
    EXPECT_GT(p.num_layers, 0);
    EXPECT_GT(p.max_model_len, 0);
    for (const LayerShape& l : p.layers()) {
      EXPECT_GT(l.num_heads, 0);
      EXPECT_GT(l.head_size, 0);
      if (l.kind != LayerKind::mla) EXPECT_EQ(l.num_heads % l.num_kv_heads, 0);
      if (l.kind == LayerKind::sliding_window) EXPECT_GT(l.sliding_window, 0);
      if (l.kind == LayerKind::chunked_local) EXPECT_GT(l.attention_chunk_size, 0);
    }
  }
  EXPECT_EQ(find_preset("llama3-8b").layer(0).num_heads, 32);
  EXPECT_EQ(find_preset("gemma2-9b").layer(0).kind, LayerKind::sliding_window);
  EXPECT_EQ(find_preset("gemma2-9b").layer(1).kind, LayerKind::full);
  EXPECT_EQ(find_preset("llama4-scout").layer(3).kind, LayerKind::full);
  EXPECT_EQ(find_preset("llama4-scout").layer(2).kind, LayerKind::chunked_local);
  EXPECT_TRUE(find_preset("gpt-oss-20b").layer(1).has_sinks);
  EXPECT_EQ(find_preset("deepseek-v3").layer(0).selector_head_size(), 576);
  EXPECT_THROW(find_preset("llama2"), UsageError);
}

}  // namespace
}  // namespace pagedattn::cli
