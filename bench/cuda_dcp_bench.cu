// Decode context parallelism on N GPUs against one (pagedattn/dcp.h over NCCL), in one run: the
// long-context decode shapes of the DCP issue, one process per GPU (tests/gpu_dcp/nccl_ranks.h).
//   mla-ds3-16h  DeepSeek-V3 MLA (latent 512 + rope 64, bf16), 16 heads (one TP-8 rank), B32 x 128k
//   llama3-8b    32 query / 8 KV heads, d 128, bf16, B8 x 256k
// Per shape: the unsharded layer's decode step on GPU 0 alone (the other ranks wait), then the
// DCP step on every rank (planned once: dcp_plan), timed per iteration with CUDA events around its
// two halves -- dcp_attend (the local attention over the rank's 1/N of the cache) and dcp_combine
// (the NCCL all-gather of (output, LSE) and the merge: the communication). Medians over the
// iterations. Reported: 1-GPU time and its floor (KV bytes over the measured copy rate), the
// N-GPU step (the slowest rank), attend / combine of the rank that waited least in the combine,
// the speed-up, communication's share of the step, and the KV bytes per rank against one GPU's.
// Usage: cuda_dcp_bench [--ranks N] [--iters K] [--quick] [--only NAME] [--out FILE.json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "gpu_dcp/nccl_ranks.h"
#include "pagedattn/dcp_nccl.h"
#include "pagedattn/pagedattn.h"

