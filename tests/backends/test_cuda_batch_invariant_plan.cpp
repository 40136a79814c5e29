// The CUDA planner's batch-invariant plans (planner.h, PlannerConfig::fixed_split_tiles), host
// only (runs in every build): a request's items and splits are the same whatever the rest of the
// batch, its position, the SM count and whether the batch is decode-only; decode-path items are cut
// in fixed 2048-key chunks from their first tile, prefill-path items never; the decode-only kernel
// and cascade are never planned; fixed_split_capacity bounds every such plan. The CUDA_MLA decode's
// fixed plan (mla_decode.h, make_fixed_plan) likewise: a request's segments are its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/cuda/attention/planner.h"
#include "backends/cuda/mla/mla_decode.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

PlannerConfig invariant_config(int resident_ctas, int decode_resident_ctas) {
  PlannerConfig c;
  c.group_size = 4;
  c.num_kv_heads = 2;
  c.prefill_rows = 128;
  c.resident_ctas = resident_ctas;
  c.decode_resident_ctas = decode_resident_ctas;
  c.partial_rows_capacity = 1 << 20;
  c.max_work_items = 1 << 20;
  c.max_combine_items = 1 << 20;
  c.fixed_split_tiles = kBatchInvariantSplitKeys / kKeysPerTile;
  return c;
}

struct Request {
  int query_len, seq_len;
};

// A random subset of the pool's other requests with pool[target] inserted at a random position;
// returns the batch and that position.
template <class T>
std::pair<std::vector<T>, size_t> random_batch_with(const std::vector<T>& pool, size_t target, std::mt19937_64& rng) {
  std::vector<T> batch;
  for (size_t r = 0; r < pool.size(); ++r) {
    if (r != target && rng() % 2 == 0) batch.push_back(pool[r]);
  }
  const size_t position = rng() % (batch.size() + 1);
  batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(position), pool[target]);
  return {batch, position};
}

// What the items of one request compute: (kv head, rows, keys, flags, writes a partial), sorted.
using ItemKey = std::tuple<int, int, int, int, int, int, bool>;

