// The decode path of the paged attention kernels (items of <= 16 packed rows: decodes, short
// speculative rows): run by the paged attention kernel (paged_attention_kernel.cuh) for its
// decode-path items and by the decode-only kernel (paged_decode_kernel.cuh) for every item.
//
// Tiling: Q (16 rows) in registers; keys stream in steps of one 64-key tile (direct fp8: two at
// D = 128, four at D = 64, Tr::kDecodeStepTiles); warp w takes keys [Kw w, Kw (w+1)) of each step
// (Kw = 16, 32 or 64), so the 4 warps split each step's keys (flash-decoding inside a CTA); their (m, l, o) are
// merged through shared memory at the end. Q.K^T and P.V on tensor cores (mma.sync m16n8k16, f32
// accumulate); 16-bit K fragments via ldmatrix, V via ldmatrix.trans.
// Pipeline: kStages stages of a step (the paged attention kernel 3, 4 for one-tile fp8 steps; the
// decode-only kernel 2, 3 for fp8: paged_decode_kernel.cuh); each iteration first refills the
// stage freed by the previous step, then waits for the current one, so kStages - 1 steps are in
// flight while a CTA computes (decode is latency-bound: bytes in flight per SM set the bandwidth,
// and the fixed costs of a step, barriers and softmax, are paid per step: an fp8 tile is half the
// bytes of a 16-bit one, hence the two-tile steps).
// fp8 caches with D % 32 == 0 ("direct"): both MMAs run on f16 operands whatever the activation
// type, and the B fragments are converted in registers straight from the raw staged rows, one
// cvt.rn.f16x2.{e4m3,e5m2}x2 per 2 values (no 16-bit tile, no f32 round trip, no bf16 repack):
//   Q.K^T: lane (quad_row n, quad_col c) owns bytes [c D/4, (c+1) D/4) of its key rows (keys
//          8j + n of its warp's keys) and reads them with 16-byte (8, 4 when D/4 demands) loads;
//          the k16 step kk takes that segment's dims c D/4 + 4kk + {0, 1} as MMA columns
//          2c + {0, 1} and + {2, 3} as 2c + 8 + {0, 1}; Q's A fragments take the same dims (the
//          order of a dot product's terms is free).
//   P.V:   lane n owns output dims [n D/8, (n+1) D/8) (n8 tile t, column n = dim n D/8 + t) and
//          reads them from each of its 4 keys with one vector load; a byte_perm pairs two keys'
//          bytes of a dim; the warp merge puts the dims back in order.
//   Q (f16 A fragments): an f16 query as it is; a bf16 query times 2^s, s chosen per item from
//   the tile's largest |q| so that it lands in [2^14, 2^15) (exact for every element above 2^-28
//   of the largest; below, an absolute error under 2^-39 of it); 2^-s goes into the logit scale.
//   P is rounded to f16 (in [0, 1]: finer than bf16). The format (e4m3 / e5m2) is a uniform
//   branch around each step's conversions. Multi-tile steps stage rows unpadded with their 16-byte
//   chunks swizzled (kv_tile_loads.cuh swizzled_chunk); both fragment loads stay conflict-free.
// Per warp and 64-key tile at D = 128: 8 16-byte shared loads, 64 conversions, 16 byte_perms, 32
// MMAs (before, bf16 operands: 32 4-byte loads, 64 conversions + 128 f16 -> f32 + 64 bf16 packs).
// k_scale is folded into the logit scale, v_scale applied to o once at the end.
// NaN isolation (speculative rows): a masked step whose partly visible V rows of a warp's keys hold
// a non-finite value takes that warp's P . V key by key (value_isolation.cuh).
// Other fp8 head sizes (D % 32 != 0) convert each staged tile to the activation type in shared
// memory (convert_kv_tile) and take the 16-bit path.
//
// Memory traffic: each KV byte of an item's range once per GQA group (the group's heads are the
// item's rows); the floor is KV bytes / copy bandwidth. Items over a kv-head pair (fp8, head size
// 64: run_decode_item's kPaired) read both heads' rows of a token as one 128-byte row.
#pragma once

#include "backends/cuda/attention/kv_tile_loads.cuh"
#include "backends/cuda/common/async_primitives.cuh"

#include <type_traits>

