// Hopper wgmma prefill path of the paged attention kernel (AttentionKernel::wgmma, kernel_selection.h):
// 16-bit caches, head sizes D = 64, 128, 256; sm_90a. It reuses the shared helpers (item context,
// row ranges, logit transform, online softmax, page lookups: paged_attention_common.cuh) and
// computes exactly what run_prefill_item (the mma.sync path, prefill_mma.cuh) computes, for the
// same work items.
//
// Tiling. One CTA = one warpgroup (the kernel's 128 threads, so one launch still serves decode
// and prefill items). A prefill item has 128 packed rows (D <= 128) or 64 (D = 256): H = 2 or 1
// blocks of 64 rows, the wgmma M. Keys stream through shared memory in tiles of 64 (cp.async,
// 16-byte copies by all threads, 8 threads a key row so a warp request covers whole 128-byte lines;
// zero-filled outside the item's range; the page lookups of a tile are read one tile ahead, with a
// shift for power-of-two block sizes), 2 stages. One barrier a tile: after it (tile landed, every
// warp done with tile - 1) S_0 is issued first and the copies of tile + 1 into the stage of
// tile - 1 go out while the tensor core runs it (faster than refilling before the barrier, which
// needs a second barrier: docs/perf/cuda.md).
// Per tile and per 64-row block h (blocks whose rows see none of the tile's keys are skipped):
//   S_h (64 x 64, f32 registers) = Q_h . K^T: wgmma m64n64k16, D/16 steps, both operands from
//        shared memory (K-major);
//   the logit transform / masks of the mma.sync path (transform_scores) and the online softmax
//        (the wgmma accumulator layout of a warp is the m16n8 layout of mma.sync: warp w holds rows
//        16w..16w+15 of the block, n8 column block j in s[j][0..3]); O is rescaled only when a row
//        of the warp has a new maximum;
//   O_h (64 x D, f32 registers) += P_h . V: wgmma m64nDk16 with P from registers (the S
//        accumulators rounded to the activation type ARE the A fragments) and V from shared
//        memory read N-major (transpose flag), 4 steps; left in flight under S_{h+1}.
// Overlap: across CTAs only, 2 CTAs per SM (D <= 128): one CTA's softmax and copies run under the
// other's MMAs. (An in-CTA schedule with S_1 issued before the softmax of S_0 needs a second S
// and P register set, spills at 255 registers and ran slower: docs/perf/cuda.md.)
// Shared layout (1024-byte aligned): Q (H blocks of 64 rows x D), then 2 stages of [K tile, V
// tile] (64 keys x D each). Every 64-row tile is stored as D/64 column blocks of 64 rows x 128
// bytes, the 16-byte chunks of row r XOR-swizzled by (r & 7): the wgmma 128-byte swizzle.
// D = 128: Q 32 KB + 2 x 32 KB = 96 KB (the decode path's 109 KB sets the kernel's size); D = 64:
// 48 KB; D = 256: 32 KB + 2 x 64 KB = 160 KB (1 CTA per SM, as the mma.sync kernel).
// Registers: O 2 x 64 (D = 128) or 128 (D = 256) floats, S 32, P 16 a thread.
//
// Memory traffic and floor: per item each K/V byte of its key range once from L2 (items of one
// request and kv head share it: about 128 FLOP per L2 byte at D = 128, so the L2 is not the
// limit up to the MMA rate); floor = 4 * rows * visible keys * D / MMA rate (the dense bf16 GEMM
// rate). Shared memory per tile and CTA (D = 128): 32 KB of copies, 64 KB
// read by S (SS, n = 64), 32 KB by P . V: 128 KB per 4.2 MFLOP, the 128 B/clock of an SM at the
// MMA peak.
// Measured and predicted: docs/perf/cuda.md (the wgmma prefill path).
//
// Precision points: as the mma.sync path (f32 logits, softmax state and O; P rounded to the
// activation type for P . V, the row sums from the f32 P; output rounded once).
// NaN isolation: a masked tile whose partly visible V rows hold a non-finite value takes P . V key
// by key instead of the wgmma (value_isolation.cuh).
//
// Not sm_90a (a build for another target): the body is a trap and the builder never selects this
// variant (wgmma_kernels_available()).
#pragma once

#include "backends/cuda/attention/kernel_selection.h"
#include "backends/cuda/attention/paged_attention_common.cuh"
#include "backends/cuda/common/async_primitives.cuh"

