// MLA 128-head decode probe (issue 18): where the wgmma decode kernel's time goes. Each part of
// its work runs alone over the plan the builder makes (B requests x ctx keys, 128 heads: two
// 64-row tiles a request, parts = SMs / 2, one CTA per (part, row tile), the kernel's 230 KB of
// shared memory: one CTA an SM), so the kernel's own time (cuda_mla_bench, same run) can be read
// against the floors of its pieces:
//   load      the copier alone: WG1 streams each segment's 64-key tiles as the kernel does
//             (cp.async 16 B, 8 threads a row, page lookups from a random block table, 2 stages of
//             64 x 576); WG0 waits for each tile and releases it at once: the ingress time of the
//             kernel's two-stage pipeline, the two row tiles of a request sharing rows through L2;
//   load-1    the same with one row tile a request: each latent row read by one CTA;
//   mma       the tensor work alone in the kernel's schedule: per tile WG0 S = Q.K^T (36 wgmma
//             m64n64k16) and its half of P.V (4 m64n256k16), WG1 the other half once WG0's S is
//             done (named barrier); no loads (the stages keep finite values), no softmax;
//   mma-pair  the same instructions with no hand-off: per pair of tiles each warpgroup issues one
//             S and both tiles' P.V for its half (FlashMLA's "seesaw" split without its softmax):
//             the tensor core's own rate for this instruction mix;
//   load-hold the copier with WG0 holding each tile for mma's time a tile before releasing it (a
//             stand-in for the compute: the kernel's overlap of copies and math, no math);
//   load-hold-l2, load-l2  the same (and with no hold) with an L2 prefetch of the tile kL2Ahead
//             ahead issued when tile t + 2 is copied (cp.async.bulk.prefetch.L2, a row a thread).
//   load-tma, load-tma-hold  the copier as TMA instead (the same two stages and release order): one
//             thread of WG1 arms the stage's mbarrier with the tile's bytes and issues 9 tensor
//             copies, one a 64-column block of the tile's page (box 64 columns x 64 rows, 128-byte
//             swizzle: the kernel's shared layout); WG0 waits on the mbarrier. The copier of a
//             producer that costs the compute warps nothing: does it keep up under the hold?
//   pipe-mma[-tma]  mma's tensor work on tiles a third warpgroup copies meanwhile (2 stages on
//             mbarriers, setmaxnreg): the copies against the MMAs' shared-memory reads, a producer
//             that only copies;
//   pipe-{cp,tma}-SxK[-hold]  the copier's depth: S stages of K-key tiles (2 x 64, 4 x 32, and
//             without Q's 73.7 KB 3 x 64 and 6 x 32) on a FULL and an EMPTY mbarrier a stage, each
//             tile held for its share of mma's time; per-tile figures are per 64 keys throughout.
// Reading: `load` against the GEMM pieces says whether the kernel could be bound by its ingress or
// by its tensor work, and the kernel's own time against both says how well it overlaps them
// (docs/perf/mla.md, session 28).
//
// Build: the mla_wgmma_probe target (bench/CMakeLists.txt; preset `cuda`, sm_90a). Run it alone:
//   mla_wgmma_probe [BATCH CONTEXT]   (default 128 4096)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/common/async_primitives.cuh"
#include "backends/cuda/mla/mla_decode.h"
#include "cuda_bench_common.cuh"

