// split_decodes_and_prefills (incl. require_uniform and decode_threshold > 1) and
// reorder_batch_to_split_decodes_and_prefills: hand-worked cases and seeded property tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "metadata/metadata_test_util.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

using testing::metadata_from_query_lens;

DecodePrefillSplit split(const std::vector<int32_t>& query_lens, int threshold = 1,
                         bool require_uniform = false) {
  const OwnedCommonAttentionMetadata owned = metadata_from_query_lens(query_lens);
  return split_decodes_and_prefills(owned.common, threshold, require_uniform);
}

DecodePrefillSplit make_split(int nd, int np, int ndt, int npt) { return {nd, np, ndt, npt}; }

TEST(SplitDecodesAndPrefills, DefaultThreshold) {
  EXPECT_EQ(split({1, 1, 1}), make_split(3, 0, 3, 0));         // max_query_len <= 1
  EXPECT_EQ(split({1, 1, 5, 7}), make_split(2, 2, 2, 12));
  EXPECT_EQ(split({5, 1, 1}), make_split(0, 3, 0, 7));         // first is not a decode
  EXPECT_EQ(split({0, 1, 3}), make_split(2, 1, 1, 3));         // empty query counts as decode
  EXPECT_EQ(split({1, 9}), make_split(1, 1, 1, 9));
}

TEST(SplitDecodesAndPrefills, ThresholdAboveOne) {
  EXPECT_EQ(split({2, 3, 1, 8, 9}, 4), make_split(3, 2, 6, 17));
  EXPECT_EQ(split({2, 4, 1}, 4), make_split(3, 0, 7, 0));      // max_query_len <= threshold
  EXPECT_EQ(split({4, 4, 5}, 4), make_split(2, 1, 8, 5));
  EXPECT_EQ(split({1, 1}, 0), make_split(0, 2, 0, 2));         // threshold 0: nothing is a decode
  EXPECT_EQ(split({0, 0, 2}, 0), make_split(2, 1, 0, 2));
}

TEST(SplitDecodesAndPrefills, RequireUniform) {
  // threshold <= 1: the max_query_len shortcut still applies.
  EXPECT_EQ(split({1, 1, 1}, 1, true), make_split(3, 0, 3, 0));
  EXPECT_EQ(split({1, 0, 1}, 1, true), make_split(3, 0, 2, 0));
  EXPECT_EQ(split({1, 1, 4}, 1, true), make_split(2, 1, 2, 4));
  // threshold > 1: uniform batches are all decodes, padded (zero-length) requests included.
  EXPECT_EQ(split({2, 2, 2}, 4, true), make_split(3, 0, 6, 0));
  EXPECT_EQ(split({3, 3, 0, 0}, 4, true), make_split(4, 0, 6, 0));
  // Non-uniform: the first request whose length differs from the first one starts the prefills,
  // even when it is below the threshold (or a zero-length request).
  EXPECT_EQ(split({3, 3, 2, 9}, 4, true), make_split(2, 2, 6, 11));
  EXPECT_EQ(split({3, 0, 3, 1}, 4, true), make_split(1, 3, 3, 4));
  EXPECT_EQ(split({2, 3}, 4, true), make_split(1, 1, 2, 3));
  // Without require_uniform the same batches split at the threshold.
  EXPECT_EQ(split({3, 3, 2, 9}, 4, false), make_split(3, 1, 8, 9));
  EXPECT_EQ(split({2, 3}, 4, false), make_split(2, 0, 5, 0));
  // First request above the threshold: no decodes.
  EXPECT_EQ(split({5, 5}, 4, true), make_split(0, 2, 0, 10));
}

TEST(SplitDecodesAndPrefills, EmptyBatch) {
  EXPECT_EQ(split({}), make_split(0, 0, 0, 0));
  EXPECT_EQ(split({}, 4, true), make_split(0, 0, 0, 0));
}

TEST(SplitDecodesAndPrefills, RejectsMissingHostQueryStartLoc) {
  OwnedCommonAttentionMetadata owned = metadata_from_query_lens({1, 2});
  owned.common.query_start_loc_cpu = owned.query_start_loc_cpu.view().narrow(0, 0, 2);
  testing::expect_error_mentions([&] { split_decodes_and_prefills(owned.common); },
                                 {"query_start_loc_cpu", "num_reqs + 1 = 3"});
}

TEST(SplitDecodesAndPrefills, RejectsDecreasingHostQueryStartLocWithoutOverflow) {
  // Found by fuzz/fuzz_common_metadata: on metadata that was never validated, query lengths
  // were int differences (query_start_loc_cpu[2] - [1] = INT32_MIN - 1 overflowed; undefined
  // behaviour, in practice a huge "prefill"). Now lengths are int64 and a decrease is an Error.
  OwnedCommonAttentionMetadata owned = metadata_from_query_lens({1, 1, 4});
  int32_t* qsl = owned.query_start_loc_cpu.data_as<int32_t>();
  qsl[2] = std::numeric_limits<int32_t>::min();
  testing::expect_error_mentions([&] { split_decodes_and_prefills(owned.common); },
                                 {"query_start_loc_cpu[2] = -2147483648", "non-decreasing"});
  qsl[2] = 2;                      // restored: [0, 1, 2, 6]
  qsl[3] = 1;                      // request 2 now has a negative length
  owned.common.max_query_len = 4;  // (inconsistent on purpose: validate() was never called)
  testing::expect_error_mentions([&] { split_decodes_and_prefills(owned.common); },
                                 {"query_start_loc_cpu[3] = 1", "non-decreasing"});
}