namespace pagedattn::cuda {

template <int D>
struct WgmmaPrefillTraits {
  static constexpr bool kSupported = wgmma_prefill_head_size(D);
  static constexpr int kBlocks = D / 64;                  // 64-row blocks of an item (wgmma M = 64)
  static constexpr int kHalves = D <= 128 ? 2 : 1;        // 64-row blocks per item
  static constexpr int kRows = 64 * kHalves;
  static constexpr int kBlockBytes = 64 * 128;            // 64 rows x one 128-byte column block
  static constexpr int kTileBytes = (D / 64) * kBlockBytes;  // 64 rows x D, 16-bit
  static constexpr int kQBytes = kHalves * kTileBytes;
  static constexpr int kStages = 2;
  static constexpr int kSmemBytes = kQBytes + kStages * 2 * kTileBytes;
  static constexpr int kChunks = D / 8;                   // 16-byte chunks of a row
};

// Copies the item's packed query rows into the swizzled Q blocks (zero rows past the item).
template <int D, typename T>
__device__ __forceinline__ void load_q_swizzled(const AttentionKernelParams& p, const ItemContext& ctx,
                                                char* q_smem) {
  using W = WgmmaPrefillTraits<D>;
  const auto dst = [&](int idx) {
    const int row = idx / W::kChunks;
    return q_smem + (row >> 6) * W::kTileBytes + swizzled_offset(row & 63, idx - row * W::kChunks);
  };
  if (p.query_fp8) {  // e4m3: converting loads
    load_q8_rows<T>(
        p, W::kRows * W::kChunks,
        [&](int idx, int64_t& elem) {
          const int row = idx / W::kChunks;
          if (row >= ctx.item.num_rows) return false;
          elem = row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride + (idx - row * W::kChunks) * 8;
          return true;
        },
        dst);
    return;
  }
  for (int idx = threadIdx.x; idx < W::kRows * W::kChunks; idx += kThreadsPerCta) {
    const int row = idx / W::kChunks;
    const int c = idx - row * W::kChunks;
    const bool valid = row < ctx.item.num_rows;
    const T* src = static_cast<const T*>(p.query);
    if (valid) src += row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride + c * 8;
    cp_async_16(dst(idx), src, valid);
  }
}

// Key rows this thread copies: rows tid / 8 + 16 i of every tile (8 threads a row, 16-byte chunks
// tid % 8 + 8 k: a warp request covers whole 128-byte lines of 4 rows). The page lookup of a row is
// done once, one tile ahead (the block-table read in flight during the current tile); a power-of-two
// block size (the usual case) takes a shift instead of a division.
template <int D>
struct WgmmaKvRows {
  static constexpr int kRows = 4;                 // rows per thread (64 / 16)
  static constexpr int kChunksPerThread = D / 64;  // 16-byte chunks of a row per thread
  int block[kRows];   // page id (paged) or 0; < 0: the row reads as zeros
  int offset[kRows];  // token within the page (paged) or key position (not paged)

  __device__ __forceinline__ static int row(int i) { return (threadIdx.x >> 3) + 16 * i; }

  // Page lookups of tile `tile` (rows outside the item's range and tiles past the last: zeros).
  __device__ __forceinline__ void fetch(const AttentionKernelParams& p, const ItemContext& ctx, int tile) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int pos = ctx.tile_base + tile * kKeysPerTile + row(i);
      const bool in_range = tile < ctx.num_tiles && pos >= ctx.item.kv_start && pos < ctx.item.kv_end;
      offset[i] = pos;
      block[i] = in_range ? 0 : -1;
      if (p.paged) {
        const int blk_idx = page_index(p, ctx, pos);
        offset[i] = pos - blk_idx * p.block_size;
        if (in_range) {
          const int b = __ldg(p.block_table + ctx.item.request * p.block_table_stride + blk_idx);
          block[i] = b >= 0 && b < p.num_blocks ? b : -1;
        }
      }
    }
  }

  // Issues the copies of the fetched rows into a stage ([K tile][V tile], swizzled).
  __device__ __forceinline__ void copy(const AttentionKernelParams& p, const ItemContext& ctx, char* stage) const {
    const int lane_chunk = threadIdx.x & 7;
    const char* key = static_cast<const char*>(p.key);
    const char* value = static_cast<const char*>(p.value);
    const int64_t k_head = static_cast<int64_t>(ctx.item.kv_head) * p.k_head_stride;
    const int64_t v_head = static_cast<int64_t>(ctx.item.kv_head) * p.v_head_stride;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const bool valid = block[i] >= 0;
      int64_t k_off, v_off;  // elements
      if (p.paged) {
        k_off = static_cast<int64_t>(block[i]) * p.k_block_stride + offset[i] * p.k_token_stride + k_head;
        v_off = static_cast<int64_t>(block[i]) * p.v_block_stride + offset[i] * p.v_token_stride + v_head;
      } else {
        const int64_t token = ctx.item.query_start + offset[i];
        k_off = token * p.k_token_stride + k_head;
        v_off = token * p.v_token_stride + v_head;
      }
      const char* k_src = key + (valid ? k_off * 2 : 0);
      const char* v_src = value + (valid ? v_off * 2 : 0);
#pragma unroll
      for (int k = 0; k < kChunksPerThread; ++k) {
        const int c = lane_chunk + 8 * k;
        const int dst = swizzled_offset(row(i), c);
        cp_async_16(stage + dst, k_src + c * 16, valid);
        cp_async_16(stage + (D / 64) * 64 * 128 + dst, v_src + c * 16, valid);
      }
    }
  }
};