namespace pagedattn::cuda {

// Direct fp8 path: the fragment layout (see the top comment).
template <int D>
struct DirectFp8Layout {
  static constexpr int vec_bytes(int n) { return n % 16 == 0 ? 16 : n % 8 == 0 ? 8 : 4; }
  static constexpr int kKBytes = D / 4;                    // a lane's bytes of a key row (Q.K^T)
  static constexpr int kKVec = vec_bytes(kKBytes);         // per shared load
  static constexpr int kVBytes = D / 8;                    // a lane's bytes of a value row (P.V)
  static constexpr int kVVec = vec_bytes(kVBytes);
};

// Loads kBytes (4, 8 or 16; aligned to them) of shared memory as words.
template <int kBytes>
__device__ __forceinline__ void load_words(const char* src, uint32_t (&w)[kBytes / 4]) {
  if constexpr (kBytes == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x; w[1] = v.y;
  } else {
    static_assert(kBytes == 4);
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  }
}

// Direct fp8 path: the query tile's f16 A fragments, dims as the K fragments take them (top
// comment). Returns the factor (2^-s) that the logit scale takes for the query's scaling: 1 for
// an f16 query; for a bf16 one, 2^s puts the tile's largest |q| in [2^14, 2^15) (s <= 126; every
// warp computes the same s, as each holds the whole tile).
template <int D, typename T, int kRowStride>
__device__ __forceinline__ float direct_fp8_q_frags(const T* q_smem, int quad_row, int quad_col,
                                                    uint32_t (&q_frag)[D / 16][4]) {
  const T* q0 = q_smem + quad_row * kRowStride + quad_col * (D / 4);
  const T* q8 = q0 + 8 * kRowStride;
  if constexpr (std::is_same_v<T, __half>) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      q_frag[kk][0] = *reinterpret_cast<const uint32_t*>(q0 + 4 * kk);
      q_frag[kk][1] = *reinterpret_cast<const uint32_t*>(q8 + 4 * kk);
      q_frag[kk][2] = *reinterpret_cast<const uint32_t*>(q0 + 4 * kk + 2);
      q_frag[kk][3] = *reinterpret_cast<const uint32_t*>(q8 + 4 * kk + 2);
    }
    return 1.f;
  } else {
    const auto four = [](const T* src, float (&x)[4]) {
      const uint2 raw = *reinterpret_cast<const uint2*>(src);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
    };
    float mx = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      float x[4], y[4];
      four(q0 + 4 * kk, x);
      four(q8 + 4 * kk, y);
#pragma unroll
      for (int e = 0; e < 4; ++e) mx = fmaxf(mx, fmaxf(fabsf(x[e]), fabsf(y[e])));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const int biased = (__float_as_int(mx) >> 23) & 0xff;  // 0: zero / subnormal; 255: inf / NaN
    const int s = min(126, 141 - biased);                  // max * 2^s in [2^14, 2^15)
    const float up = __int_as_float((127 + s) << 23);
    const float down = __int_as_float((127 - s) << 23);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      float x[4], y[4];
      four(q0 + 4 * kk, x);
      four(q8 + 4 * kk, y);
      q_frag[kk][0] = Mma<__half>::pack(x[0] * up, x[1] * up);
      q_frag[kk][1] = Mma<__half>::pack(y[0] * up, y[1] * up);
      q_frag[kk][2] = Mma<__half>::pack(x[2] * up, x[3] * up);
      q_frag[kk][3] = Mma<__half>::pack(y[2] * up, y[3] * up);
    }
    return down;
  }
}

