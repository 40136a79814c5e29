// Host planning of the CUDA backend (see planner.h). Pure C++: compiled in every build.
//
// Items: each request with query_len > 0 contributes, per kv head, either one decode-path item
// (query_len * G <= 16 packed rows) or ceil(rows / prefill_rows) prefill-path items. A speculative
// decode (1 + k tokens, BuilderConfig::num_speculative_tokens) takes the decode path when its rows
// fit 16 (k <= 3 at GQA 4), else one prefill-path item per kv head, which reads its keys once:
// measured faster than cutting it into 16-row decode items that each read them (docs/perf/cuda.md,
// speculative decodes). Each item's
// key range is the union of its rows' visible keys (causal end at the last row's position + 1;
// a sliding window trims the start).
// Split-KV: when the items are fewer than the resident CTAs, long ranges are cut into chunks of
// about total_tiles / resident_ctas tiles (at least kMinTilesPerSplit, rounded up to a decode
// pipeline step), boundaries aligned to a 64-key tile, so one launch fills the device
// (flash-decoding); the combine kernel merges them.
// Decode-only plans (the decode-only kernel, more resident CTAs) also split when the items
// outnumber the CTAs but would leave the last wave short (choose_decode_chunk).
// Cascade (common prefix P): prefix items over keys [0, P) for every query row of the batch
// (tiles of packed global rows, one set per kv head), the requests' items over [P, seq_len);
// all write partials (the prefix ones at (split, kv head, global row)) and every request item
// group gets a combine item that also merges its rows' prefix states.
// Batch-invariant plans (fixed_split_tiles > 0): no search; every decode-path item in chunks of
// fixed_split_tiles tiles from its first tile, prefill-path items whole, never the decode-only
// kernel (one kernel for every plan of the builder), no cascade.
// Order: costliest first, dealt to the persistent CTAs boustrophedon (band b of resident_ctas
// items is reversed when b is odd) so the big items are spread over the CTAs.
#include "backends/cuda/attention/planner.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

constexpr int kMinTilesPerSplit = 2;
constexpr int64_t kMinDecodeKernelChunk = 8;  // tiles of a split item on the decode-only kernel
constexpr int64_t kMinPairedTilesPerCta = 16;  // decode tiles a CTA that make kv-head pairs pay

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

int64_t max_prefix_work_items(const PlannerConfig& config, int64_t max_num_batched_tokens) {
  const int64_t rows = max_num_batched_tokens * config.group_size;
  return config.num_kv_heads * (1 + (rows + config.prefill_rows - 1) / config.prefill_rows);
}

FixedSplitCapacity fixed_split_capacity(const PlannerConfig& config, int64_t max_num_seqs,
                                        int64_t max_num_batched_tokens, int64_t max_model_len) {
  FixedSplitCapacity cap;
  if (config.fixed_split_tiles <= 0) return cap;
  const int64_t tiles = (max_model_len + kKeysPerTile - 1) / kKeysPerTile + 1;  // + a misaligned start
  const int64_t splits = (tiles + config.fixed_split_tiles - 1) / config.fixed_split_tiles;
  // Decode-path items: one per (request, kv head), their rows <= 16 and <= the batch's rows.
  const int64_t items = config.num_kv_heads * std::min(max_num_seqs, max_num_batched_tokens);
  const int64_t rows = config.num_kv_heads * std::min(max_num_seqs * kDecodeRows,
                                                      max_num_batched_tokens * config.group_size);
  cap.partial_rows = splits > 1 ? splits * rows : 0;
  cap.work_items = max_unsplit_work_items(config, max_num_seqs, max_num_batched_tokens) + items * (splits - 1);
  cap.combine_items = splits > 1 ? items : 0;
  return cap;
}

