// The fp8 e4m3 operand path of the warp-specialized kernel (paged_attention_ws.cuh, kFp8): both
// products run on the tensor core's 8-bit wgmma (k32, twice the 16-bit rate) on the cache bytes as
// they are, instead of widening K and V to 16 bits.
//
// What changes against the 16-bit path:
//   Q      copied in 16 bits as before; each consumer thread quantises its two rows to e4m3
//          once per item (ws_q_fragments_e4m3), each row with its own scale (amax / 448): no row
//          saturates, and the scale returns through the softmax's per-row factor; the consumer
//          stores them into its own e4m3 Q tile (ws_store_q_e4m3), and the 16-bit Q buffer is
//          free again for the next item;
//   K      copied as it is (rows of D bytes, the 16-bit K tile's layout at half the width);
//   V      wgmma has no transposed 8-bit B operand, so the producer copies V rows into a staging
//          ring along with K and, kVLag tiles later (the copies of the tiles between in flight),
//          writes them transposed (rows of kKeys keys per head dim, V^T) into the stage, with the
//          keys of each group of 16 in the order of the P fragment below;
//   P      the softmax's f32 scores packed straight into e4m3 A fragments: a thread's accumulator
//          columns of one 16-key half are 2q, 2q+1, 2q+8, 2q+9 (q = lane % 4), the fragment's
//          are 4q..4q+3, so fragment column 4q + i multiplies V^T column perm(4q + i) (ws_v_key).
// Scales: S = q_row_scale * k_scale * (Q8 . K8) (the per-row factor of the online softmax);
// O = v_scale * (P8 . V8) / l, l summed from the f32 P.
// Traffic per tile (D = 128, 128 keys): 16 KB of K and 16 KB of V copied, the V transpose reads
// the staging slot once and writes V^T once (16 KB each, conflict-free: ws_transpose_v).
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

// Consumer: this thread's Q rows r, r + 8 (row, row + 8 of its warpgroup's 64-row tile, 16-bit,
// swizzled column blocks of 64 rows x 128 bytes) quantised to e4m3 as the register A fragments of
// S = Q8 . K8^T: fragment ks, register 2 h + e holds row r + 8 e, columns 32 ks + 16 h + 4 q .. + 3
// (q = lane % 4). Each row's scale (amax / 448, reduced over the quad that holds the row) goes to
// scale[e]: no row saturates, and the softmax multiplies it back through its per-row factor.
template <int D, typename T>
__device__ __forceinline__ void ws_q_fragments_e4m3(const char* q_tile, int row, uint32_t (&qa)[D / 32][4],
                                                    float (&scale)[2]) {
  const int q = threadIdx.x & 3;
  float v[2][D / 32][2][4];
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 32 * ks + 16 * h + 4 * q;  // 4 elements: 8 bytes inside a 16-byte chunk
        const char* src = q_tile + (col >> 6) * (64 * 128) + swizzled_offset<64>(row + 8 * e, (col & 63) >> 3) +
                          (col & 7) * 2;
        const uint2 w = *reinterpret_cast<const uint2*>(src);
        const float2 lo = unpack_16bit_pair<T>(w.x), hi = unpack_16bit_pair<T>(w.y);
        v[e][ks][h][0] = lo.x;
        v[e][ks][h][1] = lo.y;
        v[e][ks][h][2] = hi.x;
        v[e][ks][h][3] = hi.y;
        amax[e] = fmaxf(amax[e], fmaxf(fmaxf(fabsf(lo.x), fabsf(lo.y)), fmaxf(fabsf(hi.x), fabsf(hi.y))));
      }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    amax[e] = fmaxf(amax[e], __shfl_xor_sync(0xffffffffu, amax[e], 1));
    amax[e] = fmaxf(amax[e], __shfl_xor_sync(0xffffffffu, amax[e], 2));
    const float inv = amax[e] > 0.f ? 448.f / amax[e] : 1.f;
    scale[e] = amax[e] > 0.f ? amax[e] / 448.f : 1.f;
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float(&x)[4] = v[e][ks][h];
        qa[ks][2 * h + e] = pack_e4m3x4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
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

// Consumer: the Q fragments of this thread (ws_q_fragments_e4m3) stored into the consumer's e4m3
// Q tile (64 rows x D bytes, 128-byte swizzled, the A operand of issue_scores_e4m3): row r + 8 e,
// bytes 32 ks + 16 h + 4 q; a warp's stores cover 8 rows x 128 bytes, no bank conflicts.
template <int D>
__device__ __forceinline__ void ws_store_q_e4m3(char* q8_tile, int row, const uint32_t (&qa)[D / 32][4]) {
  static_assert(D == 128, "one 128-byte column block a row");
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        *reinterpret_cast<uint32_t*>(q8_tile + swizzled_offset<64>(row + 8 * e, 2 * ks + h) + 4 * q) = qa[ks][2 * h + e];
      }
}

// S (64 x NK) = Q8 . K8^T for one consumer's 64 rows, both operands in shared memory (K-major),
// issued (not waited for): D / 32 k32 steps of 32 bytes inside 128-byte rows.
template <int D, int NK, typename Desc>
__device__ __forceinline__ void issue_scores_e4m3(float (&s)[NK / 8][4], Desc q_desc, Desc k_desc) {
  static_assert(NK == 128 && D == 128, "one 128-byte column block a row");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) {
    wgmma::OpsE4m3::ss_n128(s, wgmma::desc_at(q_desc, kk * 32), wgmma::desc_at(k_desc, kk * 32), kk > 0 ? 1 : 0);
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