// ---- reorder: hand-worked ----------------------------------------------------------------------
std::vector<int32_t> permuted(const std::vector<int32_t>& lens, const std::vector<int>& order) {
  std::vector<int32_t> out;
  for (int i : order) out.push_back(lens[static_cast<size_t>(i)]);
  return out;
}

TEST(ReorderBatch, HandWorkedSwaps) {
  {
    // decodes [1, 2, 4] (num_decodes 3), prefills [0, 3]. i=1: decode 4 >= 3 -> swap(0, 4);
    // i=2: decode 2 < 3 -> stop.
    const std::vector<int32_t> lens = {5, 1, 1, 7, 1};
    const BatchReorder r = reorder_batch_to_split_decodes_and_prefills(lens);
    EXPECT_TRUE(r.modified);
    EXPECT_EQ(r.order, (std::vector<int>{4, 1, 2, 3, 0}));
    EXPECT_EQ(permuted(lens, r.order), (std::vector<int32_t>{1, 1, 1, 7, 5}));
  }
  {
    // decodes [2, 3], prefills [0, 1]: swap(0, 3) then swap(1, 2).
    const std::vector<int32_t> lens = {5, 7, 1, 1};
    const BatchReorder r = reorder_batch_to_split_decodes_and_prefills(lens);
    EXPECT_TRUE(r.modified);
    EXPECT_EQ(r.order, (std::vector<int>{3, 2, 1, 0}));
  }
  {
    // threshold 4: decodes [1, 3, 4, 5] (num_decodes 4), prefills [0, 2]:
    // swap(0, 5) then swap(2, 4).
    const std::vector<int32_t> lens = {8, 2, 9, 3, 4, 1};
    const BatchReorder r = reorder_batch_to_split_decodes_and_prefills(lens, 4);
    EXPECT_TRUE(r.modified);
    EXPECT_EQ(r.order, (std::vector<int>{5, 1, 4, 3, 2, 0}));
    EXPECT_EQ(permuted(lens, r.order), (std::vector<int32_t>{1, 2, 4, 3, 9, 8}));
  }
  {
    // The same batch with threshold 1: decodes [5], prefills [0..4]: swap(0, 5).
    const std::vector<int32_t> lens = {8, 2, 9, 3, 4, 1};
    const BatchReorder r = reorder_batch_to_split_decodes_and_prefills(lens, 1);
    EXPECT_EQ(r.order, (std::vector<int>{5, 1, 2, 3, 4, 0}));
  }
}

TEST(ReorderBatch, AlreadySplitOrUniformBatchesAreUntouched) {
  for (const std::vector<int32_t>& lens : {std::vector<int32_t>{1, 1, 5, 7}, std::vector<int32_t>{1, 1, 1},
                                           std::vector<int32_t>{3, 9}, std::vector<int32_t>{},
                                           std::vector<int32_t>{0, 1, 2}}) {
    const BatchReorder r = reorder_batch_to_split_decodes_and_prefills(lens);
    EXPECT_FALSE(r.modified);
    std::vector<int> identity(lens.size());
    std::iota(identity.begin(), identity.end(), 0);
    EXPECT_EQ(r.order, identity);
  }
}

TEST(ReorderBatch, RejectsNegativeTokenCounts) {
  testing::expect_error_mentions(
      [] { reorder_batch_to_split_decodes_and_prefills(std::vector<int32_t>{1, 4, -2}); },
      {"num_scheduled_tokens[2] = -2"});
}

// ---- reorder + split: seeded property tests -----------------------------------------------------
std::vector<int32_t> random_query_lens(std::mt19937& rng, int num_reqs, int max_len) {
  std::vector<int32_t> lens(static_cast<size_t>(num_reqs));
  std::uniform_int_distribution<int> kind(0, 3);
  for (auto& q : lens) {
    switch (kind(rng)) {
      case 0: q = 1; break;
      case 1: q = std::uniform_int_distribution<int>(0, 4)(rng); break;
      default: q = std::uniform_int_distribution<int>(1, max_len)(rng); break;
    }
  }
  return lens;
}