namespace {

// Split s of n of an item's key range: tile-aligned boundaries; split 0 keeps the sink.
WorkItem split_part(const WorkItem& it, int s, int n) {
  const int first_tile = it.kv_start / kKeysPerTile;
  const int tiles = tiles_of(KeyRange{it.kv_start, it.kv_end});
  const int t_begin = first_tile + static_cast<int>(static_cast<int64_t>(tiles) * s / n);
  const int t_end = first_tile + static_cast<int>(static_cast<int64_t>(tiles) * (s + 1) / n);
  WorkItem part = it;
  if (n > 1) {
    part.kv_start = std::max(it.kv_start, t_begin * kKeysPerTile);
    part.kv_end = std::min(it.kv_end, t_end * kKeysPerTile);
  }
  part.flags = (it.flags & (kItemDecodePath | kItemPairedHeads)) | (s == 0 ? (it.flags & kItemOwnsSink) : 0);
  return part;
}

// Part s of an item cut in chunks of `chunk` tiles counted from its first tile (the last one
// shorter): fixed sizes, a function of the item alone.
WorkItem fixed_split_part(const WorkItem& it, int s, int chunk) {
  const int first_tile = it.kv_start / kKeysPerTile;
  WorkItem part = split_part(it, 0, 1);
  part.kv_start = std::max(it.kv_start, (first_tile + s * chunk) * kKeysPerTile);
  part.kv_end = std::min(it.kv_end, (first_tile + (s + 1) * chunk) * kKeysPerTile);
  if (s > 0) part.flags &= ~kItemOwnsSink;
  return part;
}

// Splits of an item of `tiles` tiles cut in chunks of about `chunk` tiles (chunk > 0): at least
// kMinTilesPerSplit tiles each, at most max_splits.
int64_t split_count(int64_t tiles, int64_t chunk, int max_splits) {
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(max_splits, tiles / kMinTilesPerSplit));
  return std::clamp<int64_t>((tiles + chunk / 2) / chunk, 1, most);
}

// Decode-only plans: an item costs about its tiles plus a fixed overhead (Q load, pipeline fill,
// warp merge), and the persistent CTAs take the cost-sorted items in turn, so the time is about
// max(largest item, ceil(items / CTAs) * mean item) (decode items are near-equal), plus the
// combine launch once anything is split. Returns the chunk size (tiles) with the smallest such
// estimate among: no split (0), total / CTAs (fill the CTAs once) and the median item cut in 2..8,
// leaving out chunkings that exceed the workspace.
int64_t choose_decode_chunk(const PlannerConfig& config, const std::vector<WorkItem>& base, int64_t resident) {
  constexpr double kItemOverhead = 1.5;  // tiles
  constexpr double kCombineCost = 2.0;   // tiles
  std::vector<int64_t> tiles(base.size());
  int64_t total = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    tiles[i] = tiles_of(KeyRange{base[i].kv_start, base[i].kv_end});
    total += tiles[i];
  }
  std::vector<int64_t> sorted = tiles;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(sorted.size() / 2), sorted.end());
  const int64_t median = sorted[sorted.size() / 2];
  const auto estimate = [&](int64_t chunk) {
    int64_t items = 0, rows = 0, groups = 0;
    double sum = 0.0, largest = 0.0;
    for (size_t i = 0; i < base.size(); ++i) {
      const int64_t n = chunk <= 0 ? 1 : split_count(tiles[i], chunk, config.max_splits);
      items += n;
      sum += static_cast<double>(tiles[i]) + kItemOverhead * static_cast<double>(n);
      largest = std::max(largest, static_cast<double>((tiles[i] + n - 1) / n) + kItemOverhead);
      if (n > 1) {
        rows += n * base[i].num_rows;
        ++groups;
      }
    }
    const bool fits = rows <= config.partial_rows_capacity && items <= config.max_work_items &&
                      groups <= config.max_combine_items;
    const double waves = static_cast<double>((items + resident - 1) / resident);
    const double time = std::max(largest, waves * sum / static_cast<double>(items)) + (groups > 0 ? kCombineCost : 0.0);
    return std::pair<bool, double>(fits, time);
  };
  int64_t best = 0;
  double best_time = estimate(0).second;
  std::vector<int64_t> candidates = {(total + resident - 1) / resident};
  for (int64_t n = 2; n <= 8; ++n) candidates.push_back((median + n - 1) / n);
  for (int64_t chunk : candidates) {
    if (chunk < kMinTilesPerSplit) continue;
    const auto [fits, time] = estimate(chunk);
    if (fits && time < best_time) {
      best = chunk;
      best_time = time;
    }
  }
  return best;
}

}  // namespace