namespace {

struct BenchShape {
  const char* name;
  bool mla;
  int batch;
  int context;  // tokens before the decoded one
};

constexpr int kMaxShapes = 4, kMaxRanks = 8;

// What each rank leaves for the parent (shared memory).
struct RankResult {
  double one_gpu_ms = 0, one_gpu_floor_ms = 0, one_gpu_kv_bytes = 0;  // rank 0 only
  double attend_ms = 0, combine_ms = 0, step_ms = 0, kv_bytes = 0, floor_ms = 0;
  double copy_tbps = 0;
};
struct Results {
  RankResult r[kMaxShapes][kMaxRanks];
  char device[64];
  char nccl[32];
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// A decode step of `batch` requests of context + 1 tokens over a table of `blocks_per_req` virtual
// blocks each (block * n tokens), ids a random permutation of [0, batch * blocks_per_req).
CommonAttentionMetadataArgs decode_step(int batch, int context, int block, int n, uint32_t seed) {
  CommonAttentionMetadataArgs a;
  const int cols = (context + 1 + block * n - 1) / (block * n);
  std::vector<int32_t> ids(static_cast<size_t>(batch) * cols);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
  a.query_start_loc = {0};
  a.max_num_blocks_per_req = cols;
  a.block_table = ids;
  for (int r = 0; r < batch; ++r) {
    a.query_start_loc.push_back(r + 1);
    a.seq_lens.push_back(context + 1);
  }
  return a;
}

Tensor random_tensor(Shape shape, uint64_t seed) {
  Tensor t(shape, DType::bf16, Device::cuda);
  fill(t.data(), static_cast<size_t>(t.numel()), DType::bf16, seed);
  return t;
}

// The per-iteration times of `iters` runs of attend() then combine() (after 3 warm-ups).
struct Times {
  double attend_ms, combine_ms, step_ms;
};
Times time_halves(const std::function<void()>& attend, const std::function<void()>& combine, int iters) {
  for (int i = 0; i < 3; ++i) {
    attend();
    combine();
  }
  const auto stream = static_cast<cudaStream_t>(current_cuda_stream());
  std::vector<cudaEvent_t> ev(3 * static_cast<size_t>(iters));
  for (cudaEvent_t& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(ev[3 * i], stream);
    attend();
    cudaEventRecord(ev[3 * i + 1], stream);
    combine();
    cudaEventRecord(ev[3 * i + 2], stream);
  }
  BENCH_CUDA(cudaEventSynchronize(ev.back()));
  std::vector<double> a, c, s;
  for (int i = 0; i < iters; ++i) {
    float x = 0, y = 0;
    cudaEventElapsedTime(&x, ev[3 * i], ev[3 * i + 1]);
    cudaEventElapsedTime(&y, ev[3 * i + 1], ev[3 * i + 2]);
    a.push_back(x);
    c.push_back(y);
    s.push_back(x + y);
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  return {median(a), median(c), median(s)};
}

// The group's barrier: a one-int all-gather, waited for.
void barrier(DcpCommunicator& comm) {
  Tensor send(Shape{1}, DType::i32, Device::cuda), recv(Shape{comm.world_size(), 1}, DType::i32, Device::cuda);
  comm.all_gather(send, recv);
  synchronize_cuda();
}

// One shape on one rank: the 1-GPU step (rank 0) then the DCP step.
void run_shape(const BenchShape& s, int rank, DcpCommunicator& comm, int iters, const Ceilings& ceil, RankResult& out) {
  const int n = comm.world_size();
  const DcpConfig config{n, rank, 1};
  MLAAttentionLayerParams mp;
  mp.num_heads = 16;
  mp.kv_lora_rank = 512;
  mp.qk_nope_head_dim = 128;
  mp.qk_rope_head_dim = 64;
  mp.qk_head_dim = 192;
  mp.v_head_dim = 128;
  mp.block_size = 64;
  mp.dtype = DType::bf16;
  mp.device = Device::cuda;
  mp.backend = "CUDA_MLA";
  mp.prefix = "layer.0";
  AttentionLayerParams sp;
  sp.num_heads = 32;
  sp.num_kv_heads = 8;
  sp.head_size = 128;
  sp.block_size = 16;
  sp.dtype = DType::bf16;
  sp.device = Device::cuda;
  sp.backend = "CUDA";
  sp.prefix = "layer.0";
  const int block = s.mla ? mp.block_size : sp.block_size;
  const int64_t b = s.batch;
  const int heads = s.mla ? mp.num_heads : sp.num_heads;
  const int dv = s.mla ? mp.v_head_dim : sp.head_size;
  // The step's activations (the same on every rank).
  const Tensor q = s.mla ? random_tensor(Shape{b, heads, 192}, 11) : random_tensor(Shape{b, heads, 128}, 11);
  const Tensor k = s.mla ? random_tensor(Shape{b, 512}, 12) : random_tensor(Shape{b, 8, 128}, 12);
  const Tensor v = s.mla ? random_tensor(Shape{b, 64}, 13) : random_tensor(Shape{b, 8, 128}, 13);
  Tensor weight = random_tensor(Shape{int64_t{mp.num_heads} * (128 + 128), 512}, 14);
  Tensor o(Shape{b, heads, dv}, DType::bf16, Device::cuda), lse(Shape{heads, b}, DType::f32, Device::cuda);
  const double kv_token_bytes = s.mla ? 576.0 * 2 : 2.0 * 8 * 128 * 2;
  const auto make_cache = [&](auto& layer, int groups) {
    const int cols = (s.context + 1 + block * groups - 1) / (block * groups);
    Tensor cache = layer.allocate_kv_cache(int64_t{s.batch} * cols + 1);
    fill(cache.data(), cache.nbytes() / 2, DType::bf16, 20 + static_cast<uint64_t>(rank));
    return cache;
  };

  barrier(comm);
  if (rank == 0) {  // the unsharded step, on this GPU alone
    const CommonAttentionMetadataArgs g = decode_step(s.batch, s.context, block, 1, 7);
    const DcpLocalStep local = make_dcp_local_step(g, DcpConfig{}, block);  // (its slots)
    const OwnedCommonAttentionMetadata md = make_common_attention_metadata(local.args, Device::cuda);
    Times t{};
    if (s.mla) {
      MLAAttention layer(mp);
      layer.process_weights_after_loading(weight);
      Tensor cache = make_cache(layer, 1);
      auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(s.batch, s.batch, s.context + 64), Device::cuda);
      const auto plan = builder->build(0, md.common);
      t = time_halves([&] { layer.forward(q, k, v, cache, *plan, o); }, [] {}, iters);
      out.one_gpu_kv_bytes = static_cast<double>(cache.nbytes());
    } else {
      Attention layer(sp);
      Tensor cache = make_cache(layer, 1);
      auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(s.batch, s.batch, s.context + 64), Device::cuda);
      const auto plan = builder->build(0, md.common);
      t = time_halves([&] { layer.forward(q, k, v, cache, *plan, o); }, [] {}, iters);
      out.one_gpu_kv_bytes = static_cast<double>(cache.nbytes());
    }
    out.one_gpu_ms = t.step_ms;
    out.one_gpu_floor_ms = s.batch * (s.context + 1.0) * kv_token_bytes / (ceil.copy_tbps * 1e12) * 1e3;
  }
  barrier(comm);
  // The DCP step: each rank's 1/N of every request.
  const CommonAttentionMetadataArgs g = decode_step(s.batch, s.context, block, n, 8);
  Times t{};
  if (s.mla) {
    mp.dcp = config;
    MLAAttention layer(mp);
    layer.process_weights_after_loading(weight);
    Tensor cache = make_cache(layer, n);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(s.batch, s.batch, s.context + 64), Device::cuda);
    const auto plan = dcp_plan(layer, *builder, config, g);
    t = time_halves([&] { dcp_attend(layer, *plan, q, k, v, cache); }, [&] { dcp_combine(*plan, comm, o, lse); }, iters);
    out.kv_bytes = static_cast<double>(cache.nbytes());
  } else {
    sp.dcp = config;
    Attention layer(sp);
    Tensor cache = make_cache(layer, n);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(s.batch, s.batch, s.context + 64), Device::cuda);
    const auto plan = dcp_plan(layer, *builder, config, g);
    t = time_halves([&] { dcp_attend(layer, *plan, q, k, v, cache); }, [&] { dcp_combine(*plan, comm, o, lse); }, iters);
    out.kv_bytes = static_cast<double>(cache.nbytes());
  }
  out.attend_ms = t.attend_ms;
  out.combine_ms = t.combine_ms;
  out.step_ms = t.step_ms;
  out.floor_ms = s.batch * static_cast<double>(dcp_local_seq_len(s.context + 1, config)) * kv_token_bytes /
                 (ceil.copy_tbps * 1e12) * 1e3;
  out.copy_tbps = ceil.copy_tbps;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 2, iters = 30;
  bool quick = false;
  std::string only, out_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ranks" && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--ranks N] [--iters K] [--quick] [--only NAME] [--out FILE.json]\n", argv[0]);
      return 2;
    }
  }
  if (ranks < 1 || ranks > kMaxRanks || iters < 1) {
    std::fprintf(stderr, "cuda_dcp_bench: --ranks must be in [1, %d] and --iters >= 1\n", kMaxRanks);
    return 2;
  }
  const int scale = quick ? 8 : 1;
  std::vector<BenchShape> shapes = {{"mla-ds3-16h", true, 32, 131072 / scale}, {"llama3-8b", false, 8, 262144 / scale}};
  if (!only.empty()) {
    std::erase_if(shapes, [&](const BenchShape& s) { return std::string(s.name).find(only) == std::string::npos; });
  }
  if (const int gpus = nccl_ranks::gpu_count(); gpus < ranks) {
    std::fprintf(stderr, "cuda_dcp_bench: %d ranks need %d GPUs, %d visible\n", ranks, ranks, gpus);
    return 1;
  }
  nccl_ranks::SharedBytes shared(sizeof(Results));
  Results& res = *shared.as<Results>();
  const std::vector<int> codes = nccl_ranks::run_nccl_ranks(ranks, [&](int rank, DcpCommunicator& comm) {
    const Ceilings ceil = measure_ceilings();
    if (rank == 0) {
      cudaDeviceProp prop{};
      BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
      std::snprintf(res.device, sizeof(res.device), "%s", prop.name);
      std::snprintf(res.nccl, sizeof(res.nccl), "%s", nccl_version().c_str());
    }
    for (size_t i = 0; i < shapes.size(); ++i) run_shape(shapes[i], rank, comm, iters, ceil, res.r[i][rank]);
  });
  for (size_t r = 0; r < codes.size(); ++r) {
    if (codes[r] != 0) {
      std::fprintf(stderr, "cuda_dcp_bench: rank %zu failed\n", r);
      return 1;
    }
  }
  std::printf("device %s x %d, NCCL %s, copy %.2f TB/s (read + write, GPU 0); %d iterations, medians\n\n", res.device,
              ranks, res.nccl, res.r[0][0].copy_tbps, iters);
  std::printf("| shape | batch x context | 1 GPU ms | 1-GPU floor | %d GPUs ms | floor | attend | combine | speed-up | "
              "comm share | KV / rank vs 1 GPU |\n|---|---|---|---|---|---|---|---|---|---|---|\n", ranks);
  std::ofstream json;
  if (!out_path.empty()) json.open(out_path);
  if (json) json << "{\"device\": \"" << res.device << "\", \"ranks\": " << ranks << ", \"nccl\": \"" << res.nccl << "\", \"rows\": [";
  for (size_t i = 0; i < shapes.size(); ++i) {
    const RankResult* r = res.r[i];
    double step = 0, floor = 0;
    int slowest = 0;  // the rank whose attend is longest: it waits least in the combine
    for (int k = 0; k < ranks; ++k) {
      step = std::max(step, r[k].step_ms);
      floor = std::max(floor, r[k].floor_ms);
      if (r[k].attend_ms > r[slowest].attend_ms) slowest = k;
    }
    const double comm_ms = r[slowest].combine_ms;
    std::printf("| %s | %d x %dk | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2fx | %.1f%% | %.3f |\n", shapes[i].name,
                shapes[i].batch, shapes[i].context / 1024, r[0].one_gpu_ms, r[0].one_gpu_floor_ms, step, floor,
                r[slowest].attend_ms, comm_ms, r[0].one_gpu_ms / step, 100.0 * comm_ms / step,
                r[0].kv_bytes / r[0].one_gpu_kv_bytes);
    if (json) {
      json << (i ? ", " : "") << "{\"shape\": \"" << shapes[i].name << "\", \"batch\": " << shapes[i].batch
           << ", \"context\": " << shapes[i].context << ", \"one_gpu_ms\": " << r[0].one_gpu_ms
           << ", \"one_gpu_floor_ms\": " << r[0].one_gpu_floor_ms << ", \"dcp_step_ms\": " << step
           << ", \"dcp_floor_ms\": " << floor << ", \"attend_ms\": " << r[slowest].attend_ms
           << ", \"comm_ms\": " << comm_ms << ", \"kv_bytes_per_rank\": " << r[0].kv_bytes
           << ", \"one_gpu_kv_bytes\": " << r[0].one_gpu_kv_bytes << "}";
    }
  }
  if (json) json << "]}\n";
  return 0;
}