namespace {
using namespace pagedattn::cuda;
namespace md = pagedattn::cuda::mla_decode;

constexpr int kRows = 64, kKeys = md::kKeysPerTile, kThreads = 256;
constexpr int kChunks = md::kLatent * 2 / 16;           // 72 16-byte chunks a row
constexpr int kBlockBytes = kRows * 128;                // a 64-column block of a 64-row tile
constexpr int kTileBytes = md::kLatent / 64 * kBlockBytes;
constexpr int kSmem = 3 * kTileBytes + kBlockBytes;     // Q, 2 stages, P
constexpr int kSmemTma = kSmem + 2 * 8;                 // + the stages' mbarriers (load-tma)
constexpr int kPage = 64;
[[maybe_unused]] constexpr int kBarFull = 1, kBarFree = 2, kBarS = 3;
constexpr int kL2Ahead = 4;  // load-*-l2: tiles between a tile's L2 prefetch and its release

struct Args {
  const char* cache;          // (blocks, 64, 576) bf16
  const int32_t* table;       // (requests, cols)
  int cols;
  const md::Segment* segments;
  const int32_t* part_begin;
  int row_tiles;
  unsigned long long* sink;
  long long hold_cycles;      // load-hold: WG0 holds each tile this long before releasing it
};

// The cache row of key `pos` of the segment's request (pos < kv_end).
__device__ __forceinline__ const char* row_src(const Args& a, const md::Segment& seg, int pos) {
  const int block = __ldg(a.table + static_cast<int64_t>(seg.request) * a.cols + pos / kPage);
  return a.cache + (static_cast<int64_t>(block) * kPage + pos % kPage) * md::kLatent * 2;
}

// Tile `tile` (kTK keys) of the segment by cp.async, 8 threads (t1 of 128) a row, into the kernel's
// swizzled layout with column blocks of kTK rows; rows past kv_end zero-filled.
template <int kTK = kKeys>
__device__ __forceinline__ void issue_tile(const Args& a, const md::Segment& seg, int tile, int t1, char* stage) {
  const int sub = t1 & 7;
#pragma unroll
  for (int pass = 0; pass < kTK / 16; ++pass) {
    const int row = (t1 >> 3) + pass * 16;
    const int pos = seg.kv_start + tile * kTK + row;
    const bool valid = pos < seg.kv_end;
    const char* src = (valid ? row_src(a, seg, pos) : a.cache) + sub * 16;
#pragma unroll
    for (int j = 0; j < kChunks / 8; ++j) {
      const int chunk = sub + 8 * j;
      cp_async_16(stage + (chunk >> 3) * (kTK * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4), src + j * 128,
                  valid);
    }
  }
  cp_async_commit();
}

// The same tile by TMA from the calling thread: `bar` armed with its bytes, 9 tensor copies (one a
// 64-column block; `map`'s boxes are kTK rows of the tile's page).
template <int kTK = kKeys>
__device__ __forceinline__ void issue_tile_tma(const Args& a, const md::Segment& seg, int tile, char* stage,
                                               const CUtensorMap* map, uint64_t* bar) {
  const int pos0 = seg.kv_start + tile * kTK;
  const int block = __ldg(a.table + static_cast<int64_t>(seg.request) * a.cols + pos0 / kPage);
  mbar::arrive_expect_tx(bar, kTK * md::kLatent * 2);
#pragma unroll
  for (int c = 0; c < md::kLatent / 64; ++c) tma::load_4d(stage + c * kTK * 128, map, c * 64, pos0 % kPage, block, 0, bar);
}

// A stand-in for a tile's compute: spins for `cycles` SM clocks.
__device__ __forceinline__ void hold(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__device__ __forceinline__ int tiles_of(const md::Segment& s) { return (s.kv_end - s.kv_start + kKeys - 1) / kKeys; }

// L2 prefetch of a tile's rows: one bulk prefetch of a row's 1,152 bytes by one thread of each 8.
__device__ __forceinline__ void prefetch_tile(const Args& a, const md::Segment& seg, int tile, int t1) {
  if ((t1 & 7) != 0) return;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int pos = seg.kv_start + tile * kKeys + (t1 >> 3) + pass * 16;
    if (pos < seg.kv_end) prefetch_l2_bulk(row_src(a, seg, pos), md::kLatent * 2);
  }
}

// WG0's part of the copier probes, once tile t (of n) landed: reads a word of it, holds it for
// hold_cycles (a stand-in for the tile's compute) and releases its stage to WG1 (kBarFree).
__device__ __forceinline__ uint32_t hold_and_release(const Args& a, const char* stages, int t, int n, int t1) {
  const uint32_t word = *reinterpret_cast<const uint32_t*>(stages + (t & 1) * kTileBytes + t1 * 16);
  if (a.hold_cycles > 0) hold(a.hold_cycles);
  if (t + 2 < n) named_barrier::arrive<kThreads>(kBarFree);
  return word;
}

// `load`: WG1 copies, WG0 releases each tile as soon as it landed, or after hold_cycles (a
// stand-in for the tile's compute); kAhead > 0: WG1 also prefetches tile t + kAhead into L2 when
// it copies tile t + 2 (the wgmma kernel's candidate, docs/perf/mla.md session 28).
template <int kAhead>
__global__ void __launch_bounds__(kThreads, 1) probe_load(const Args a) {
  extern __shared__ __align__(1024) char smem[];
  char* stages = smem + kTileBytes;
  const int part = blockIdx.x / a.row_tiles;
  const int wg = threadIdx.x >> 7, t1 = threadIdx.x & 127;
  uint32_t acc = 0;
  for (int si = a.part_begin[part]; si < a.part_begin[part + 1]; ++si) {
    const md::Segment seg = a.segments[si];
    const int n = tiles_of(seg);
    if (wg == 1) {
      for (int t = 0; t < 2; ++t) {
        if (t < n) issue_tile(a, seg, t, t1, stages + t * kTileBytes);
        else cp_async_commit();
      }
      for (int t = 2; t < kAhead && t < n; ++t) prefetch_tile(a, seg, t, t1);
      for (int t = 0; t < n; ++t) {
        cp_async_wait<1>();
        named_barrier::arrive<kThreads>(kBarFull);       // tile t landed
        if (t + 2 < n) {
          named_barrier::sync<kThreads>(kBarFree);       // WG0 released it
          issue_tile(a, seg, t + 2, t1, stages + (t & 1) * kTileBytes);
        } else {
          cp_async_commit();
        }
        if (kAhead > 0 && t + kAhead < n) prefetch_tile(a, seg, t + kAhead, t1);
      }
      cp_async_wait<0>();
    } else {
      for (int t = 0; t < n; ++t) {
        named_barrier::sync<kThreads>(kBarFull);
        acc += hold_and_release(a, stages, t, n, t1);
      }
    }
    __syncthreads();
  }
  if (acc == 0x12345678u) atomicAdd(a.sink, 1ull);
}

// `load-tma`: as probe_load<0>, the copies by TMA (see the file comment). Tiles start at page
// boundaries (page = tile = 64 keys); a segment's last tile copies its whole page.
__global__ void __launch_bounds__(kThreads, 1) probe_load_tma(const Args a, const __grid_constant__ CUtensorMap map) {
  extern __shared__ __align__(1024) char smem[];
  char* stages = smem + kTileBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kSmem);
  const int part = blockIdx.x / a.row_tiles;
  const int wg = threadIdx.x >> 7, t1 = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    mbar::init(&full[0], 1);
    mbar::init(&full[1], 1);
    mbar::fence_init();
  }
  __syncthreads();
  const auto issue = [&](const md::Segment& seg, int tile, int stage) {
    issue_tile_tma(a, seg, tile, stages + stage * kTileBytes, &map, &full[stage]);
  };
  uint32_t acc = 0, parity = 0;  // WG0: the phase parity of each stage's barrier, across segments
  for (int si = a.part_begin[part]; si < a.part_begin[part + 1]; ++si) {
    const md::Segment seg = a.segments[si];
    const int n = tiles_of(seg);
    if (wg == 1) {
      if (t1 == 0) {
        for (int t = 0; t < 2 && t < n; ++t) issue(seg, t, t);
      }
      for (int t = 0; t + 2 < n; ++t) {
        named_barrier::sync<kThreads>(kBarFree);  // WG0 released tile t's stage
        if (t1 == 0) issue(seg, t + 2, t & 1);
      }
    } else {
      for (int t = 0; t < n; ++t) {
        mbar::wait(&full[t & 1], (parity >> (t & 1)) & 1u);
        parity ^= 1u << (t & 1);
        acc += hold_and_release(a, stages, t, n, t1);
      }
    }
    __syncthreads();
  }
  if (acc == 0x12345678u) atomicAdd(a.sink, 1ull);
}

