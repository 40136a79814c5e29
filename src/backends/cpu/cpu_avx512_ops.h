// AVX-512 vector operations and the bf16 (vdpbf16ps) tile operations of the CPU backend, shared
// by the translation units compiled with the AVX-512 flags (cpu_kernels_avx512.cpp and
// cpu_kernels_amx.cpp, see module.cmake). Internal linkage only (see cpu_kernels.h for why):
// include this header from AVX-512 translation units only.
//
//   Vec512   f32 vector ops for cpu_attention_tile.h (16 lanes; exp, transpose, conversions).
//   Bf16Ops  (bf16 activations, fp8 caches): Q·Kᵀ and P·V with vdpbf16ps, f32 accumulation.
//            K pack [D/2][64] dwords, each = (k[j][2p], k[j][2p+1]) -> one zmm = 16 keys of one
//            d pair; Q·Kᵀ microkernel 6 rows x 64 keys = 24 zmm accumulators, per d pair 4 K
//            loads + 6 dword broadcasts of Q + 24 vdpbf16ps (64 FLOP each).
//            V pack [32][Dv] dwords, each = (v[2p][d], v[2p+1][d]) (key pairs, built with
//            vpermt2w); P·V microkernel 6 rows x 64 dims = 24 accumulators, per key pair 4 V
//            loads + 6 broadcasts of P pairs + 24 vdpbf16ps.
//            Both packs are also the VNNI layouts AMX's tdpbf16ps reads as its B operand
//            (cpu_kernels_amx.cpp).
// Precision: see cpu_attention_tile.h; bf16 rounding of f32/f16 operands uses vcvtne2ps2bf16
// (round to nearest even; f32 denormals flush to zero, far below every tolerance).
#pragma once

#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
#error "cpu_avx512_ops.h needs the AVX-512 F/BW/DQ/VL/BF16 flags of module.cmake"
#endif

#include <immintrin.h>

#include "cpu_attention_tile.h"

namespace pagedattn::cpu {
namespace {

inline __m512i broadcast_dword(const void* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

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

  // e^x, |relative error| ~ 1-2 ulp (Cephes expf polynomial); x = -inf gives 0.
  static V exp(V x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.72283935f));
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

// ---- bf16 pairs + vdpbf16ps -----------------------------------------------------------------
struct Bf16Ops {
  using Vec = Vec512;
  using V = __m512;

  template <DType DT>
  static void convert_row(uint16_t* dst, const char* src, int n) {
    if constexpr (DT == DType::bf16) {
      std::memcpy(dst, src, static_cast<size_t>(n) * 2);
    } else {
      int d = 0;
      for (; d + 32 <= n; d += 32) {
        const __m512bh h = _mm512_cvtne2ps_pbh(Vec512::load_f32<DT>(src, d + 16),
                                               Vec512::load_f32<DT>(src, d));
        _mm512_storeu_si512(dst + d, reinterpret_cast<const __m512i&>(h));
      }
      if (d < n) {  // n % 32 == 16
        const __m256bh h = _mm512_cvtneps_pbh(Vec512::load_f32<DT>(src, d));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<const __m256i&>(h));
      }
    }
  }

  static void convert_row_any(uint16_t* dst, const char* src, DType dtype, int n) {
    switch (dtype) {
      case DType::f32: convert_row<DType::f32>(dst, src, n); break;
      case DType::f16: convert_row<DType::f16>(dst, src, n); break;
      case DType::bf16: convert_row<DType::bf16>(dst, src, n); break;
      case DType::fp8_e4m3: convert_row<DType::fp8_e4m3>(dst, src, n); break;
      default: convert_row<DType::fp8_e5m2>(dst, src, n); break;
    }
  }

  static void pack_q_row(void* q, int row, const char* src, DType dtype, int head_size) {
    convert_row_any(static_cast<uint16_t*>(q) + static_cast<size_t>(row) * head_size, src, dtype,
                    head_size);
  }

