// Per-SM streaming probe (issue 5, mixed batch): how fast can ONE SM stream a paged KV cache
// into the warp-specialized kernel's shared-memory ring, by copy engine, and does that rate hold
// when fewer SMs stream? No attention math: a producer warpgroup fills a ring of kStages stages
// of one 128-key K/V tile each (64 KB at d 128), a consumer warpgroup waits for each stage, holds
// it for `delay` ns (a stand-in for the decode tile's MMAs and softmax) and releases it.
//
// Engines:
//   cp.async  the ws kernel's copier: 128 threads, 16-byte cp.async, 8 threads a key row, page ids
//             read one tile ahead, cp.async.mbarrier.arrive.noinc on the stage's full barrier;
//   tma       one warp: lane j issues the tensor copies of page j of the tile (box: 64 d x 1 head
//             x 16 tokens x 1 page, 128-byte swizzle, the same smem layout), lane 0 arms the full
//             barrier with the tile's bytes (mbarrier expect_tx).
// Work: 64 requests x 2048 tokens x 8 kv heads (d 128, bf16, page 16, NHD, random block tables):
// 512 items of 16 tiles, dealt strided over G CTAs (1 per SM: the ring takes 192 KB).
// Output: per engine, delay and G: time, GB/s, GB/s per CTA. Prediction written before running:
// if the per-SM rate is capped by the LSU's outstanding-request budget, cp.async stays ~30 GB/s
// per SM at small G while TMA scales until HBM saturates.
// Result (H200, 2026-11-26, docs/perf/cuda.md): the prediction was wrong. cp.async streams 137 GB/s
// an SM at 8 CTAs and saturates the memory (4.1 TB/s) from 66; TMA with 2 KB page boxes stays at
// ~63 GB/s an SM; with an 800 ns hold both run ~63 GB/s an SM. So the ws kernel's ~37 GB/s an SM
// was its own producer's instruction stream (fixed by the branch-free copy path), not the copy
// engine.
//
// Build: the sm_stream_probe target (bench/CMakeLists.txt; preset `cuda`). Run it alone.
#include <numeric>
#include <random>

#include "backends/cuda/common/async_primitives.cuh"
#include "cuda_bench_common.cuh"

#define CHECK(expr) BENCH_CUDA(expr)

namespace {
using namespace pagedattn::cuda;

constexpr int kD = 128;
constexpr int kHeads = 8;
constexpr int kBlock = 16;
constexpr int kSeqs = 64;
constexpr int kCtx = 2048;
constexpr int kPagesPerSeq = kCtx / kBlock;
constexpr int kNumBlocks = kSeqs * kPagesPerSeq;
constexpr int kKeys = 128;
constexpr int kTiles = kCtx / kKeys;
constexpr int kStages = 3;
constexpr int kTileBytes = kKeys * kD * 2;   // one of K / V
constexpr int kStageBytes = 2 * kTileBytes;  // 64 KB
constexpr int kItems = kSeqs * kHeads;
constexpr int kSmem = kStages * kStageBytes + 2 * kStages * 8;

struct Args {
  const char* k;
  const char* v;
  const int* table;
  unsigned long long* sink;
  int delay_ns;
};

__device__ __forceinline__ void consumer(const Args& a, char* smem, uint64_t* full, uint64_t* empty) {
  int stage = 0;
  uint32_t phase = 0;
  uint32_t acc = 0;
  for (int item = blockIdx.x; item < kItems; item += gridDim.x) {
    for (int t = 0; t < kTiles; ++t) {
      mbar::wait(full + stage, phase);
      acc += *reinterpret_cast<const uint32_t*>(smem + stage * kStageBytes + (threadIdx.x & 127) * 512);
      if (a.delay_ns > 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < a.delay_ns * 2) {
        }
      }
      mbar::arrive(empty + stage);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1u;
      }
    }
  }
  if (acc == 0x12345678u) atomicAdd(a.sink, 1ull);
}

// The ring's barriers (after the stages): full (full_count arrivals) and empty (the 128 consumer
// threads) per stage. Threads 128.. run the consumer and get nullptr; the producer threads get the
// full barriers (the empty ones follow).
__device__ __forceinline__ uint64_t* start_ring(const Args& a, char* smem, int full_count) {
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar::init(full + s, full_count);
      mbar::init(full + kStages + s, 128);
    }
    mbar::fence_init();
  }
  __syncthreads();
  if (threadIdx.x >= 128) {
    consumer(a, smem, full, full + kStages);
    return nullptr;
  }
  return full;
}

