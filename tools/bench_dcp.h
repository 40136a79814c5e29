// `pagedattn bench --dcp N`: the long-context decode grid of decode context parallelism. Each point
// runs the layer unsharded on one rank (GPU 0 / the host), then striped over N ranks (dcp_ranks.h:
// threads; on CUDA one GPU and NCCL communicator each), each rank planned once (dcp_plan) and timed
// per iteration around its two halves: dcp_attend (local attention over its 1/N of the cache) and
// dcp_combine (the all-gather of (output, LSE) and the merge: the communication).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedattn/pagedattn.h"
#include "presets.h"

namespace pagedattn::cli {

struct DcpBenchPoint {
  int batch = 0, context = 0;  // decodes of `context` cached tokens + 1 new
};
// quick: B4 x 16k, B8 x 32k; full: B8 x 64k, B8 x 256k (Llama-3-8B's DCP target shape).
std::vector<DcpBenchPoint> dcp_bench_grid(const std::string& grid);

struct DcpBenchResult {
  std::string backend, label;
  int ranks = 0;
  double one_rank_seconds = 0;  // the unsharded layer's forward (median)
  double step_seconds = 0;      // the slowest rank's attend + combine (medians)
  double attend_seconds = 0;    // the slowest rank's attend
  double comm_seconds = 0;      // that rank's combine (it waits least for the others)
  int64_t kv_bytes_one_rank = 0, kv_bytes_per_rank = 0;
  int iterations = 0;
};

struct DcpBenchConfig {
  int ranks = 2;
  int block_size = 16;
  std::string kv_cache_dtype = "auto";
  Device device = Device::cpu;
  DType dtype = DType::bf16;
  double min_seconds = 0.2;  // per point and per side (the iteration count follows the 1-rank time)
  uint64_t seed = 0;
};

DcpBenchResult run_dcp_bench_point(const AttentionBackend& backend, const LayerShape& shape, const DcpBenchPoint& point,
                                   const DcpBenchConfig& config);

}  // namespace pagedattn::cli
