// The timeline probe's recorder, its variants and the measurement (ws_timeline_probe.cu has the
// command line). Each variant's kernels are instantiated in a translation unit of their own
// (ws_timeline_probe_<variant>.cu, through run_variant), so that the builds run in parallel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../src/backends/cuda/attention/cuda_backend.h"
#include "../src/backends/cuda/attention/cuda_backend_internal.h"
#include "../src/backends/cuda/attention/paged_attention_ws.cuh"
#include "cuda_bench_common.cuh"
#include "pagedattn/pagedattn.h"

// The recorder, its variants and the probe are local to each translation unit (each has its own
// g_trace, no -rdc), so each variant's file holds the whole chain for its kernels. (One anonymous
// namespace at file scope: nvcc's generated stubs cannot name one nested in a named namespace.)
namespace {

constexpr int kMaxIters = 48;      // iterations recorded per consumer warp
constexpr int kConsumerWarps = 8;  // 2 warpgroups x 4 warps
constexpr int kSlots = pagedattn::cuda::kWsMarks + 1;  // the marks, then the step's kind (1 + general)

__device__ unsigned long long* g_trace;  // (CTA, consumer warp, iteration, slot) SM clocks / kind

struct ClockTrace {
  int iter = 0;
  __device__ __forceinline__ unsigned long long* slot(int s) {
    const int warp = (threadIdx.x >> 5) - 4;  // consumer warps 0..7
    return g_trace + ((static_cast<size_t>(blockIdx.x) * kConsumerWarps + warp) * kMaxIters + iter) * kSlots + s;
  }
  __device__ __forceinline__ void mark(int event) {
    if (iter >= kMaxIters || (threadIdx.x & 31) != 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    *slot(event) = t;
  }
  __device__ __forceinline__ void kind(int general) {
    if (iter < kMaxIters && (threadIdx.x & 31) == 0) *slot(pagedattn::cuda::kWsMarks) = 1 + general;
  }
  __device__ __forceinline__ void next() { ++iter; }
};
// The kernel's probe policies (paged_attention_ws.cuh: ws_trace_solo, ws_trace_turns).
struct SoloTrace : ClockTrace {
  static constexpr bool kSoloConsumer = true;
};
struct Turns1Trace : ClockTrace {
  static constexpr int kTurns = 1;
};
struct Turns2Trace : ClockTrace {
  static constexpr int kTurns = 2;
};
struct WarpScanTrace : ClockTrace {
  static constexpr bool kWarpScan = true;
};

using namespace pagedattn;
using namespace pagedattn::cuda;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <int D, bool kFp8, class Tr>
void probe(int seqs, int len, const char* variant) {
  using W = WsTraits<D, kFp8>;
  const int hq = 32, hkv = 8, bs = 16;
  const DType cache_dtype = kFp8 ? DType::fp8_e4m3 : DType::bf16;
  const AttentionBackend& backend = cuda_backend();
  AttentionImplParams params;
  params.num_heads = hq;
  params.num_kv_heads = hkv;
  params.head_size = D;
  params.scale = 1.f / std::sqrt(float(D));
  params.dtype = DType::bf16;
  params.device = Device::cuda;
  params.block_size = bs;
  params.kv_cache_dtype = kFp8 ? "fp8_e4m3" : "auto";
  auto impl = backend.make_impl(params);
  const int blocks_per_seq = (len + bs - 1) / bs;
  const int64_t num_blocks = int64_t(seqs) * blocks_per_seq + 1;
  Tensor cache = backend.allocate_kv_cache(num_blocks, bs, hkv, D, cache_dtype, Device::cuda);
  fill(cache.data(), cache.numel(), cache_dtype, 11);
  const int tokens = seqs * len;
  Tensor query(Shape{tokens, hq, D}, DType::bf16, Device::cuda);
  Tensor output(Shape{tokens, hq, D}, DType::bf16, Device::cuda);
  fill(query.data(), query.numel(), DType::bf16, 12);

  std::mt19937_64 rng(42);
  std::vector<int32_t> perm(num_blocks - 1);
  std::iota(perm.begin(), perm.end(), 1);
  std::shuffle(perm.begin(), perm.end(), rng);
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  args.max_num_blocks_per_req = blocks_per_seq;
  for (int r = 0; r < seqs; ++r) {
    args.query_start_loc.push_back(args.query_start_loc.back() + len);
    args.seq_lens.push_back(len);
    for (int c = 0; c < blocks_per_seq; ++c) args.block_table.push_back(perm[r * blocks_per_seq + c]);
    for (int i = 0; i < len; ++i) args.slot_mapping.push_back(-1);
  }
  const OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, Device::cuda);
  BuilderConfig config;
  config.num_heads = hq;
  config.num_kv_heads = hkv;
  config.head_size = D;
  config.max_num_batched_tokens = std::max(8192, tokens);
  config.max_model_len = len;
  auto builder = backend.make_builder(KVCacheSpec::full_attention(bs, hkv, D, cache_dtype), config, Device::cuda);
  const auto plan = builder->build(0, common.common);
  const auto& md = dynamic_cast<const CudaAttentionMetadata&>(*plan);
  if (md.kernel != AttentionKernel::ws) {
    std::printf("d %d: the plan's kernel is %s, not ws\n", D, attention_kernel_name(md.kernel));
    return;
  }
  LayerScales scales;
  impl->forward(scales, query, {}, {}, cache, *plan, output);  // warm-up, configures the kernel

