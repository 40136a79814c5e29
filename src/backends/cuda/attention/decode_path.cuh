// The decode path of the paged attention kernels (items of <= 16 packed rows: decodes, short
// speculative rows): run by the paged attention kernel (paged_attention_kernel.cuh) for its
// decode-path items and by the decode-only kernel (paged_decode_kernel.cuh) for every item.
//
// Tiling: Q (16 rows) in registers; warp w takes keys [16w, 16w+16) of each 64-key tile, so the 4
// warps split each tile's keys (flash-decoding inside a CTA); their (m, l, o) are merged through
// shared memory at the end. Q.K^T and P.V on tensor cores (mma.sync m16n8k16, f32 accumulate); K
// fragments via ldmatrix, V via ldmatrix.trans.
// Pipeline: kStages stages (the paged attention kernel 3, 4 for fp8; the decode-only kernel 2);
// each iteration first refills the stage freed by the previous tile, then waits for the current
// tile, so kStages tiles are in flight while a CTA waits (decode is latency-bound: bytes in
// flight per SM set the bandwidth).
// fp8 caches (D % 32 == 0): the MMA fragments are converted in registers straight from the raw
// rows: Q.K^T with the head dims permuted alike in Q and K (4-byte loads), P.V with the output
// dims permuted (4 bytes of each of a lane's 4 keys, paired by byte_perm) and put back in order
// in the warp merge. k_scale is folded into the logit scale, v_scale applied to o.
//
// Memory traffic: each KV byte of an item's range once per GQA group (the group's heads are the
// item's rows); the floor is KV bytes / copy bandwidth.
#pragma once

#include "backends/cuda/attention/kv_tile_loads.cuh"
#include "backends/cuda/common/async_primitives.cuh"

namespace pagedattn::cuda {

// kStages: pipeline depth (the unified kernel's Tr::kDecodeStages; the decode-only kernel runs 2
// stages so that 3 CTAs fit an SM).
template <int D, typename T, bool kFp8, int kStages = AttentionTraits<D, T, kFp8>::kDecodeStages>
__device__ void run_decode_item(const AttentionKernelParams& p, const ItemContext& ctx, char* smem) {
  using Tr = AttentionTraits<D, T, kFp8>;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int quad_row = lane >> 2;  // rows quad_row, quad_row + 8
  const int quad_col = lane & 3;

  constexpr bool kDirect = Tr::kDecodeDirectFp8;
  T* q_smem = reinterpret_cast<T*>(smem);  // (16, kRowStride)
  char* stages = smem + kDecodeRows * Tr::kRowStride * 2;
  char* converted = stages + kStages * Tr::kStageBytes;  // fp8 with D % 32 != 0 only

  load_q_tile<Tr, T>(p, ctx, kDecodeRows, q_smem);
  cp_async_commit();
  constexpr int kRows = TileCopy<Tr, kFp8>::kRowsPerThread;
  int blocks[kRows], next_blocks[kRows];
  fetch_blocks<Tr, kFp8>(p, ctx, 0, next_blocks);
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) blocks[i] = next_blocks[i];
    fetch_blocks<Tr, kFp8>(p, ctx, t + 1, next_blocks);
    if (t < ctx.num_tiles) load_kv_tile<Tr, kFp8>(p, ctx, t, blocks, stages + t * Tr::kStageBytes);
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();
  __syncthreads();