// kStages: pipeline depth (the unified kernel's Tr::kDecodeStages; the decode-only kernel's
// DecodeKernelTraits::kStages, shallower so that 3 CTAs fit an SM).
// kPaired: an item of kItemPairedHeads (attention_plan.h), run at D = 2 x the layer's head size:
// its rows are the query heads of kv heads 2 kv_head and 2 kv_head + 1 (ctx.group_size = 2G), a
// staged row is both heads' rows side by side, each query row is zero in the other head's half
// (load_q_tile_paired). Q . K^T runs as two accumulations, each over one head's k columns (the
// direct layout puts the first head's dims in lanes quad_col 0, 1 and the second's in 2, 3; the
// other lanes give zero K words), and each row takes its own head's: not the one full sum, where
// zero times a NaN or an infinity in the other head's K row would make it NaN. P . V covers both
// halves and each row keeps its half of O. The k / v scales are applied per row (the two heads'
// per-head scales may differ).
template <int D, typename T, bool kFp8, int kStages = AttentionTraits<D, T, kFp8>::kDecodeStages, bool kPaired = false>
__device__ void run_decode_item(const AttentionKernelParams& p, const ItemContext& item_ctx, char* smem) {
  using Tr = AttentionTraits<D, T, kFp8>;
  ItemContext ctx = item_ctx;  // direct fp8 with a bf16 query: qk_scale takes the query's 2^-s
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int quad_row = lane >> 2;  // rows quad_row, quad_row + 8
  const int quad_col = lane & 3;
  float row_k_scale[2] = {1.f, 1.f};  // kPaired: the k scale of each of this thread's rows
  bool row_second[2] = {false, false};  // kPaired: the row is a query head of kv head 2 kv_head + 1
  if constexpr (kPaired) {
    static_assert(kFp8 && Tr::kDecodeDirectFp8, "paired kv heads: the direct fp8 decode path");
    ctx.group_size = 2 * p.group_size;
    set_row_visibility(p, ctx, ctx.group_size);
    ctx.qk_scale = p.scale;
    ctx.v_scale = 1.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = quad_row + 8 * h;
      const int kv = r < ctx.item.num_rows ? row_head(ctx, r) / p.group_size : 0;
      row_k_scale[h] = p.k_scale_per_head != nullptr ? p.k_scale_per_head[kv] : p.k_scale;
      row_second[h] = (ctx.item.row_start + r) % ctx.group_size >= p.group_size;
    }
  }

  constexpr bool kDirect = Tr::kDecodeDirectFp8;
  constexpr int kStep = Tr::kDecodeStepTiles;         // 64-key tiles per pipeline step
  constexpr int kWarpKeys = kStep * kKeysPerTile / 4;  // keys of a step per warp: 16, 32 or 64
  constexpr int kNT = kWarpKeys / 8;                   // n8 score tiles per warp
  constexpr bool kSwizzled = Tr::kDecodeSwizzled;
  constexpr int kRawRow = Tr::kDecodeRawRowBytes;      // fp8: bytes between staged rows
  T* q_smem = reinterpret_cast<T*>(smem);  // (16, kRowStride)
  char* stages = smem + kDecodeRows * Tr::kRowStride * 2;
  char* converted = stages + kStages * Tr::kDecodeStepBytes;  // fp8 with D % 32 != 0 only

  if constexpr (kPaired) {
    load_q_tile_paired<Tr, T>(p, ctx, q_smem);
  } else {
    load_q_tile<Tr, T>(p, ctx, kDecodeRows, q_smem);
  }
  cp_async_commit();
  const int num_steps = (ctx.num_tiles + kStep - 1) / kStep;
  constexpr int kRows = TileCopy<Tr, kFp8>::kRowsPerThread;
  int blocks[kStep][kRows], next_blocks[kStep][kRows];
  // Page ids are fetched one step ahead of their copies (blocks: this step's, next_blocks: the next).
#pragma unroll
  for (int i = 0; i < kStep; ++i) fetch_blocks<Tr, kFp8>(p, ctx, i, next_blocks[i]);
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
#pragma unroll
    for (int i = 0; i < kStep; ++i) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) blocks[i][r] = next_blocks[i][r];
    }
