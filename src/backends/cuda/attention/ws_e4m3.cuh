// The fp8 e4m3 operand path of the warp-specialized kernel (paged_attention_ws.cuh, kFp8): both
// products run on the tensor core's 8-bit wgmma (k32, twice the 16-bit rate) on the cache bytes as
// they are, instead of widening K and V to 16 bits.
//
// What changes against the 16-bit path:
//   Q      the producer quantises each packed query row to e4m3 with its own scale
//          (amax / 448, stored beside the Q buffer): no row saturates, and the scale returns in
//          the softmax's per-row factor (exact: a power-free f32 multiply of the f32 dot product);
//   K      copied as it is (rows of D bytes, the 16-bit K tile's layout at half the width);
//   V      wgmma has no transposed 8-bit B operand, so the producer copies V rows into a staging
//          buffer and writes them transposed (rows of kKeys keys per head dim, V^T) into the
//          stage, with the keys of each group of 16 in the order of the P fragment below;
//   P      the softmax's f32 scores packed straight into e4m3 A fragments: a thread's accumulator
//          columns of one 16-key half are 2q, 2q+1, 2q+8, 2q+9 (q = lane % 4), the fragment's
//          are 4q..4q+3, so fragment column 4q + i multiplies V^T column perm(4q + i) (ws_v_key).
// Scales: S = q_row_scale * k_scale * (Q8 . K8) (the per-row factor of the online softmax);
// O = v_scale * (P8 . V8) / l, l summed from the f32 P.
// Traffic per tile (D = 128, 128 keys): 16 KB of K and 16 KB of V copied, the V transpose reads
// the staging buffer once and writes V^T once (16 KB each, conflict-free: ws_transpose_v).
// Precision: Q, P rounded to e4m3 (3 mantissa bits) besides the cache's own rounding; f32 logits,
// softmax state and O; output rounded once.
#pragma once

#include "backends/cuda/attention/paged_attention_common.cuh"
#include "backends/cuda/common/async_primitives.cuh"

namespace pagedattn::cuda {

// Four floats -> four e4m3 bytes (a in the lowest byte), rounded to nearest, saturating.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// A pair of 16-bit values (first in the low half) -> two floats.
template <typename T>
__device__ __forceinline__ float2 unpack_16bit_pair(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    return __half22float2(h);
  }
}

// Key of V^T column p (0..15) of a group of 16: the key whose P value the fragment holds there.
constexpr int ws_v_key(int p) { return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1); }

// Byte offset of 16-byte chunk `chunk` of key row `row` in the V staging buffer (rows of 128
// bytes). The swizzle also flips on bit 4 of the row, so that the transpose's reads of rows
// 16 g + 2 q (+ 0, 1, 8, 9) by a quarter warp fall on 8 distinct chunks.
__device__ __forceinline__ int ws_staging_offset(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7) ^ ((row >> 4) & 1)) << 4);
}

// Producer: one item's packed query rows quantised to e4m3 into a Q buffer (zero rows past the
// item), the row scales into q_scales. 8 threads a row (consecutive lanes): thread pt loads 16-byte
// chunks pt % 8 + 8 k of the row, the row's amax is reduced over the 8 lanes.
template <int D, int kRows, int kQTileBytes, typename T>
__device__ __forceinline__ void ws_load_q_e4m3(const AttentionKernelParams& p, const ItemContext& ctx, char* q_smem,
                                               float* q_scales, int pt) {
  static_assert(D == 128, "one 128-byte column block a row");
  constexpr int kLoads = D / 64;  // 16-byte loads (8 elements) a thread and row
  const int lc = pt & 7;
#pragma unroll 2
  for (int row = pt >> 3; row < kRows; row += 16) {
    const bool valid = row < ctx.item.num_rows;
    uint4 x[kLoads];
    const T* src = static_cast<const T*>(p.query);
    if (valid) src += row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      x[k] = valid ? __ldg(reinterpret_cast<const uint4*>(src + 8 * lc + 64 * k)) : make_uint4(0, 0, 0, 0);
    }
    float v[kLoads][8];
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const uint32_t w[4] = {x[k].x, x[k].y, x[k].z, x[k].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = unpack_16bit_pair<T>(w[j]);
        v[k][2 * j] = f.x;
        v[k][2 * j + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    const float inv = amax > 0.f ? 448.f / amax : 1.f;
    if (lc == 0) q_scales[row] = amax > 0.f ? amax / 448.f : 1.f;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int e0 = 8 * lc + 64 * k;  // first element = first byte of the e4m3 row
      const uint32_t lo = pack_e4m3x4(v[k][0] * inv, v[k][1] * inv, v[k][2] * inv, v[k][3] * inv);
      const uint32_t hi = pack_e4m3x4(v[k][4] * inv, v[k][5] * inv, v[k][6] * inv, v[k][7] * inv);
      char* dst = q_smem + (row >> 6) * kQTileBytes + swizzled_offset<64>(row & 63, e0 >> 4) + (e0 & 15);
      asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(smem_addr(dst)), "r"(lo), "r"(hi) : "memory");
    }
  }
}