  uint32_t q_frag[Tr::kKTiles][4];  // A fragments of the 16 x D query tile
#pragma unroll
  for (int kk = 0; kk < Tr::kKTiles; ++kk) {
    if constexpr (kDirect) {
      // Direct fp8: the k16 step kk takes dims 16kk + 4c + {0, 1} as MMA columns 2c + {0, 1} and
      // 16kk + 4c + {2, 3} as 2c + 8 + {0, 1} (c = quad_col); K's fragments below take the same
      // dims, so Q.K^T sums the same products (the order of a dot product's terms is free).
      const T* q0 = q_smem + quad_row * Tr::kRowStride + kk * 16 + 4 * quad_col;
      const T* q8 = q0 + 8 * Tr::kRowStride;
      q_frag[kk][0] = *reinterpret_cast<const uint32_t*>(q0);
      q_frag[kk][1] = *reinterpret_cast<const uint32_t*>(q8);
      q_frag[kk][2] = *reinterpret_cast<const uint32_t*>(q0 + 2);
      q_frag[kk][3] = *reinterpret_cast<const uint32_t*>(q8 + 2);
    } else {
      ldmatrix_x4(q_frag[kk], q_smem + (lane & 15) * Tr::kRowStride + kk * 16 + (lane >> 4) * 8);
    }
  }
  RowRange rows[2];
  float m[2], l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rows[h] = make_row_range(p, ctx, quad_row + 8 * h);
    init_row_state(p, ctx, quad_row + 8 * h, warp == 0, m[h], l[h]);
  }
  float o[Tr::kDTiles][4];