// `pipe`: a copier of kStages stages of kTK-key tiles on mbarriers (a FULL and an EMPTY barrier a
// stage), cp.async by WG1's 128 threads (each arrives on FULL when its copies landed) or TMA by one
// thread (kTma: 9 tensor copies of box 64 columns x kTK rows). WG0 waits on FULL, holds the tile for
// hold_cycles and arrives on EMPTY; WG1 refills a stage as soon as its EMPTY phase completed. No
// Q: the stages alone, so 3 x 64 keys fits (what a kernel without Q in shared memory could have).
// What it answers: how the copier's period under a hold falls with the depth of the pipeline (the
// bytes in flight while one tile is held), for both copy mechanisms.
template <int kStages, int kTK, bool kTma>
__global__ void __launch_bounds__(kThreads, 1) probe_pipe(const Args a, const __grid_constant__ CUtensorMap map) {
  constexpr int kStageBytes = kTK * md::kLatent * 2;
  extern __shared__ __align__(1024) char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int part = blockIdx.x / a.row_tiles;
  const int wg = threadIdx.x >> 7, t1 = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar::init(&full[s], kTma ? 1 : 128);
      mbar::init(&empty[s], 128);
    }
    mbar::fence_init();
  }
  __syncthreads();
  uint32_t acc = 0;
  int g = 0;  // the CTA's tile counter across segments: stage g % kStages, phase g / kStages
  for (int si = a.part_begin[part]; si < a.part_begin[part + 1]; ++si) {
    const md::Segment seg = a.segments[si];
    const int n = (seg.kv_end - seg.kv_start + kTK - 1) / kTK;
    for (int t = 0; t < n; ++t, ++g) {
      const int s = g % kStages;
      const uint32_t phase = static_cast<uint32_t>(g / kStages) & 1u;
      char* stage = smem + s * kStageBytes;
      if (wg == 1) {
        if (g >= kStages) mbar::wait(&empty[s], phase ^ 1u);  // the stage's last reader is done
        if constexpr (kTma) {
          if (t1 == 0) issue_tile_tma<kTK>(a, seg, t, stage, &map, &full[s]);
        } else {
          issue_tile<kTK>(a, seg, t, t1, stage);
          mbar::arrive_on_copies(&full[s]);
        }
      } else {
        mbar::wait(&full[s], phase);
        acc += *reinterpret_cast<const uint32_t*>(stage + t1 * 16);
        if (a.hold_cycles > 0) hold(a.hold_cycles);
        mbar::arrive(&empty[s]);
      }
    }
  }
  if (acc == 0x12345678u) atomicAdd(a.sink, 1ull);
}

