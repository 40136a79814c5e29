// Host planning of the CUDA backend (see planner.h). Pure C++: compiled in every build.
//
// Items: each request with query_len > 0 contributes, per kv head, either one decode-path item
// (query_len * G <= 16 packed rows) or ceil(rows / prefill_rows) prefill-path items. Each item's
// key range is the union of its rows' visible keys (causal end at the last row's position + 1;
// a sliding window trims the start).
// Split-KV: when the items are fewer than the resident CTAs, long ranges are cut into chunks of
// about total_tiles / resident_ctas tiles (at least kMinTilesPerSplit), boundaries aligned to a
// 64-key tile, so one launch fills the device (flash-decoding); the combine kernel merges them.
// Order: costliest first, dealt to the persistent CTAs boustrophedon (band b of resident_ctas
// items is reversed when b is odd) so the big items are spread over the CTAs.
#include "backends/cuda/planner.h"

#include <algorithm>
#include <numeric>

#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

constexpr int kMinTilesPerSplit = 2;

int tiles_of(const KeyRange& r) {
  if (r.end <= r.start) return 0;
  const int first = r.start / kKeysPerTile;
  const int last = (r.end + kKeysPerTile - 1) / kKeysPerTile;
  return last - first;
}

int64_t item_cost(const WorkItem& it) {
  const int64_t tiles = tiles_of(KeyRange{it.kv_start, it.kv_end});
  // A prefill-path tile does 4-8x the MMA work of a decode tile on the same bytes.
  return (it.flags & kItemDecodePath) ? tiles + 1 : 4 * tiles + 1;
}

}  // namespace

KeyRange visible_key_range(const PlannerConfig& config, int query_len, int seq_len, int t0, int t1) {
  KeyRange r{0, seq_len};
  if (!config.positional) return r;
  const int p0 = seq_len - query_len + t0;
  const int p1 = seq_len - query_len + t1;
  if (config.sliding_window) r.start = std::max(0, p0 - (*config.sliding_window - 1));
  if (config.causal) {
    r.end = std::min(seq_len, p1 + 1);
  } else if (config.sliding_window) {
    r.end = std::min(seq_len, p1 + *config.sliding_window);
  }
  if (r.end < r.start) r.end = r.start;
  return r;
}

int64_t max_unsplit_work_items(const PlannerConfig& config, int64_t max_num_seqs,
                               int64_t max_num_batched_tokens) {
  const int64_t rows = max_num_batched_tokens * config.group_size;
  return config.num_kv_heads * (max_num_seqs + (rows + config.prefill_rows - 1) / config.prefill_rows);
}

