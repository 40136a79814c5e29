// use_cascade_attention (every early return and both sides of the CTA cost model),
// common_prefix_len, and infer_global_hyperparameters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "metadata/metadata_test_util.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

using testing::expect_error_mentions;

std::vector<int32_t> ones(int n) { return std::vector<int32_t>(static_cast<size_t>(n), 1); }

bool cascade(int prefix, const std::vector<int32_t>& query_lens, int q_heads, int kv_heads,
             int num_sms = 132, bool alibi = false, bool window = false, bool local = false,
             int dcp = 1) {
  return use_cascade_attention(prefix, query_lens, q_heads, kv_heads, alibi, window, local, num_sms, dcp);
}

TEST(UseCascadeAttention, EarlyReturns) {
  const std::vector<int32_t> mixed = {1, 1, 4, 1, 1, 1, 9, 1};  // 8 requests, not all decodes
  ASSERT_TRUE(cascade(256, mixed, 32, 8));                       // baseline: cascade
  EXPECT_FALSE(cascade(255, mixed, 32, 8));                      // prefix < 256
  EXPECT_FALSE(cascade(0, mixed, 32, 8));
  EXPECT_FALSE(cascade(4096, mixed, 32, 8, 132, /*alibi=*/true));
  EXPECT_FALSE(cascade(4096, mixed, 32, 8, 132, false, /*window=*/true));
  EXPECT_FALSE(cascade(4096, mixed, 32, 8, 132, false, false, /*local=*/true));
  EXPECT_FALSE(cascade(4096, std::vector<int32_t>(mixed.begin(), mixed.begin() + 7), 32, 8));  // 7 reqs
  EXPECT_FALSE(cascade(4096, mixed, 32, 8, 132, false, false, false, /*dcp=*/2));
}

TEST(UseCascadeAttention, WithoutFlashDecodingCascadeWins) {
  // Not all single-token queries, or MHA (one query head per KV head): flash-decoding is not
  // used by the normal path, so cascade is chosen without the cost model.
  EXPECT_TRUE(cascade(1024, {1, 1, 1, 1, 1, 1, 1, 2}, 32, 8));
  EXPECT_TRUE(cascade(1024, ones(8), 32, 32));
  EXPECT_TRUE(cascade(1024, ones(8), 8, 16));  // num_queries_per_kv = 8 // 16 = 0
}

TEST(UseCascadeAttention, CostModelBothSides) {
  // 8 decodes, 32 query heads, 8 KV heads (4 per KV head), prefix 1024 (8 KV tiles), 132 SMs:
  //   cascade:        ctas = 32 * cdiv(8, 128) = 32, waves = 1, time = 1 * 8 = 8
  //   flash-decoding: ctas = 8 * 8 * cdiv(4, 128) * 8 = 512, time = cdiv(512, 132) = 4
  // 8 < 4 is false: flash-decoding.
  EXPECT_FALSE(cascade(1024, ones(8), 32, 8, 132));
  // 128 decodes: flash-decoding ctas = 128 * 8 * 1 * 8 = 8192, time = 63 > 8: cascade.
  EXPECT_TRUE(cascade(1024, ones(128), 32, 8, 132));
  // Boundary: 16 decodes, 16 SMs: cascade ctas 32 -> 2 waves -> time 16;
  // flash-decoding ctas = 16 * 8 * 8 = 1024 -> time 64: cascade.
  EXPECT_TRUE(cascade(1024, ones(16), 32, 8, 16));
  // Equal times are not "faster": 8 decodes, 4 KV heads, 1 SM, prefix 256 (2 tiles):
  //   cascade ctas = 32 -> 32 waves -> time 64; flash-decoding ctas = 8 * 4 * 1 * 2 = 64 -> 64.
  EXPECT_FALSE(cascade(256, ones(8), 32, 4, 1));
  // One more request tips it: flash-decoding ctas = 9 * 4 * 2 = 72 -> 72 > 64.
  EXPECT_TRUE(cascade(256, ones(9), 32, 4, 1));
}

