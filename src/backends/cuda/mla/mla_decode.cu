// CUDA_MLA decode: latent MQA over the paged latent cache (DeepSeek-V2/V3 absorbed decode).
//
// What it computes, per decode token b (token t of a request of q tokens and seq_len s) and query
// head h:
//   s_n   = scale * k_scale * (q_latent[b, h, :576] . cache_row_n[:576])    n < s - q + 1 + t
//   o     = sum_n softmax(s)_n * k_scale * cache_row_n[:512]                 (512 values)
//   LSE   = log(sum_n e^{s_n})                                                natural log
// VALUES ARE THE FIRST 512 ELEMENTS OF THE SAME ROWS as the keys: every 64-key tile is loaded
// into shared memory ONCE and feeds both Q.K^T and P.V.
//
// Tiling. A CTA owns kRows query rows (16 or 64 (token, head) rows: mla_decode.h) of one request
// segment and walks it in 64-key tiles (2-stage cp.async pipeline, 16-byte copies, 8 threads a row (4 for fp8)
// so a warp request covers whole 128-byte lines; zero-filled past the segment's end or for a page id
// outside the cache). The page lookups of tile t + 2 are issued during tile t (row byte offsets
// kept in shared memory), so the block-table latency never sits in front of a copy.
// Warps form kKG key groups x kRowWarps row groups x 4 column warps; warp (kg, rw, cw) owns rows
// [16*kMT*rw, 16*kMT*(rw + 1)) and, within the key group's keys of each tile,
//   Q.K^T  its keys (8 or 16) of the tile (36 k16 steps, mma.sync m16n8k16);
//   P.V    its 128 output columns [128*cw, 128*cw + 128) over all of the group's keys.
// The 4 column warps of a (key group, row group) exchange their row maxima and their P slices
// through shared memory under a named barrier of those 128 threads (so every warp applies the
// same running max; each keeps its own partial row sum, summed at the end); key groups keep
// separate softmax states that are merged in the epilogue. Rows of a speculative decode's earlier
// tokens mask the keys past their causal end (only in the tiles that reach the first token's end).
// Configurations (R = rows of a request = tokens_per_request * H):
//   16 rows (R <= 32): 2 key groups (32 keys each) x 4 warps = 256 threads: 2 warps per
//     scheduler to hide latency; o 16 x 128 per warp; 170 KB of shared memory;
//   64 rows (R  > 32): 2 row groups x 4 warps = 256 threads, 32 rows a warp, o 32 x 128; 232 KB.
// Shared rows are 1152 bytes, unpadded, with the 16-byte chunks XOR-swizzled by (row & 7) so
// ldmatrix (8 rows of one chunk) and ldmatrix.trans hit 8 distinct bank groups.
// fp8 caches: raw fp8 tiles (36.9 KB) are staged and converted (exactly) to the activation
// type into one 16-bit tile before the MMAs; k_scale folds into the logit scale and the output.
//
// Memory traffic and floor. Each latent byte of a request is read once per row tile (R <= 16
// and R = 64: once; R = 128: twice, the two row tiles of a part are adjacent CTAs and mostly
// share it through L2), Q and O once. Floor: B * seq * 576 * elem / copy bandwidth (16 heads: 30
// FLOP per byte, memory-bound), or 2 * H * seq * (576 + 512) FLOPs / MMA rate (128 heads: 242 FLOP
// per byte, above Hopper's ridge point).
// Split requests: their segments' f32 partials are merged by mla_combine_kernel, launched on sm_90+
// as the decode kernel's programmatic dependent (programmatic_launch.cuh), so it ramps while the
// decode's last CTAs run.
// The mma.sync operands are read from shared memory by ldmatrix; at 64 rows a tile reads about
// 570 KB of shared memory per 8.9 MFLOP, which bounds this kernel near half the wgmma rate
// (measured: docs/perf/mla.md).
//
// Precision points: logits, the softmax state and o accumulate in f32; P is rounded to the
// activation type (f16/bf16) before the P.V MMA (the row sum uses the f32 P); exp2 via
// ex2.approx; fp8 -> 16-bit is exact; partials of split segments are f32 and merged in f32; the
// output is rounded once to the activation type (RNE).
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <type_traits>

