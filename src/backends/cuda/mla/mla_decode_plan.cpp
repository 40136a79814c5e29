// Host planning of the CUDA_MLA decode (mla_decode.h): the decode kernel and the split-KV
// partition.
//
// Cost of a segment = its 64-key tiles + kSegmentOverhead (Q load, pipeline fill, epilogue,
// in tile units). Two candidate partitions:
//   balanced  the requests' tiles laid end to end; part p receives about
//             ceil((tiles + overhead * (requests + parts)) / num_parts) of it; a request crossing
//             a part boundary is cut there (at a tile boundary), so every CTA gets the same amount
//             of work whatever the mix of lengths, and a single long request is spread over every
//             part;
//   whole     no cut: whole requests, longest first, each to the least loaded part (LPT).
// A cut is not free: each segment of a cut request writes a slot of f32 partial rows that the
// combine reads back after the decode. make_plan prices both (plan_cost) and keeps the cheaper:
// the balanced one wins where it spreads a few requests over idle parts (one long request, fewer
// requests than parts); the whole one where many requests fill every part and cutting only evens
// out the last few tiles (128 requests of 4k keys over 66 parts: 132 tiles a part against 130,
// while the cuts would write and merge 128 slots). Pure host code, O(n log n + num_parts).
// Batch-invariant plans (make_fixed_plan): fixed 2048-key segments per request instead.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

#include "backends/cuda/mla/mla_decode.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda::mla_decode {
namespace {
constexpr int64_t kSegmentOverhead = 2;
// The combine's launch and tail, in tile units: paid once by a plan with a cut request.
constexpr double kCombineTiles = 1.0;

int64_t tiles_of(int64_t keys) { return (keys + kKeysPerTile - 1) / kKeysPerTile; }

// The plan's requests (their tokens and keys, unsplit) from seq_lens and query_start_loc.
void add_requests(Plan& plan, std::span<const int32_t> seq_lens, std::span<const int32_t> query_start_loc) {
  const int n = static_cast<int>(seq_lens.size());
  PAGEDATTN_CHECK(query_start_loc.empty() || static_cast<int>(query_start_loc.size()) == n + 1, "query_start_loc",
                  "CUDA_MLA plan: query_start_loc has ", query_start_loc.size(), " entries, expected 0 or ", n + 1);
  PAGEDATTN_CHECK(query_start_loc.empty() || query_start_loc[0] == 0, "query_start_loc",
                  "CUDA_MLA plan: query_start_loc[0] = ", query_start_loc.empty() ? 0 : query_start_loc[0],
                  ", expected 0");
  plan.requests.resize(static_cast<size_t>(n));
  plan.tokens_per_request = 1;
  for (int r = 0; r < n; ++r) {
    PAGEDATTN_CHECK(seq_lens[r] >= 0, "seq_lens", "CUDA_MLA plan: a decode seq_len is ", seq_lens[r], ", expected >= 0");
    const int32_t first = query_start_loc.empty() ? r : query_start_loc[r];
    const int32_t q = query_start_loc.empty() ? 1 : query_start_loc[r + 1] - first;
    PAGEDATTN_CHECK(q >= 1, "query_start_loc", "CUDA_MLA plan: decode request ", r, " has ", q,
                    " tokens, expected >= 1");
    plan.requests[r] = DecodeRequest{first, q, seq_lens[r], 1, -1};
    plan.tokens_per_request = std::max(plan.tokens_per_request, static_cast<int>(q));
  }
}
}  // namespace

DecodeKernel select_decode_kernel(MlaDecodeKernelChoice choice, int rows, DType cache_dtype, bool wgmma_image) {
  const bool sixteen_bit = cache_dtype == DType::bf16 || cache_dtype == DType::f16;
  if (rows <= 16) return DecodeKernel::mma_16_rows;
  // fp8 with 17..32 rows keeps two 16-row CTAs (not measured on the wgmma kernel's fp8 path).
  if ((sixteen_bit || rows > 32) && wgmma_image && choice == MlaDecodeKernelChoice::automatic) {
    return DecodeKernel::wgmma;
  }
  return rows <= 32 ? DecodeKernel::mma_16_rows : DecodeKernel::mma_64_rows;
}

