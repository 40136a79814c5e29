// The fp8 operand path of the warp-specialized kernel (paged_attention_ws.cuh, kFp8): both
// products run on the tensor core's 8-bit wgmma (k32, twice the 16-bit rate) on the cache bytes as
// they are, instead of widening K and V to 16 bits. The cache is e4m3 or e5m2 (kE5m2): the wgmma
// takes e4m3 A (Q, P, quantised here) times B in the cache's format; nothing else differs.
//
// What changes against the 16-bit path:
//   Q      copied in 16 bits as before; each consumer thread quantises its two rows to e4m3
//          once per item (ws_q_fragments_e4m3), each row with its own scale (amax / 448): no row
//          saturates, and the scale returns through the softmax's per-row factor; the consumer
//          stores them into its own e4m3 Q tile (ws_store_q_e4m3), and the 16-bit Q buffer is
//          free again for the next item. A pre-quantized e4m3 query (p.query_fp8) is copied as
//          its bytes (ws_load_q<D, 1>) and taken as they are (ws_q8_words): row scale 1, no amax, no
//          conversion; q_scale rides in the logit scale;
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
// Its inverse: the V^T column of key k (0..15) of a group.
constexpr int ws_v_col(int k) { return 4 * ((k & 7) >> 1) + 2 * (k >> 3) + (k & 1); }
constexpr bool ws_v_col_inverts_key() {
  for (int k = 0; k < 16; ++k)
    if (ws_v_key(ws_v_col(k)) != k) return false;
  return true;
}
static_assert(ws_v_col_inverts_key());

// Byte offset of 16-byte chunk `chunk` (0 .. D / 16 - 1) of key row `row` in a V staging slot:
// the K tile's layout (column blocks of kKeys rows x 128 bytes, 128-byte swizzle) with the swizzle
// also flipped on bit 4 of the row, so that the transpose's reads of rows 16 g + 2 q (+ 0, 1, 8, 9)
// by a quarter warp fall on 8 distinct chunks.
template <int kKeys>
__device__ __forceinline__ int ws_staging_offset(int row, int chunk) {
  return (chunk >> 3) * (kKeys * 128) + row * 128 + (((chunk & 7) ^ (row & 7) ^ ((row >> 4) & 1)) << 4);
}

// Byte offset of the 4 bytes at column 16 g + 4 q of row n of a V^T tile (rows of kKeys bytes,
// 128-byte swizzle for 128 keys, 64-byte swizzle for 64: the wgmma layouts of a K-major operand).
template <int kKeys>
__device__ __forceinline__ int ws_vt_offset(int n, int g, int q) {
  if constexpr (kKeys == 128) {
    return n * 128 + ((g ^ (n & 7)) << 4) + 4 * q;
  } else {
    static_assert(kKeys == 64);
    return n * 64 + ((g ^ ((n >> 1) & 3)) << 4) + 4 * q;
  }
}

