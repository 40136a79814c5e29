// The mma.sync prefill path of the paged attention kernel (items of 64 / 128 packed rows; every
// head size and cache; the kVariantMma variant of paged_attention_kernel.cuh).
//
// Tiling: warp w owns rows [16*MT*w, 16*MT*(w+1)) (MT = 2 16-row MMA tiles up to D = 128, else
// 1) and sees every key of a 64-key tile; 2-stage pipeline (kv_tile_loads.cuh). Q.K^T and P.V on
// tensor cores (mma.sync m16n8k16, f32 accumulate); Q and K fragments via ldmatrix, V via
// ldmatrix.trans. Keys past a warp's last visible one are skipped per warp (causal: the upper
// triangle). fp8 caches: each tile is converted to the activation type in shared memory first.
// Epilogue: the warp stages its normalized rows in its own Q rows and writes 16-byte chunks;
// split items write f32 partials from registers.
//
// NaN isolation: a masked tile whose partly visible V rows hold a non-finite value takes P . V key
// by key instead of the MMAs (value_isolation.cuh).
//
// Memory traffic and floor: each KV byte of an item's range once per item (items of one request
// and kv head share it through L2); the floor is 4 * rows * visible keys * D / MMA rate.
#pragma once

#include "backends/cuda/attention/kv_tile_loads.cuh"
#include "backends/cuda/common/async_primitives.cuh"

namespace pagedattn::cuda {

template <int D, typename T, bool kFp8>
__device__ void run_prefill_item(const AttentionKernelParams& p, const ItemContext& ctx, char* smem) {
  using Tr = AttentionTraits<D, T, kFp8>;
  constexpr int kStages = Tr::kPrefillStages;
  constexpr int MT = Tr::kMTiles;
  constexpr int NT = kKeysPerTile / 8;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int quad_row = lane >> 2;
  const int quad_col = lane & 3;
  const int warp_row0 = warp * 16 * MT;

  T* q_smem = reinterpret_cast<T*>(smem);  // (kPrefillRows, kRowStride)
  char* stages = smem + Tr::kPrefillRows * Tr::kRowStride * 2;
  char* converted = stages + kStages * Tr::kStageBytes;

  load_q_tile<Tr, T>(p, ctx, Tr::kPrefillRows, q_smem);
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

  RowRange rows[MT][2];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + quad_row + 8 * h;
      rows[mt][h] = make_row_range(p, ctx, r);
      init_row_state(p, ctx, r, true, m[mt][h], l[mt][h]);
    }
  }
  float o[MT][Tr::kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < Tr::kDTiles; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
  const bool general = p.soft_cap > 0.f || p.alibi_slopes != nullptr;
  // Keys past the last row's visibility are skipped per warp (causal: the upper triangle).
  int warp_hi = -1;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) warp_hi = max(warp_hi, rows[mt][h].hi);
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 4));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 8));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 16));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 1));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 2));

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
    if constexpr (kFp8) {
      convert_kv_tile<Tr, T>(stage, converted, p.fp8_format);
      __syncthreads();
      stage = converted;
    }
    const int key0 = ctx.tile_base + tile * kKeysPerTile;
    if (key0 > warp_hi) continue;  // no row of this warp sees this tile (uniform per warp)
    const T* k_tile = reinterpret_cast<const T*>(stage);
    const T* v_tile = reinterpret_cast<const T*>(stage + Tr::kTileBytes);

    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::kKTiles; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ldmatrix_x4(qa[mt], q_smem + (warp_row0 + mt * 16 + (lane & 15)) * Tr::kRowStride + kk * 16 +
                                (lane >> 4) * 8);
      }