#pragma unroll
    for (int i = 0; i < kStep; ++i) fetch_blocks<Tr, kFp8>(p, ctx, (t + 1) * kStep + i, next_blocks[i]);
    if (t * kStep < ctx.num_tiles) {
#pragma unroll
      for (int i = 0; i < kStep; ++i) {
        load_kv_tile<Tr, kFp8, kSwizzled, kPaired>(p, ctx, t * kStep + i, blocks[i],
                                          stages + t * Tr::kDecodeStepBytes + i * Tr::kDecodeTileBytes);
      }
    }
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();
  __syncthreads();

  uint32_t q_frag[Tr::kKTiles][4];  // A fragments of the 16 x D query tile (direct fp8: f16)
  if constexpr (kDirect) {
    ctx.qk_scale *= direct_fp8_q_frags<D, T, Tr::kRowStride>(q_smem, quad_row, quad_col, q_frag);
  } else {
#pragma unroll
    for (int kk = 0; kk < Tr::kKTiles; ++kk) {
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
  for (int step = 0; step < num_steps; ++step) {
    __syncthreads();  // every warp is done with step - 1, whose stage is refilled below
    {
      const int t = step + kStages - 1;
#pragma unroll
      for (int i = 0; i < kStep; ++i) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) blocks[i][r] = next_blocks[i][r];
      }
#pragma unroll
      for (int i = 0; i < kStep; ++i) fetch_blocks<Tr, kFp8>(p, ctx, (t + 1) * kStep + i, next_blocks[i]);
      if (t * kStep < ctx.num_tiles) {
#pragma unroll
        for (int i = 0; i < kStep; ++i) {
          load_kv_tile<Tr, kFp8, kSwizzled, kPaired>(p, ctx, t * kStep + i, blocks[i],
                                            stages + (t % kStages) * Tr::kDecodeStepBytes + i * Tr::kDecodeTileBytes);
        }
      }
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // step landed; the kStages - 1 newer steps stay in flight
    __syncthreads();
    const char* stage = stages + (step % kStages) * Tr::kDecodeStepBytes;
    if constexpr (kFp8 && !kDirect) {
      convert_kv_tile<Tr, T>(stage, converted, p.fp8_format);
      __syncthreads();
      stage = converted;
    }
    const T* k_tile = reinterpret_cast<const T*>(stage);
    const T* v_tile = reinterpret_cast<const T*>(stage + Tr::kTileBytes);

    // S (16 x kWarpKeys) = Q . K^T for keys [kWarpKeys*warp, kWarpKeys*(warp + 1)) of the step
    // (tile kWarpKeys*warp / 64 of it).
    float s[kNT][4] = {};
    float s_second[kPaired ? kNT : 1][4] = {};  // kPaired: over the second head's k columns
    if constexpr (kDirect) {
      // Keys kWarpKeys*warp + 8j + quad_row, bytes [c D/4, (c+1) D/4): word kk is the k16 step kk.
      // Swizzled rows (their row & 7 is quad_row): 16-byte chunk c' at c' ^ quad_row.
      using L = DirectFp8Layout<D>;
      const int wkey = warp * kWarpKeys;
      const char* k_raw = stage + (wkey / kKeysPerTile) * Tr::kDecodeTileBytes + (wkey % kKeysPerTile + quad_row) * kRawRow;
      const auto k_col = [&](int v) {  // (row & 7 of every row read is quad_row; kKVec = 16 here)
        if constexpr (kSwizzled) {
          return swizzled_chunk<kRawRow>(quad_row, quad_col * (L::kKBytes / 16) + v) * 16;
        } else {
          return quad_col * L::kKBytes + v * L::kKVec;
        }
      };
      const auto qk = [&](auto format) {
#pragma unroll
        for (int v = 0; v < L::kKBytes / L::kKVec; ++v) {
          uint32_t w[kNT][L::kKVec / 4];
#pragma unroll
          for (int j = 0; j < kNT; ++j) load_words<L::kKVec>(k_raw + 8 * j * kRawRow + k_col(v), w[j]);
#pragma unroll
          for (int i = 0; i < L::kKVec / 4; ++i) {
            const int kk = v * (L::kKVec / 4) + i;
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
              const uint2 kb = fp8x4_to_f16x4<decltype(format)::value>(w[j][i]);
              if constexpr (kPaired) {
                const bool second = quad_col >= 2;  // this lane's k columns: the second head's dims
                Mma<__half>::mma(s[j], q_frag[kk], second ? 0u : kb.x, second ? 0u : kb.y);
                Mma<__half>::mma(s_second[j], q_frag[kk], second ? kb.x : 0u, second ? kb.y : 0u);
              } else {
                Mma<__half>::mma(s[j], q_frag[kk], kb.x, kb.y);
              }
            }
          }
        }
      };
      if (p.fp8_format == 1) {
        qk(std::integral_constant<int, 1>{});
      } else {
        qk(std::integral_constant<int, 2>{});
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < Tr::kKTiles; ++kk) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_tile + (warp * 16 + (lane & 7) + (lane >> 4) * 8) * Tr::kRowStride + kk * 16 +
                            ((lane >> 3) & 1) * 8);
        Mma<T>::mma(s[0], q_frag[kk], kb[0], kb[1]);
        Mma<T>::mma(s[1], q_frag[kk], kb[2], kb[3]);
      }
    }
    if constexpr (kPaired) {  // each row its own head's dot products
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = row_second[e >> 1] ? s_second[j][e] : s[j][e];
    }
    const int key0 = ctx.tile_base + step * kStep * kKeysPerTile;
    const bool masked = tile_masked(ctx, key0, kStep * kKeysPerTile);
    if constexpr (kPaired) {  // the general logit transform takes the true dot products
      if (general) {
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] *= row_k_scale[e >> 1];
      }
    }
    const float factor = transform_scores<kNT>(s, p, ctx, rows, quad_row, key0 + warp * kWarpKeys, general, masked);
    const bool row_factor = kPaired && !general;
    const float c0 = online_softmax_row<kNT>(s, 0, row_factor ? factor * row_k_scale[0] : factor, m[0], l[0]);
    const float c1 = online_softmax_row<kNT>(s, 1, row_factor ? factor * row_k_scale[1] : factor, m[1], l[1]);
    rescale_o(o, c0, c1);

    // A masked step whose partly visible V rows (of this warp's keys) hold a non-finite value
    // takes P . V key by key, each row over the keys it sees (value_isolation.cuh; speculative
    // rows: the causal diagonal). The direct layout's o column n of n8 tile t is dim n D/8 + t.
    if (masked) {
      const int wkey0 = key0 + warp * kWarpKeys;
      const PartlyVisibleKeys pvk = tile_partly_visible(ctx, wkey0, kWarpKeys);
      bool bad;
      if constexpr (kDirect) {
        constexpr int kRowChunks = D / 16;
        bad = any_nonfinite<1>(pvk.count() * kRowChunks, nonfinite_fp8_mask(p.fp8_format), lane, 32, [&](int i) {
          const int key = warp * kWarpKeys + pvk.key(i / kRowChunks);  // in the step
          return stage + (key / kKeysPerTile) * Tr::kDecodeTileBytes + (kKeysPerTile + key % kKeysPerTile) * kRawRow +
                 (i % kRowChunks) * 16;
        });
      } else {
        const char* v_rows = reinterpret_cast<const char*>(v_tile) + warp * kWarpKeys * Tr::kRowStride * 2;
        bad = any_nonfinite<2>(pvk.count() * Tr::kChunks, kNonFinite16<T>, lane, 32, [&](int i) {
          return v_rows + pvk.key(i / Tr::kChunks) * Tr::kRowStride * 2 + (i % Tr::kChunks) * 16;
        });
      }
      if (__any_sync(0xffffffffu, bad)) {
        const auto sees = [&](int e, int key) { return rows[e].sees(key); };
        if constexpr (kDirect) {
          pv_visible_keys<kNT, Tr::kDTiles>(o, s, wkey0, sees, [&](int key) {
            const CacheValueRow<T, kPaired> v = cache_value_row<T, kPaired>(p, ctx, key);
            return [v](int dim) { return v((dim & 7) * (D / 8) + (dim >> 3)); };
          });
        } else {
          pv_visible_keys<kNT, Tr::kDTiles>(o, s, wkey0, sees, [&](int key) {
            const T* v = v_tile + (key - key0) * Tr::kRowStride;
            return [v](int dim) { return to_f32(v[dim]); };
          });
        }
        continue;
      }
    }

    // O += P (16 x kWarpKeys) . V (kWarpKeys x D), one k16 step (16 keys) at a time.
    using PT = std::conditional_t<kDirect, __half, T>;  // the MMA operand type
    if constexpr (kDirect) {
      // Lane n = quad_row reads bytes [n D/8, (n+1) D/8) (its output dims) of its keys 2c, 2c + 1,
      // 2c + 8, 2c + 9 (of the k16 step); word i of them holds n8 tiles 4i .. 4i + 3; byte_perm
      // pairs two keys' bytes of a dim ([k0 d0, k1 d0, k0 d1, k1 d1]), each half then one B
      // register. Swizzled rows: row & 7 is 2c + (key & 1).
      using L = DirectFp8Layout<D>;
      const auto v_col = [&](int v, int k) {  // (row & 7 of key k is 2c + (k & 1))
        if constexpr (kSwizzled && L::kVBytes >= 16) {
          return swizzled_chunk<kRawRow>(2 * quad_col + (k & 1), quad_row * (L::kVBytes / 16) + v) * 16;
        } else if constexpr (kSwizzled) {  // D = 64: 8 bytes a lane, half a chunk
          const int byte = quad_row * L::kVBytes + v * L::kVVec;
          return swizzled_chunk<kRawRow>(2 * quad_col + (k & 1), byte >> 4) * 16 + (byte & 15);
        } else {
          return quad_row * L::kVBytes + v * L::kVVec;
        }
      };
      const auto pv = [&](auto format) {
#pragma unroll
        for (int ks = 0; ks < kNT / 2; ++ks) {
          uint32_t pa[4];
          pa[0] = Mma<PT>::pack(s[2 * ks][0], s[2 * ks][1]);
          pa[1] = Mma<PT>::pack(s[2 * ks][2], s[2 * ks][3]);
          pa[2] = Mma<PT>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
          pa[3] = Mma<PT>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
          const int key = warp * kWarpKeys + 16 * ks;  // first key of the k16 step in the step
          const char* v_raw = stage + (key / kKeysPerTile) * Tr::kDecodeTileBytes + kKeysPerTile * kRawRow +
                              (key % kKeysPerTile + 2 * quad_col) * kRawRow;
#pragma unroll
          for (int v = 0; v < L::kVBytes / L::kVVec; ++v) {
            uint32_t u[4][L::kVVec / 4];  // keys 2c, 2c + 1, 2c + 8, 2c + 9
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              load_words<L::kVVec>(v_raw + ((k & 1) + 8 * (k >> 1)) * kRawRow + v_col(v, k), u[k]);
            }
#pragma unroll
            for (int i = 0; i < L::kVVec / 4; ++i) {
              const int t = 4 * (v * (L::kVVec / 4) + i);
              constexpr int F = decltype(format)::value;
              const uint2 lo01 = fp8x4_to_f16x4<F>(__byte_perm(u[0][i], u[1][i], 0x5140));  // tiles t, t + 1
              const uint2 hi01 = fp8x4_to_f16x4<F>(__byte_perm(u[0][i], u[1][i], 0x7362));  // tiles t + 2, t + 3
              const uint2 lo89 = fp8x4_to_f16x4<F>(__byte_perm(u[2][i], u[3][i], 0x5140));
              const uint2 hi89 = fp8x4_to_f16x4<F>(__byte_perm(u[2][i], u[3][i], 0x7362));
              Mma<__half>::mma(o[t], pa, lo01.x, lo89.x);
              Mma<__half>::mma(o[t + 1], pa, lo01.y, lo89.y);
              Mma<__half>::mma(o[t + 2], pa, hi01.x, hi89.x);
              Mma<__half>::mma(o[t + 3], pa, hi01.y, hi89.y);
            }
          }
        }
      };
      if (p.fp8_format == 1) {
        pv(std::integral_constant<int, 1>{});
      } else {
        pv(std::integral_constant<int, 2>{});
      }
    } else {
      uint32_t pa[4];
      pa[0] = Mma<PT>::pack(s[0][0], s[0][1]);
      pa[1] = Mma<PT>::pack(s[0][2], s[0][3]);
      pa[2] = Mma<PT>::pack(s[1][0], s[1][1]);
      pa[3] = Mma<PT>::pack(s[1][2], s[1][3]);
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
      // Tile t, column 2c + e holds dim (2c + e) D/8 + t.
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int t = 0; t < Tr::kDTiles; t += 4) {
          *reinterpret_cast<float4*>(dst + (2 * quad_col + e) * Tr::kDTiles + t) =
              make_float4(o[t][2 * h + e], o[t + 1][2 * h + e], o[t + 2][2 * h + e], o[t + 3][2 * h + e]);
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
    float out_scale = inv * ctx.v_scale;
    const bool split = ctx.item.partial_row >= 0;
    const int token = row_token(ctx, r);
    const int head = row_head(ctx, r);
    int col0 = 0;  // kPaired: the row's half of the D columns, and its head's v scale
    if constexpr (kPaired) {
      out_scale = inv * (p.v_scale_per_head != nullptr ? p.v_scale_per_head[head / p.group_size] : p.v_scale);
      col0 = ((ctx.item.row_start + r) % ctx.group_size) / p.group_size * (D / 2);
    }
    for (int c = threadIdx.x & 7; c < p.head_size_v / 8; c += 8) {
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float* src = merge_o + (w * kDecodeRows + r) * Tr::kMergeRowStride + col0 + c * 8;
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
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = acc[i] * out_scale;
        store_output8<T>(p.output, token * p.o_token_stride + head * p.o_head_stride + c * 8, v,
                         p.output_scale != nullptr, output_quant_factor(p.output_scale));
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
