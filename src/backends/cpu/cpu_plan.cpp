// The CPU backend's plan ("build", host only) and its execution loop.
//
// Plan = a list of work items (cpu_kernels.h) sorted largest first, plus split-KV merge tasks:
//   prefill / mixed  one item per (request, kv head, q tile of max_rows / G tokens): the rows of
//                    every query head of the group share each K/V tile.
//   decode           when the items do not give every thread kItemsPerThread of them, requests
//                    with <= max_split_query_len query tokens (8, or 1 + num_speculative_tokens
//                    when larger: speculative decodes) are split along their visible keys
//                    (splits of >= kMinSplitKeys keys, boundaries on 64-key tiles); each split
//                    writes partial rows (O, max, sum) that a merge task combines (LSE merge).
//   cascade          (common_prefix_len > 0) consecutive requests are grouped (up to max_rows
//                    rows): one item reads the shared prefix pages ONCE for all rows of its
//                    group, then each request's own keys, with one online softmax per row.
//   fast_build       (build_for_drafting) none of the above decisions: one item per (request,
//                    q tile), its KV heads fused when they fit, in batch order; no cost model,
//                    no split-KV, no cascade, no sort.
//   batch_invariant  (BuilderConfig::batch_invariant / PAGEDATTN_BATCH_INVARIANT=1) the fast
//                    build's partition, which is a function of each request alone (its q tiles
//                    from its first token, KV heads fused iff its rows fit the scratch, never
//                    split, no cascade), then the cost order. Every row is computed by one item on
//                    one thread in the same order whatever the batch and the thread count; the
//                    order of the items only decides which thread runs them
//                    (docs/batch_invariance.md).
// The workspace (per-thread scratch, partial rows) is sized once by the builder from
// BuilderConfig, which allocates its first set of run buffers; a plan that would need more
// partial rows than a set has splits less. Each forward leases a set (cpu_internal.h).
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backends/cpu/cpu_internal.h"
#include "pagedattn/batch_invariance.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn::cpu {
namespace {

constexpr const char* kThreadsEnv = "PAGEDATTN_NUM_THREADS";

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Visible key range [lo, hi) of a query at `pos` (mirrors the kernel's row setup).
struct KeyRange {
  int lo = 0, hi = 0;
};

KeyRange visible_keys(int pos, int kv_len, bool causal, int window) {
  KeyRange range{0, causal ? std::min(kv_len, pos + 1) : kv_len};
  if (window > 0) {
    range.lo = std::max(0, pos - (window - 1));
    if (!causal) range.hi = std::min(range.hi, pos + window);
  }
  if (range.hi < range.lo) range.hi = range.lo;
  return range;
}

}  // namespace

int resolve_num_threads(int configured) {
  if (configured > 0) return configured;
  const char* env = std::getenv(kThreadsEnv);
  if (env != nullptr && env[0] != '\0') {
    char* end = nullptr;
    const long value = std::strtol(env, &end, 10);
    PAGEDATTN_CHECK(end != env && *end == '\0' && value > 0 && value <= 4096, kThreadsEnv,
                    kThreadsEnv, " = '", env, "' is not a thread count: expected an integer in [1, 4096]");
    return static_cast<int>(value);
  }
  return std::max(1, omp_get_max_threads());
}

std::unique_ptr<CpuRunBuffers> make_run_buffers(int num_threads, size_t scratch_stride,
                                                int64_t partial_rows, int64_t partial_o_stride) {
  auto buffers = std::make_unique<CpuRunBuffers>();
  buffers->scratch = Tensor(Shape{static_cast<int64_t>(scratch_stride) * num_threads}, DType::u8);
  if (partial_rows > 0) {
    buffers->partial_o = Tensor(Shape{partial_rows, partial_o_stride}, DType::f32);
    buffers->partial_ml = Tensor(Shape{partial_rows, 2}, DType::f32);
  }
  return buffers;
}

// ---- builder ------------------------------------------------------------------------------------

CpuMetadataBuilder::CpuMetadataBuilder(KVCacheSpec spec, BuilderConfig config)
    : AttentionMetadataBuilder(std::move(spec)), config_(std::move(config)) {
  const char* who = "CPU make_builder: ";
  PAGEDATTN_CHECK(config_.num_heads > 0, "config.num_heads", who, "BuilderConfig.num_heads = ",
                  config_.num_heads, " must be positive: the CPU backend sizes its workspace from it");
  if (config_.num_kv_heads <= 0) config_.num_kv_heads = spec_.num_kv_heads;
  if (config_.head_size <= 0) config_.head_size = spec_.head_size;
  if (config_.head_size_v <= 0) config_.head_size_v = spec_.value_head_size();
  PAGEDATTN_CHECK(config_.num_kv_heads > 0 && config_.num_heads % config_.num_kv_heads == 0,
                  "config.num_kv_heads", who, "BuilderConfig.num_kv_heads = ", config_.num_kv_heads,
                  " must be positive and divide num_heads = ", config_.num_heads);
  for (const auto& [size, arg] : {std::pair{config_.head_size, "config.head_size"},
                                  std::pair{config_.head_size_v, "config.head_size_v"}}) {
    PAGEDATTN_CHECK(size % kHeadSizeMultiple == 0 && size >= kHeadSizeMultiple && size <= kMaxHeadSize,
                    arg, who, arg, " = ", size, " is not supported: the CPU backend supports head "
                    "sizes that are multiples of ", kHeadSizeMultiple, " from ", kHeadSizeMultiple,
                    " to ", kMaxHeadSize);
  }
  PAGEDATTN_CHECK(config_.max_num_seqs > 0 && config_.max_num_batched_tokens > 0 &&
                      config_.max_model_len > 0,
                  "config", who, "max_num_seqs = ", config_.max_num_seqs,
                  ", max_num_batched_tokens = ", config_.max_num_batched_tokens,
                  ", max_model_len = ", config_.max_model_len, " must all be positive");

  config_.batch_invariant = batch_invariant_mode(config_);

  auto ws = std::make_shared<CpuWorkspace>();
  ws->num_threads = resolve_num_threads(config_.num_sms);
  const int group = config_.num_heads / config_.num_kv_heads;
  ws->max_rows = std::max(kMaxItemRows, group);
  ws->head_size = config_.head_size;
  ws->head_size_v = config_.head_size_v;
  ws->scratch_stride = (thread_scratch_bytes(ws->head_size, ws->head_size_v, ws->max_rows) + 63) &
                       ~static_cast<size_t>(63);
  // Split-KV partials: splits only exist while items < kItemsPerThread * threads, so at most
  // 2 * target groups of <= max_split_query_len * G rows each (see cpu_plan.cpp header). The
  // batch-invariant mode never splits.
  ws->max_split_query_len = std::max(kMaxSplitQueryLen, speculative_decode_threshold(config_));
  if (ws->num_threads > 1 && !config_.batch_invariant) {
    const int64_t target = static_cast<int64_t>(kItemsPerThread) * ws->num_threads;
    ws->partial_capacity_rows = 2 * target * ws->max_split_query_len * group;
  }
  ws->partial_o_stride = (ws->head_size_v + 15) / 16 * 16;
  ws->buffers.start([threads = ws->num_threads, stride = ws->scratch_stride,
                     rows = ws->partial_capacity_rows, row_floats = ws->partial_o_stride] {
    return make_run_buffers(threads, stride, rows, row_floats);
  });
  workspace_ = std::move(ws);
}

std::shared_ptr<const AttentionMetadata> CpuMetadataBuilder::build(
    int common_prefix_len, const CommonAttentionMetadata& common, bool fast_build) {
  const char* who = "CPU build: ";
  auto md = std::make_shared<CpuAttentionMetadata>();
  host::fill_host_batch_plan(*md, common_prefix_len, common, spec_, config_, who, fast_build);
  const AttentionType type = config_.attn_type;
  const bool cached = uses_kv_cache(type);
  const int num_reqs = common.num_reqs;
  md->num_heads = config_.num_heads;
  md->num_kv_heads = config_.num_kv_heads;
  md->head_size = config_.head_size;
  md->head_size_v = config_.head_size_v;
  md->workspace = workspace_;
  md->first_query_pos.resize(static_cast<size_t>(num_reqs));
  for (int r = 0; r < num_reqs; ++r) {
    md->first_query_pos[r] = cached ? md->seq_lens[r] - md->query_len(r) : 0;
  }

  // ---- work items --------------------------------------------------------------------------
  const CpuWorkspace& ws = *workspace_;
  const int group = config_.num_heads / config_.num_kv_heads;
  const int hkv = config_.num_kv_heads;
  const int tokens_per_tile = std::max(1, ws.max_rows / group);
  const int window = config_.sliding_window.value_or(0);
  const int64_t dims = config_.head_size + config_.head_size_v;
  const int64_t target_items = static_cast<int64_t>(kItemsPerThread) * ws.num_threads;

  // Multiply-adds of a token range of request r over keys [kb, ke) (plus `extra` prefix keys).
  auto range_cost = [&](int r, int tok_begin, int tok_end, int kb, int ke, int extra) {
    int64_t keys = 0;
    for (int t = tok_begin; t < tok_end; ++t) {
      const int pos = md->first_query_pos[r] + (t - md->query_start_loc[r]);
      const KeyRange range = visible_keys(pos, md->seq_lens[r], md->causal, window);
      keys += std::max(0, std::min(range.hi, ke) - std::max(range.lo, kb)) + extra;
    }
    return keys * group * dims + 1;
  };
  // One request's token range over keys [kb, ke) of KV head g (cost unset), and the same with its
  // cost (the fast build orders nothing and skips the cost model).
  auto base_item = [&](int r, int g, int tok_begin, int tok_end, int kb, int ke, int prefix) {
    WorkItem item;
    item.kv_head = g;
    item.req_begin = r;
    item.req_end = r + 1;
    item.tok_begin = tok_begin;
    item.tok_end = tok_end;
    item.kv_begin = kb;
    item.kv_end = ke;
    item.prefix_len = prefix;
    return item;
  };
  auto single_item = [&](int r, int g, int tok_begin, int tok_end, int kb, int ke, int prefix) {
    WorkItem item = base_item(r, g, tok_begin, tok_end, kb, ke, prefix);
    item.cost = range_cost(r, tok_begin, tok_end, std::max(kb, prefix), ke, prefix);
    return item;
  };

  std::vector<WorkItem>& items = md->items;
  if (md->use_cascade) {
    const int prefix = md->common_prefix_len;
    const int64_t total_rows = static_cast<int64_t>(md->num_actual_tokens) * group;
    const int64_t wanted_groups = std::max<int64_t>(1, cdiv(target_items, hkv));
    const int64_t budget = std::clamp<int64_t>(cdiv(total_rows, wanted_groups), group, ws.max_rows);
    int r = 0;
    while (r < num_reqs) {
      const int q_first = md->query_start_loc[r];
      const int64_t rows = static_cast<int64_t>(md->query_len(r)) * group;
      if (rows > budget) {  // a long request: its own q tiles, each reading the prefix
        for (int t = q_first; t < md->query_start_loc[r + 1]; t += tokens_per_tile) {
          const int t_end = std::min(md->query_start_loc[r + 1], t + tokens_per_tile);
          for (int g = 0; g < hkv; ++g) items.push_back(single_item(r, g, t, t_end, 0, md->seq_lens[r], prefix));
        }
        ++r;
        continue;
      }
      int end = r;
      int64_t group_rows = 0;
      while (end < num_reqs && group_rows + static_cast<int64_t>(md->query_len(end)) * group <= budget) {
        group_rows += static_cast<int64_t>(md->query_len(end)) * group;
        ++end;
      }
      if (group_rows > 0) {
        int64_t cost = 1;
        for (int k = r; k < end; ++k) {
          cost += range_cost(k, md->query_start_loc[k], md->query_start_loc[k + 1], prefix,
                             md->seq_lens[k], 0);
        }
        cost += group_rows * prefix * dims;
        for (int g = 0; g < hkv; ++g) {
          WorkItem item;
          item.kv_head = g;
          item.req_begin = r;
          item.req_end = end;
          item.tok_begin = q_first;
          item.tok_end = md->query_start_loc[end];
          item.kv_begin = 0;
          item.kv_end = end - r == 1 ? md->seq_lens[r] : 0;
          item.prefix_len = prefix;
          item.cost = cost;
          items.push_back(item);
        }
      }
      r = end;
    }
  } else if (fast_build || config_.batch_invariant) {
    // fast_build: the fixed default partition, in batch order, with no cost model, no split-KV
    // search and no thread-balance test before fusing: one item per (request, q tile) over all KV
    // heads when its rows fit the scratch, else one per KV head. Dynamic scheduling balances the
    // threads. batch_invariant: the same partition (it depends on each request alone), then the
    // cost order below.
    for (int r = 0; r < num_reqs; ++r) {
      const int q_first = md->query_start_loc[r];
      const int q_end = md->query_start_loc[r + 1];
      for (int t = q_first; t < q_end; t += tokens_per_tile) {
        const int t_end = std::min(q_end, t + tokens_per_tile);
        WorkItem item = base_item(r, 0, t, t_end, 0, md->seq_lens[r], 0);
        if (hkv > 1 && static_cast<int64_t>(t_end - t) * group * hkv <= ws.max_rows) {
          item.num_kv_heads = hkv;
          items.push_back(item);
        } else {
          for (int g = 0; g < hkv; ++g) {
            item.kv_head = g;
            items.push_back(item);
          }
        }
      }
    }
    if (fast_build) return md;
    for (WorkItem& item : items) {
      item.cost = range_cost(item.req_begin, item.tok_begin, item.tok_end, item.kv_begin,
                             item.kv_end, 0) * item.num_kv_heads;
    }
  } else {
    for (int r = 0; r < num_reqs; ++r) {
      const int q_first = md->query_start_loc[r];
      const int q_end = md->query_start_loc[r + 1];
      for (int t = q_first; t < q_end; t += tokens_per_tile) {
        const int t_end = std::min(q_end, t + tokens_per_tile);
        for (int g = 0; g < hkv; ++g) items.push_back(single_item(r, g, t, t_end, 0, md->seq_lens[r], 0));
      }
    }
    // Split-KV for short queries over long contexts when the threads lack work.
    const int64_t base_items = static_cast<int64_t>(items.size());
    if (ws.num_threads > 1 && base_items > 0 && base_items < target_items) {
      const int64_t want_splits = cdiv(target_items, base_items);
      std::vector<WorkItem> split_items;
      int64_t partial_rows = 0;
      for (int r = 0; r < num_reqs; ++r) {
        const int q_first = md->query_start_loc[r];
        const int q_len = md->query_len(r);
        if (q_len == 0) continue;
        bool split = false;
        if (q_len <= std::min(ws.max_split_query_len, tokens_per_tile)) {
          int lo = md->seq_lens[r], hi = 0;
          for (int t = 0; t < q_len; ++t) {
            const KeyRange range =
                visible_keys(md->first_query_pos[r] + t, md->seq_lens[r], md->causal, window);
            lo = std::min(lo, range.lo);
            hi = std::max(hi, range.hi);
          }
          const int begin = lo / kKeyTile * kKeyTile;
          const int64_t span = hi - begin;
          int64_t splits = std::min<int64_t>({want_splits, span / kMinSplitKeys, kMaxSplits});
          const int64_t rows = static_cast<int64_t>(q_len) * group;
          if (splits >= 2) {
            const int64_t chunk = cdiv(cdiv(span, splits), kKeyTile) * kKeyTile;
            splits = cdiv(span, chunk);
            if (splits >= 2 && partial_rows + splits * rows * hkv <= ws.partial_capacity_rows) {
              split = true;
              for (int g = 0; g < hkv; ++g) {
                MergeTask merge;
                merge.kv_head = g;
                merge.tok_begin = q_first;
                merge.tok_end = q_first + q_len;
                merge.num_splits = static_cast<int32_t>(splits);
                merge.partial_base = static_cast<int32_t>(partial_rows);
                for (int64_t s = 0; s < splits; ++s) {
                  const int kb = static_cast<int>(begin + s * chunk);
                  const int ke = static_cast<int>(std::min<int64_t>(hi, begin + (s + 1) * chunk));
                  WorkItem item = single_item(r, g, q_first, q_first + q_len, kb, ke, 0);
                  item.partial_base = merge.partial_base;
                  item.split_index = static_cast<int32_t>(s);
                  split_items.push_back(item);
                }
                md->merges.push_back(merge);
                partial_rows += splits * rows;
              }
            }
          }
        }
        if (!split) {
          for (const WorkItem& item : items) {
            if (item.req_begin == r) split_items.push_back(item);
          }
        }
      }
      items = std::move(split_items);
      md->partial_rows_used = partial_rows;
    }
    // Head fusion: the hkv items of one (request, token range) that write final rows become one
    // item over all KV heads when its rows fit the scratch and the threads keep enough items. It
    // reads each key tile for all heads in turn: whole contiguous pages instead of 256-byte runs.
    const int64_t fused_rows_limit = ws.max_rows;
    auto fusable = [&](size_t i) {
      if (i + static_cast<size_t>(hkv) > items.size()) return false;
      const WorkItem& first = items[i];
      if (first.kv_head != 0 || first.partial_base >= 0 || first.prefix_len != 0 ||
          first.req_end - first.req_begin != 1 ||
          static_cast<int64_t>(first.tok_end - first.tok_begin) * group * hkv > fused_rows_limit) {
        return false;
      }
      for (int g = 1; g < hkv; ++g) {
        const WorkItem& other = items[i + g];
        if (other.kv_head != g || other.partial_base >= 0 || other.req_begin != first.req_begin ||
            other.tok_begin != first.tok_begin || other.tok_end != first.tok_end ||
            other.kv_begin != first.kv_begin || other.kv_end != first.kv_end ||
            other.prefix_len != 0) {
          return false;
        }
      }
      return true;
    };
    if (hkv > 1) {
      int64_t fused_count = 0;
      for (size_t i = 0; i < items.size();) {
        if (fusable(i)) {
          ++fused_count;
          i += hkv;
        } else {
          ++i;
        }
      }
      const int64_t after = static_cast<int64_t>(items.size()) - fused_count * (hkv - 1);
      if (fused_count > 0 && (ws.num_threads == 1 || after >= target_items)) {
        std::vector<WorkItem> fused;
        fused.reserve(static_cast<size_t>(after));
        for (size_t i = 0; i < items.size();) {
          if (fusable(i)) {
            WorkItem item = items[i];
            item.num_kv_heads = hkv;
            for (int g = 1; g < hkv; ++g) item.cost += items[i + g].cost;
            fused.push_back(item);
            i += hkv;
          } else {
            fused.push_back(items[i]);
            ++i;
          }
        }
        items = std::move(fused);
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return md;
}

// ---- execution ------------------------------------------------------------------------------------

void execute_plan(const CpuAttentionMetadata& md, const AttentionArgs& args,
                  const KernelTable& kernels) {
  const int64_t num_items = static_cast<int64_t>(md.items.size());
  const int64_t num_merges = static_cast<int64_t>(md.merges.size());
  if (num_items == 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(md.workspace->num_threads, num_items));
  if (threads <= 1) {
    for (int64_t i = 0; i < num_items; ++i) kernels.run_item(args, md.items[i], args.scratch);
    for (int64_t i = 0; i < num_merges; ++i) kernels.merge(args, md.merges[i]);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    char* scratch = args.scratch + static_cast<size_t>(omp_get_thread_num()) * args.scratch_stride;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) kernels.run_item(args, md.items[i], scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_merges; ++i) kernels.merge(args, md.merges[i]);
  }
}

}  // namespace pagedattn::cpu