#pragma unroll
  for (int d = 0; d < Tr::kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  const bool general = p.soft_cap > 0.f || p.alibi_slopes != nullptr;

#pragma unroll 1
  for (int tile = 0; tile < ctx.num_tiles; ++tile) {
    __syncthreads();  // every warp is done with tile - 1, whose stage is refilled below
    {
      const int t = tile + kStages - 1;
#pragma unroll
      for (int i = 0; i < kRows; ++i) blocks[i] = next_blocks[i];
      fetch_blocks<Tr, kFp8>(p, ctx, t + 1, next_blocks);
      if (t < ctx.num_tiles) load_kv_tile<Tr, kFp8>(p, ctx, t, blocks, stages + (t % kStages) * Tr::kStageBytes);
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // tile landed; the kStages - 1 newer tiles stay in flight
    __syncthreads();
    const char* stage = stages + (tile % kStages) * Tr::kStageBytes;
    if constexpr (kFp8 && !kDirect) {
      convert_kv_tile<Tr, T>(stage, converted, p.fp8_format);
      __syncthreads();
      stage = converted;
    }
    const T* k_tile = reinterpret_cast<const T*>(stage);
    const T* v_tile = reinterpret_cast<const T*>(stage + Tr::kTileBytes);

    // S (16 x 16) = Q . K^T for keys [16*warp, 16*warp + 16) of the tile.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < Tr::kKTiles; ++kk) {
      uint32_t kb[4];
      if constexpr (kDirect) {
        // Key warp*16 + 8j + quad_row, dims 16kk + 4c .. + 3 (the Q order above): one 4-byte load.
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t raw = *reinterpret_cast<const uint32_t*>(
              stage + (warp * 16 + 8 * j + quad_row) * Tr::kRawRowBytes + kk * 16 + 4 * quad_col);
          const uint2 pairs = fp8x4_to_16bit<T>(raw, p.fp8_format);
          kb[2 * j] = pairs.x;
          kb[2 * j + 1] = pairs.y;
        }
      } else {
        ldmatrix_x4(kb, k_tile + (warp * 16 + (lane & 7) + (lane >> 4) * 8) * Tr::kRowStride + kk * 16 +
                            ((lane >> 3) & 1) * 8);
      }
      Mma<T>::mma(s[0], q_frag[kk], kb[0], kb[1]);
      Mma<T>::mma(s[1], q_frag[kk], kb[2], kb[3]);
    }
    const int key0 = ctx.tile_base + tile * kKeysPerTile;
    const bool masked = key0 < ctx.lo_max || key0 + kKeysPerTile - 1 > ctx.hi_min;
    const float factor = transform_scores<2>(s, p, ctx, rows, quad_row, key0 + warp * 16, general, masked);
    const float c0 = online_softmax_row<2>(s, 0, factor, m[0], l[0]);
    const float c1 = online_softmax_row<2>(s, 1, factor, m[1], l[1]);
    rescale_o(o, c0, c1);

    // O += P (16 x 16) . V (16 x D)
    uint32_t pa[4];
    pa[0] = Mma<T>::pack(s[0][0], s[0][1]);
    pa[1] = Mma<T>::pack(s[0][2], s[0][3]);
    pa[2] = Mma<T>::pack(s[1][0], s[1][1]);
    pa[3] = Mma<T>::pack(s[1][2], s[1][3]);
    if constexpr (kDirect) {
      // Direct fp8: output n8 tile 4b + t holds dims 32b + 4n + t (n = the MMA column): a lane
      // (n = quad_row) reads 4 bytes (dims 32b + 4n .. + 3) of each of its keys 2c, 2c + 1,
      // 2c + 8, 2c + 9 and pairs the keys' bytes of one dim (byte_perm) for the B fragments.
      const char* v_raw = stage + Tr::kRawTileBytes + (warp * 16 + 2 * quad_col) * Tr::kRawRowBytes + 4 * quad_row;
#pragma unroll
      for (int b = 0; b < Tr::kDTiles / 4; ++b) {
        const char* src = v_raw + 32 * b;
        const uint32_t u0 = *reinterpret_cast<const uint32_t*>(src);
        const uint32_t u1 = *reinterpret_cast<const uint32_t*>(src + Tr::kRawRowBytes);
        const uint32_t u8 = *reinterpret_cast<const uint32_t*>(src + 8 * Tr::kRawRowBytes);
        const uint32_t u9 = *reinterpret_cast<const uint32_t*>(src + 9 * Tr::kRawRowBytes);
        const uint2 lo01 = fp8x4_to_16bit<T>(__byte_perm(u0, u1, 0x5140), p.fp8_format);  // dims +0, +1
        const uint2 hi01 = fp8x4_to_16bit<T>(__byte_perm(u0, u1, 0x7362), p.fp8_format);  // dims +2, +3
        const uint2 lo89 = fp8x4_to_16bit<T>(__byte_perm(u8, u9, 0x5140), p.fp8_format);
        const uint2 hi89 = fp8x4_to_16bit<T>(__byte_perm(u8, u9, 0x7362), p.fp8_format);
        Mma<T>::mma(o[4 * b], pa, lo01.x, lo89.x);
        Mma<T>::mma(o[4 * b + 1], pa, lo01.y, lo89.y);
        Mma<T>::mma(o[4 * b + 2], pa, hi01.x, hi89.x);
        Mma<T>::mma(o[4 * b + 3], pa, hi01.y, hi89.y);
      }
    } else {
#pragma unroll
      for (int dd = 0; dd < Tr::kDTiles / 2; ++dd) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_tile + (warp * 16 + (lane & 15)) * Tr::kRowStride + dd * 16 + (lane >> 4) * 8);
        Mma<T>::mma(o[2 * dd], pa, vb[0], vb[1]);
        Mma<T>::mma(o[2 * dd + 1], pa, vb[2], vb[3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: reuse them for the merge

  // Merge the 4 warps' states: (m, l) per row and o (16 x D) per warp, through shared memory.
  float* merge_o = reinterpret_cast<float*>(stages);                      // (4, 16, kMergeRowStride)
  float* merge_m = merge_o + 4 * kDecodeRows * Tr::kMergeRowStride;       // (4, 16)
  float* merge_l = merge_m + 4 * kDecodeRows;                              // (4, 16)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = quad_row + 8 * h;
    const float lsum = quad_sum(l[h]);
    if (quad_col == 0) {
      merge_m[warp * kDecodeRows + r] = m[h];
      merge_l[warp * kDecodeRows + r] = lsum;
    }
    float* dst = merge_o + (warp * kDecodeRows + r) * Tr::kMergeRowStride;
    if constexpr (kDirect) {
      // Tile 4b + t, column 2c + e holds dim 32b + 8c + 4e + t.
#pragma unroll
      for (int b = 0; b < Tr::kDTiles / 4; ++b) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *reinterpret_cast<float4*>(dst + 32 * b + 8 * quad_col + 4 * e) =
              make_float4(o[4 * b][2 * h + e], o[4 * b + 1][2 * h + e], o[4 * b + 2][2 * h + e],
                          o[4 * b + 3][2 * h + e]);
        }
      }
    } else {
#pragma unroll
      for (int d = 0; d < Tr::kDTiles; ++d) {
        *reinterpret_cast<float2*>(dst + d * 8 + 2 * quad_col) = make_float2(o[d][2 * h], o[d][2 * h + 1]);
      }
    }
  }
  __syncthreads();

  // 8 threads per row, 8 columns per step.
  const int r = threadIdx.x >> 3;
  if (r < ctx.item.num_rows) {
    float weight[4];
    float mmax = neg_inf();
#pragma unroll
    for (int w = 0; w < 4; ++w) mmax = fmaxf(mmax, merge_m[w * kDecodeRows + r]);
    const float base = mmax == neg_inf() ? 0.f : mmax;
    float lsum = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      weight[w] = fast_exp2(merge_m[w * kDecodeRows + r] - base);
      lsum += weight[w] * merge_l[w * kDecodeRows + r];
    }
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const float out_scale = inv * ctx.v_scale;
    const bool split = ctx.item.partial_row >= 0;
    const int token = row_token(ctx, r);
    const int head = row_head(ctx, r);
    for (int c = threadIdx.x & 7; c < p.head_size_v / 8; c += 8) {
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float* src = merge_o + (w * kDecodeRows + r) * Tr::kMergeRowStride + c * 8;
        const float4 a = *reinterpret_cast<const float4*>(src);
        const float4 b = *reinterpret_cast<const float4*>(src + 4);
        acc[0] += weight[w] * a.x; acc[1] += weight[w] * a.y;
        acc[2] += weight[w] * a.z; acc[3] += weight[w] * a.w;
        acc[4] += weight[w] * b.x; acc[5] += weight[w] * b.y;
        acc[6] += weight[w] * b.z; acc[7] += weight[w] * b.w;
      }
      if (split) {
        float* dst = p.partial_out + static_cast<int64_t>(ctx.item.partial_row + r) * p.head_size_v + c * 8;
        *reinterpret_cast<float4*>(dst) =
            make_float4(acc[0] * out_scale, acc[1] * out_scale, acc[2] * out_scale, acc[3] * out_scale);
        *reinterpret_cast<float4*>(dst + 4) =
            make_float4(acc[4] * out_scale, acc[5] * out_scale, acc[6] * out_scale, acc[7] * out_scale);
      } else {
        uint4 packed;
        packed.x = Mma<T>::pack(acc[0] * out_scale, acc[1] * out_scale);
        packed.y = Mma<T>::pack(acc[2] * out_scale, acc[3] * out_scale);
        packed.z = Mma<T>::pack(acc[4] * out_scale, acc[5] * out_scale);
        packed.w = Mma<T>::pack(acc[6] * out_scale, acc[7] * out_scale);
        T* dst = static_cast<T*>(p.output) + token * p.o_token_stride + head * p.o_head_stride + c * 8;
        *reinterpret_cast<uint4*>(dst) = packed;
      }
    }
    if ((threadIdx.x & 7) == 0) {
      const float lse = lse_from_state(mmax, lsum);
      if (split) {
        p.partial_lse[ctx.item.partial_row + r] = lse;
      } else if (p.lse != nullptr) {
        p.lse[head * p.lse_head_stride + static_cast<int64_t>(token) * p.lse_token_stride] = lse;
      }
    }
  }
}

}  // namespace pagedattn::cuda