namespace {
// The balanced partition (the top comment).
Plan make_balanced_plan(std::span<const int32_t> seq_lens, std::span<const int32_t> query_start_loc, int num_parts) {
  Plan plan;
  const int n = static_cast<int>(seq_lens.size());
  add_requests(plan, seq_lens, query_start_loc);
  if (n == 0) return plan;
  int64_t tiles_total = 0;
  for (int32_t s : seq_lens) tiles_total += tiles_of(s);
  // At most num_requests + num_parts segments, each paying the overhead: with this budget the
  // greedy fill below fits in num_parts parts (the last part's catch-all only absorbs rounding).
  const int64_t total = tiles_total + kSegmentOverhead * (n + num_parts);
  const int64_t budget = std::max<int64_t>((total + num_parts - 1) / num_parts, kSegmentOverhead + 1);

  plan.part_begin.push_back(0);
  int part = 0;
  int64_t left = budget;  // cost left in the current part
  auto close_part = [&] {
    plan.part_begin.push_back(static_cast<int32_t>(plan.segments.size()));
    ++part;
    left = budget;
  };
  std::vector<int> segments_of(static_cast<size_t>(n), 0);
  for (int r = 0; r < n; ++r) {
    const int64_t tiles = tiles_of(seq_lens[r]);
    int64_t done = 0;
    while (true) {
      const int64_t rest = tiles - done;
      const bool last_part = part == num_parts - 1;
      int64_t take;
      if (last_part || left >= rest + kSegmentOverhead) {
        take = rest;
      } else if (left - kSegmentOverhead >= 1) {
        take = left - kSegmentOverhead;
      } else {
        close_part();  // too little left here for a segment (never on the last part)
        continue;
      }
      Segment seg;
      seg.request = r;
      seg.kv_start = static_cast<int32_t>(done * kKeysPerTile);
      seg.kv_end = static_cast<int32_t>(std::min<int64_t>((done + take) * kKeysPerTile, seq_lens[r]));
      seg.partial_row = -1;
      plan.segments.push_back(seg);
      ++segments_of[r];
      done += take;
      left -= take + kSegmentOverhead;
      if (left <= kSegmentOverhead && !last_part && (done < tiles || r + 1 < n)) close_part();
      if (done >= tiles) break;
    }
  }
  if (static_cast<int32_t>(plan.segments.size()) != plan.part_begin.back()) {
    plan.part_begin.push_back(static_cast<int32_t>(plan.segments.size()));
  }
  plan.num_parts = static_cast<int>(plan.part_begin.size()) - 1;

  // Slots for the requests cut into several segments.
  int slot = 0;
  size_t seg_i = 0;
  for (int r = 0; r < n; ++r) {
    const int k = segments_of[r];
    if (k > 1) {
      plan.requests[r].num_splits = k;
      plan.requests[r].partial_base = slot;
      for (int j = 0; j < k; ++j) plan.segments[seg_i + j].partial_row = slot + j;
      slot += k;
      plan.any_split = true;
    }
    seg_i += static_cast<size_t>(k);
  }
  plan.num_partial_slots = slot;
  return plan;
}

// Whole requests, longest first (ties: the lower index), each to the least loaded part (ties: the
// lower part); a part's segments in request order; parts left empty are dropped.
Plan make_whole_plan(std::span<const int32_t> seq_lens, std::span<const int32_t> query_start_loc, int num_parts) {
  Plan plan;
  const int n = static_cast<int>(seq_lens.size());
  add_requests(plan, seq_lens, query_start_loc);
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return seq_lens[a] > seq_lens[b]; });
  using Load = std::pair<int64_t, int>;  // (cost, part)
  std::priority_queue<Load, std::vector<Load>, std::greater<>> least;
  for (int pi = 0; pi < num_parts; ++pi) least.emplace(0, pi);
  std::vector<std::vector<int>> members(static_cast<size_t>(num_parts));
  for (const int r : order) {
    auto [cost, pi] = least.top();
    least.pop();
    members[pi].push_back(r);
    least.emplace(cost + tiles_of(seq_lens[r]) + kSegmentOverhead, pi);
  }
  plan.part_begin.push_back(0);
  for (std::vector<int>& part : members) {
    if (part.empty()) continue;
    std::sort(part.begin(), part.end());
    for (const int r : part) plan.segments.push_back(Segment{r, 0, seq_lens[r], -1});
    plan.part_begin.push_back(static_cast<int32_t>(plan.segments.size()));
  }
  plan.num_parts = static_cast<int>(plan.part_begin.size()) - 1;
  return plan;
}
}  // namespace