AttentionPlan make_attention_plan(const PlannerConfig& config, std::span<const int32_t> query_start_loc,
                                  std::span<const int32_t> seq_lens, int cascade_prefix) {
  AttentionPlan plan;
  const int num_reqs = static_cast<int>(seq_lens.size());
  const int G = config.group_size;
  const bool cascade = cascade_prefix > 0 && num_reqs > 0;
  const bool fixed = config.fixed_split_tiles > 0;
  PAGEDATTN_CHECK(!fixed || !cascade, "cascade_prefix", "CUDA planner: cascade_prefix = ", cascade_prefix,
                  " in a batch-invariant plan: the batch-invariant mode has no cascade");
  plan.cascade_prefix = cascade ? cascade_prefix : 0;

  // 1. Unsplit items: each request's rows in tiles (under cascade its keys from P on), then
  //    (cascade) the prefix items over every row of the batch.
  std::vector<WorkItem> base;
  const auto add_tiles = [&](const WorkItem& proto, int rows, const auto& range_of) {
    const bool decode = rows <= kDecodeRows;
    const int tile_rows = decode ? kDecodeRows : config.prefill_rows;
    for (int row0 = 0; row0 < rows; row0 += tile_rows) {
      const int n = std::min(tile_rows, rows - row0);
      const KeyRange range = range_of(row0 / G, (row0 + n - 1) / G);
      for (int g = 0; g < config.num_kv_heads; ++g) {
        WorkItem it = proto;
        it.kv_head = g;
        it.row_start = row0;
        it.num_rows = n;
        it.kv_start = range.start;
        it.kv_end = range.end;
        it.flags = proto.flags | (decode ? kItemDecodePath : 0);
        it.partial_row = -1;
        base.push_back(it);
      }
    }
  };
  // Paired kv heads (no cascade): a request whose rows of two heads fit the decode path gets one
  // item per kv-head pair (kItemPairedHeads: kv_head = the pair, rows token * 2G + h), when the
  // batch's decode keys give each CTA at least kMinPairedTilesPerCta tiles (or the decode-only
  // kernel is forced): pairs stream a large batch faster, while a small one, cut into short
  // splits, runs each split item slower on the pairs' wider path (docs/perf/cuda.md).
  bool pairs = config.pair_kv_heads && !cascade && config.num_kv_heads % 2 == 0;
  if (pairs && !config.force_decode_kernel) {
    int64_t decode_tiles = 0;
    for (int r = 0; r < num_reqs; ++r) {
      const int q = query_start_loc[r + 1] - query_start_loc[r];
      if (q <= 0 || 2 * q * G > kDecodeRows) continue;
      decode_tiles += int64_t{config.num_kv_heads} * tiles_of(visible_key_range(config, q, seq_lens[r], 0, q - 1));
    }
    const int64_t ctas = config.decode_resident_ctas > 0 ? config.decode_resident_ctas : config.resident_ctas;
    pairs = decode_tiles >= kMinPairedTilesPerCta * ctas;
  }
  for (int r = 0; r < num_reqs; ++r) {
    const int q = query_start_loc[r + 1] - query_start_loc[r];
    if (q <= 0) continue;
    WorkItem proto{};
    proto.request = r;
    proto.query_start = query_start_loc[r];
    proto.query_len = q;
    proto.seq_len = seq_lens[r];
    proto.flags = kItemOwnsSink;
    if (pairs && 2 * q * G <= kDecodeRows) {
      const KeyRange range = visible_key_range(config, q, seq_lens[r], 0, q - 1);
      for (int j = 0; j < config.num_kv_heads / 2; ++j) {
        WorkItem it = proto;
        it.kv_head = j;
        it.row_start = 0;
        it.num_rows = 2 * q * G;
        it.kv_start = range.start;
        it.kv_end = range.end;
        it.flags = proto.flags | kItemDecodePath | kItemPairedHeads;
        it.partial_row = -1;
        base.push_back(it);
      }
      continue;
    }
    add_tiles(proto, q * G, [&](int t0, int t1) {
      KeyRange range = visible_key_range(config, q, seq_lens[r], t0, t1);
      if (cascade) {
        range.start = std::max(range.start, cascade_prefix);
        range.end = std::max(range.end, range.start);
      }
      return range;
    });
  }
  const size_t num_suffix = base.size();
  // Prefix rows: global row = flat_token * G + head_in_group. As one request of T queries with
  // seq_len P + T, every row's causal range covers [0, P): the kernel needs no special case.
  const int num_tokens = num_reqs > 0 ? query_start_loc[num_reqs] - query_start_loc[0] : 0;
  if (cascade && num_suffix > 0) {
    WorkItem proto{};
    proto.request = 0;  // the prefix pages are request 0's (shared by every request)
    proto.query_start = query_start_loc[0];
    proto.query_len = num_tokens;
    proto.seq_len = cascade_prefix + num_tokens;
    proto.flags = 0;    // the sink belongs to the suffix
    add_tiles(proto, num_tokens * G, [&](int, int) { return KeyRange{0, cascade_prefix}; });
  }
  const bool has_prefix = base.size() > num_suffix;

  // 2. Split-KV when the unsplit items leave CTAs idle (decode-only plans: when that balances the
  //    waves). Under cascade every item writes partial states (prefix items: the same split count
  //    for all, as they share one key range).
  std::vector<int> splits(base.size(), 1);
  const int64_t num_base = static_cast<int64_t>(base.size());
  int64_t ideal = 0;  // chunk size in tiles; 0: no split
  plan.decode_kernel = !fixed && !has_prefix && config.decode_resident_ctas > 0 && !base.empty() &&
                       std::all_of(base.begin(), base.end(),
                                   [](const WorkItem& it) { return (it.flags & kItemDecodePath) != 0; });
  if (plan.decode_kernel && config.decode_kernel_max_tiles > 0 && !config.force_decode_kernel) {
    int64_t tiles = 0;
    for (const WorkItem& it : base) tiles += tiles_of(KeyRange{it.kv_start, it.kv_end});
    plan.decode_kernel = tiles <= config.decode_kernel_max_tiles;
  }
  if (plan.decode_kernel && config.allow_split) {
    ideal = choose_decode_chunk(config, base, config.decode_resident_ctas);
    // Chunks this short are mostly pipeline fill: the unified kernel's deeper pipeline runs them
    // faster (one 8k request: docs/perf/cuda.md, decode-only kernel).
    if (ideal > 0 && ideal < kMinDecodeKernelChunk && !config.force_decode_kernel) {
      plan.decode_kernel = false;
      ideal = 0;
    }
  }
  const int resident = plan.decode_kernel ? config.decode_resident_ctas : config.resident_ctas;
  if (fixed) {
    for (size_t i = 0; i < base.size(); ++i) {
      const int tiles = tiles_of(KeyRange{base[i].kv_start, base[i].kv_end});
      if (base[i].flags & kItemDecodePath) {
        splits[i] = std::max(1, (tiles + config.fixed_split_tiles - 1) / config.fixed_split_tiles);
        PAGEDATTN_CHECK(splits[i] <= config.max_splits, "metadata", "CUDA builder: a request of ",
                        base[i].seq_len, " keys needs ", splits[i], " fixed splits of ",
                        config.fixed_split_tiles * kKeysPerTile, " keys in the batch-invariant mode; the combine merges ",
                        config.max_splits, " at most");
      }
    }
  } else if (!plan.decode_kernel && config.allow_split && num_base > 0 && num_base < resident) {
    int64_t total_tiles = 0;
    for (const WorkItem& it : base) total_tiles += tiles_of(KeyRange{it.kv_start, it.kv_end});
    ideal = std::max<int64_t>(kMinTilesPerSplit, (total_tiles + resident - 1) / resident);
  }
  // A decode-path item runs in steps of decode_step_tiles tiles (fp8 at D = 64 / 128: 4 / 2; a
  // kv-head pair's: 2): a chunk shorter than a step only adds zero-filled tiles.
  const int step = pairs ? config.paired_decode_step_tiles : config.decode_step_tiles;
  if (ideal > 0 && step > 1) ideal = (ideal + step - 1) / step * step;
  if (ideal > 0) {
    for (;;) {
      int64_t partial_rows = 0;
      int64_t num_items = 0;
      int64_t num_groups = 0;
      bool any_split = false;
      for (size_t i = 0; i < base.size(); ++i) {
        const int64_t tiles = tiles_of(KeyRange{base[i].kv_start, base[i].kv_end});
        splits[i] = static_cast<int>(split_count(tiles, ideal, config.max_splits));
        num_items += splits[i];
        any_split = any_split || splits[i] > 1;
        if (cascade || splits[i] > 1) {
          partial_rows += static_cast<int64_t>(splits[i]) * base[i].num_rows;
          if (i < num_suffix) ++num_groups;
        }
      }
      if (partial_rows <= config.partial_rows_capacity && num_items <= config.max_work_items &&
          num_groups <= config.max_combine_items) {
        break;
      }
      if (!any_split) break;  // nothing left to merge: the checks below name the limit
      ideal *= 2;  // fewer, longer splits until the plan fits the workspace
    }
  }

  // 3. Materialize: the prefix states first ((split, kv head, global row) order), then each
  //    request item group with its combine item.
  int prefix_base = 0, prefix_stride = 0;
  if (has_prefix) {
    plan.prefix_splits = splits[num_suffix];
    prefix_stride = config.num_kv_heads * num_tokens * G;
    prefix_base = plan.partial_rows;
    plan.partial_rows += plan.prefix_splits * prefix_stride;
    for (size_t i = num_suffix; i < base.size(); ++i) {
      const WorkItem& it = base[i];
      for (int s = 0; s < plan.prefix_splits; ++s) {
        WorkItem part = split_part(it, s, plan.prefix_splits);
        part.partial_row = prefix_base + s * prefix_stride + it.kv_head * num_tokens * G + it.row_start;
        plan.items.push_back(part);
        ++plan.prefix_items;
      }
    }
  }
  for (size_t i = 0; i < num_suffix; ++i) {
    const WorkItem& it = base[i];
    const int n = splits[i];
    if (n == 1 && !has_prefix) {
      plan.items.push_back(it);
      continue;
    }
    CombineItem c{};
    c.query_start = it.query_start;
    c.row_start = it.row_start;
    c.num_rows = it.num_rows;
    c.kv_head = it.kv_head;
    c.group_size = (it.flags & kItemPairedHeads) ? 2 * G : 0;
    c.num_splits = n;
    c.partial_row = plan.partial_rows;
    if (has_prefix) {
      c.prefix_splits = plan.prefix_splits;
      c.prefix_row = prefix_base + it.kv_head * num_tokens * G + (it.query_start - query_start_loc[0]) * G +
                     it.row_start;
      c.prefix_stride = prefix_stride;
    }
    plan.combine.push_back(c);
    for (int s = 0; s < n; ++s) {
      WorkItem part = fixed ? fixed_split_part(it, s, config.fixed_split_tiles) : split_part(it, s, n);
      part.partial_row = plan.partial_rows + s * it.num_rows;
      plan.items.push_back(part);
    }
    plan.partial_rows += n * it.num_rows;
  }
  PAGEDATTN_CHECK(static_cast<int64_t>(plan.items.size()) <= config.max_work_items, "metadata",
                  "CUDA builder: the batch needs ", plan.items.size(),
                  " work items but the workspace holds ", config.max_work_items,
                  ": raise max_num_seqs / max_num_batched_tokens of the builder");
  PAGEDATTN_CHECK(plan.partial_rows <= config.partial_rows_capacity, "metadata", "CUDA builder: the batch needs ",
                  plan.partial_rows, " partial rows", cascade ? " (cascade prefix + suffix states)" : "",
                  " but the workspace holds ", config.partial_rows_capacity,
                  ": raise max_num_batched_tokens of the builder");
  PAGEDATTN_CHECK(static_cast<int64_t>(plan.combine.size()) <= config.max_combine_items, "metadata",
                  "CUDA builder: the plan needs ", plan.combine.size(), " combine groups but the workspace holds ",
                  config.max_combine_items, ": raise max_num_seqs / max_num_batched_tokens of the builder");

  // 4. Order: costliest first, boustrophedon over the resident CTAs.
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return item_cost(a) > item_cost(b); });
  const size_t band = static_cast<size_t>(std::max(1, resident));
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