  // The launch's parameters: the CUDA impl's own for this forward.
  const AttentionKernelParams p =
      dynamic_cast<const CudaAttentionImpl&>(*impl).kernel_params(scales, query, {}, {}, cache, *plan, output, {}, {});

  const int grid = md.attention_grid;
  const size_t entries = size_t(grid) * kConsumerWarps * kMaxIters * kSlots;
  unsigned long long* trace = nullptr;
  BENCH_CUDA(cudaMalloc(&trace, entries * sizeof(unsigned long long)));
  BENCH_CUDA(cudaMemset(trace, 0, entries * sizeof(unsigned long long)));
  BENCH_CUDA(cudaMemcpyToSymbol(g_trace, &trace, sizeof(trace)));
  auto kernel = paged_attention_ws_kernel<D, __nv_bfloat16, kFp8, false, Tr>;
  BENCH_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, W::kSmemBytes));
  kernel<<<grid, W::kThreads, W::kSmemBytes>>>(p);  // warm
  BENCH_CUDA(cudaDeviceSynchronize());
  // The launch's time with the recorder in (medians of 7; the stamps cost a little).
  std::vector<double> ms;
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  for (int r = 0; r < 7; ++r) {
    BENCH_CUDA(cudaEventRecord(e0));
    kernel<<<grid, W::kThreads, W::kSmemBytes>>>(p);
    BENCH_CUDA(cudaEventRecord(e1));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  BENCH_CUDA(cudaMemset(trace, 0, entries * sizeof(unsigned long long)));
  kernel<<<grid, W::kThreads, W::kSmemBytes>>>(p);
  BENCH_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned long long> h(entries);
  BENCH_CUDA(cudaMemcpy(h.data(), trace, entries * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  cudaFree(trace);

  // Phases of an iteration i of a warp: [start, landed) wait for K/V, [landed, issued) issue,
  // [issued, scores) S wait, [scores, softmax) softmax, [softmax, pv) P.V wait, [pv, packed)
  // rescale and pack, then a masked tile's NaN isolation: [packed, scan landed) its V wait,
  // [scan landed, scanned) the scan and its vote, [scanned, end) the fix-up; [end, next start)
  // loop. Iterations whose next start is missing (an item's last) drop the last phase; so does an
  // item's last step, whose next start is the next item's (the epilogue between). Kept apart by
  // the step's kind: the branch-free step (fast) and the general one (masks, transforms).
  constexpr int kPhases = kWsMarks + 1;
  const char* names[kPhases] = {"K/V wait", "issue",       "S wait", "softmax", "P.V wait", "pack",
                                "scan V wait", "scan+vote", "fix-up",  "loop",    "iteration"};
  std::vector<double> phase[2][kPhases];
  double both_softmax = 0, any_softmax = 0;
  auto at = [&](int cta, int w, int i, int e) { return h[((size_t(cta) * kConsumerWarps + w) * kMaxIters + i) * kSlots + e]; };
  for (int cta = 0; cta < grid; ++cta) {
    for (int w = 0; w < kConsumerWarps; ++w) {
      for (int i = 0; i < kMaxIters; ++i) {
        if (at(cta, w, i, kWsMarkEnd) == 0) break;
        const int kind = at(cta, w, i, kWsMarks) == 2 ? 1 : 0;
        for (int e = 0; e + 1 < kWsMarks; ++e) phase[kind][e].push_back(double(at(cta, w, i, e + 1)) - double(at(cta, w, i, e)));
        if (i + 1 < kMaxIters && at(cta, w, i + 1, kWsMarkStart) != 0) {
          const double next = double(at(cta, w, i + 1, kWsMarkStart));
          const double gap = next - double(at(cta, w, i, kWsMarkEnd));
          if (gap < 2000) {  // the same item (not the epilogue and the next item's prologue)
            phase[kind][kWsMarks - 1].push_back(gap);
            phase[kind][kWsMarks].push_back(next - double(at(cta, w, i, kWsMarkStart)));
          }
        }
      }
    }
    // Softmax overlap of the two consumers of each sub-partition (warp w of warpgroup 0 with
    // warp w of warpgroup 1), over the recorded iterations: cycles where both are in a softmax,
    // against cycles where either is.
    for (int w = 0; w < 4; ++w) {
      std::vector<std::pair<double, double>> a, b;
      for (int i = 0; i < kMaxIters; ++i) {
        if (at(cta, w, i, kWsMarkPv) != 0) a.push_back({double(at(cta, w, i, kWsMarkScores)), double(at(cta, w, i, kWsMarkSoftmax))});
        if (at(cta, w + 4, i, kWsMarkPv) != 0) b.push_back({double(at(cta, w + 4, i, kWsMarkScores)), double(at(cta, w + 4, i, kWsMarkSoftmax))});
      }
      if (a.empty() || b.empty()) continue;
      const double lo = std::max(a.front().first, b.front().first);
      const double hi = std::min(a.back().second, b.back().second);
      double both = 0, either = 0;
      for (auto [s, e] : a) {
        s = std::clamp(s, lo, hi), e = std::clamp(e, lo, hi);
        either += e - s;
        for (auto [s2, e2] : b) {
          s2 = std::clamp(s2, lo, hi), e2 = std::clamp(e2, lo, hi);
          both += std::max(0.0, std::min(e, e2) - std::max(s, s2));
        }
      }
      for (auto [s2, e2] : b) either += std::clamp(e2, lo, hi) - std::clamp(s2, lo, hi);
      both_softmax += both;
      any_softmax += either - both;
    }
  }
  // Masked steps that scanned (the scan marks apart), per consumer (4 warps, same iteration):
  // arrival spread = last warp's scan start - first warp's (what a warpgroup vote waits for),
  // scan = first exit - last arrival (the scan and its vote alone), against the spread of the same
  // warps' S landed (the skew they carry into the step).
  std::vector<double> arrive_spread, scan_alone, scores_spread;
  for (int cta = 0; cta < grid; ++cta) {
    for (int g = 0; g < 2; ++g) {
      for (int i = 0; i < kMaxIters; ++i) {
        double a_lo = 1e300, a_hi = 0, x_lo = 1e300, s_lo = 1e300, s_hi = 0;
        bool all = true;
        for (int w = 4 * g; w < 4 * g + 4 && all; ++w) {
          const double a = double(at(cta, w, i, kWsMarkScanLanded)), x = double(at(cta, w, i, kWsMarkScanned));
          const double sc = double(at(cta, w, i, kWsMarkScores));
          all = at(cta, w, i, kWsMarkEnd) != 0 && at(cta, w, i, kWsMarks) == 2 && x - a > 32 && sc > 0;  // (no-scan marks: back to back)
          a_lo = std::min(a_lo, a), a_hi = std::max(a_hi, a), x_lo = std::min(x_lo, x);
          s_lo = std::min(s_lo, sc), s_hi = std::max(s_hi, sc);
        }
        if (!all) continue;
        arrive_spread.push_back(a_hi - a_lo);
        scan_alone.push_back(x_lo - a_hi);
        scores_spread.push_back(s_hi - s_lo);
      }
    }
  }
  // Tensor-core share of one tile per consumer: its S and P.V wgmma (both warpgroups' work per
  // tile is twice this), at 1024 dense bf16 (2048 fp8) FLOP per clock per SM sub-partition.
  const double tc_per_consumer = 2.0 * 2 * 64 * W::kKeys * D / (kFp8 ? 8192.0 : 4096.0);
  std::printf("d %d, %s cache, %d x %d causal, grid %d, variant %s: launch %.4f ms (median of 7, recorder in); "
              "medians over %zu fast / %zu general iterations (SM clocks)\n",
              D, kFp8 ? "fp8 e4m3" : "bf16", seqs, len, grid, variant, median(ms), phase[0][0].size(), phase[1][0].size());
  std::printf("  %-12s %8s %8s\n", "phase", "fast", "general");
  for (int e = 0; e < kPhases; ++e) std::printf("  %-12s %8.0f %8.0f\n", names[e], median(phase[0][e]), median(phase[1][e]));
  std::printf("  tensor core per tile: %.0f a consumer, %.0f both\n", tc_per_consumer, 2 * tc_per_consumer);
  if (!scan_alone.empty()) {
    std::printf("  masked steps (%zu, a consumer's 4 warps): scan start spread %.0f, last arrival to first exit %.0f, "
                "S landed spread %.0f\n",
                scan_alone.size(), median(arrive_spread), median(scan_alone), median(scores_spread));
  }
  std::printf("  both consumers of a sub-partition in softmax: %.0f%% of the time either is\n",
              any_softmax > 0 ? 100.0 * both_softmax / any_softmax : 0.0);
}


// Runs the probe with trace Tr at one head size over a 16-bit or an e4m3 cache.
template <class Tr>
void run_variant(int head_size, bool fp8, int seqs, int len, const char* name) {
  auto at = [&]<int D>() {
    if (!fp8) return probe<D, false, Tr>(seqs, len, name);
    if constexpr (WsTraits<D, true>::kSupported) {
      probe<D, true, Tr>(seqs, len, name);
    } else {
      std::printf("d %d: the warp-specialized kernel has no fp8 instance\n", D);
    }
  };
  if (head_size == 64) at.template operator()<64>();
  if (head_size == 128) at.template operator()<128>();
  if (head_size == 256) at.template operator()<256>();
}

}  // namespace

namespace ws_probe {
// One per variant translation unit.
void run_duo(int head_size, bool fp8, int seqs, int len);
void run_solo(int head_size, bool fp8, int seqs, int len);
void run_turns1(int head_size, bool fp8, int seqs, int len);
void run_turns2(int head_size, bool fp8, int seqs, int len);
void run_warp_scan(int head_size, bool fp8, int seqs, int len);

}  // namespace ws_probe