#include "backends/cuda/common/async_primitives.cuh"
#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "backends/cuda/common/programmatic_launch.cuh"
#include "backends/cuda/mla/mla_decode.h"
#include "backends/cuda/mla/mla_decode_rows.cuh"
#include "backends/cuda/mla/mla_decode_wgmma.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda::mla_decode {
namespace {

constexpr int kChunks = kLatent * 2 / 16;        // 72 16-byte chunks of a 16-bit row
constexpr int kRawChunks = kLatent / 16;         // 36 of an fp8 row
constexpr int kRowBytes = kLatent * 2;           // 1152
constexpr int kColWarps = 4;
constexpr int kColsPerWarp = kValue / kColWarps;  // 128

// kKG key groups x kRowWarps row groups x 4 column warps; 16 * kMT rows per warp; tiles of kKeys
// keys (key group g takes keys [g * kKeys / kKG, (g + 1) * kKeys / kKG) of every tile with its
// own softmax state; the groups merge at the end); kStages pipeline stages.
template <int kKG, int kRowWarps, int kMT, int kKeys, int kStages, bool kFp8>
struct Cfg {
  static constexpr int kGroupWarps = kRowWarps * kColWarps;
  static constexpr int kWarps = kKG * kGroupWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = kRowWarps * 16 * kMT;
  static constexpr int kGroupKeys = kKeys / kKG;            // keys of a key group per tile
  static constexpr int kKeysPerWarp = kGroupKeys / kColWarps;  // 8 or 16: Q.K^T keys of a warp
  static constexpr int kNJ = kKeysPerWarp / 8;              // n8 tiles of S per warp
  static constexpr int kPChunks = kGroupKeys / 8;           // 16-byte chunks of a P row
  static constexpr int kTileBytes = kKeys * kRowBytes;      // one 16-bit tile
  static constexpr int kRawTileBytes = kKeys * kLatent;     // one fp8 tile
  static constexpr int kStageBytes = kFp8 ? kRawTileBytes : kTileBytes;
  static constexpr int kQBytes = kRows * kRowBytes;
  static constexpr int kPBytes = kRows * kGroupKeys * 2;    // per key group
  static constexpr int kRedFloats = kRows * kColWarps;      // per key group: row maxima, then sums
  static constexpr int kOffsetSlots = kStages + 1;          // row offsets of tiles t .. t + kStages
  static constexpr int kOffsetBytes = kOffsetSlots * kKeys * 8;
  static constexpr int kSmem = kQBytes + kStages * kStageBytes + (kFp8 ? kTileBytes : 0) + kKG * kPBytes +
                               kKG * kRedFloats * 4 + kOffsetBytes;
  // Copy mapping: kTPR adjacent threads per row, 16-byte chunks tpr apart (a warp request covers
  // whole 128-byte lines of 4 or 8 rows).
  static constexpr int kTPR = kFp8 ? 4 : 8;
  static constexpr int kRowsPerPass = kThreads / kTPR;
  static_assert(kSmem <= 232448, "shared memory over the sm_90 limit");
  static_assert(kNJ == 1 || kNJ == 2);
  static_assert(kKeys % kRowsPerPass == 0 && kGroupKeys % 16 == 0);
  // The key groups' merge buffer (o f32 + m) reuses the stages.
  static_assert(kKG == 1 || kStages * kStageBytes >= kRows * (kValue + 1) * 4);
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled 16-bit latent tile.
__device__ __forceinline__ int swz(int row, int chunk) { return row * kRowBytes + ((chunk ^ (row & 7)) << 4); }
// Byte offset of chunk `chunk` of row `row` of a P tile (kPChunks chunks a row; the XOR keeps
// the 8 rows of an ldmatrix on 8 distinct bank groups).
template <int kPChunks>
__device__ __forceinline__ int swz_p(int row, int chunk) {
  if constexpr (kPChunks == 8) return row * 128 + ((chunk ^ (row & 7)) << 4);
  return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);
}

// Barrier of the 4 column warps of one (key group, row group) (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int id) { named_barrier::sync<kColWarps * 32>(id + 1); }

// Q rows r0 .. r0 + kRows of the request (row t * H + h: token t, head h; rows of tokens past the
// request's read as zeros).
template <class C>
__device__ __forceinline__ void load_q(const DecodeParams& p, const DecodeRequest& req, int r0, char* q_smem) {
  for (int idx = threadIdx.x; idx < C::kRows * kChunks; idx += C::kThreads) {
    const int row = idx / kChunks, chunk = idx - row * kChunks;
    bool valid;
    const char* src = q_row(p, req, r0 + row, valid) + chunk * 16;
    cp_async_16(q_smem + swz(row, chunk), src, valid);
  }
}

// Byte offset in the cache of key `pos` of `request`, or -1 (past the segment's end, or a page
// id outside the cache: the row reads as zeros). The block-table read is the latency that the
// one-tile-ahead schedule below hides.
template <bool kFp8>
__device__ __forceinline__ int64_t row_offset(const DecodeParams& p, int request, int pos, int kv_end) {
  if (pos >= kv_end) return -1;
  const int blk_idx = pos / p.block_size;
  const int block = __ldg(p.block_table + static_cast<int64_t>(request) * p.bt_stride + blk_idx);
  if (block < 0 || block >= p.num_blocks) return -1;
  return (static_cast<int64_t>(block) * p.block_stride +
          static_cast<int64_t>(pos - blk_idx * p.block_size) * p.token_stride) * (kFp8 ? 1 : 2);
}

// Issues the copies of one tile whose row offsets are in `offsets` (kKeys entries).
template <class C, int kKeys, bool kFp8>
__device__ __forceinline__ void load_tile(const DecodeParams& p, const int64_t* offsets, char* stage) {
  constexpr int kRowChunks = kFp8 ? kRawChunks : kChunks;
  const int sub = threadIdx.x % C::kTPR;
#pragma unroll 1
  for (int pass = 0; pass < kKeys / C::kRowsPerPass; ++pass) {
    const int row = threadIdx.x / C::kTPR + pass * C::kRowsPerPass;
    const int64_t offset = offsets[row];
    const bool valid = offset >= 0;
    const char* src = static_cast<const char*>(p.cache) + (valid ? offset : 0) + sub * 16;
#pragma unroll
    for (int j = 0; j < kRowChunks / C::kTPR; ++j) {
      const int chunk = sub + j * C::kTPR;
      char* dst = kFp8 ? stage + row * kLatent + chunk * 16 : stage + swz(row, chunk);
      cp_async_16(dst, src + j * C::kTPR * 16, valid);
    }
  }
}

// Raw fp8 tile -> swizzled 16-bit tile (exact): 8 threads a row, 9 chunks each.
template <class C, int kKeys, typename T>
__device__ __forceinline__ void convert_tile(const char* raw, char* tile, int format) {
  constexpr int kRowsPerPass = C::kThreads / 8;
  const int sub = threadIdx.x % 8;
#pragma unroll
  for (int pass = 0; pass < kKeys / kRowsPerPass; ++pass) {
    const int row = threadIdx.x / 8 + pass * kRowsPerPass;
#pragma unroll
    for (int j = 0; j < kChunks / 8; ++j) {
      const int chunk = sub + 8 * j;
      const uint2 in = *reinterpret_cast<const uint2*>(raw + row * kLatent + chunk * 8);
      *reinterpret_cast<uint4*>(tile + swz(row, chunk)) = fp8x8_to_16bit<T>(in, format);
    }
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kKG, int kRowWarps, int kMT, int kKeys, int kStages, typename T, bool kFp8>
__global__ void __launch_bounds__(Cfg<kKG, kRowWarps, kMT, kKeys, kStages, kFp8>::kThreads, 1)
    mla_decode_kernel(const DecodeParams p, int row_tiles, int fp8_format) {
  using C = Cfg<kKG, kRowWarps, kMT, kKeys, kStages, kFp8>;
  constexpr int kNJ = C::kNJ;
  constexpr int kSlots = C::kOffsetSlots;
  extern __shared__ __align__(128) char smem[];
  char* q_smem = smem;                                        // (kRows, 576) swizzled
  char* stages = q_smem + C::kQBytes;                         // kStages x (tile | raw tile)
  char* converted = stages + kStages * C::kStageBytes;        // fp8: one 16-bit tile
  char* p_all = converted + (kFp8 ? C::kTileBytes : 0);       // (kKG, kRows, kGroupKeys) swizzled
  float* red_all = reinterpret_cast<float*>(p_all + kKG * C::kPBytes);  // (kKG, 4, kRows)
  int64_t* row_offsets = reinterpret_cast<int64_t*>(red_all + kKG * C::kRedFloats);  // (kSlots, kKeys)

  pdl::launch_dependents();  // the combine's CTAs may be scheduled (they wait for this grid)
  const int part = blockIdx.x / row_tiles;
  const int r0 = (blockIdx.x - part * row_tiles) * C::kRows;  // the CTA's first row of a request
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kg = warp / C::kGroupWarps;
  const int rw = (warp - kg * C::kGroupWarps) / kColWarps;
  const int cw = warp % kColWarps;
  const int quad_row = lane >> 2, quad_col = lane & 3;
  const int row0 = rw * 16 * kMT;
  const int barrier_id = kg * kRowWarps + rw;
  char* p_smem = p_all + kg * C::kPBytes;
  float* red_max = red_all + kg * C::kRedFloats;
  float* red_sum = red_max;  // the epilogue's row sums reuse it (the last max read precedes a barrier)
  const int group_key0 = kg * C::kGroupKeys;  // this key group's first key within a tile

  const int seg_end = p.part_begin[part + 1];
  for (int seg_i = p.part_begin[part]; seg_i < seg_end; ++seg_i) {
    const Segment seg = p.segments[seg_i];
    const DecodeRequest req = p.requests[seg.request];
    const int num_tiles = seg.kv_end > seg.kv_start ? (seg.kv_end - seg.kv_start + kKeys - 1) / kKeys : 0;
    // Keys from mask_from on are masked for some row (each row past its own causal end).
    const int mask_from = min(seg.kv_end, causal_end(req, 0));
    // Row offsets of tiles 0 .. kStages - 1 (later tiles: fetched one iteration ahead).
    for (int i = threadIdx.x; i < kStages * kKeys; i += C::kThreads) {
      row_offsets[i] = row_offset<kFp8>(p, seg.request, seg.kv_start + i, seg.kv_end);
    }
    load_q<C>(p, req, r0, q_smem);
    cp_async_commit();
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) {
      if (t < num_tiles) load_tile<C, kKeys, kFp8>(p, row_offsets + t * kKeys, stages + t * C::kStageBytes);
      cp_async_commit();
    }

    float m[kMT][2], l[kMT][2];
    float o[kMT][kColsPerWarp / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      m[mt][0] = m[mt][1] = neg_inf();
      l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
      for (int d = 0; d < kColsPerWarp / 8; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
    }

#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) {
      // Row offsets of tile + kStages: read now, stored after this tile's math (latency hidden).
      int64_t next_offset = -1;
      if (threadIdx.x < kKeys && tile + kStages < num_tiles) {
        next_offset = row_offset<kFp8>(p, seg.request, seg.kv_start + (tile + kStages) * kKeys + threadIdx.x, seg.kv_end);
      }
      __syncthreads();  // every warp is done with tile - 1 (its stage)
      {
        const int t = tile + kStages - 1;
        if (t < num_tiles) {
          load_tile<C, kKeys, kFp8>(p, row_offsets + (t % kSlots) * kKeys, stages + (t % kStages) * C::kStageBytes);
        }
        cp_async_commit();
      }
      cp_async_wait<kStages - 1>();  // Q and this tile landed; the newer tiles stay in flight
      __syncthreads();
      const char* kv = stages + (tile % kStages) * C::kStageBytes;
      if constexpr (kFp8) {
        convert_tile<C, kKeys, T>(kv, converted, fp8_format);
        __syncthreads();
        kv = converted;
      }
      const int key0 = seg.kv_start + tile * kKeys + group_key0;  // this group's first key

      // S (16*kMT x kKeysPerWarp) = Q . K^T for this warp's keys. With one n8 tile, even and odd
      // k steps accumulate separately (two dependency chains), summed after.
      float s[kMT][2][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
      if constexpr (kNJ == 2) {
        const int k_row = group_key0 + cw * 16 + (lane & 7) + (lane >> 4) * 8;
#pragma unroll 4
        for (int kk = 0; kk < kLatent / 16; ++kk) {
          uint32_t kb[4];
          ldmatrix_x4(kb, kv + swz(k_row, kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            uint32_t qa[4];
            ldmatrix_x4(qa, q_smem + swz(row0 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
            Mma<T>::mma(s[mt][0], qa, kb[0], kb[1]);
            Mma<T>::mma(s[mt][1], qa, kb[2], kb[3]);
          }
        }
      } else {
        // 8 keys x 32 dims per ldmatrix_x4: registers {0, 1} = k step kk, {2, 3} = kk + 1.
        const int k_row = group_key0 + cw * 8 + (lane & 7);
#pragma unroll 3
        for (int kk = 0; kk < kLatent / 16; kk += 2) {
          uint32_t kb[4];
          ldmatrix_x4(kb, kv + swz(k_row, kk * 2 + (lane >> 3)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            uint32_t qa[4], qb[4];
            ldmatrix_x4(qa, q_smem + swz(row0 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
            ldmatrix_x4(qb, q_smem + swz(row0 + mt * 16 + (lane & 15), kk * 2 + 2 + (lane >> 4)));
            Mma<T>::mma(s[mt][0], qa, kb[0], kb[1]);
            Mma<T>::mma(s[mt][1], qb, kb[2], kb[3]);
          }
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][0][e] += s[mt][1][e];
      }
      // Mask keys past each row's end (the segment's, or its token's causal end), then the row
      // maxima of this warp's keys.
      if (key0 + C::kGroupKeys > mask_from) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int end = row_key_end(p, req, seg.kv_end, r0 + row0 + mt * 16 + quad_row + 8 * h);
#pragma unroll
            for (int j = 0; j < kNJ; ++j)
#pragma unroll
              for (int c = 0; c < 2; ++c)
                if (key0 + cw * C::kKeysPerWarp + j * 8 + 2 * quad_col + c >= end) s[mt][j][2 * h + c] = neg_inf();
          }
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = fmaxf(s[mt][0][2 * h], s[mt][0][2 * h + 1]);
          if constexpr (kNJ == 2) mx = fmaxf(mx, fmaxf(s[mt][1][2 * h], s[mt][1][2 * h + 1]));
          mx = quad_max(mx);
          if (quad_col == 0) red_max[cw * C::kRows + row0 + mt * 16 + quad_row + 8 * h] = mx;
        }
      }
      group_sync(barrier_id);  // the group's 4 column warps have written their maxima
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row0 + mt * 16 + quad_row + 8 * h;
          float mx = red_max[r];
#pragma unroll
          for (int w = 1; w < kColWarps; ++w) mx = fmaxf(mx, red_max[w * C::kRows + r]);
          const float m_new = fmaxf(m[mt][h], mx * p.scale_log2);
          const float base = m_new == neg_inf() ? 0.f : m_new;
          const float alpha = fast_exp2(m[mt][h] - base);
          m[mt][h] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kNJ; ++j) {
            s[mt][j][2 * h] = fast_exp2(fmaf(s[mt][j][2 * h], p.scale_log2, -base));
            s[mt][j][2 * h + 1] = fast_exp2(fmaf(s[mt][j][2 * h + 1], p.scale_log2, -base));
            sum += s[mt][j][2 * h] + s[mt][j][2 * h + 1];
          }
          l[mt][h] = l[mt][h] * alpha + sum;
#pragma unroll
          for (int d = 0; d < kColsPerWarp / 8; ++d) {
            o[mt][d][2 * h] *= alpha;
            o[mt][d][2 * h + 1] *= alpha;
          }
#pragma unroll
          for (int j = 0; j < kNJ; ++j) {
            const int col = cw * C::kKeysPerWarp + j * 8 + 2 * quad_col;
            *reinterpret_cast<uint32_t*>(p_smem + swz_p<C::kPChunks>(r, col >> 3) + (col & 7) * 2) =
                Mma<T>::pack(s[mt][j][2 * h], s[mt][j][2 * h + 1]);
          }
        }
      }
      group_sync(barrier_id);  // the group's P is complete (and every maximum was read)

      // O (16*kMT x 128) += P (16*kMT x kGroupKeys) . V (the group's keys x this warp's 128 columns)
#pragma unroll
      for (int ks = 0; ks < C::kGroupKeys / 16; ++ks) {
        uint32_t pa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          ldmatrix_x4(pa[mt], p_smem + swz_p<C::kPChunks>(row0 + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
        for (int dd = 0; dd < kColsPerWarp / 16; ++dd) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, kv + swz(group_key0 + ks * 16 + (lane & 15), (cw * kColsPerWarp + dd * 16) / 8 + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            Mma<T>::mma(o[mt][2 * dd], pa[mt], vb[0], vb[1]);
            Mma<T>::mma(o[mt][2 * dd + 1], pa[mt], vb[2], vb[3]);
          }
        }
      }
      // Slot (tile + kStages) % kSlots last held tile - 1's offsets, read long before.
      if (threadIdx.x < kKeys && tile + kStages < num_tiles) {
        row_offsets[((tile + kStages) % kSlots) * kKeys + threadIdx.x] = next_offset;
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is past its last P / maxima / stage reads

    // Epilogue: each group's row sums over its 4 column warps; key group 1 (if any) hands its
    // (m, o) to group 0 through the free stages; group 0 merges and writes its 128 columns.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(l[mt][h]);
        if (quad_col == 0) red_sum[cw * C::kRows + row0 + mt * 16 + quad_row + 8 * h] = sum;
      }
    float* merge_o = reinterpret_cast<float*>(stages);   // (kRows, 512) f32
    float* merge_m = merge_o + C::kRows * kValue;        // (kRows,)
    if (kKG == 2 && kg == 1) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row0 + mt * 16 + quad_row + 8 * h;
          float* dst = merge_o + r * kValue + cw * kColsPerWarp + 2 * quad_col;
#pragma unroll
          for (int d = 0; d < kColsPerWarp / 8; ++d)
            *reinterpret_cast<float2*>(dst + d * 8) = make_float2(o[mt][d][2 * h], o[mt][d][2 * h + 1]);
          if (cw == 0 && quad_col == 0) merge_m[r] = m[mt][h];
        }
    }
    __syncthreads();
    if (kg == 0) {
      const bool split = seg.partial_row >= 0;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row0 + mt * 16 + quad_row + 8 * h;
          const RowPlace at = row_place(p, req, r0 + r);
          float lsum = 0.f;
#pragma unroll
          for (int w = 0; w < kColWarps; ++w) lsum += red_all[w * C::kRows + r];
          float mrow = m[mt][h], w0 = 1.f, w1 = 0.f;
          if constexpr (kKG == 2) {
            float lsum1 = 0.f;
#pragma unroll
            for (int w = 0; w < kColWarps; ++w) lsum1 += red_all[C::kRedFloats + w * C::kRows + r];
            const float m1 = merge_m[r];
            mrow = fmaxf(m[mt][h], m1);
            const float base = mrow == neg_inf() ? 0.f : mrow;
            w0 = fast_exp2(m[mt][h] - base);
            w1 = fast_exp2(m1 - base);
            lsum = w0 * lsum + w1 * lsum1;
          }
          if (!at.valid) continue;
          const float scale = lsum > 0.f ? p.out_scale / lsum : 0.f;
          const float lse = lse_base2(mrow, lsum);
          const float* other = merge_o + r * kValue + cw * kColsPerWarp + 2 * quad_col;
          // Column pair d of this row, merged over the key groups and normalized.
          auto value = [&](int d) {
            float2 v = make_float2(o[mt][d][2 * h] * w0, o[mt][d][2 * h + 1] * w0);
            if constexpr (kKG == 2) {
              const float2 x = *reinterpret_cast<const float2*>(other + d * 8);
              v.x += x.x * w1;
              v.y += x.y * w1;
            }
            return make_float2(v.x * scale, v.y * scale);
          };
          if (split) {
            const int64_t prow = partial_row(p, seg.partial_row, r0 + r);
            float* dst = p.partial_out + prow * kValue + cw * kColsPerWarp + 2 * quad_col;
#pragma unroll
            for (int d = 0; d < kColsPerWarp / 8; ++d) *reinterpret_cast<float2*>(dst + d * 8) = value(d);
            if (cw == 0 && quad_col == 0) p.partial_lse[prow] = lse;
          } else {
            T* dst = static_cast<T*>(p.out) + at.token * p.o_token_stride + at.head * p.o_head_stride +
                     cw * kColsPerWarp + 2 * quad_col;
#pragma unroll
            for (int d = 0; d < kColsPerWarp / 8; ++d) {
              const float2 v = value(d);
              *reinterpret_cast<uint32_t*>(dst + d * 8) = Mma<T>::pack(v.x, v.y);
            }
            if (cw == 0 && quad_col == 0 && p.lse != nullptr)
              p.lse[at.head * p.lse_head_stride + static_cast<int64_t>(at.token) * p.lse_token_stride] = lse;
          }
        }
      }
    }
    __syncthreads();  // Q, the stages, the offsets and the sums are reused by the next segment
  }
}

// Merges the split partials of each request (its slots' f32 o and LSE). A request of at most
// kNarrowSplits segments (a batch's requests cut at part boundaries: 2-3 slots): a warp a row, 8
// rows a CTA, its slots in one batch of loads. A request of more (one or a few long requests
// spread over every part: up to one slot a part) is latency-bound that way (a warp would wait for
// one batch of 8 slots after another), so it takes a CTA a row: warp w merges slots w, w + 8, ..
// (one batch for 64 slots), the 8 warps' sums are added in shared memory in warp order. CTA (b, y)
// holds rows [8y, 8y + 8) of a narrow request and row y of a wide one; the launch makes gridDim.y
// cover a wide request's rows when its plan holds one (Combine::wide). Which way a request
// is merged depends on its own split count alone (batch-invariant plans stay invariant). Under a
// narrow grid (captured graphs: a row a CTA would launch requests x rows CTAs at every replay, most
// of them empty, one an SM at this kernel's registers) a request of any split count takes the warp
// a row, its slots in consecutive batches.
template <typename T>
__global__ void __launch_bounds__(256) mla_combine_kernel(const DecodeParams p) {
  constexpr int kWarps = 8, kBatch = 8;  // kBatch slots' loads in flight a warp
  static_assert(kNarrowSplits == kBatch);
  __shared__ float warp_o[kWarps][kValue];
  __shared__ float warp_w[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Launched as the decode kernel's programmatic dependent (sm_90+): every CTA waits for the whole
  // decode grid, the ones with nothing to merge too, so that this grid's end is the decode's end
  // for whatever the stream runs next.
  pdl::wait_for_prerequisites();
  const DecodeRequest sp = p.requests[blockIdx.x];
  if (sp.num_splits <= 1) return;
  const int rows = p.tokens_per_request * p.num_heads;
  const bool wide = sp.num_splits > kNarrowSplits && static_cast<int>(gridDim.y) >= rows;
  const int row = wide ? static_cast<int>(blockIdx.y) : static_cast<int>(blockIdx.y) * kWarps + warp;
  if (row >= rows) return;  // (wide: the whole CTA)
  const RowPlace at = row_place(p, sp, row);
  if (!at.valid) return;    // (wide: the whole CTA)
  // Slot s of this row: lse[s * rows], out[s * rows * 512 ..].
  const int64_t stride = rows;
  const float* lse_src = p.partial_lse + partial_row(p, sp.partial_base, row);
  const float* out_src = p.partial_out + partial_row(p, sp.partial_base, row) * kValue + lane * 4;
  const auto finite_lse = [](float v) { return v == -neg_inf() ? neg_inf() : v; };  // +inf as -inf (merge_attn_states)
  float mx = neg_inf();
  for (int s = lane; s < sp.num_splits; s += 32) mx = fmaxf(mx, finite_lse(lse_src[s * stride]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float base = mx == neg_inf() ? 0.f : mx;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
  float wsum = 0.f;
  // This warp's slots, kBatch a step: every load of the step is issued before the first is used.
  const int first = wide ? warp : 0, step = wide ? kWarps : 1;
  for (int s0 = first; s0 < sp.num_splits; s0 += kBatch * step) {
    float v[kBatch];
    float4 x[kBatch][4];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t slot = s0 + u * step;
      const bool in = slot < sp.num_splits;  // past the end: weight 0 on zeros
      v[u] = in ? lse_src[slot * stride] : neg_inf();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[u][i] = in ? *reinterpret_cast<const float4*>(out_src + slot * stride * kValue + i * 128)
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const float lv = finite_lse(v[u]);
      const float w = lv == neg_inf() ? 0.f : expf(lv - base);
      wsum += w;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[4 * i] += w * x[u][i].x; acc[4 * i + 1] += w * x[u][i].y;
        acc[4 * i + 2] += w * x[u][i].z; acc[4 * i + 3] += w * x[u][i].w;
      }
    }
  }
  T* dst = static_cast<T*>(p.out) + at.token * p.o_token_stride + at.head * p.o_head_stride;
  float* lse_dst =
      p.lse != nullptr ? p.lse + at.head * p.lse_head_stride + static_cast<int64_t>(at.token) * p.lse_token_stride
                       : nullptr;
  if (!wide) {
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint2 packed;
      packed.x = Mma<T>::pack(acc[4 * i] * inv, acc[4 * i + 1] * inv);
      packed.y = Mma<T>::pack(acc[4 * i + 2] * inv, acc[4 * i + 3] * inv);
      *reinterpret_cast<uint2*>(dst + i * 128 + lane * 4) = packed;
    }
    if (lane == 0 && lse_dst != nullptr) *lse_dst = lse_natural(base, wsum);
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    *reinterpret_cast<float4*>(&warp_o[warp][i * 128 + lane * 4]) =
        make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
  }
  if (lane == 0) warp_w[warp] = wsum;
  __syncthreads();
  const int c = 2 * static_cast<int>(threadIdx.x);  // this thread's two columns
  float o0 = warp_o[0][c], o1 = warp_o[0][c + 1], w = warp_w[0];
#pragma unroll
  for (int k = 1; k < kWarps; ++k) {
    o0 += warp_o[k][c];
    o1 += warp_o[k][c + 1];
    w += warp_w[k];
  }
  const float inv = w > 0.f ? 1.f / w : 0.f;
  *reinterpret_cast<uint32_t*>(dst + c) = Mma<T>::pack(o0 * inv, o1 * inv);
  if (threadIdx.x == 0 && lse_dst != nullptr) *lse_dst = lse_natural(base, w);
}

template <class C, typename T, bool kFp8>
struct Kernel;
template <int kKG, int kRowWarps, int kMT, int kKeys, int kStages, typename T, bool kFp8>
struct Kernel<Cfg<kKG, kRowWarps, kMT, kKeys, kStages, kFp8>, T, kFp8> {
  static constexpr auto fn = mla_decode_kernel<kKG, kRowWarps, kMT, kKeys, kStages, T, kFp8>;
};

template <class C, typename T, bool kFp8>
void launch_variant(const DecodeParams& params, int num_parts, int fp8_format, cudaStream_t stream) {
  auto* kernel = Kernel<C, T, kFp8>::fn;
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((configured.load() & bit) == 0) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
    check_launch("cudaFuncSetAttribute(mla_decode_kernel)");
    configured.fetch_or(bit);
  }
  const int tiles = (params.tokens_per_request * params.num_heads + C::kRows - 1) / C::kRows;
  kernel<<<num_parts * tiles, C::kThreads, C::kSmem, stream>>>(params, tiles, fp8_format);
  check_launch("mla_decode_kernel");
}