// The cache as 4-d tensor (576 columns, 64 rows, blocks, 1), boxes of 64 columns x box_rows rows.
CUtensorMap latent_map(const void* cache, int64_t blocks, cuuint32_t box_rows = kPage) {
  const cuuint64_t row = md::kLatent * 2, page = row * kPage;
  return tensor_map_4d_u16(cache, {md::kLatent, kPage, static_cast<cuuint64_t>(blocks), 1},
                           {row, page, page * static_cast<cuuint64_t>(blocks)}, {64, box_rows, 1, 1});
}

// The tensor work of one tile, as the kernel issues it: S = Q . K^T (36 wgmma m64n64k16) and a
// warpgroup's half of P . V (4 wgmma m64n256k16, V N-major), each waited for.
__device__ __forceinline__ void tile_scores(float (&s)[32], const char* q_smem, const char* kv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgmma::reg_fence(s);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < md::kLatent / 16; ++kk) {
    const int off = (kk >> 2) * kBlockBytes + (kk & 3) * 32;
    wgmma::Ops<__nv_bfloat16>::ss_n64(s, wgmma::smem_desc(q_smem + off, 16, 1024), wgmma::smem_desc(kv + off, 16, 1024));
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::reg_fence(s);
#endif
}
__device__ __forceinline__ void tile_pv_half(float (&o)[128], const char* p_smem, const char* v_half) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgmma::reg_fence(o);
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < kKeys / 16; ++ks) {
    wgmma::Ops<__nv_bfloat16>::ss_n256_tb(o, wgmma::smem_desc(p_smem + ks * 32, 16, 1024),
                                          wgmma::smem_desc(v_half + ks * 16 * 128, kBlockBytes, 1024));
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::reg_fence(o);
#endif
}