__global__ void __launch_bounds__(256, 1) stream_cp_async(const Args a) {
  extern __shared__ __align__(1024) char smem[];
  uint64_t* full = start_ring(a, smem, 128);
  if (full == nullptr) return;  // a consumer thread, done
  uint64_t* empty = full + kStages;
  const int pt = threadIdx.x;
  const int row0 = pt >> 3;
  const int chunk = pt & 7;
  const int dst0 = swizzled_offset<kKeys>(row0, chunk);
  int stage = 0;
  uint32_t phase = 0;
  for (int item = blockIdx.x; item < kItems; item += gridDim.x) {
    const int seq = item / kHeads;
    const int head = item % kHeads;
    const int* table = a.table + seq * kPagesPerSeq;
    const char* kb = a.k + (head * kD + chunk * 8) * 2;
    const char* vb = a.v + (head * kD + chunk * 8) * 2;
    int ahead[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) ahead[i] = __ldg(table + (row0 + 16 * i) / kBlock);
    for (int t = 0; t < kTiles; ++t) {
      int cur[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) cur[i] = ahead[i];
      if (t + 1 < kTiles) {
#pragma unroll
        for (int i = 0; i < 8; ++i) ahead[i] = __ldg(table + ((t + 1) * kKeys + row0 + 16 * i) / kBlock);
      }
      mbar::wait(empty + stage, phase ^ 1u);
      char* dst = smem + stage * kStageBytes + dst0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t row = static_cast<uint32_t>(t * kKeys + row0 + 16 * i) & (kBlock - 1);
        const uint64_t off = static_cast<uint64_t>(cur[i]) * (kBlock * kHeads * kD * 2) + row * (kHeads * kD * 2);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          cp_async_16(dst + i * 2048 + c * kKeys * 128, kb + off + c * 128, true);
          cp_async_16(dst + kTileBytes + i * 2048 + c * kKeys * 128, vb + off + c * 128, true);
        }
      }
      mbar::arrive_on_copies(full + stage);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1u;
      }
    }
  }
  cp_async_wait<0>();
}

__global__ void __launch_bounds__(256, 1)
    stream_tma(const Args a, const __grid_constant__ CUtensorMap kmap, const __grid_constant__ CUtensorMap vmap) {
  extern __shared__ __align__(1024) char smem[];
  uint64_t* full = start_ring(a, smem, 1);
  if (full == nullptr) return;  // a consumer thread, done
  uint64_t* empty = full + kStages;
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int stage = 0;
  uint32_t phase = 0;
  for (int item = blockIdx.x; item < kItems; item += gridDim.x) {
    const int seq = item / kHeads;
    const int head = item % kHeads;
    const int* table = a.table + seq * kPagesPerSeq;
    int ahead = lane < 8 ? __ldg(table + lane) : 0;
    for (int t = 0; t < kTiles; ++t) {
      const int page = ahead;
      if (t + 1 < kTiles && lane < 8) ahead = __ldg(table + (t + 1) * 8 + lane);
      mbar::wait(empty + stage, phase ^ 1u);
      if (lane == 0) mbar::arrive_expect_tx(full + stage, kStageBytes);
      __syncwarp();
      if (lane < 8) {
        char* dst = smem + stage * kStageBytes + lane * 2048;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          tma::load_4d(dst + c * kKeys * 128, &kmap, c * 64, head, 0, page, full + stage);
          tma::load_4d(dst + kTileBytes + c * kKeys * 128, &vmap, c * 64, head, 0, page, full + stage);
        }
      }
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1u;
      }
    }
  }
}

CUtensorMap make_map(void* base) {
  return tensor_map_4d_u16(base, {kD, kHeads, kBlock, kNumBlocks},
                           {kD * 2, kHeads * kD * 2, static_cast<cuuint64_t>(kBlock) * kHeads * kD * 2},
                           {64, 1, kBlock, 1});
}

}  // namespace

int main() {
  const size_t bytes = static_cast<size_t>(kNumBlocks) * kBlock * kHeads * kD * 2;
  char *k, *v;
  int* table;
  unsigned long long* sink;
  CHECK(cudaMalloc(&k, bytes));
  CHECK(cudaMalloc(&v, bytes));
  CHECK(cudaMemset(k, 1, bytes));
  CHECK(cudaMemset(v, 2, bytes));
  std::vector<int> ids(kNumBlocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  CHECK(cudaMalloc(&table, ids.size() * sizeof(int)));
  CHECK(cudaMemcpy(table, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&sink, sizeof(unsigned long long)));
  const CUtensorMap kmap = make_map(k);
  const CUtensorMap vmap = make_map(v);
  CHECK(cudaFuncSetAttribute(stream_cp_async, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CHECK(cudaFuncSetAttribute(stream_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("engine,delay_ns,ctas,ms,GBps,GBps_per_cta\n");
  const int grids[] = {8, 16, 33, 66, 99, sms};
  for (int delay : {0, 800}) {
    for (int engine = 0; engine < 2; ++engine) {
      for (int g : grids) {
        const Args a{k, v, table, sink, delay};
        auto launch = [&] {
          if (engine == 0) {
            stream_cp_async<<<g, 256, kSmem>>>(a);
          } else {
            stream_tma<<<g, 256, kSmem>>>(a, kmap, vmap);
          }
        };
        launch();
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        const int reps = 5;
        std::vector<float> ms;
        for (int r = 0; r < reps; ++r) {
          CHECK(cudaEventRecord(e0));
          launch();
          CHECK(cudaEventRecord(e1));
          CHECK(cudaEventSynchronize(e1));
          float t = 0;
          CHECK(cudaEventElapsedTime(&t, e0, e1));
          ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        const double t = ms[reps / 2];
        const double gbps = 2.0 * bytes / (t * 1e-3) / 1e9;
        std::printf("%s,%d,%d,%.4f,%.1f,%.2f\n", engine == 0 ? "cp.async" : "tma", delay, g, t, gbps, gbps / g);
      }
    }
  }
  return 0;
}