// Producer: the V rows of a tile (staging, ws_staging_offset) written transposed into the stage's
// V^T tile: row n = head dim n, kKeys = 128 bytes of keys, 128-byte swizzled (the K-major B operand
// of P . V), key 16 g + ws_v_key(p) at column 16 g + p. Thread pt (lane = 4 g + q, warp w) takes
// key group g, the keys 16 g + 2 q + {0, 1, 8, 9}, and dims chunks 2 w, 2 w + 1: four 16-byte reads,
// a 4 x 4 byte transpose per 4 dims (8 byte permutes), 16 4-byte writes at column 16 g + 4 q, a
// warp's writes covering one 128-byte row: no bank conflicts either way.
__device__ __forceinline__ void ws_transpose_v(const char* staging, char* vt, int pt) {
  const int lane = pt & 31;
  const int q = lane & 3;
  const int g = lane >> 2;
#pragma unroll
  for (int task = 0; task < 2; ++task) {
    const int c = 2 * (pt >> 5) + task;  // 16 dims 16 c ..
    uint4 r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int key = 16 * g + 2 * q + (j & 1) + 8 * (j >> 1);
      r[j] = *reinterpret_cast<const uint4*>(staging + ws_staging_offset(key, c));
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t a = (&r[0].x)[w], b = (&r[1].x)[w], cc = (&r[2].x)[w], d = (&r[3].x)[w];
      const uint32_t t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(cc, d, 0x5140);
      const uint32_t t2 = __byte_perm(a, b, 0x7362), t3 = __byte_perm(cc, d, 0x7362);
      const uint32_t out[4] = {__byte_perm(t0, t1, 0x5410), __byte_perm(t0, t1, 0x7632), __byte_perm(t2, t3, 0x5410),
                               __byte_perm(t2, t3, 0x7632)};
#pragma unroll
      for (int b4 = 0; b4 < 4; ++b4) {
        const int n = 16 * c + 4 * w + b4;
        *reinterpret_cast<uint32_t*>(vt + n * 128 + ((g ^ (n & 7)) << 4) + 4 * q) = out[b4];
      }
    }
  }
}

// S (64 x NK) = Q8 . K8^T for one consumer's 64 rows, issued (not waited for): D / 32 k32 steps
// of 32 bytes inside 128-byte rows.
template <int D, int NK, typename Desc>
__device__ __forceinline__ void issue_scores_e4m3(float (&s)[NK / 8][4], Desc q_desc, Desc k_desc) {
  static_assert(NK == 128);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) {
    const uint32_t qs = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
    const uint32_t ks = (kk >> 2) * (NK * 128) + (kk & 3) * 32;
    wgmma::OpsE4m3::ss_n128(s, wgmma::desc_at(q_desc, qs), wgmma::desc_at(k_desc, ks), kk > 0 ? 1 : 0);
  }
  wgmma::commit();
#endif
}

// O (64 x D) += P8 (64 x 32 KS keys, registers) . V8 (V^T tile, K-major), issued: step ks moves 32
// keys (32 bytes of each V^T row).
template <int D, int KS, typename Desc>
__device__ __forceinline__ void issue_pv_e4m3(float (&o)[D / 8][4], const uint32_t (&pa)[KS][4], Desc vt_desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) wgmma::OpsE4m3::rs<D>(o, pa[ks], wgmma::desc_at(vt_desc, ks * 32));
  wgmma::commit();
#endif
}

// P (the softmax's f32 scores, n8 tiles 4 ks .. 4 ks + 3 for k32 step ks) packed as e4m3 A
// fragments: register 0 row r, 1 row r + 8 (tiles 4 ks, 4 ks + 1), registers 2, 3 the same of
// tiles 4 ks + 2, 4 ks + 3; the keys' order is the V^T tile's (ws_v_key).
template <int KS>
__device__ __forceinline__ void pack_p_e4m3(const float (&s)[4 * KS][4], uint32_t (&pa)[KS][4]) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float(&x)[4] = s[4 * ks + 2 * h];
      const float(&y)[4] = s[4 * ks + 2 * h + 1];
      pa[ks][2 * h] = pack_e4m3x4(x[0], x[1], y[0], y[1]);
      pa[ks][2 * h + 1] = pack_e4m3x4(x[2], x[3], y[2], y[3]);
    }
  }
}

}  // namespace pagedattn::cuda