// Keeps the accumulators (and so the MMAs) from being optimized away: a write only for an
// impossible sum.
__device__ __forceinline__ void keep_alive(const Args& a, const float (&s)[32], const float (&o)[128]) {
  float x = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) x += s[i];
#pragma unroll
  for (int i = 0; i < 128; ++i) x += o[i];
  if (x == 1234.5f) atomicAdd(a.sink, 1ull);
}

// `mma` (kPair false) and `mma-pair` (kPair true): the tensor work alone over the part's tiles.
template <bool kPair>
__global__ void __launch_bounds__(kThreads, 1) probe_mma(const Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem[];
  char* q_smem = smem;
  char* stages = smem + kTileBytes;
  char* p_smem = stages + 2 * kTileBytes;
  const int part = blockIdx.x / a.row_tiles;
  const int wg = threadIdx.x >> 7;
  // Finite operands once: Q and both stages from the cache's first rows, P zeros.
  for (int idx = threadIdx.x; idx < 3 * kRows * kChunks; idx += kThreads) {
    const int tile = idx / (kRows * kChunks), rest = idx % (kRows * kChunks);
    const int row = rest / kChunks, chunk = rest % kChunks;
    cp_async_16(smem + tile * kTileBytes + swizzled_offset(row, chunk),
                a.cache + (static_cast<int64_t>(tile) * kRows + row) * md::kLatent * 2 + chunk * 16, true);
  }
  cp_async_commit();
  for (int i = threadIdx.x; i < kBlockBytes / 4; i += kThreads) reinterpret_cast<uint32_t*>(p_smem)[i] = 0;
  cp_async_wait<0>();
  wgmma::fence_async_smem();
  __syncthreads();
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  const char* v_half = nullptr;
  for (int si = a.part_begin[part]; si < a.part_begin[part + 1]; ++si) {
    const md::Segment seg = a.segments[si];
    const int n = tiles_of(seg);
    for (int t = 0; t < n; ++t) {
      const char* kv = stages + (t & 1) * kTileBytes;
      v_half = kv + wg * 4 * kBlockBytes;
      const bool do_s = kPair ? (t & 1) == wg : wg == 0;
      if (do_s) tile_scores(s, q_smem, kv);
      if (!kPair) {
        if (wg == 0) named_barrier::arrive<kThreads>(kBarS);
        else named_barrier::sync<kThreads>(kBarS);
      }
      tile_pv_half(o, p_smem, v_half);
    }
  }
  keep_alive(a, s, o);
#endif
}