// Consumer: this thread's Q rows r = row, row + 8 of its warpgroup's 64-row tile (16-bit, swizzled
// column blocks of 64 rows x 128 bytes) quantised to e4m3 and stored into the consumer's e4m3 Q
// tile (64 rows x D bytes, column blocks of 64 rows x 128 bytes, 128-byte swizzle: the A operand
// of S = Q8 . K8^T, issue_scores_with). Each row's scale (amax / 448, reduced over the quad that
// holds the row) goes to scale[e]: no row saturates, and the softmax multiplies it back through
// its per-row factor. A thread handles columns 16 j + 4 q .. + 3 (q = lane % 4) of its rows: two
// passes over the 16-bit tile (the amax, then the conversion), no register arrays; a warp's
// stores cover 8 rows x 128 bytes, no bank conflicts. q_tile and q8_tile may be the same rows
// (callers order it).
__device__ __forceinline__ const char* ws_q_src(const char* q_tile, int row, int col) {
  return q_tile + (col >> 6) * (64 * 128) + swizzled_offset<64>(row, (col & 63) >> 3) + (col & 7) * 2;
}
template <int D, typename T>
__device__ __forceinline__ void ws_q_amax_e4m3(const char* q_tile, int row, float (&scale)[2]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      const uint2 w = *reinterpret_cast<const uint2*>(ws_q_src(q_tile, row + 8 * e, 16 * j + 4 * q));
      const float2 lo = unpack_16bit_pair<T>(w.x), hi = unpack_16bit_pair<T>(w.y);
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(lo.x), fabsf(lo.y)), fmaxf(fabsf(hi.x), fabsf(hi.y))));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    scale[e] = amax > 0.f ? amax / 448.f : 1.f;
  }
}
// Loads the thread's converted words into `words` (before any store: q8_tile may overlay q_tile).
template <int D, typename T>
__device__ __forceinline__ void ws_q_convert_e4m3(const char* q_tile, int row, const float (&scale)[2],
                                                  uint32_t (&words)[2][D / 16]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float inv = 1.f / scale[e];
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      const uint2 w = *reinterpret_cast<const uint2*>(ws_q_src(q_tile, row + 8 * e, 16 * j + 4 * q));
      const float2 lo = unpack_16bit_pair<T>(w.x), hi = unpack_16bit_pair<T>(w.y);
      words[e][j] = pack_e4m3x4(lo.x * inv, lo.y * inv, hi.x * inv, hi.y * inv);
    }
  }
}
// An e4m3 query's words as ws_load_q<D, 1> placed them (what ws_q_convert_e4m3 computes for a 16-bit
// one): word q of 16-byte chunk j holds elements 16 j + 4 q .. + 3.
template <int D>
__device__ __forceinline__ void ws_q8_words(const char* q_tile, int row, uint32_t (&words)[2][D / 16]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      words[e][j] = *reinterpret_cast<const uint32_t*>(q_tile + swizzled_offset<64>(row + 8 * e, j) + 4 * q);
    }
}
template <int D>
__device__ __forceinline__ void ws_q_store_e4m3(char* q8_tile, int row, const uint32_t (&words)[2][D / 16]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      *reinterpret_cast<uint32_t*>(q8_tile + (j >> 3) * (64 * 128) + swizzled_offset<64>(row + 8 * e, j & 7) + 4 * q) =
          words[e][j];
    }
}

// Producer: the V rows of a tile (a staging slot, ws_staging_offset) written transposed into the
// stage's V^T tile: row n = head dim n, kKeys bytes of keys (ws_vt_offset), key 16 g +
// ws_v_key(p) at column 16 g + p. A task: key group g, the keys 16 g + 2 q + {0, 1, 8, 9}, 16 dims
// 16 c ..: four 16-byte reads, a 4 x 4 byte transpose per 4 dims (8 byte permutes), 16 4-byte
// writes at column 16 g + 4 q. kKeys / 16 x D / 16 x 4 tasks, 2 a thread: lane = 4 g + q (128 keys;
// 64 keys: lane = 16 h + 4 g + q, a warp taking 2 chunks c an instruction). Reads conflict-free;
// writes conflict-free at 128 keys (a warp's writes cover one 128-byte row), 2-way at 64.
template <int D, int kKeys>
__device__ __forceinline__ void ws_transpose_v(const char* staging, char* vt, int pt) {
  constexpr int kGroups = kKeys / 16;          // key groups a lane index covers
  constexpr int kChunkLanes = 32 / (4 * kGroups);  // dims chunks a warp instruction covers
  static_assert((kKeys / 16) * (D / 16) * 4 == 2 * 128, "2 tasks a producer thread");
  const int lane = pt & 31;
  const int q = lane & 3;
  const int g = (lane >> 2) & (kGroups - 1);
  const int h = lane / (4 * kGroups);
#pragma unroll
  for (int task = 0; task < 2; ++task) {
    const int c = ((pt >> 5) * 2 + task) * kChunkLanes + h;  // 16 dims 16 c ..
    uint4 r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int key = 16 * g + 2 * q + (j & 1) + 8 * (j >> 1);
      r[j] = *reinterpret_cast<const uint4*>(staging + ws_staging_offset<kKeys>(key, c));
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
        *reinterpret_cast<uint32_t*>(vt + ws_vt_offset<kKeys>(16 * c + 4 * w + b4, g, q)) = out[b4];
      }
    }
  }
}

// O (64 x D) += P8 (64 x 32 KS keys, registers) . V8 (V^T tile, K-major, ws_vt_offset), issued:
// step ks moves 32 keys (32 bytes of each V^T row). Ops: wgmma::OpsFp8 of the cache's format.
template <int D, class Ops, int KS, typename Desc>
__device__ __forceinline__ void issue_pv_fp8(float (&o)[D / 8][4], const uint32_t (&pa)[KS][4], Desc vt_desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) Ops::template rs<D>(o, pa[ks], wgmma::desc_at(vt_desc, ks * 32));
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