TEST(UseCascadeAttention, RejectsBadArguments) {
  expect_error_mentions([] { cascade(1024, ones(8), 32, 0); }, {"num_kv_heads = 0"});
  expect_error_mentions([] { cascade(1024, ones(8), 0, 8); }, {"num_query_heads = 0"});
  expect_error_mentions([] { cascade(1024, ones(8), 32, 8, 0); }, {"num_sms = 0"});
  expect_error_mentions([] { cascade(-1, ones(8), 32, 8); }, {"common_prefix_len = -1"});
  expect_error_mentions([] { cascade(1024, ones(8), 32, 8, 132, false, false, false, 0); },
                        {"dcp_world_size = 0"});
}

// ---- common_prefix_len -------------------------------------------------------------------------
OwnedCommonAttentionMetadata batch(const std::vector<int32_t>& query_lens,
                                   const std::vector<int32_t>& seq_lens,
                                   const std::vector<std::vector<int32_t>>& rows) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  for (int32_t q : query_lens) args.query_start_loc.push_back(args.query_start_loc.back() + q);
  args.seq_lens = seq_lens;
  args.max_num_blocks_per_req = rows.empty() ? 0 : static_cast<int>(rows[0].size());
  for (const auto& row : rows) args.block_table.insert(args.block_table.end(), row.begin(), row.end());
  args.slot_mapping.assign(static_cast<size_t>(args.query_start_loc.back()), -1);
  return make_common_attention_metadata(args);
}

TEST(CommonPrefixLen, SharedLeadingColumns) {
  // Block size 4. Rows share columns 0..2; column 3 differs. Columns used: min(cdiv(20, 4) = 5,
  // cdiv(16, 4) = 4, cdiv(30, 4) = 8) = 4. Shared: 3 blocks = 12 tokens; min computed = 15.
  const auto owned = batch({1, 1, 1}, {20, 16, 30},
                           {{7, 8, 9, 1, 2, 3, 4, 5}, {7, 8, 9, 10, 11, 0, 0, 0}, {7, 8, 9, 12, 13, 14, 15, 16}});
  EXPECT_EQ(common_prefix_len(owned.common, 4), 12);
}

TEST(CommonPrefixLen, CappedByComputedTokensAndRoundedDown) {
  // Same table, but request 1 has 6 new tokens: computed = 10 -> min(12, 10) = 10 -> 8.
  const auto owned = batch({1, 6, 1}, {20, 16, 30},
                           {{7, 8, 9, 1, 2, 3, 4, 5}, {7, 8, 9, 10, 11, 0, 0, 0}, {7, 8, 9, 12, 13, 14, 15, 16}});
  EXPECT_EQ(common_prefix_len(owned.common, 4), 8);
}

TEST(CommonPrefixLen, OnlyColumnsEveryRequestUses) {
  // Identical rows, but request 1 (seq 9) uses only cdiv(9, 4) = 3 columns -> 12; its computed
  // count is 8 -> 8.
  const std::vector<int32_t> row = {3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const auto owned = batch({1, 1, 1}, {40, 9, 40}, {row, row, row});
  EXPECT_EQ(common_prefix_len(owned.common, 4), 8);
  // Rows identical and long: capped by the smallest computed count only (39 -> 36).
  const auto same = batch({1, 1}, {40, 40}, {row, row});
  EXPECT_EQ(common_prefix_len(same.common, 4), 36);
}

TEST(CommonPrefixLen, NothingShared) {
  const auto owned = batch({1, 1}, {20, 20}, {{1, 2, 3, 4, 5}, {6, 2, 3, 4, 5}});
  EXPECT_EQ(common_prefix_len(owned.common, 4), 0);
  // A request with no computed tokens (a first prefill chunk) leaves no prefix either.
  const auto fresh = batch({1, 8}, {20, 8}, {{1, 2, 3, 4, 5}, {1, 2, 0, 0, 0}});
  EXPECT_EQ(common_prefix_len(fresh.common, 4), 0);
}

TEST(CommonPrefixLen, SingleRequestAndEmptyBatch) {
  // One request: its own computed part, rounded down (37 - 5 = 32).
  const auto one = batch({5}, {37}, {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}});
  EXPECT_EQ(common_prefix_len(one.common, 4), 32);
  const auto none = batch({}, {}, {});
  EXPECT_EQ(common_prefix_len(none.common, 4), 0);
}

TEST(CommonPrefixLen, RejectsNonPositiveBlockSize) {
  const auto one = batch({5}, {37}, {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}});
  expect_error_mentions([&] { common_prefix_len(one.common, 0); }, {"block_size = 0"});
}