#pragma unroll
      for (int nn = 0; nn < NT / 2; ++nn) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_tile + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * Tr::kRowStride + kk * 16 +
                            ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::mma(s[mt][2 * nn], qa[mt], kb[0], kb[1]);
          Mma<T>::mma(s[mt][2 * nn + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }
    const bool masked = tile_masked(ctx, key0, kKeysPerTile);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float factor =
          transform_scores<NT>(s[mt], p, ctx, rows[mt], warp_row0 + mt * 16 + quad_row, key0, general, masked);
      const float c0 = online_softmax_row<NT>(s[mt], 0, factor, m[mt][0], l[mt][0]);
      const float c1 = online_softmax_row<NT>(s[mt], 1, factor, m[mt][1], l[mt][1]);
      rescale_o(o[mt], c0, c1);
    }
    // A masked tile whose partly visible V rows hold a non-finite value takes P . V key by key,
    // each row over the keys it sees (value_isolation.cuh; the scan runs on masked tiles only).
    bool exact = false;
    if (masked) {
      const PartlyVisibleKeys pvk = tile_partly_visible(ctx, key0, kKeysPerTile);
      const char* v_rows = reinterpret_cast<const char*>(v_tile);
      exact = __any_sync(0xffffffffu, any_nonfinite<2>(pvk.count() * Tr::kChunks, kNonFinite16<T>, lane, 32, [&](int i) {
                return v_rows + pvk.key(i / Tr::kChunks) * Tr::kRowStride * 2 + (i % Tr::kChunks) * 16;
              }));
    }
    if (exact) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pv_visible_keys<NT, Tr::kDTiles>(
            o[mt], s[mt], key0, [&](int e, int key) { return rows[mt][e].sees(key); },
            [&](int key) {
              const T* v = v_tile + (key - key0) * Tr::kRowStride;
              return [v](int dim) { return to_f32(v[dim]); };
            });
      }
      continue;
    }
#pragma unroll
    for (int kk = 0; kk < kKeysPerTile / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dd = 0; dd < Tr::kDTiles / 2; ++dd) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_tile + (kk * 16 + (lane & 15)) * Tr::kRowStride + dd * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::mma(o[mt][2 * dd], pa[mt], vb[0], vb[1]);
          Mma<T>::mma(o[mt][2 * dd + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncwarp();  // the warp's last ldmatrix reads of its Q rows precede the staging writes

  // Epilogue: normalize; the warp stages its rows in its own (no longer read) Q rows, then
  // writes 16-byte chunks. Split items write f32 partials straight from registers.
  const bool split = ctx.item.partial_row >= 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + quad_row + 8 * h;
      const float lsum = quad_sum(l[mt][h]);
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      const float out_scale = inv * ctx.v_scale;
      const float lse = lse_from_state(m[mt][h], lsum);
      const bool live = r < ctx.item.num_rows;
      if (split) {
        if (live) {
          float* dst =
              p.partial_out + static_cast<int64_t>(ctx.item.partial_row + r) * p.head_size_v + 2 * quad_col;
#pragma unroll
          for (int d = 0; d < Tr::kDTiles; ++d) {
            if (d * 8 < p.head_size_v) {
              *reinterpret_cast<float2*>(dst + d * 8) =
                  make_float2(o[mt][d][2 * h] * out_scale, o[mt][d][2 * h + 1] * out_scale);
            }
          }
          if (quad_col == 0) p.partial_lse[ctx.item.partial_row + r] = lse;
        }
      } else {
        T* dst = q_smem + r * Tr::kRowStride + 2 * quad_col;
#pragma unroll
        for (int d = 0; d < Tr::kDTiles; ++d) {
          *reinterpret_cast<uint32_t*>(dst + d * 8) =
              Mma<T>::pack(o[mt][d][2 * h] * out_scale, o[mt][d][2 * h + 1] * out_scale);
        }
        if (live && quad_col == 0 && p.lse != nullptr) {
          p.lse[row_head(ctx, r) * p.lse_head_stride +
                static_cast<int64_t>(row_token(ctx, r)) * p.lse_token_stride] = lse;
        }
      }
    }
  }
  if (!split) {
    __syncwarp();
    const int out_chunks = p.head_size_v / 8;
    const bool fp8_out = p.output_scale != nullptr;
    const float q = output_quant_factor(p.output_scale);
    for (int idx = lane; idx < 16 * MT * Tr::kChunks; idx += 32) {
      const int rr = idx / Tr::kChunks;
      const int c = idx - rr * Tr::kChunks;
      const int r = warp_row0 + rr;
      if (r < ctx.item.num_rows && c < out_chunks) {
        store_output8_staged<T>(p.output, row_token(ctx, r) * p.o_token_stride + row_head(ctx, r) * p.o_head_stride + c * 8,
                                q_smem + r * Tr::kRowStride + c * 8, fp8_out, q);
      }
    }
  }
}

}  // namespace pagedattn::cuda