AttentionPlan make_attention_plan(const PlannerConfig& config, std::span<const int32_t> query_start_loc,
                                  std::span<const int32_t> seq_lens) {
  AttentionPlan plan;
  const int num_reqs = static_cast<int>(seq_lens.size());
  const int G = config.group_size;

  // 1. Unsplit items.
  std::vector<WorkItem> base;
  for (int r = 0; r < num_reqs; ++r) {
    const int q = query_start_loc[r + 1] - query_start_loc[r];
    if (q <= 0) continue;
    const int rows = q * G;
    const bool decode = rows <= kDecodeRows;
    const int tile_rows = decode ? kDecodeRows : config.prefill_rows;
    for (int row0 = 0; row0 < rows; row0 += tile_rows) {
      const int n = std::min(tile_rows, rows - row0);
      const KeyRange range = visible_key_range(config, q, seq_lens[r], row0 / G, (row0 + n - 1) / G);
      for (int g = 0; g < config.num_kv_heads; ++g) {
        WorkItem it{};
        it.request = r;
        it.kv_head = g;
        it.query_start = query_start_loc[r];
        it.query_len = q;
        it.seq_len = seq_lens[r];
        it.row_start = row0;
        it.num_rows = n;
        it.kv_start = range.start;
        it.kv_end = range.end;
        it.flags = (decode ? kItemDecodePath : 0) | kItemOwnsSink;
        it.partial_row = -1;
        base.push_back(it);
      }
    }
  }

  // 2. Split-KV when the unsplit items leave CTAs idle.
  std::vector<int> splits(base.size(), 1);
  const int64_t num_base = static_cast<int64_t>(base.size());
  if (config.allow_split && num_base > 0 && num_base < config.resident_ctas) {
    int64_t total_tiles = 0;
    for (const WorkItem& it : base) total_tiles += tiles_of(KeyRange{it.kv_start, it.kv_end});
    int64_t ideal = std::max<int64_t>(kMinTilesPerSplit,
                                      (total_tiles + config.resident_ctas - 1) / config.resident_ctas);
    for (;;) {
      int64_t partial_rows = 0;
      int64_t num_items = 0;
      int64_t num_groups = 0;
      for (size_t i = 0; i < base.size(); ++i) {
        const int64_t tiles = tiles_of(KeyRange{base[i].kv_start, base[i].kv_end});
        const int64_t most = std::max<int64_t>(1, std::min<int64_t>(config.max_splits, tiles / kMinTilesPerSplit));
        splits[i] = static_cast<int>(std::clamp<int64_t>((tiles + ideal / 2) / ideal, 1, most));
        num_items += splits[i];
        if (splits[i] > 1) {
          partial_rows += static_cast<int64_t>(splits[i]) * base[i].num_rows;
          ++num_groups;
        }
      }
      if (partial_rows <= config.partial_rows_capacity && num_items <= config.max_work_items &&
          num_groups <= config.max_combine_items) {
        break;
      }
      ideal *= 2;  // fewer, longer splits until the plan fits the workspace
    }
  }

  // 3. Materialize splits and combine groups.
  for (size_t i = 0; i < base.size(); ++i) {
    const WorkItem& it = base[i];
    const int n = splits[i];
    if (n == 1) {
      plan.items.push_back(it);
      continue;
    }
    CombineItem c{};
    c.query_start = it.query_start;
    c.row_start = it.row_start;
    c.num_rows = it.num_rows;
    c.kv_head = it.kv_head;
    c.num_splits = n;
    c.partial_row = plan.partial_rows;
    plan.combine.push_back(c);
    const int first_tile = it.kv_start / kKeysPerTile;
    const int tiles = tiles_of(KeyRange{it.kv_start, it.kv_end});
    for (int s = 0; s < n; ++s) {
      const int t_begin = first_tile + static_cast<int>(static_cast<int64_t>(tiles) * s / n);
      const int t_end = first_tile + static_cast<int>(static_cast<int64_t>(tiles) * (s + 1) / n);
      WorkItem part = it;
      part.kv_start = std::max(it.kv_start, t_begin * kKeysPerTile);
      part.kv_end = std::min(it.kv_end, t_end * kKeysPerTile);
      part.flags = (it.flags & kItemDecodePath) | (s == 0 ? kItemOwnsSink : 0);
      part.partial_row = plan.partial_rows + s * it.num_rows;
      plan.items.push_back(part);
    }
    plan.partial_rows += n * it.num_rows;
  }
  PAGEDATTN_CHECK(static_cast<int64_t>(plan.items.size()) <= config.max_work_items, "metadata",
                  "CUDA builder: the batch needs ", plan.items.size(),
                  " work items but the workspace holds ", config.max_work_items,
                  ": raise max_num_seqs / max_num_batched_tokens of the builder");

  // 4. Order: costliest first, boustrophedon over the resident CTAs.
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return item_cost(a) > item_cost(b); });
  const size_t band = static_cast<size_t>(std::max(1, config.resident_ctas));
  for (size_t start = band, b = 1; start < plan.items.size(); start += band, ++b) {
    if (b % 2 == 1) {
      const size_t end = std::min(plan.items.size(), start + band);
      std::reverse(plan.items.begin() + static_cast<std::ptrdiff_t>(start),
                   plan.items.begin() + static_cast<std::ptrdiff_t>(end));
    }
  }
  return plan;
}

}  // namespace pagedattn::cuda
