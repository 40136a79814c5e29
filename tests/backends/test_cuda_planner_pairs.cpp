// The CUDA planner's kv-head pairs (planner.h, PlannerConfig::pair_kv_heads; fp8 caches at head
// size 64), host only (runs in every build): a large decode batch gets one item per (request, kv-head
// pair) where the pair's rows fit the decode path, flagged kItemPairedHeads, its splits keep the flag
// and their combine item the pair's group of 2G rows; a small batch is not paired unless the
// decode-only kernel is forced; requests whose two heads' rows exceed 16 keep one item per kv head;
// split chunks are multiples of the plan's decode step.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "backends/cuda/attention/planner.h"

namespace pagedattn::cuda {
namespace {

PlannerConfig pair_config() {
  PlannerConfig c;
  c.group_size = 4;
  c.num_kv_heads = 8;
  c.prefill_rows = 128;
  c.resident_ctas = 264;
  c.decode_resident_ctas = 264;
  c.partial_rows_capacity = 1 << 20;
  c.max_work_items = 1 << 20;
  c.max_combine_items = 1 << 20;
  c.decode_step_tiles = 4;
  c.paired_decode_step_tiles = 2;
  c.pair_kv_heads = true;
  return c;
}

int paired_items(const AttentionPlan& plan) {
  return static_cast<int>(std::count_if(plan.items.begin(), plan.items.end(),
                                        [](const WorkItem& it) { return (it.flags & kItemPairedHeads) != 0; }));
}

TEST(CudaPlannerPairs, LargeDecodeBatchesArePaired) {
  const PlannerConfig config = pair_config();
  std::vector<int32_t> qsl = {0}, lens;
  for (int r = 0; r < 128; ++r) {
    qsl.push_back(qsl.back() + 1);
    lens.push_back(8192);
  }
  const AttentionPlan plan = make_attention_plan(config, qsl, lens);
  ASSERT_EQ(static_cast<int>(plan.items.size()), paired_items(plan));
  std::vector<std::vector<std::pair<int, int>>> ranges(128 * 4);
  for (const WorkItem& it : plan.items) {
    EXPECT_NE(it.flags & kItemDecodePath, 0);
    EXPECT_EQ(it.num_rows, 8);  // 2G rows: the query heads of kv heads 2j, 2j + 1
    ASSERT_LT(it.kv_head, 4);
    ranges[it.request * 4 + it.kv_head].push_back({it.kv_start, it.kv_end});
  }
  for (auto& list : ranges) {  // every (request, pair) covers its keys once
    std::sort(list.begin(), list.end());
    int at = 0;
    for (const auto& [a, b] : list) {
      EXPECT_EQ(a, at);
      at = b;
    }
    EXPECT_EQ(at, 8192);
  }
  for (const CombineItem& c : plan.combine) EXPECT_EQ(c.group_size, 8);
}

TEST(CudaPlannerPairs, SmallBatchesAndWideRequestsAreNot) {
  PlannerConfig config = pair_config();
  const std::vector<int32_t> qsl = {0, 1, 4}, lens = {2048, 300};  // 296 decode tiles, 264 CTAs
  EXPECT_EQ(paired_items(make_attention_plan(config, qsl, lens)), 0);
  config.force_decode_kernel = true;
  const AttentionPlan forced = make_attention_plan(config, qsl, lens);
  int singles = 0;
  for (const WorkItem& it : forced.items) {
    if (it.flags & kItemPairedHeads) {
      EXPECT_EQ(it.request, 0);
      EXPECT_EQ(it.num_rows, 8);
    } else {
      EXPECT_EQ(it.request, 1);  // 3 tokens: 24 rows for two heads, 12 for one
      EXPECT_EQ(it.num_rows, 12);
      ++singles;
    }
  }
  EXPECT_GE(paired_items(forced), 4);
  EXPECT_EQ(singles, 8);
  for (const CombineItem& c : forced.combine) EXPECT_EQ(c.group_size, c.query_start == 0 ? 8 : 0);
  // An odd number of kv heads: never paired.
  config.num_kv_heads = 7;
  EXPECT_EQ(paired_items(make_attention_plan(config, qsl, lens)), 0);
}

TEST(CudaPlannerPairs, SplitChunksAreWholeDecodeSteps) {
  PlannerConfig config = pair_config();
  config.decode_resident_ctas = 0;
  // One request of 2048 keys (32 tiles a kv head), split to fill 264 CTAs: unpaired (a small batch),
  // so in chunks of the single-head step (4 tiles), not 2.
  const std::vector<int32_t> qsl = {0, 1}, lens = {2048};
  const auto shortest = [&] {
    int tiles = 1 << 30;
    for (const WorkItem& it : make_attention_plan(config, qsl, lens).items) {
      tiles = std::min(tiles, (it.kv_end - it.kv_start + kKeysPerTile - 1) / kKeysPerTile);
    }
    return tiles;
  };
  EXPECT_EQ(shortest(), 4);
  config.paired_decode_step_tiles = 4;
  config.decode_step_tiles = 1;  // the single-head step is what an unpaired plan rounds to
  EXPECT_EQ(shortest(), 2);
}

}  // namespace
}  // namespace pagedattn::cuda
