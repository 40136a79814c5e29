// `pagedattn bench --dcp N` (bench_dcp.h).
#include "bench_dcp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>

#include "bench_fill.h"
#include "cli_common.h"
#include "dcp_ranks.h"

namespace pagedattn::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

AttentionLayerParams layer_params(const AttentionBackend& backend, const LayerShape& shape, const DcpBenchConfig& c) {
  AttentionLayerParams p;
  p.num_heads = shape.num_heads;
  if (shape.num_kv_heads > 0) p.num_kv_heads = shape.num_kv_heads;
  p.head_size = shape.head_size;
  p.head_size_v = shape.head_size_v;
  if (shape.scale > 0.f) p.scale = shape.scale;
  p.logits_soft_cap = shape.logits_soft_cap;
  p.kv_cache_dtype = c.kv_cache_dtype;
  p.block_size = c.block_size;
  p.prefix = "bench.layer";
  p.dtype = c.dtype;
  p.device = c.device;
  p.backend = std::string(backend.name());
  return p;
}

// A decode step of point.batch requests over tables of virtual blocks (block_size x n tokens),
// distinct shuffled ids; *blocks: the blocks one rank's cache needs.
CommonAttentionMetadataArgs decode_step(const DcpBenchPoint& point, int block_size, int n, uint64_t seed, int* blocks) {
  const int seq = point.context + 1;
  const int cols = (seq + block_size * n - 1) / (block_size * n);
  std::vector<int32_t> ids(static_cast<size_t>(point.batch) * static_cast<size_t>(cols));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0};
  a.max_num_blocks_per_req = cols;
  a.block_table = ids;
  for (int r = 0; r < point.batch; ++r) {
    a.query_start_loc.push_back(r + 1);
    a.seq_lens.push_back(seq);
  }
  *blocks = static_cast<int>(ids.size());
  return a;
}

struct Inputs {
  Tensor q, k, v, out, lse;
};

Inputs make_inputs(const LayerShape& shape, const DcpBenchConfig& c, int64_t tokens, uint64_t seed) {
  const int64_t hq = shape.num_heads, hkv = shape.num_kv_heads, d = shape.head_size, dv = shape.value_head_size();
  Inputs in{Tensor(Shape{tokens, hq, d}, c.dtype, c.device), Tensor(Shape{tokens, hkv, d}, c.dtype, c.device),
            Tensor(Shape{tokens, hkv, dv}, c.dtype, c.device), Tensor(Shape{tokens, hq, dv}, c.dtype, c.device),
            Tensor(Shape{hq, tokens}, DType::f32, c.device)};
  fill_random(in.q, seed);
  fill_random(in.k, seed + 1);
  fill_random(in.v, seed + 2);
  return in;
}

void sync(Device device) {
  if (device == Device::cuda) synchronize_cuda();
}

}  // namespace

std::vector<DcpBenchPoint> dcp_bench_grid(const std::string& grid) {
  if (grid == "full") return {{8, 65535}, {8, 262143}};
  return {{4, 16383}, {8, 32767}};
}

DcpBenchResult run_dcp_bench_point(const AttentionBackend& backend, const LayerShape& shape, const DcpBenchPoint& point,
                                   const DcpBenchConfig& c) {
  DcpBenchResult res;
  res.backend = std::string(backend.name());
  res.label = "B=" + std::to_string(point.batch) + " ctx=" + std::to_string(point.context + 1);
  res.ranks = c.ranks;
  // The unsharded layer on rank 0's device.
  {
    Attention layer(layer_params(backend, shape, c));
    int blocks = 0;
    const DcpLocalStep step = make_dcp_local_step(decode_step(point, c.block_size, 1, c.seed, &blocks), DcpConfig{},
                                                  c.block_size);
    Tensor cache = layer.allocate_kv_cache(blocks);
    fill_random(cache, c.seed + 5);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(),
                                                layer.builder_config(point.batch, point.batch, point.context + 1),
                                                c.device);
    const OwnedCommonAttentionMetadata md = make_common_attention_metadata(step.args, c.device);
    const auto plan = builder->build(0, md.common);
    Inputs in = make_inputs(shape, c, point.batch, c.seed + 10);
    std::vector<double> times;
    double spent = 0;
    layer.forward(in.q, in.k, in.v, cache, *plan, in.out);  // warm-up
    sync(c.device);
    while (times.size() < 3 || (spent < c.min_seconds && times.size() < 200)) {
      const auto t = Clock::now();
      layer.forward(in.q, in.k, in.v, cache, *plan, in.out);
      sync(c.device);
      times.push_back(seconds_since(t));
      spent += times.back();
    }
    res.one_rank_seconds = median(times);
    res.kv_bytes_one_rank = static_cast<int64_t>(cache.nbytes());
  }
  // Striped over the group: every rank runs the same number of iterations (each has a collective).
  res.iterations = static_cast<int>(std::clamp(c.min_seconds / std::max(res.one_rank_seconds, 1e-6) * c.ranks, 3.0, 200.0));
  const DcpRanks ranks(c.ranks, c.device);
  std::vector<double> attend(static_cast<size_t>(c.ranks)), combine(attend), total(attend);
  std::vector<int64_t> kv_bytes(static_cast<size_t>(c.ranks));
  ranks.run([&](int r) {
    AttentionLayerParams p = layer_params(backend, shape, c);
    const DcpConfig config{c.ranks, r, 1};
    p.dcp = config;
    Attention layer(p);
    int blocks = 0;
    const CommonAttentionMetadataArgs global = decode_step(point, c.block_size, c.ranks, c.seed, &blocks);
    Tensor cache = layer.allocate_kv_cache(blocks);
    fill_random(cache, c.seed + 5 + static_cast<uint64_t>(r));
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(),
                                                layer.builder_config(point.batch, point.batch, point.context + 1),
                                                c.device);
    const auto plan = dcp_plan(layer, *builder, config, global);
    Inputs in = make_inputs(shape, c, point.batch, c.seed + 10);
    DcpCommunicator& comm = ranks.comm(r);
    std::vector<double> a, b, s;
    for (int i = -1; i < res.iterations; ++i) {  // (i = -1: warm-up)
      const auto t0 = Clock::now();
      dcp_attend(layer, *plan, in.q, in.k, in.v, cache);
      sync(c.device);
      const auto t1 = Clock::now();
      dcp_combine(*plan, comm, in.out, in.lse);
      sync(c.device);
      if (i < 0) continue;
      a.push_back(std::chrono::duration<double>(t1 - t0).count());
      b.push_back(seconds_since(t1));
      s.push_back(a.back() + b.back());
    }
    attend[static_cast<size_t>(r)] = median(a);
    combine[static_cast<size_t>(r)] = median(b);
    total[static_cast<size_t>(r)] = median(s);
    kv_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(cache.nbytes());
  });
  const auto slowest = static_cast<size_t>(std::max_element(attend.begin(), attend.end()) - attend.begin());
  res.step_seconds = *std::max_element(total.begin(), total.end());
  res.attend_seconds = attend[slowest];
  res.comm_seconds = combine[slowest];
  res.kv_bytes_per_rank = *std::max_element(kv_bytes.begin(), kv_bytes.end());
  return res;
}

}  // namespace pagedattn::cli