// `pipe-mma[-tma]`: the tensor work of `mma` (WG0: S, then its half of P.V; WG1: its half once S is
// done) on tiles that a third warpgroup copies while the MMAs run (384 threads; `setmaxnreg`: the
// copier 40 registers, the MMA warpgroups 232): 2 stages, a FULL and an EMPTY mbarrier a stage as
// `pipe`, the stage released once both halves of P.V(t) are done. The copier is the producer
// warpgroup's 128 threads (cp.async as `load`, page lookups included) or one of them (kTma: 9
// tensor copies). What `pipe-*-hold` cannot show: the copies' shared-memory writes competing with
// the MMAs' operand reads (the tile's MMAs read ~227 KB of shared memory, at the tensor rate close
// to all of its bandwidth), and whether a producer that only copies keeps the kernel's serial
// schedule fed.
template <bool kTma>
__global__ void __launch_bounds__(384, 1) probe_pipe_mma(const Args a, const __grid_constant__ CUtensorMap map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem[];
  char* q_smem = smem;
  char* stages = smem + kTileBytes;
  char* p_smem = stages + 2 * kTileBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(p_smem + kBlockBytes);
  uint64_t* empty = full + 2;
  const int part = blockIdx.x / a.row_tiles;
  const int wg = threadIdx.x >> 7, t1 = threadIdx.x & 127;  // 0, 1: the MMAs; 2: the copier
  // Finite operands once: Q from the cache's first rows, P zeros; the barriers.
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += 384) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    cp_async_16(q_smem + swizzled_offset(row, chunk), a.cache + static_cast<int64_t>(row) * md::kLatent * 2 + chunk * 16,
                true);
  }
  cp_async_commit();
  for (int i = threadIdx.x; i < kBlockBytes / 4; i += 384) reinterpret_cast<uint32_t*>(p_smem)[i] = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar::init(&full[s], kTma ? 1 : 128);
      mbar::init(&empty[s], 256);
    }
    mbar::fence_init();
  }
  cp_async_wait<0>();
  wgmma::fence_async_smem();
  __syncthreads();
  if (wg == 2) {  // the copier
    warpgroup_regs_dec<40>();
    int g = 0;  // tile counter across segments: stage g & 1, phase g >> 1
    for (int si = a.part_begin[part]; si < a.part_begin[part + 1]; ++si) {
      const md::Segment seg = a.segments[si];
      const int n = tiles_of(seg);
      for (int t = 0; t < n; ++t, ++g) {
        const int s = g & 1;
        char* kv = stages + s * kTileBytes;
        if (g >= 2) mbar::wait(&empty[s], (static_cast<uint32_t>(g >> 1) & 1u) ^ 1u);
        if constexpr (kTma) {
          if (t1 == 0) issue_tile_tma(a, seg, t, kv, &map, &full[s]);
        } else {
          issue_tile(a, seg, t, t1, kv);
          mbar::arrive_on_copies(&full[s]);
        }
      }
    }
    cp_async_wait<0>();
    return;
  }
  warpgroup_regs_inc<232>();
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float sacc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) sacc[i] = 0.f;
  int g = 0;
  for (int si = a.part_begin[part]; si < a.part_begin[part + 1]; ++si) {
    const md::Segment seg = a.segments[si];
    const int n = tiles_of(seg);
    for (int t = 0; t < n; ++t, ++g) {
      const int s = g & 1;
      const char* kv = stages + s * kTileBytes;
      mbar::wait(&full[s], static_cast<uint32_t>(g >> 1) & 1u);
      if (wg == 0) {
        tile_scores(sacc, q_smem, kv);
        named_barrier::arrive<kThreads>(kBarS);
      } else {
        named_barrier::sync<kThreads>(kBarS);
      }
      tile_pv_half(o, p_smem, kv + wg * 4 * kBlockBytes);
      mbar::arrive(&empty[s]);
    }
  }
  keep_alive(a, sacc, o);
#endif
}

// clock64 cycles and %globaltimer nanoseconds over a spin of 20 M cycles.
__global__ void clock_rate(long long* out) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  long long c = c0;
  while (c - c0 < 20000000) c = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[0] = c - c0;
  out[1] = static_cast<long long>(t1 - t0);
}

}  // namespace