TEST(CommonPrefixLen, RandomBatchesMatchBruteForce) {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 300; ++trial) {
    const int block_size = 1 << std::uniform_int_distribution<int>(0, 4)(rng);
    const int num_reqs = std::uniform_int_distribution<int>(1, 8)(rng);
    const int shared_blocks = std::uniform_int_distribution<int>(0, 6)(rng);
    std::vector<int32_t> q_lens, seq_lens;
    int max_blocks = 1;
    for (int r = 0; r < num_reqs; ++r) {
      q_lens.push_back(std::uniform_int_distribution<int>(0, 3 * block_size)(rng));
      seq_lens.push_back(q_lens.back() + std::uniform_int_distribution<int>(0, 10 * block_size)(rng));
      max_blocks = std::max(max_blocks, (seq_lens.back() + block_size - 1) / block_size);
    }
    // Rows: `shared_blocks` common ids, then distinct ids per request.
    std::vector<std::vector<int32_t>> rows(static_cast<size_t>(num_reqs));
    int32_t next_id = 1000;
    for (int r = 0; r < num_reqs; ++r) {
      for (int c = 0; c < max_blocks; ++c) rows[r].push_back(c < shared_blocks ? c : next_id++);
    }
    const auto owned = batch(q_lens, seq_lens, rows);
    // Brute force over token positions: position p is shared when every request has p inside its
    // computed part and the block holding p has one id in every row.
    int expected = 0;
    for (int p = 0;; ++p) {
      bool shared = true;
      for (int r = 0; r < num_reqs && shared; ++r) {
        // (one request shares every block of its row with itself)
        shared = p < seq_lens[r] - q_lens[r] && (num_reqs == 1 || p / block_size < shared_blocks);
      }
      if (!shared) break;
      expected = p + 1;
    }
    expected = expected / block_size * block_size;
    ASSERT_EQ(common_prefix_len(owned.common, block_size), expected) << "trial " << trial;
  }
}

// ---- infer_global_hyperparameters --------------------------------------------------------------
TEST(InferGlobalHyperparameters, AgreeingLayers) {
  const PerLayerParameters p{127, 30.f, 0.125f};
  const std::map<std::string, PerLayerParameters> layers = {
      {"model.layers.0.attn", p}, {"model.layers.1.attn", p}, {"model.layers.2.attn", p}};
  EXPECT_EQ(infer_global_hyperparameters(layers), p);
  EXPECT_EQ(infer_global_hyperparameters({{"only", PerLayerParameters{}}}), PerLayerParameters{});
}

TEST(InferGlobalHyperparameters, RejectsEmptyMap) {
  expect_error_mentions([] { infer_global_hyperparameters({}); }, {"per_layer is empty"});
}

TEST(InferGlobalHyperparameters, NamesTheFirstDifferingLayerAndField) {
  const PerLayerParameters base{-1, std::nullopt, 0.125f};
  std::map<std::string, PerLayerParameters> layers = {
      {"layers.0", base}, {"layers.1", base}, {"layers.2", base}, {"layers.3", base}};
  layers["layers.2"].window_left = 4095;
  layers["layers.3"].sm_scale = 0.25f;
  expect_error_mentions([&] { infer_global_hyperparameters(layers); },
                        {"layer 'layers.2'", "window_left = 4095", "layer 'layers.0'", "window_left = -1"});
  layers["layers.2"] = base;
  expect_error_mentions([&] { infer_global_hyperparameters(layers); },
                        {"layer 'layers.3'", "sm_scale = 0.25", "sm_scale = 0.125"});
  layers["layers.3"] = base;
  layers["layers.1"].logits_soft_cap = 50.f;
  expect_error_mentions([&] { infer_global_hyperparameters(layers); },
                        {"layer 'layers.1'", "logits_soft_cap = 50", "logits_soft_cap = none"});
  // A difference in the last bit of sm_scale is a difference (and is printed distinctly).
  layers["layers.1"] = base;
  layers["layers.1"].sm_scale = std::nextafter(0.125f, 1.f);
  expect_error_mentions([&] { infer_global_hyperparameters(layers); },
                        {"layer 'layers.1'", "sm_scale = 0.125000015"});
}

}  // namespace
}  // namespace pagedattn