// The two configurations: 16 rows (memory-bound head counts): two key groups of 4 warps (8
// warps: twice the warps a scheduler can switch between), 64-key tiles, 2 stages; 64 rows
// (compute-bound): 2 row groups of 4 warps, 32 rows a warp, 64-key tiles, 2 stages.
template <bool kFp8>
using Cfg16 = Cfg<2, 1, 1, 64, 2, kFp8>;
template <bool kFp8>
using Cfg64 = Cfg<1, 2, 2, 64, 2, kFp8>;
static_assert(Cfg16<false>::kRows == rows_per_cta(DecodeKernel::mma_16_rows) &&
              Cfg64<false>::kRows == rows_per_cta(DecodeKernel::mma_64_rows));

template <typename T>
void launch_typed(const DecodeParams& params, DType cache_dtype, DecodeKernel kernel, int num_parts, Combine combine,
                  cudaStream_t stream) {
  const bool fp8 = is_fp8(cache_dtype);
  const int fmt = cache_dtype == DType::fp8_e4m3 ? 1 : cache_dtype == DType::fp8_e5m2 ? 2 : 0;
  constexpr DType act = std::is_same_v<T, __nv_bfloat16> ? DType::bf16 : DType::f16;
  switch (kernel) {
    case DecodeKernel::wgmma:  // (launch_decode checked the cache dtype: the activation's or fp8)
      launch_decode_wgmma(params, act, fmt, num_parts, stream);
      break;
    case DecodeKernel::mma_16_rows:
      fp8 ? launch_variant<Cfg16<true>, T, true>(params, num_parts, fmt, stream)
          : launch_variant<Cfg16<false>, T, false>(params, num_parts, fmt, stream);
      break;
    case DecodeKernel::mma_64_rows:
      fp8 ? launch_variant<Cfg64<true>, T, true>(params, num_parts, fmt, stream)
          : launch_variant<Cfg64<false>, T, false>(params, num_parts, fmt, stream);
      break;
  }
  if (combine != Combine::none) {
    const int rows = params.tokens_per_request * params.num_heads;
    const dim3 grid(static_cast<unsigned>(params.num_requests),
                    static_cast<unsigned>(combine == Combine::wide ? rows : (rows + 7) / 8));
    // the decode kernel's programmatic dependent (sm_90+): it ramps while the decode's last CTAs run
    launch_dependent(mla_combine_kernel<T>, grid, dim3(256), stream, "mla_combine_kernel", params);
  }
}

}  // namespace