// S (64 x NK) = Q_h . K^T for one 64-row block, issued (not waited for); K tiles of NK = 64 keys
// (the wgmma path) or 128 (the warp-specialized kernel). Descriptors of the two tiles' starts; step
// kk (Ops::kK elements: 16 of a 16-bit type, 32 of fp8) moves 32 bytes inside a 128-byte row, 4
// steps to the next column block (64 rows apart in Q, NK in K). Ops: wgmma::Ops<T> or
// wgmma::OpsFp8.
template <int D, class Ops, int NK, typename Desc>
__device__ __forceinline__ void issue_scores_with(float (&s)[NK / 8][4], Desc q_desc, Desc k_desc) {
  static_assert(NK == 64 || NK == 128);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int kk = 0; kk < D / Ops::kK; ++kk) {
    const uint32_t qs = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
    const uint32_t ks = (kk >> 2) * (NK * 128) + (kk & 3) * 32;
    if constexpr (NK == 64) {
      Ops::ss_n64(s, wgmma::desc_at(q_desc, qs), wgmma::desc_at(k_desc, ks), kk > 0 ? 1 : 0);
    } else {
      Ops::ss_n128(s, wgmma::desc_at(q_desc, qs), wgmma::desc_at(k_desc, ks), kk > 0 ? 1 : 0);
    }
  }
  wgmma::commit();
#endif
}
template <int D, typename T, int NK = 64, typename Desc>
__device__ __forceinline__ void issue_scores(float (&s)[NK / 8][4], Desc q_desc, Desc k_desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  issue_scores_with<D, wgmma::Ops<T>, NK>(s, q_desc, k_desc);
#endif
}

// O_h (64 x D) += P_h (64 x 16 KS keys, registers) . V (16 KS keys x D, N-major), issued (not
// waited for); step ks moves 16 keys (2048 bytes).
template <int D, typename T, int KS, typename Desc>
__device__ __forceinline__ void issue_pv(float (&o)[D / 8][4], const uint32_t (&pa)[KS][4], Desc v_desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    wgmma::Ops<T>::template rs_tb<D>(o, pa[ks], wgmma::desc_at(v_desc, ks * 16 * 128));
  }
  wgmma::commit();
#endif
}

// P (the softmax's f32 scores of KS k16 steps, n8 tiles 2 ks and 2 ks + 1) rounded to the
// activation type and packed as the register A fragments of P . V (wgmma m64nNk16).
template <typename T, int KS>
__device__ __forceinline__ void pack_p(const float (&s)[2 * KS][4], uint32_t (&pa)[KS][4]) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    pa[ks][0] = Mma<T>::pack(s[2 * ks][0], s[2 * ks][1]);
    pa[ks][1] = Mma<T>::pack(s[2 * ks][2], s[2 * ks][3]);
    pa[ks][2] = Mma<T>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    pa[ks][3] = Mma<T>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
  }
}

// Logit transform (the mma.sync path's transform_scores) and online softmax of one 64-row block's
// scores for this thread's rows r, r + 8 (online_softmax_row, rescale_o); P packed as the A
// fragments of P . V.
template <int D, typename T>
__device__ __forceinline__ void softmax_to_p(float (&s)[8][4], const AttentionKernelParams& p,
                                             const ItemContext& ctx, const RowRange (&rows)[2], int first_local_row,
                                             int key0, bool general, bool masked, float (&m)[2], float (&l)[2],
                                             float (&o)[D / 8][4], uint32_t (&pa)[4][4]) {
  const float factor = transform_scores<8>(s, p, ctx, rows, first_local_row, key0, general, masked);
  const float c0 = online_softmax_row<8>(s, 0, factor, m[0], l[0]);
  const float c1 = online_softmax_row<8>(s, 1, factor, m[1], l[1]);
  rescale_o(o, c0, c1);
  pack_p<T>(s, pa);
}