double plan_cost(const Plan& plan, DecodeKernel kernel) {
  int64_t worst = 0;
  for (int pi = 0; pi < plan.num_parts; ++pi) {
    int64_t load = 0;
    for (int si = plan.part_begin[pi]; si < plan.part_begin[pi + 1]; ++si) {
      load += tiles_of(plan.segments[si].kv_end - plan.segments[si].kv_start) + kSegmentOverhead;
    }
    worst = std::max(worst, load);
  }
  if (!plan.any_split) return static_cast<double>(worst);
  // A slot: rows_per_cta x 512 f32 written, then read by the combine, against a 16-bit tile's
  // 64 x 576 x 2 bytes; the slots' traffic is spread over the parts.
  const double slot_tiles = rows_per_cta(kernel) * kValue * 4.0 * 2.0 / (kKeysPerTile * kLatent * 2.0);
  return static_cast<double>(worst) + plan.num_partial_slots * slot_tiles / plan.num_parts + kCombineTiles;
}

Plan make_plan(std::span<const int32_t> seq_lens, std::span<const int32_t> query_start_loc, int num_parts,
               DecodeKernel kernel) {
  PAGEDATTN_CHECK(num_parts >= 1, "num_parts", "CUDA_MLA plan: num_parts = ", num_parts, " must be >= 1");
  Plan balanced = make_balanced_plan(seq_lens, query_start_loc, num_parts);
  if (!balanced.any_split) return balanced;
  Plan whole = make_whole_plan(seq_lens, query_start_loc, num_parts);
  return plan_cost(whole, kernel) <= plan_cost(balanced, kernel) ? whole : balanced;
}

Plan make_fixed_plan(std::span<const int32_t> seq_lens, std::span<const int32_t> query_start_loc, int split_tiles,
                     int num_parts) {
  PAGEDATTN_CHECK(num_parts >= 1 && split_tiles >= 1, "num_parts", "CUDA_MLA fixed plan: num_parts = ", num_parts,
                  ", split_tiles = ", split_tiles, ": both must be >= 1");
  Plan plan;
  const int n = static_cast<int>(seq_lens.size());
  add_requests(plan, seq_lens, query_start_loc);
  if (n == 0) return plan;
  // Segments, request by request (fixed sizes), and their total cost.
  int64_t total = 0;
  int slot = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t tiles = tiles_of(seq_lens[r]);
    const int64_t count = std::max<int64_t>(1, (tiles + split_tiles - 1) / split_tiles);
    if (count > 1) {
      plan.requests[r].num_splits = static_cast<int32_t>(count);
      plan.requests[r].partial_base = slot;
      plan.any_split = true;
    }
    for (int64_t j = 0; j < count; ++j) {
      Segment seg;
      seg.request = r;
      seg.kv_start = static_cast<int32_t>(j * split_tiles * kKeysPerTile);
      seg.kv_end = static_cast<int32_t>(std::min<int64_t>((j + 1) * split_tiles * kKeysPerTile, seq_lens[r]));
      seg.partial_row = count > 1 ? slot + static_cast<int32_t>(j) : -1;
      total += std::min<int64_t>(split_tiles, tiles - j * split_tiles) + kSegmentOverhead;
      plan.segments.push_back(seg);
    }
    if (count > 1) slot += static_cast<int>(count);
  }
  plan.num_partial_slots = slot;
  // Parts: consecutive segments up to about total / num_parts each.
  const int64_t budget = (total + num_parts - 1) / num_parts;
  plan.part_begin.push_back(0);
  int64_t load = 0;
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const Segment& seg = plan.segments[i];
    const int64_t cost = tiles_of(seg.kv_end - seg.kv_start) + kSegmentOverhead;
    if (load > 0 && load + cost > budget && static_cast<int>(plan.part_begin.size()) < num_parts) {
      plan.part_begin.push_back(static_cast<int32_t>(i));
      load = 0;
    }
    load += cost;
  }
  plan.part_begin.push_back(static_cast<int32_t>(plan.segments.size()));
  plan.num_parts = static_cast<int>(plan.part_begin.size()) - 1;
  return plan;
}

}  // namespace pagedattn::cuda::mla_decode