std::vector<ItemKey> items_of(const AttentionPlan& plan, int position) {
  std::vector<ItemKey> keys;
  for (const WorkItem& it : plan.items) {
    if (it.request != position) continue;
    keys.emplace_back(it.kv_head, it.row_start, it.num_rows, it.kv_start, it.kv_end, it.flags, it.partial_row >= 0);
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

AttentionPlan plan_of(const PlannerConfig& config, const std::vector<Request>& batch) {
  std::vector<int32_t> qsl = {0}, lens;
  for (const Request& r : batch) {
    qsl.push_back(qsl.back() + r.query_len);
    lens.push_back(r.seq_len);
  }
  return make_attention_plan(config, qsl, lens);
}

TEST(CudaBatchInvariantPlan, ARequestsItemsDoNotDependOnTheBatch) {
  const std::vector<Request> pool = {{1, 4097}, {1, 300}, {1, 9000}, {3, 2100}, {1, 1},
                                     {40, 5000}, {200, 200}, {1, 2048}, {2, 6000}};
  std::mt19937_64 rng(21);
  for (size_t target = 0; target < pool.size(); ++target) {
    const std::vector<ItemKey> alone = items_of(plan_of(invariant_config(132, 396), {pool[target]}), 0);
    ASSERT_FALSE(alone.empty());
    for (int trial = 0; trial < 50; ++trial) {
      const auto [batch, position] = random_batch_with(pool, target, rng);
      const int resident = 1 + static_cast<int>(rng() % 600);
      const AttentionPlan plan = plan_of(invariant_config(resident, 3 * resident), batch);
      EXPECT_FALSE(plan.decode_kernel);
      EXPECT_EQ(plan.cascade_prefix, 0);
      EXPECT_EQ(items_of(plan, static_cast<int>(position)), alone)
          << "request " << target << " at " << position << " of " << batch.size() << ", " << resident << " CTAs";
    }
  }
}

TEST(CudaBatchInvariantPlan, DecodesSplitInFixedChunksPrefillsNever) {
  const PlannerConfig config = invariant_config(132, 396);
  // A decode of 4097 keys (one over two chunks): [0, 2048), [2048, 4096), [4096, 4097); the sink
  // with the first part only; a combine item per kv head.
  const AttentionPlan decode = plan_of(config, {{1, 4097}});
  ASSERT_EQ(decode.items.size(), 6u);
  ASSERT_EQ(decode.combine.size(), 2u);
  for (int g = 0; g < 2; ++g) {
    std::vector<std::pair<int, int>> ranges;
    for (const WorkItem& it : decode.items) {
      if (it.kv_head != g) continue;
      ranges.push_back({it.kv_start, it.kv_end});
      EXPECT_EQ((it.flags & kItemOwnsSink) != 0, it.kv_start == 0);
      EXPECT_GE(it.partial_row, 0);
    }
    std::sort(ranges.begin(), ranges.end());
    EXPECT_EQ(ranges, (std::vector<std::pair<int, int>>{{0, 2048}, {2048, 4096}, {4096, 4097}}));
  }
  // 2048 keys: one chunk, written directly.
  const AttentionPlan exact = plan_of(config, {{1, 2048}});
  EXPECT_EQ(exact.items.size(), 2u);
  EXPECT_TRUE(exact.combine.empty());
  // A prefill over a long context: never split, whatever the CTAs left idle.
  const AttentionPlan prefill = plan_of(invariant_config(1000, 0), {{64, 30000}});
  EXPECT_EQ(prefill.items.size(), 4u);  // 64 * 4 rows = 2 prefill tiles, 2 kv heads
  EXPECT_TRUE(prefill.combine.empty());
}

TEST(CudaBatchInvariantPlan, CapacityBoundsTheLargestBatches) {
  PlannerConfig config = invariant_config(132, 396);
  const int max_seqs = 16, max_tokens = 64, max_len = 9000;
  const FixedSplitCapacity cap = fixed_split_capacity(config, max_seqs, max_tokens, max_len);
  for (const int query_len : {1, 2, 4}) {
    std::vector<Request> batch(static_cast<size_t>(std::min(max_seqs, max_tokens / query_len)),
                               Request{query_len, max_len});
    const AttentionPlan plan = plan_of(config, batch);
    EXPECT_LE(plan.partial_rows, cap.partial_rows) << query_len;
    EXPECT_LE(static_cast<int64_t>(plan.items.size()), cap.work_items) << query_len;
    EXPECT_LE(static_cast<int64_t>(plan.combine.size()), cap.combine_items) << query_len;
  }
  EXPECT_EQ(fixed_split_capacity(invariant_config(132, 0), 16, 64, 1900).partial_rows, 0);  // one chunk
  config.fixed_split_tiles = 0;
  EXPECT_EQ(fixed_split_capacity(config, max_seqs, max_tokens, max_len).work_items, 0);
}

TEST(CudaBatchInvariantPlan, MoreSplitsThanTheCombineMergesIsAnError) {
  const std::vector<Request> longest = {{1, 256 * kBatchInvariantSplitKeys}};
  EXPECT_EQ(plan_of(invariant_config(132, 0), longest).combine.front().num_splits, 256);
  try {
    plan_of(invariant_config(132, 0), {{1, 256 * kBatchInvariantSplitKeys + 1}});
    ADD_FAILURE() << "257 fixed splits were planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "metadata");
  }
}

TEST(CudaBatchInvariantPlan, CascadeIsAnError) {
  try {
    make_attention_plan(invariant_config(132, 0), std::vector<int32_t>{0, 1, 2}, std::vector<int32_t>{600, 700}, 256);
    ADD_FAILURE() << "a cascade prefix was accepted in a batch-invariant plan";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "cascade_prefix");
  }
}

TEST(CudaMlaBatchInvariantPlan, ARequestsSegmentsDoNotDependOnTheBatch) {
  namespace md = mla_decode;
  const std::vector<int32_t> pool = {4097, 300, 9000, 2048, 1, 0, 6000, 2049};
  // (kv_start, kv_end, writes a partial) of request `r`'s segments.
  const auto segments_of = [](const md::Plan& plan, int r) {
    std::vector<std::tuple<int, int, bool>> out;
    for (const md::Segment& s : plan.segments) {
      if (s.request == r) out.emplace_back(s.kv_start, s.kv_end, s.partial_row >= 0);
    }
    return out;
  };
  std::mt19937_64 rng(22);
  for (size_t target = 0; target < pool.size(); ++target) {
    const md::Plan alone = md::make_fixed_plan(std::vector<int32_t>{pool[target]}, {}, md::kBatchInvariantSplitTiles, 132);
    const auto expected = segments_of(alone, 0);
    const int64_t tiles = (pool[target] + 63) / 64;
    EXPECT_EQ(expected.size(), static_cast<size_t>(std::max<int64_t>(1, (tiles + 31) / 32)));
    for (int trial = 0; trial < 50; ++trial) {
      const auto [batch, position] = random_batch_with(pool, target, rng);
      const int parts = 1 + static_cast<int>(rng() % 200);
      const md::Plan plan = md::make_fixed_plan(batch, {}, md::kBatchInvariantSplitTiles, parts);
      EXPECT_EQ(segments_of(plan, static_cast<int>(position)), expected) << target << " at " << position;
      ASSERT_LE(plan.num_parts, parts);
      EXPECT_EQ(plan.part_begin.front(), 0);
      EXPECT_EQ(plan.part_begin.back(), static_cast<int32_t>(plan.segments.size()));
      EXPECT_LE(static_cast<int64_t>(plan.segments.size()),
                md::max_fixed_segments(static_cast<int64_t>(batch.size()), 9000, md::kBatchInvariantSplitTiles));
      // Every split request's slots are its own, consecutive, in key order.
      for (size_t r = 0; r < batch.size(); ++r) {
        const md::DecodeRequest split = plan.requests[r];
        int seen = 0;
        for (const md::Segment& s : plan.segments) {
          if (s.request != static_cast<int>(r)) continue;
          EXPECT_EQ(s.partial_row, split.num_splits > 1 ? split.partial_base + seen : -1);
          ++seen;
        }
        EXPECT_EQ(seen, split.num_splits);
      }
    }
  }
}

}  // namespace
}  // namespace pagedattn::cuda