// One prefill-path item (the planner's rows per item are the mma.sync path's: 128, or 64 at
// D = 256).
template <int D, typename T>
__device__ void run_prefill_item_wgmma(const AttentionKernelParams& p, const ItemContext& ctx, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tr = AttentionTraits<D, T, false>;
  using W = WgmmaPrefillTraits<D>;
  static_assert(W::kRows == Tr::kPrefillRows);
  constexpr int kStages = W::kStages;
  constexpr int H = W::kHalves;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int quad_row = lane >> 2;
  const int quad_col = lane & 3;
  char* q_smem = smem;
  char* stages = smem + W::kQBytes;

  load_q_swizzled<D, T>(p, ctx, q_smem);
  cp_async_commit();
  WgmmaKvRows<D> rows_next;  // page lookups of the next tile to copy
  rows_next.fetch(p, ctx, 0);
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    const WgmmaKvRows<D> rows_now = rows_next;
    rows_next.fetch(p, ctx, t + 1);
    if (t < ctx.num_tiles) rows_now.copy(p, ctx, stages + t * 2 * W::kTileBytes);
    cp_async_commit();
  }

  // Rows of this thread: 64 h + 16 warp + quad_row (+ 8).
  RowRange rows[H][2];
  float m[H][2], l[H][2];
  float o[H][D / 8][4];
#pragma unroll
  for (int h = 0; h < H; ++h) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 64 * h + 16 * warp + quad_row + 8 * e;
      rows[h][e] = make_row_range(p, ctx, r);
      init_row_state(p, ctx, r, true, m[h][e], l[h][e]);
    }
#pragma unroll
    for (int d = 0; d < D / 8; ++d) o[h][d][0] = o[h][d][1] = o[h][d][2] = o[h][d][3] = 0.f;
  }
  const bool general = p.soft_cap > 0.f || p.alibi_slopes != nullptr;
  // Last key any row of block h sees (visibility is monotone in position: the block's last live
  // row's); -1 for a block without live rows. Tiles past it skip the block (uniform over the CTA).
  int block_hi[H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const int last = min(64 * h + 63, ctx.item.num_rows - 1);
    block_hi[h] = 64 * h < ctx.item.num_rows ? make_row_range(p, ctx, last).hi : -1;
  }
  uint64_t q_desc[H];
#pragma unroll
  for (int h = 0; h < H; ++h) q_desc[h] = wgmma::smem_desc(q_smem + h * W::kTileBytes, 16, 1024);

  float s[8][4];
  uint32_t pa[4][4];
  // One barrier a tile: after it (the tile landed, every warp done with tile - 1), S_0 is issued
  // first and the copies of tile + 1 into the stage of tile - 1 go out while the tensor core runs it.
  static_assert(kStages == 2);