TEST(ReorderBatch, RandomBatchesMatchTheMinimalSwapCharacterisation) {
  std::mt19937 rng(424242);
  for (int trial = 0; trial < 2000; ++trial) {
    const int num_reqs = std::uniform_int_distribution<int>(0, 24)(rng);
    const int threshold = std::uniform_int_distribution<int>(0, 5)(rng);
    const std::vector<int32_t> lens = random_query_lens(rng, num_reqs, 40);
    const BatchReorder r = reorder_batch_to_split_decodes_and_prefills(lens, threshold);
    ASSERT_EQ(r.order.size(), lens.size());
    // A permutation.
    std::vector<int> sorted = r.order;
    std::sort(sorted.begin(), sorted.end());
    for (int i = 0; i < num_reqs; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i);
    // Every decode before every prefill.
    const auto is_decode = [&](int original) { return lens[static_cast<size_t>(original)] <= threshold; };
    const int num_decodes = static_cast<int>(std::count_if(lens.begin(), lens.end(),
                                                           [&](int32_t q) { return q <= threshold; }));
    for (int i = 0; i < num_reqs; ++i) {
      ASSERT_EQ(is_decode(r.order[static_cast<size_t>(i)]), i < num_decodes) << "trial " << trial;
    }
    // Brute force: the misplaced requests are the decodes at positions >= num_decodes and the
    // prefills at positions < num_decodes (equally many). Each swap fixes one pair, so exactly
    // those 2k positions change and every other position keeps its request.
    std::vector<int> misplaced_prefills;  // ascending
    std::vector<int> misplaced_decodes;   // ascending
    for (int i = 0; i < num_reqs; ++i) {
      if (i < num_decodes && !is_decode(i)) misplaced_prefills.push_back(i);
      if (i >= num_decodes && is_decode(i)) misplaced_decodes.push_back(i);
    }
    ASSERT_EQ(misplaced_prefills.size(), misplaced_decodes.size());
    const size_t k = misplaced_prefills.size();
    int changed = 0;
    for (int i = 0; i < num_reqs; ++i) changed += r.order[static_cast<size_t>(i)] != i;
    ASSERT_EQ(changed, static_cast<int>(2 * k));
    ASSERT_EQ(r.modified, k > 0);
    // The j-th front-most misplaced prefill is paired with the j-th back-most misplaced decode.
    for (size_t j = 0; j < k; ++j) {
      const int p = misplaced_prefills[j];
      const int d = misplaced_decodes[k - 1 - j];
      ASSERT_EQ(r.order[static_cast<size_t>(p)], d);
      ASSERT_EQ(r.order[static_cast<size_t>(d)], p);
    }
  }
}

TEST(SplitDecodesAndPrefills, RandomReorderedBatchesSplitConsistently) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 600; ++trial) {
    const int num_reqs = std::uniform_int_distribution<int>(0, 16)(rng);
    const int threshold = std::uniform_int_distribution<int>(0, 5)(rng);
    const std::vector<int32_t> raw = random_query_lens(rng, num_reqs, 30);
    const BatchReorder r = reorder_batch_to_split_decodes_and_prefills(raw, threshold);
    const std::vector<int32_t> lens = permuted(raw, r.order);
    const int num_tokens = std::accumulate(lens.begin(), lens.end(), 0);
    const OwnedCommonAttentionMetadata owned = metadata_from_query_lens(lens);

    // Plain split: decodes are exactly the requests <= threshold (all at the front now).
    const DecodePrefillSplit s = split_decodes_and_prefills(owned.common, threshold, false);
    const int expected_decodes = static_cast<int>(
        std::count_if(lens.begin(), lens.end(), [&](int32_t q) { return q <= threshold; }));
    ASSERT_EQ(s.num_decodes, expected_decodes) << "trial " << trial;
    ASSERT_EQ(s.num_decodes + s.num_prefills, num_reqs);
    ASSERT_EQ(s.num_decode_tokens + s.num_prefill_tokens, num_tokens);
    ASSERT_EQ(s.num_decode_tokens, std::accumulate(lens.begin(), lens.begin() + s.num_decodes, 0));

    // Uniform split: sums hold, and the decodes are uniform in the sense vLLM guarantees.
    const DecodePrefillSplit u = split_decodes_and_prefills(owned.common, threshold, true);
    ASSERT_EQ(u.num_decodes + u.num_prefills, num_reqs);
    ASSERT_EQ(u.num_decode_tokens + u.num_prefill_tokens, num_tokens);
    ASSERT_EQ(u.num_decode_tokens, std::accumulate(lens.begin(), lens.begin() + u.num_decodes, 0));
    if (num_reqs == 0) continue;
    const int max_len = *std::max_element(lens.begin(), lens.end());
    if (max_len <= threshold && threshold <= 1) {
      ASSERT_EQ(u.num_decodes, num_reqs);
    } else if (lens[0] > threshold) {
      ASSERT_EQ(u.num_decodes, 0);
    } else if (u.num_decodes == num_reqs) {
      for (int32_t q : lens) ASSERT_TRUE(q == lens[0] || q == 0);
    } else {
      for (int i = 0; i < u.num_decodes; ++i) ASSERT_EQ(lens[static_cast<size_t>(i)], lens[0]);
      ASSERT_NE(lens[static_cast<size_t>(u.num_decodes)], lens[0]);
    }
  }
}

}  // namespace
}  // namespace pagedattn
