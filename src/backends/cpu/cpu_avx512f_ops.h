// AVX-512 F/BW/DQ/VL f32 vector operations of the CPU backend (16 lanes, no BF16 instruction):
// Vec512 for the tile algorithm of cpu_attention_tile.h (F32Ops<Vec512>). Shared by every
// translation unit compiled with the AVX-512 flags (cpu_kernels_avx512f.cpp; and through
// cpu_avx512_ops.h, cpu_kernels_avx512.cpp and cpu_kernels_amx.cpp, see module.cmake).
// Internal linkage only (see cpu_kernels.h).
#pragma once

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
      defined(__AVX512VL__))
#error "cpu_avx512f_ops.h needs the AVX-512 F/BW/DQ/VL flags of module.cmake"
#endif

#include <immintrin.h>

#include "cpu_f32_ops.h"

// GCC 12's avx512fintrin.h starts unpack / shuffle / permute / min / max from `__m512 __Y = __Y`
// (undefined); once those are inlined into a header's templates it reports a false
// -Wuninitialized there. The AVX-512 decode kernel headers open their code with
// PAGEDATTN_AVX512_HEADER_BEGIN and close it with PAGEDATTN_AVX512_HEADER_END.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#define PAGEDATTN_AVX512_HEADER_BEGIN \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define PAGEDATTN_AVX512_HEADER_END _Pragma("GCC diagnostic pop")
#else
#define PAGEDATTN_AVX512_HEADER_BEGIN
#define PAGEDATTN_AVX512_HEADER_END
#endif

namespace pagedattn::cpu {
namespace {

struct Vec512 {
  using V = __m512;
  using M = __mmask16;
  static constexpr int W = 16;
  static constexpr int kMR = 6;  // rows per register block
  static constexpr int kNC = 4;  // vectors per register block (64 keys / 64 dims)

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V abs(V a) { return _mm512_abs_ps(a); }
  static V iota() {
    return _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                          14.f, 15.f);
  }
  static M ge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M and_mask(M a, M b) { return static_cast<M>(a & b); }
  static V select(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }

  // e^x, |relative error| ~ 1-2 ulp (Cephes expf polynomial); x = -inf gives 0, NaN gives NaN
  // (the clamps take x as their second operand, which max/min return when either is NaN).
  // x <= -104 gives exactly 0 (p ~ 0.97 times 2^-150 rounds to 0): the softmax relies on it
  // for masked logits (kExpOfNegInfIsZero: P = 0 exactly there, no select needed).
  static constexpr bool kExpOfNegInfIsZero = true;
  static V exp(V x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
    x = _mm512_min_ps(_mm512_set1_ps(88.72283935f), x);
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    V p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
  }

  // 16 elements of dtype DT starting at element `index` of `src`, as f32 (exact).
  template <DType DT>
  static V load_f32(const char* src, int index) {
    if constexpr (DT == DType::f32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(src) + index);
    } else if constexpr (DT == DType::f16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * index)));
    } else if constexpr (DT == DType::bf16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * index));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else if constexpr (DT == DType::fp8_e4m3) {
      // e4m3 -> f16 bit pattern (sign, then exponent/mantissa shifted into place) scaled by 2^8:
      // exact for normals and subnormals; S.1111.111 is NaN.
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + index)));
      const __m256i magnitude = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
      const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                        _mm256_slli_epi16(magnitude, 7));
      const V f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
      const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
      return _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(__builtin_nanf("")));
    } else {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + index)));
      return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    }
  }

  // dst[c * dst_stride + i] = rows[i][c] for 16 rows and ncols 32-bit columns (ncols % 8 == 0).
  static void transpose16(uint32_t* dst, int dst_stride, const char* const rows[16], int ncols) {
    for (int c0 = 0; c0 < ncols; c0 += 16) {
      const bool half = ncols - c0 < 16;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const char* p = rows[i] + 4 * c0;
        r[i] = half ? _mm512_maskz_loadu_epi32(0x00FF, p) : _mm512_loadu_si512(p);
      }
      __m512i t[16];
      for (int a = 0; a < 8; ++a) {
        t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
        t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
      }
      __m512i u[16];
      for (int b = 0; b < 4; ++b) {
        u[4 * b] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
        u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
        u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
        u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
      }
      // u[4b + k], lane L = column 4L + k of rows 4b..4b+3: transpose the 128-bit lanes.
      for (int k = 0; k < 4; ++k) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
        const __m512i col[4] = {_mm512_shuffle_i32x4(v0, v2, 0x88), _mm512_shuffle_i32x4(v1, v3, 0x88),
                                _mm512_shuffle_i32x4(v0, v2, 0xDD), _mm512_shuffle_i32x4(v1, v3, 0xDD)};
        for (int lane = 0; lane < 4; ++lane) {
          const int column = c0 + 4 * lane + k;
          if (column < ncols) {
            _mm512_storeu_si512(dst + static_cast<size_t>(column) * dst_stride, col[lane]);
          }
        }
      }
    }
  }
};

}  // namespace
}  // namespace pagedattn::cpu