#pragma unroll 1
  for (int tile = 0; tile < ctx.num_tiles; ++tile) {
    cp_async_wait<0>();  // tile (and Q) landed: the only copies in flight
    wgmma::fence_async_smem();
    __syncthreads();  // ... for every thread; every warp is done with tile - 1
    const char* k_tile = stages + (tile % kStages) * 2 * W::kTileBytes;
    const uint64_t k_desc = wgmma::smem_desc(k_tile, 16, 1024);
    const uint64_t v_desc = wgmma::smem_desc(k_tile + W::kTileBytes, 64 * 128, 1024);
    const int key0 = ctx.tile_base + tile * kKeysPerTile;
    const bool masked = tile_masked(ctx, key0, kKeysPerTile);
    // A masked tile whose partly visible V rows hold a non-finite value takes P . V key by key,
    // each row over the keys it sees (value_isolation.cuh; the scan runs on masked tiles only).
    const char* v_tile = k_tile + W::kTileBytes;
    bool exact = false;
    if (masked) {  // (uniform over the CTA)
      const PartlyVisibleKeys pvk = tile_partly_visible(ctx, key0, kKeysPerTile);
      exact = __syncthreads_or(any_nonfinite<2>(pvk.count() * W::kChunks, kNonFinite16<T>, threadIdx.x, kThreadsPerCta,
                                                [&](int i) { return v_tile + swizzled_offset(pvk.key(i / W::kChunks), i % W::kChunks); })) != 0;
    }
    // Copies of tile + 1 into the stage of tile - 1 (issued under the first active block's S).
    bool refilled = false;
    auto refill = [&]() {
      const WgmmaKvRows<D> rows_now = rows_next;
      rows_next.fetch(p, ctx, tile + 2);
      if (tile + 1 < ctx.num_tiles) rows_now.copy(p, ctx, stages + ((tile + 1) % kStages) * 2 * W::kTileBytes);
      cp_async_commit();
      refilled = true;
    };
#pragma unroll
    for (int h = 0; h < H; ++h) {
      if (key0 > block_hi[h]) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      wgmma::reg_fence(s);
      wgmma::fence();
      issue_scores<D, T>(s, q_desc[h], k_desc);
      if (!refilled) refill();
      wgmma::wait<0>();
      wgmma::reg_fence(s);
      if (h > 0) {  // P_{h-1} . V is done: its accumulators and A registers may be touched again
        wgmma::reg_fence(o[h - 1]);
        wgmma::reg_fence(pa);
      }
      softmax_to_p<D, T>(s, p, ctx, rows[h], 64 * h + 16 * warp + quad_row, key0, general, masked, m[h], l[h],
                         o[h], pa);
      if (exact) {  // (no wgmma in flight: the wait above)
        pv_visible_keys<8, D / 8>(
            o[h], s, key0, [&](int e, int key) { return rows[h][e].sees(key); },
            [&](int key) {
              const int row = key - key0;
              const char* v = v_tile;
              return [v, row](int dim) {
                return to_f32(*reinterpret_cast<const T*>(v + swizzled_offset(row, dim >> 3) + (dim & 7) * 2));
              };
            });
        continue;
      }
      wgmma::reg_fence(o[h]);
      wgmma::reg_fence(pa);
      wgmma::fence();
      issue_pv<D, T>(o[h], pa, v_desc);
    }
    if (!refilled) refill();  // no block saw this tile
    wgmma::wait<0>();
#pragma unroll
    for (int h = 0; h < H; ++h) wgmma::reg_fence(o[h]);
    wgmma::reg_fence(pa);
  }
  cp_async_wait<0>();
  __syncthreads();  // every MMA read of Q and the stages is done: the epilogue stages rows there

  // Epilogue (as the mma.sync path): normalize; rows staged through shared memory as padded
  // 16-bit rows, then written in 16-byte chunks. Split items write f32 partials from registers.
  const bool split = ctx.item.partial_row >= 0;
  T* staged = reinterpret_cast<T*>(smem);  // (kRows, kRowStride)
#pragma unroll
  for (int h = 0; h < H; ++h) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 64 * h + 16 * warp + quad_row + 8 * e;
      const float lsum = quad_sum(l[h][e]);
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      const float out_scale = inv * ctx.v_scale;
      const float lse = lse_from_state(m[h][e], lsum);
      const bool live = r < ctx.item.num_rows;
      if (split) {
        if (live) {
          float* dst = p.partial_out + static_cast<int64_t>(ctx.item.partial_row + r) * D + 2 * quad_col;
#pragma unroll
          for (int d = 0; d < D / 8; ++d) {
            *reinterpret_cast<float2*>(dst + d * 8) =
                make_float2(o[h][d][2 * e] * out_scale, o[h][d][2 * e + 1] * out_scale);
          }
          if (quad_col == 0) p.partial_lse[ctx.item.partial_row + r] = lse;
        }
      } else {
        T* dst = staged + r * Tr::kRowStride + 2 * quad_col;
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
          *reinterpret_cast<uint32_t*>(dst + d * 8) =
              Mma<T>::pack(o[h][d][2 * e] * out_scale, o[h][d][2 * e + 1] * out_scale);
        }
        if (live && quad_col == 0 && p.lse != nullptr) {
          p.lse[row_head(ctx, r) * p.lse_head_stride + static_cast<int64_t>(row_token(ctx, r)) * p.lse_token_stride] =
              lse;
        }
      }
    }
  }
  if (!split) {
    __syncthreads();
    const bool fp8_out = p.output_scale != nullptr;
    const float q = output_quant_factor(p.output_scale);
    for (int idx = threadIdx.x; idx < W::kRows * W::kChunks; idx += kThreadsPerCta) {
      const int r = idx / W::kChunks;
      const int c = idx - r * W::kChunks;
      if (r < ctx.item.num_rows) {
        store_output8_staged<T>(p.output, row_token(ctx, r) * p.o_token_stride + row_head(ctx, r) * p.o_head_stride + c * 8,
                                staged + r * Tr::kRowStride + c * 8, fp8_out, q);
      }
    }
  }
#else
  (void)p;
  (void)ctx;
  (void)smem;
  __trap();
#endif
}

}  // namespace pagedattn::cuda
