// AVX2 vector operations of the CPU backend (8 f32 lanes), shared by the AVX2 translation unit's
// kernels: the tile algorithm (cpu_attention_tile.h, F32Ops<Vec256>) and the direct decode kernel
// (cpu_decode_avx2.h). Internal linkage only (see cpu_kernels.h): include this header from the
// AVX2 translation unit only (compiled with -mavx2 -mfma -mf16c, see module.cmake).
#pragma once

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "cpu_avx2_ops.h needs the AVX2 / FMA / F16C flags of module.cmake"
#endif

#include <immintrin.h>

#include "cpu_f32_ops.h"

namespace pagedattn::cpu {
namespace {

struct Vec256 {
  using V = __m256;
  using M = __m256;  // all-ones lanes = true
  static constexpr int W = 8;
  static constexpr int kMR = 6;
  static constexpr int kNC = 2;

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static V iota() { return _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f); }
  static M ge(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  static M lt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M and_mask(M a, M b) { return _mm256_and_ps(a, b); }
  static V select(M m, V a, V b) { return _mm256_blendv_ps(b, a, m); }
  static float hmax(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static float hsum(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }

  // e^x (Cephes expf polynomial, ~1-2 ulp). Inputs below -87.3 give 2^-126-ish tiny values, not
  // 0: callers mask dead lanes explicitly. NaN gives NaN (the clamps take x as their second
  // operand, which max/min return when either is NaN).
  static V exp(V x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
    const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    V p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i pow2 = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
  }

  template <DType DT>
  static V load_f32(const char* src, int index) {
    if constexpr (DT == DType::f32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(src) + index);
    } else if constexpr (DT == DType::f16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * index)));
    } else if constexpr (DT == DType::bf16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * index));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if constexpr (DT == DType::fp8_e4m3) {
      const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + index)));
      const __m128i magnitude = _mm_and_si128(w, _mm_set1_epi16(0x7F));
      const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                     _mm_slli_epi16(magnitude, 7));
      const V f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
      const __m256i nan16 = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F)));
      return _mm256_blendv_ps(f, _mm256_set1_ps(__builtin_nanf("")), _mm256_castsi256_ps(nan16));
    } else {
      const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + index)));
      return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
    }
  }

  // dst[c * dst_stride + i] = rows[i][c], 16 rows, ncols % 8 == 0 (8x8 transposes).
  static void transpose16(uint32_t* dst, int dst_stride, const char* const rows[16], int ncols) {
    for (int half = 0; half < 2; ++half) {
      for (int c0 = 0; c0 < ncols; c0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(rows[8 * half + i] + 4 * c0));
        }
        __m256 t[8];
        for (int a = 0; a < 4; ++a) {
          t[2 * a] = _mm256_unpacklo_ps(r[2 * a], r[2 * a + 1]);
          t[2 * a + 1] = _mm256_unpackhi_ps(r[2 * a], r[2 * a + 1]);
        }
        __m256 tt[8];
        for (int b = 0; b < 2; ++b) {
          tt[4 * b] = _mm256_shuffle_ps(t[4 * b], t[4 * b + 2], 0x44);
          tt[4 * b + 1] = _mm256_shuffle_ps(t[4 * b], t[4 * b + 2], 0xEE);
          tt[4 * b + 2] = _mm256_shuffle_ps(t[4 * b + 1], t[4 * b + 3], 0x44);
          tt[4 * b + 3] = _mm256_shuffle_ps(t[4 * b + 1], t[4 * b + 3], 0xEE);
        }
        float* out = reinterpret_cast<float*>(dst) + 8 * half;
        for (int k = 0; k < 4; ++k) {
          _mm256_storeu_ps(out + static_cast<size_t>(c0 + k) * dst_stride,
                           _mm256_permute2f128_ps(tt[k], tt[4 + k], 0x20));
          _mm256_storeu_ps(out + static_cast<size_t>(c0 + 4 + k) * dst_stride,
                           _mm256_permute2f128_ps(tt[k], tt[4 + k], 0x31));
        }
      }
    }
  }
};

}  // namespace
}  // namespace pagedattn::cpu
