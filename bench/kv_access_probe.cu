// KV access-pattern probe (issue 5, decode): how fast can a CTA stream a paged KV cache with
// random block tables, by the way it cuts the cache into work? No attention math: each CTA copies
// its K and V rows into shared memory through a cp.async pipeline (the decode kernel's copy
// engine) and touches one 16-byte word per thread per stage, so the time is the access pattern's
// own ceiling.
//
// A work item = (request, group of Hc kv heads, one of `splits` key ranges); a stage = T tokens of
// those Hc heads, K and V (T * Hc * D * 2 bytes each). Hc = 1 is the decode kernel's pattern today
// (one kv head: rows of D*2 bytes at a stride of Hkv*D*2 in NHD); Hc = Hkv reads every page whole
// (block_size * Hkv * D * 2 contiguous bytes).
//
// Pipeline probe (first section of the output): the same copies with a synthetic compute phase
// (dependent FMAs) per stage, for several pipeline shapes: CTA-wide stages of 64/32/16 tokens,
// K and V refilled separately, warp-private pipelines, 2 stages x 3 CTAs per SM. It is what chose
// the decode-only kernel's shape (docs/perf/cuda.md, 2026-11-22 decode section).
//
// Build: the kv_access_probe target (bench/CMakeLists.txt), or
//        nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a bench/kv_access_probe.cu
// Run:   kv_access_probe   (TB/s of KV bytes per pattern, beside a device-to-device copy);
//        PROBE_PIPELINE_ONLY=1 stops after the pipeline section, PROBE_PATTERNS_ONLY=1 skips it;
//        build with -DPROBE_D=N for rows of N 16-bit elements (default 128).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(expr)                                                                                 \
  do {                                                                                              \
    const cudaError_t s_ = (expr);                                                                  \
    if (s_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(s_));    \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

namespace {

// Elements of a 16-bit row; -DPROBE_D=N for other row sizes (an fp8 row of D bytes is a 16-bit
// row of D / 2: PROBE_D=32 probes fp8 d 64, 64 fp8 d 128).
#ifndef PROBE_D
#define PROBE_D 128
#endif
constexpr int kD = PROBE_D;
constexpr int kChunksPerRow = kD * 2 / 16;
constexpr int kBlockSize = 16;

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

struct Args {
  const uint4* k;
  const uint4* v;
  const int* block_table;
  int bt_stride;
  int num_kv_heads;
  int context;
  int groups;  // num_kv_heads / Hc
  int splits;
  unsigned* sink;
};

// This CTA's work item (blockIdx.x = (request, head group, split)) and its steps of kT tokens.
struct ItemSteps {
  int group, step0, step1;
  const int* block_table;  // the request's row
};
__device__ __forceinline__ ItemSteps item_steps(const Args& a, int tokens_per_step) {
  const int item = blockIdx.x;
  const int split = item % a.splits;
  const int req = item / (a.splits * a.groups);
  const int steps_total = a.context / tokens_per_step;
  ItemSteps r;
  r.group = (item / a.splits) % a.groups;
  r.step0 = static_cast<int>(static_cast<int64_t>(steps_total) * split / a.splits);
  r.step1 = static_cast<int>(static_cast<int64_t>(steps_total) * (split + 1) / a.splits);
  r.block_table = a.block_table + static_cast<int64_t>(req) * a.bt_stride;
  return r;
}

template <int kHc, int kT, int kStages, bool kHnd>
__global__ void probe(Args a) {
  extern __shared__ uint4 smem[];
  constexpr int kChunks = kT * kHc * kChunksPerRow;  // 16-byte chunks of K (or V) per stage
  const ItemSteps it = item_steps(a, kT);
  const int group = it.group, step0 = it.step0, step1 = it.step1;
  const int* bt = it.block_table;

  const auto issue = [&](int step) {
    if (step < step1) {
      uint4* dst = smem + ((step - step0) % kStages) * 2 * kChunks;
#pragma unroll 4
      for (int c = threadIdx.x; c < kChunks; c += blockDim.x) {
        int tok_l, h, ch;
        if constexpr (kHnd) {
          h = c / (kT * kChunksPerRow);
          tok_l = (c / kChunksPerRow) % kT;
        } else {
          tok_l = c / (kHc * kChunksPerRow);
          h = (c / kChunksPerRow) % kHc;
        }
        ch = c % kChunksPerRow;
        const int tok = step * kT + tok_l;
        const int64_t page = bt[tok / kBlockSize];
        const int off = tok % kBlockSize;
        const int head = group * kHc + h;
        int64_t row;
        if constexpr (kHnd) {
          row = (page * a.num_kv_heads + head) * kBlockSize + off;
        } else {
          row = (page * kBlockSize + off) * a.num_kv_heads + head;
        }
        cp_async_16(dst + c, a.k + row * kChunksPerRow + ch);
        cp_async_16(dst + kChunks + c, a.v + row * kChunksPerRow + ch);
      }
    }
    commit();
  };

  for (int s = 0; s < kStages - 1; ++s) issue(step0 + s);
  unsigned acc = 0;
  for (int step = step0; step < step1; ++step) {
    issue(step + kStages - 1);
    wait_group<kStages - 1>();
    __syncthreads();
    const uint4 w = smem[((step - step0) % kStages) * 2 * kChunks + (threadIdx.x * 7) % (2 * kChunks)];
    acc ^= w.x ^ w.w;
    __syncthreads();
  }
  if (acc == 0x9e3779b9u) a.sink[0] = acc;  // keeps the reads observable
}


// Pipeline probe: one kv head per item (Hc = 1, NHD), kT tokens per stage, kStages stages, and a
// synthetic compute phase of `delay` dependent FMAs per 64 tokens after each stage lands (what
// the decode kernel's math costs). kSplit: K and V of a stage are separate cp.async groups and
// each half is refilled as soon as it is consumed (compute split in two halves).
template <int kT, int kStages, bool kSplit>
__global__ void pipeline_probe(Args a, int delay) {
  extern __shared__ uint4 smem[];
  constexpr int kChunks = kT * kChunksPerRow;
  const ItemSteps it = item_steps(a, kT);
  const int group = it.group, step0 = it.step0, step1 = it.step1;
  const int* bt = it.block_table;
  const auto issue = [&](int step, int parts) {
    if (step < step1) {
      uint4* dst = smem + ((step - step0) % kStages) * 2 * kChunks;
#pragma unroll 4
      for (int c = threadIdx.x; c < kChunks; c += blockDim.x) {
        const int tok = step * kT + c / kChunksPerRow;
        const int64_t page = bt[tok / kBlockSize];
        const int64_t row = (page * kBlockSize + tok % kBlockSize) * a.num_kv_heads + group;
        if (parts & 1) cp_async_16(dst + c, a.k + row * kChunksPerRow + c % kChunksPerRow);
        if (parts & 2) cp_async_16(dst + kChunks + c, a.v + row * kChunksPerRow + c % kChunksPerRow);
      }
    }
    commit();
  };
  const int work = delay * kT / 64;
  float x = static_cast<float>(threadIdx.x);
  const auto compute = [&](int iters) {
#pragma unroll 1
    for (int j = 0; j < iters; ++j) x = fmaf(x, 1.0001f, 0.5f);
  };
  unsigned acc = 0;
  if constexpr (!kSplit) {
    for (int s = 0; s < kStages - 1; ++s) issue(step0 + s, 3);
    for (int step = step0; step < step1; ++step) {
      __syncthreads();
      issue(step + kStages - 1, 3);
      wait_group<kStages - 1>();
      __syncthreads();
      const uint4 w = smem[((step - step0) % kStages) * 2 * kChunks + threadIdx.x];
      acc ^= w.x;
      compute(work);
    }
  } else {
    for (int s = 0; s < kStages - 1; ++s) {
      issue(step0 + s, 1);
      issue(step0 + s, 2);
    }
    issue(step0 + kStages - 1, 1);
    for (int step = step0; step < step1; ++step) {
      wait_group<2 * kStages - 2>();
      __syncthreads();
      issue(step + kStages - 1, 2);
      const uint4 w = smem[((step - step0) % kStages) * 2 * kChunks + threadIdx.x];
      acc ^= w.x;
      compute(work / 2);
      wait_group<2 * kStages - 2>();
      __syncthreads();
      issue(step + kStages, 1);
      const uint4 w2 = smem[((step - step0) % kStages) * 2 * kChunks + kChunks + threadIdx.x];
      acc ^= w2.y;
      compute(work - work / 2);
    }
  }
  if (acc == 0x9e3779b9u || x == 1.2345f) a.sink[0] = acc;
}


// Warp-independent pipeline probe: each warp of a 4-warp CTA streams its own quarter of the item's
// tokens through its own kStages x kT-token shared stages (no CTA barrier in the loop; cp.async
// wait + __syncwarp), with the same synthetic compute per 64 tokens per warp... scaled: each warp
// does `delay` FMAs per 16 of its tokens x 4 (the CTA-wide probe's warps each cover 16 of every
// 64 tokens, so the work per token is the same).
template <int kT, int kStages>
__global__ void warp_pipeline_probe(Args a, int delay) {
  extern __shared__ uint4 smem[];
  constexpr int kChunks = kT * kChunksPerRow;  // per K (or V) stage
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  uint4* my = smem + warp * kStages * 2 * kChunks;
  const int item = blockIdx.x;
  const int group = item % a.groups;
  const int req = item / a.groups;
  const int steps_total = a.context / kT;
  const int step0 = steps_total * warp / 4;
  const int step1 = steps_total * (warp + 1) / 4;
  const int* bt = a.block_table + static_cast<int64_t>(req) * a.bt_stride;
  const auto issue = [&](int step) {
    if (step < step1) {
      uint4* dst = my + ((step - step0) % kStages) * 2 * kChunks;
#pragma unroll
      for (int c = lane; c < kChunks; c += 32) {
        const int tok = step * kT + c / kChunksPerRow;
        const int64_t page = bt[tok / kBlockSize];
        const int64_t row = (page * kBlockSize + tok % kBlockSize) * a.num_kv_heads + group;
        cp_async_16(dst + c, a.k + row * kChunksPerRow + c % kChunksPerRow);
        cp_async_16(dst + kChunks + c, a.v + row * kChunksPerRow + c % kChunksPerRow);
      }
    }
    commit();
  };
  const int work = delay * kT / 16;
  float x = static_cast<float>(threadIdx.x);
  unsigned acc = 0;
  for (int s = 0; s < kStages - 1; ++s) issue(step0 + s);
  for (int step = step0; step < step1; ++step) {
    issue(step + kStages - 1);
    wait_group<kStages - 1>();
    __syncwarp();
    const uint4 w = my[((step - step0) % kStages) * 2 * kChunks + lane];
    acc ^= w.x;
#pragma unroll 1
    for (int j = 0; j < work; ++j) x = fmaf(x, 1.0001f, 0.5f);
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  __syncthreads();
  if (acc == 0x9e3779b9u || x == 1.2345f) a.sink[0] = acc;
}

struct PipeConfig {
  const char* name;
  int t, stages;
  void (*kernel)(Args, int);
};

struct Config {
  const char* name;
  int hc, t, stages, threads;
  bool hnd;
  void (*kernel)(Args);
};

template <int kHc, int kT, int kStages, bool kHnd>
Config make(const char* name, int threads) {
  return Config{name, kHc, kT, kStages, threads, kHnd, probe<kHc, kT, kStages, kHnd>};
}

float time_ms(const std::vector<cudaEvent_t>& ev, const auto& body) {
  std::vector<float> samples;
  for (int rep = 0; rep < 7; ++rep) {
    CHECK(cudaEventRecord(ev[0]));
    for (int i = 0; i < 10; ++i) body();
    CHECK(cudaEventRecord(ev[1]));
    CHECK(cudaEventSynchronize(ev[1]));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    samples.push_back(ms / 10);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// A paged K/V cache of batch x context tokens (8 kv heads, D 128, page 16) with a random
// permutation of its pages as the block table (request r owns row r), filled with non-zero bytes.
struct ProbeCache {
  void* k = nullptr;
  void* v = nullptr;
  int* block_table = nullptr;
  unsigned* sink = nullptr;
  int pages_per_req = 0;
  size_t cache_bytes = 0;  // of K (and of V)

  ProbeCache(int batch, int context, int num_kv_heads, std::mt19937& rng) {
    pages_per_req = context / kBlockSize;
    const int64_t num_blocks = static_cast<int64_t>(batch) * pages_per_req;
    cache_bytes = static_cast<size_t>(num_blocks) * kBlockSize * num_kv_heads * kD * 2;
    CHECK(cudaMalloc(&k, cache_bytes));
    CHECK(cudaMalloc(&v, cache_bytes));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMemset(k, 0x3c, cache_bytes));
    CHECK(cudaMemset(v, 0x45, cache_bytes));
    std::vector<int> perm(num_blocks);
    for (int64_t i = 0; i < num_blocks; ++i) perm[i] = static_cast<int>(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    CHECK(cudaMalloc(&block_table, perm.size() * 4));
    CHECK(cudaMemcpy(block_table, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  }
  ~ProbeCache() {
    cudaFree(k);
    cudaFree(v);
    cudaFree(block_table);
    cudaFree(sink);
  }
  ProbeCache(const ProbeCache&) = delete;
  ProbeCache& operator=(const ProbeCache&) = delete;
  Args args(int num_kv_heads, int context, int groups, int splits) const {
    return Args{static_cast<const uint4*>(k), static_cast<const uint4*>(v), block_table, pages_per_req,
                num_kv_heads, context, groups, splits, sink};
  }
};

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int hkv = 8;
  std::vector<cudaEvent_t> ev(2);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));

  // Copy ceiling (bytes read + written).
  const size_t copy_bytes = size_t{2} << 30;
  void *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  CHECK(cudaMemset(src, 0x3c, copy_bytes));
  const float copy_ms = time_ms(ev, [&] { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_tbps = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e12;
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  std::printf("device copy: %.3f TB/s (read + write), %d SMs\n", copy_tbps, sms);

  if (std::getenv("PROBE_PATTERNS_ONLY") == nullptr) {
    const PipeConfig pipes[] = {
        {"T=64 3 stages", 64, 3, pipeline_probe<64, 3, false>},
        {"T=64 3 stages split", 64, 3, pipeline_probe<64, 3, true>},
        {"T=32 6 stages", 32, 6, pipeline_probe<32, 6, false>},
        {"T=32 6 stages split", 32, 6, pipeline_probe<32, 6, true>},
        {"T=16 12 stages", 16, 12, pipeline_probe<16, 12, false>},
        {"T=64 2 stages", 64, 2, pipeline_probe<64, 2, false>},
        {"warp T=16 3 stages", -16, 3, warp_pipeline_probe<16, 3>},
        {"warp T=8 6 stages", -8, 6, warp_pipeline_probe<8, 6>},
        {"warp T=16 2 stages", -16, 2, warp_pipeline_probe<16, 2>},
        {"warp T=32 2 stages", -32, 2, warp_pipeline_probe<32, 2>},
    };
    const int batch = 128, context = 4096;
    std::mt19937 prng(99);
    const ProbeCache cache(batch, context, hkv, prng);
    const double kv_bytes = 2.0 * cache.cache_bytes;
    std::printf("\npipeline probe: batch %d x context %d, one kv head per item, synthetic compute per 64 tokens\n",
                batch, context);
    for (int delay : {0, 64, 128, 256, 512}) {
      for (const PipeConfig& c : pipes) {
        const int smem = c.stages * 2 * (c.t < 0 ? -4 * c.t : c.t) * kD * 2;
        CHECK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, c.kernel, 128, smem));
        const Args a = cache.args(hkv, context, hkv, 1);
        const int grid = batch * hkv;
        const float ms = time_ms(ev, [&] {
          c.kernel<<<grid, 128, smem>>>(a, delay);
          CHECK(cudaGetLastError());
        });
        std::printf("  delay %4d  %-22s (%d/SM) %8.4f ms %6.3f TB/s\n", delay, c.name, per_sm, ms,
                    kv_bytes / (ms * 1e-3) / 1e12);
      }
    }
    if (std::getenv("PROBE_PIPELINE_ONLY") != nullptr) return 0;
  }

  const std::vector<Config> configs = {
      make<1, 64, 3, false>("NHD Hc=1 T=64 (today)", 128),
      make<2, 32, 3, false>("NHD Hc=2 T=32", 128),
      make<4, 16, 3, false>("NHD Hc=4 T=16", 128),
      make<8, 8, 3, false>("NHD Hc=8 T=8", 256),
      make<8, 16, 3, false>("NHD Hc=8 T=16", 256),
      make<8, 16, 2, false>("NHD Hc=8 T=16 2st", 256),
      make<1, 64, 3, true>("HND Hc=1 T=64", 128),
      make<4, 16, 3, true>("HND Hc=4 T=16", 128),
      make<8, 16, 3, true>("HND Hc=8 T=16", 256),
  };
  struct Shape {
    int batch, context;
  };
  const Shape shapes[] = {{128, 4096}, {64, 2048}, {32, 16384}, {1, 8192}};
  std::mt19937 rng(1234);
  for (const Shape& sh : shapes) {
    const ProbeCache cache(sh.batch, sh.context, hkv, rng);
    const double kv_bytes = 2.0 * cache.cache_bytes;
    std::printf("\nbatch %d x context %d (KV %.0f MB)\n", sh.batch, sh.context, kv_bytes / 1e6);
    for (const Config& c : configs) {
      const int smem = c.stages * 2 * c.t * c.hc * kD * 2;
      CHECK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      int per_sm = 0;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, c.kernel, c.threads, smem));
      const int groups = hkv / c.hc;
      const int base_items = sh.batch * groups;
      const int resident = per_sm * sms;
      // Split counts: none, and the ones that bring the items closest to 1x and 2x the resident CTAs.
      std::vector<int> split_options = {1};
      for (int waves = 1; waves <= 2; ++waves) {
        const int s = std::max(1, (waves * resident + base_items / 2) / base_items);
        if (std::find(split_options.begin(), split_options.end(), s) == split_options.end()) split_options.push_back(s);
      }
      for (int splits : split_options) {
        if (sh.context / c.t < splits) continue;
        const Args a = cache.args(hkv, sh.context, groups, splits);
        const int grid = base_items * splits;
        const float ms = time_ms(ev, [&] {
          c.kernel<<<grid, c.threads, smem>>>(a);
          CHECK(cudaGetLastError());
        });
        const double tbps = kv_bytes / (ms * 1e-3) / 1e12;
        std::printf("  %-22s splits %3d items %5d (%d/SM) %8.4f ms %6.3f TB/s %5.1f%% of copy\n", c.name, splits,
                    grid, per_sm, ms, tbps, 100 * tbps / copy_tbps);
      }
    }
  }
  return 0;
}