  // Rows as bf16: the source rows themselves for a bf16 cache, else converted into temp.
  static void bf16_rows(const char* const rows[16], DType dtype, int n, float* temp,
                        const char* out[16]) {
    for (int i = 0; i < 16; ++i) {
      if (dtype == DType::bf16 || rows[i] == reinterpret_cast<const char*>(kZeroRow)) {
        out[i] = rows[i];
      } else {
        uint16_t* dst = reinterpret_cast<uint16_t*>(temp) + static_cast<size_t>(i) * n;
        convert_row_any(dst, rows[i], dtype, n);
        out[i] = reinterpret_cast<const char*>(dst);
      }
    }
  }

  // K pack [D/2][64] dwords: kp[p][j] = (k[j][2p], k[j][2p+1]).
  static void pack_k_chunk(void* k, int j0, const char* const rows[16], DType dtype, int head_size,
                           float* temp) {
    const char* src[16];
    bf16_rows(rows, dtype, head_size, temp, src);
    Vec512::transpose16(static_cast<uint32_t*>(k) + j0, kKeyTile, src, head_size / 2);
  }

  // V pack [32][Dv] dwords: vp[p][d] = (v[2p][d], v[2p+1][d]).
  static void pack_v_chunk(void* v, int j0, const char* const rows[16], DType dtype,
                           int head_size_v, float* temp) {
    const char* src[16];
    bf16_rows(rows, dtype, head_size_v, temp, src);
    // vpermt2w indices: word 2i <- a[i], word 2i+1 <- b[i] (b's words are indices 32..63).
    alignas(64) static const uint16_t kInterleaveLo[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t kInterleaveHi[32] = {
        16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i idx_lo = _mm512_load_si512(kInterleaveLo);
    const __m512i idx_hi = _mm512_load_si512(kInterleaveHi);
    for (int pair = 0; pair < 8; ++pair) {
      const char* a = src[2 * pair];
      const char* b = src[2 * pair + 1];
      uint16_t* dst = static_cast<uint16_t*>(v) +
                      2 * static_cast<size_t>(j0 / 2 + pair) * head_size_v;
      int d = 0;
      for (; d + 32 <= head_size_v; d += 32) {
        const __m512i va = _mm512_loadu_si512(a + 2 * d);
        const __m512i vb = _mm512_loadu_si512(b + 2 * d);
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(va, idx_lo, vb));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(va, idx_hi, vb));
      }
      if (d < head_size_v) {  // 16 dims left
        const __m512i va = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2 * d)));
        const __m512i vb = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * d)));
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(va, idx_lo, vb));
      }
    }
  }

  // P rounded to bf16 (round to nearest even); returns the rounded values as f32.
  static V store_p(void* p, int row, int j, V e) {
    const __m256bh h = _mm512_cvtneps_pbh(e);
    const __m256i bits = reinterpret_cast<const __m256i&>(h);
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + static_cast<size_t>(row) * kKeyTile + j),
        bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }

  static void zero_p_row(void* p, int row) {
    std::memset(static_cast<uint16_t*>(p) + static_cast<size_t>(row) * kKeyTile, 0, kKeyTile * 2);
  }

  // S (MR rows x 64 keys) = Q · Kᵀ; q rows of D/2 dwords.
  template <int MR>
  static void qk_block(float* s, const uint16_t* q, int head_size, const uint32_t* kp) {
    V acc[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    const int pairs = head_size / 2;
    for (int dp = 0; dp < pairs; ++dp) {
      __m512bh kv[4];
      for (int c = 0; c < 4; ++c) {
        const __m512i k = _mm512_loadu_si512(kp + static_cast<size_t>(dp) * kKeyTile + 16 * c);
        kv[c] = reinterpret_cast<const __m512bh&>(k);
      }
      for (int i = 0; i < MR; ++i) {
        const __m512i qb = broadcast_dword(q + static_cast<size_t>(i) * head_size + 2 * dp);
        const __m512bh qh = reinterpret_cast<const __m512bh&>(qb);
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qh, kv[c]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + static_cast<size_t>(i) * kKeyTile + 16 * c, acc[i][c]);
  }

  static void qk(float* s, const void* q_tile, const void* k, int r0, int r1, int head_size) {
    const uint16_t* q = static_cast<const uint16_t*>(q_tile);
    const uint32_t* kp = static_cast<const uint32_t*>(k);
    int i = r0;
    for (; i + 6 <= r1; i += 6) {
      qk_block<6>(s + static_cast<size_t>(i) * kKeyTile, q + static_cast<size_t>(i) * head_size,
                  head_size, kp);
    }
    with_static_int<5>(r1 - i, [&](auto mr) {
      qk_block<decltype(mr)::value>(s + static_cast<size_t>(i) * kKeyTile,
                                    q + static_cast<size_t>(i) * head_size, head_size, kp);
    });
  }

  // O[i][d0 .. d0 + 16*NV) = alpha_i * O + P[i] · V for MR rows.
  template <int MR, int NV>
  static void pv_block(float* o, int head_size_v, const uint16_t* p, const uint16_t* vp,
                       const float* alpha, int d0) {
    V acc[MR][NV];
    for (int i = 0; i < MR; ++i) {
      const V va = _mm512_set1_ps(alpha[i]);
      for (int c = 0; c < NV; ++c)
        acc[i][c] = _mm512_mul_ps(va, _mm512_loadu_ps(o + static_cast<size_t>(i) * head_size_v + d0 + 16 * c));
    }
    for (int kp = 0; kp < kKeyTile / 2; ++kp) {
      __m512bh vv[NV];
      for (int c = 0; c < NV; ++c) {
        const __m512i x = _mm512_loadu_si512(vp + 2 * (static_cast<size_t>(kp) * head_size_v + d0 + 16 * c));
        vv[c] = reinterpret_cast<const __m512bh&>(x);
      }
      for (int i = 0; i < MR; ++i) {
        const __m512i pb = broadcast_dword(p + static_cast<size_t>(i) * kKeyTile + 2 * kp);
        const __m512bh ph = reinterpret_cast<const __m512bh&>(pb);
        for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], ph, vv[c]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < NV; ++c)
        _mm512_storeu_ps(o + static_cast<size_t>(i) * head_size_v + d0 + 16 * c, acc[i][c]);
  }

  template <int NV>
  static void pv_columns(float* o, const uint16_t* p, const uint16_t* vp, const float* alpha,
                         int r0, int r1, int head_size_v, int d0) {
    int i = r0;
    for (; i + 6 <= r1; i += 6) {
      pv_block<6, NV>(o + static_cast<size_t>(i) * head_size_v, head_size_v,
                      p + static_cast<size_t>(i) * kKeyTile, vp, alpha + i, d0);
    }
    with_static_int<5>(r1 - i, [&](auto mr) {
      pv_block<decltype(mr)::value, NV>(o + static_cast<size_t>(i) * head_size_v, head_size_v,
                                        p + static_cast<size_t>(i) * kKeyTile, vp, alpha + i, d0);
    });
  }

  static void pv(float* o, const void* p_tile, const void* v_tile, const float* alpha, int r0,
                 int r1, int head_size_v) {
    const uint16_t* p = static_cast<const uint16_t*>(p_tile);
    const uint16_t* vp = static_cast<const uint16_t*>(v_tile);
    const int vectors = head_size_v / 16;
    int c = 0;
    for (; c + 4 <= vectors; c += 4) pv_columns<4>(o, p, vp, alpha, r0, r1, head_size_v, 16 * c);
    with_static_int<3>(vectors - c, [&](auto nv) {
      pv_columns<decltype(nv)::value>(o, p, vp, alpha, r0, r1, head_size_v, 16 * c);
    });
  }
};

}  // namespace
}  // namespace pagedattn::cpu