int main(int argc, char** argv) {
  const int batch = argc > 2 ? std::atoi(argv[1]) : 128;
  const int context = argc > 2 ? std::atoi(argv[2]) : 4096;
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const int cols = (context + kPage - 1) / kPage;
  const int64_t blocks = int64_t{batch} * cols;
  void* cache = nullptr;
  BENCH_CUDA(cudaMalloc(&cache, blocks * kPage * md::kLatent * 2));
  fill(cache, blocks * kPage * md::kLatent, DType::bf16, 3);
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(5));
  int32_t* table_d = nullptr;
  BENCH_CUDA(cudaMalloc(&table_d, table.size() * 4));
  BENCH_CUDA(cudaMemcpy(table_d, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  unsigned long long* sink = nullptr;
  BENCH_CUDA(cudaMalloc(&sink, 8));
  const CUtensorMap map = latent_map(cache, blocks);
  const CUtensorMap map32 = latent_map(cache, blocks, 32);
  std::printf("device %s, %d SMs; B%d x %d keys, 128 heads (2 row tiles a request)\n", prop.name, sms, batch, context);

  // SM cycles a nanosecond under a spin (the hold's unit).
  long long* clk_d = nullptr;
  BENCH_CUDA(cudaMalloc(&clk_d, 16));
  clock_rate<<<1, 1>>>(clk_d);
  long long clk[2] = {0, 1};
  BENCH_CUDA(cudaMemcpy(clk, clk_d, 16, cudaMemcpyDeviceToHost));
  cudaFree(clk_d);
  const double cycles_per_ns = static_cast<double>(clk[0]) / static_cast<double>(clk[1]);
  std::printf("SM clock under a spin: %.3f GHz\n", cycles_per_ns);
  double last_tile_us = 0;  // the last reported variant's time a tile a CTA
  const std::vector<int32_t> seqs(static_cast<size_t>(batch), context);
  const double tile_bytes = 64.0 * md::kLatent * 2;
  const double tile_flops = 2.0 * kRows * kKeys * (md::kLatent + md::kValue);  // a CTA's S and P.V of a tile
  for (int row_tiles : {2, 1}) {
    const md::Plan plan = md::make_plan(seqs, {}, std::max(1, sms / row_tiles), md::DecodeKernel::wgmma);
    md::Segment* seg_d = nullptr;
    int32_t* part_d = nullptr;
    BENCH_CUDA(cudaMalloc(&seg_d, plan.segments.size() * sizeof(md::Segment)));
    BENCH_CUDA(cudaMemcpy(seg_d, plan.segments.data(), plan.segments.size() * sizeof(md::Segment),
                          cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMalloc(&part_d, plan.part_begin.size() * 4));
    BENCH_CUDA(cudaMemcpy(part_d, plan.part_begin.data(), plan.part_begin.size() * 4, cudaMemcpyHostToDevice));
    Args args{static_cast<const char*>(cache), table_d, cols, seg_d, part_d, row_tiles, sink, 0};
    const dim3 grid(plan.num_parts * row_tiles);
    double tiles = 0;
    for (const md::Segment& s : plan.segments) tiles += (s.kv_end - s.kv_start + kKeys - 1) / kKeys;
    tiles *= row_tiles;  // CTA-tiles
    const auto report = [&](const char* name, const std::function<void()>& launch, bool math) {
      launch();
      BENCH_CUDA(cudaDeviceSynchronize());
      const float ms = time_events(launch, 20);
      const double per_tile_us = ms * 1e3 / (tiles / grid.x);
      last_tile_us = per_tile_us;
      if (math) {
        std::printf("%-10s %8.4f ms  %6.0f TFLOP/s  %.3f us a tile a CTA\n", name, ms,
                    tiles * tile_flops / (ms * 1e-3) / 1e12, per_tile_us);
      } else {
        std::printf("%-10s %8.4f ms  %6.2f TB/s into shared memory  %.3f us a tile a CTA  (%d CTAs)\n", name, ms,
                    tiles * tile_bytes / (ms * 1e-3) / 1e12, per_tile_us, grid.x);
      }
    };
    for (auto* k : {probe_load<0>, probe_load<kL2Ahead>, probe_mma<false>, probe_mma<true>}) {
      cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    }
    cudaFuncSetAttribute(probe_load_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemTma);
    report(row_tiles == 2 ? "load" : "load-1", [&] { probe_load<0><<<grid, kThreads, kSmem>>>(args); }, false);
    report(row_tiles == 2 ? "load-tma" : "load-tma-1", [&] { probe_load_tma<<<grid, kThreads, kSmemTma>>>(args, map); },
           false);
    if (row_tiles == 2) {
      report("mma-pair", [&] { probe_mma<true><<<grid, kThreads, kSmem>>>(args); }, true);
      report("mma", [&] { probe_mma<false><<<grid, kThreads, kSmem>>>(args); }, true);
      // The same tensor work on tiles a third warpgroup copies (cp.async, or TMA from one thread).
      constexpr int kSmemPipeMma = kSmem + 4 * 8;
      cudaFuncSetAttribute(probe_pipe_mma<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemPipeMma);
      cudaFuncSetAttribute(probe_pipe_mma<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemPipeMma);
      report("pipe-mma", [&] { probe_pipe_mma<false><<<grid, 384, kSmemPipeMma>>>(args, map); }, true);
      report("pipe-mma-tma", [&] { probe_pipe_mma<true><<<grid, 384, kSmemPipeMma>>>(args, map); }, true);
      // The copier under a hold of the kernel's tensor time a tile (mma), without and with the L2
      // prefetch kL2Ahead tiles ahead: does the prefetch let the copies keep up with the compute?
      args.hold_cycles = static_cast<long long>(last_tile_us * 1e3 * cycles_per_ns);
      report("load-hold", [&] { probe_load<0><<<grid, kThreads, kSmem>>>(args); }, false);
      report("load-tma-hold", [&] { probe_load_tma<<<grid, kThreads, kSmemTma>>>(args, map); }, false);
      report("load-hold-l2", [&] { probe_load<kL2Ahead><<<grid, kThreads, kSmem>>>(args); }, false);
      report("load-l2", [&] {
        Args no_hold = args;
        no_hold.hold_cycles = 0;
        probe_load<kL2Ahead><<<grid, kThreads, kSmem>>>(no_hold);
      }, false);
      // The pipeline's depth: stages x keys a tile, cp.async and TMA, each tile held for its share
      // of mma's time (half for 32-key tiles).
      const long long hold64 = args.hold_cycles;
      const auto pipe = [&](const char* name, auto kernel, int stage_bytes, int tk, const CUtensorMap& m, bool hold) {
        const int smem = stage_bytes + 1024;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        Args pa = args;
        pa.hold_cycles = hold ? hold64 * tk / 64 : 0;
        report(name, [&] { kernel<<<grid, kThreads, smem>>>(pa, m); }, false);
      };
      constexpr int kT64 = 64 * md::kLatent * 2, kT32 = kT64 / 2;
      pipe("pipe-cp-2x64-hold", probe_pipe<2, 64, false>, 2 * kT64, 64, map, true);
      pipe("pipe-tma-2x64-hold", probe_pipe<2, 64, true>, 2 * kT64, 64, map, true);
      pipe("pipe-cp-4x32-hold", probe_pipe<4, 32, false>, 4 * kT32, 32, map32, true);
      pipe("pipe-tma-4x32-hold", probe_pipe<4, 32, true>, 4 * kT32, 32, map32, true);
      pipe("pipe-cp-3x64-hold", probe_pipe<3, 64, false>, 3 * kT64, 64, map, true);
      pipe("pipe-tma-3x64-hold", probe_pipe<3, 64, true>, 3 * kT64, 64, map, true);
      pipe("pipe-cp-6x32-hold", probe_pipe<6, 32, false>, 6 * kT32, 32, map32, true);
      pipe("pipe-tma-6x32-hold", probe_pipe<6, 32, true>, 6 * kT32, 32, map32, true);
      pipe("pipe-tma-2x64", probe_pipe<2, 64, true>, 2 * kT64, 64, map, false);
      pipe("pipe-tma-4x32", probe_pipe<4, 32, true>, 4 * kT32, 32, map32, false);
      args.hold_cycles = 0;
    }
    BENCH_CUDA(cudaGetLastError());
    cudaFree(seg_d);
    cudaFree(part_d);
  }
  cudaFree(cache);
  cudaFree(table_d);
  cudaFree(sink);
  return 0;
}