DecodeKernel resolve_decode_kernel(int rows, DType cache_dtype) {
  return select_decode_kernel(kernel_override().mla, rows, cache_dtype, wgmma_decode_available());
}

void launch_decode(const DecodeParams& params, DType activation, DType cache_dtype, DecodeKernel kernel, int num_parts,
                   Combine combine, void* stream) {
  if (num_parts <= 0 || params.num_requests <= 0) return;
  PAGEDATTN_CHECK(params.tokens_per_request >= 1 && params.num_heads >= 1, "params", "CUDA_MLA decode: "
                  "tokens_per_request = ", params.tokens_per_request, ", num_heads = ", params.num_heads,
                  ": both must be >= 1");
  const auto s = static_cast<cudaStream_t>(stream);
  PAGEDATTN_CHECK(activation == DType::bf16 || activation == DType::f16, "dtype", "CUDA_MLA decode: activation dtype ",
                  dtype_name(activation), " is not supported: expected float16 or bfloat16");
  PAGEDATTN_CHECK(is_fp8(cache_dtype) || cache_dtype == activation, "kv_cache", "CUDA_MLA decode: cache dtype ",
                  dtype_name(cache_dtype), " must be the activation dtype ", dtype_name(activation), " or fp8");
  if (activation == DType::bf16) {
    launch_typed<__nv_bfloat16>(params, cache_dtype, kernel, num_parts, combine, s);
  } else {
    launch_typed<__half>(params, cache_dtype, kernel, num_parts, combine, s);
  }
}

}  // namespace pagedattn::cuda::mla_decode
