// What the AVX-512 direct decode kernels share (cpu_decode_avx512.h: bf16 dot products;
// cpu_decode_avx512_fma.h: f32 FMA): the order their 16-bit widening leaves O's dims in, the fold of a key pair's Q·Kᵀ partial sums, the chunk's 16
// logits from them, the prefetch pacing value and the online softmax of a chunk (16 keys, one
// zmm a row). AVX-512 F/BW/DQ/VL only (no BF16 instruction), so that every AVX-512 translation
// unit can include it. Internal linkage only (see cpu_kernels.h).
#pragma once

#include "cpu_avx512f_ops.h"
#include "cpu_decode_direct.h"

PAGEDATTN_AVX512_HEADER_BEGIN  // (cpu_avx512f_ops.h)

namespace pagedattn::cpu {
namespace {

// 0, computed from x (see zero_after_bits).
inline int64_t zero_after(__m512 x) {
  return zero_after_bits(_mm_cvtsi128_si32(_mm_castps_si128(_mm512_castps512_ps128(x))));
}

// Each 32-float group of src into dst: dst lanes 0-15 = permutex2var(lo_idx), 16-31 =
// permutex2var(hi_idx) of the group's two halves.
inline void direct_permute32(const float* src, float* dst, int n, __m512i lo_idx, __m512i hi_idx) {
  for (int g = 0; g < n; g += 32) {
    const __m512 x = _mm512_loadu_ps(src + g), y = _mm512_loadu_ps(src + g + 16);
    _mm512_storeu_ps(dst + g, _mm512_permutex2var_ps(x, lo_idx, y));
    _mm512_storeu_ps(dst + g + 16, _mm512_permutex2var_ps(x, hi_idx, y));
  }
}

// Dims of each 32-float group from the order of a vpunpck{l,h}wd pair of 32 16-bit values (lane
// 4k + j of the first 16: dim 8k + j; of the second 16: dim 8k + 4 + j) back to dimension order.
inline void direct_unpermute32(const float* src, float* dst, int n) {
  direct_permute32(src, dst, n, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                   _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31));
}

// Key pair tp (keys 2tp, 2tp + 1) of row r: a, b hold 16 partial sums each of the two dot
// products. Stored folded once into red (R x 8 x 16 f32): 128-bit lane k of the fold is
// [a(4k)+a(4k+2), b(4k)+b(4k+2), a(4k+1)+a(4k+3), b(..)].
inline void direct_fold_pair(float* red, int r, int tp, __m512 a, __m512 b) {
  _mm512_storeu_ps(red + (r * 8 + tp) * 16,
                   _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
}

// The 16 logits of row r (lane j = key j) from its 8 folded pairs: a 3-level transposed
// reduction (unpack pd, two shuffle_f32x4 levels).
inline __m512 direct_chunk_logits(const float* red, int r) {
  const float* x = red + r * 8 * 16;
  __m512 quad[4];  // 128-bit lane k: keys 4i .. 4i+3 (partial sums)
  for (int i = 0; i < 4; ++i) {
    const __m512d p0 = _mm512_castps_pd(_mm512_loadu_ps(x + (2 * i) * 16));
    const __m512d p1 = _mm512_castps_pd(_mm512_loadu_ps(x + (2 * i + 1) * 16));
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p0, p1)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p1)));
  }
  __m512 oct[2];  // 128-bit lanes: keys [8i, 8i+4) twice, then [8i+4, 8i+8) twice
  for (int i = 0; i < 2; ++i) {
    oct[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(oct[0], oct[1], 0x88),
                       _mm512_shuffle_f32x4(oct[0], oct[1], 0xDD));
}

// Online softmax of rows [row0, row0 + rows) over one chunk (logits[r] lane j = key t0 + j): P into
// the P scratch by store_p (row i's 16 values e; returns what l sums: the values as stored), m, l
// (lane sums) and alpha updated. Returns whether any row's O needs rescaling (alpha != 1).
// A template of the P form only: one copy for every register block shape.
// Common path (a row's running max already within kDirectRescaleSlack of every logit of the
// chunk): one compare instead of a horizontal max, alpha = 1.
template <class StoreP>
inline bool direct_softmax16(const ItemContext& c, float* lsum, int row0, int rows,
                             const __m512* logits, int t0, StoreP store_p) {
  const AttentionArgs& a = *c.args;
  const __m512i kpos =
      _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_epi32(t0));
  const __m512 vscale = _mm512_set1_ps(c.logit_scale);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const bool capped = a.soft_cap > 0.f;
  const bool alibi = a.alibi_slopes != nullptr;
  bool rescale = false;
  int lo = -1, hi = -1;  // the visible range `valid` was computed for (rows often share it)
  __mmask16 valid = 0;
  for (int r = 0; r < rows; ++r) {
    const int i = row0 + r;
    __m512 x = _mm512_mul_ps(logits[r], vscale);
    if (capped) {
      x = _mm512_mul_ps(_mm512_set1_ps(a.soft_cap),
                        vec_tanh<Vec512>(_mm512_mul_ps(x, _mm512_set1_ps(1.f / a.soft_cap))));
    }
    if (alibi) {
      const __m512 dist =
          _mm512_abs_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_set1_epi32(c.pos[i]), kpos)));
      x = _mm512_fnmadd_ps(_mm512_set1_ps(c.slope[i]), dist, x);
    }
    if (c.lo[i] != lo || c.hi[i] != hi) {
      lo = c.lo[i];
      hi = c.hi[i];
      valid = _mm512_cmpge_epi32_mask(kpos, _mm512_set1_epi32(lo)) &
              _mm512_cmplt_epi32_mask(kpos, _mm512_set1_epi32(hi));
    }
    x = _mm512_mask_mov_ps(neg_inf, valid, x);
    const bool exceeds =
        _mm512_cmp_ps_mask(x, _mm512_set1_ps(c.m[i] + kDirectRescaleSlack), _CMP_GT_OQ) != 0;
    const float alpha =
        direct_lazy_max(c, i, exceeds, [&] { return _mm512_reduce_max_ps(x); }, &rescale);
    float m_new = c.m[i];
    if (m_new == kNegInf) {
      // Every visible logit so far is -inf or NaN: `exceeds` is false for NaN, so a row whose
      // only visible logits here are NaN lands here too, and must become NaN (REFERENCE:
      // e^{NaN - m}), not give the key weight 0. x: masked lanes are -inf.
      if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) == 0) {  // nothing visible yet
        store_p(c.p, i, _mm512_setzero_ps());
        continue;
      }
      m_new = c.m[i] = __builtin_nanf("");  // P, l, O and the LSE of the row NaN from here on
    }
    const __m512 e =
        _mm512_maskz_mov_ps(valid, Vec512::exp(_mm512_sub_ps(x, _mm512_set1_ps(m_new))));
    const __m512 stored = store_p(c.p, i, e);
    float* l = lsum + static_cast<size_t>(i) * kDirectChunk;
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha), stored));
  }
  return rescale;
}

}  // namespace
}  // namespace pagedattn::cpu

PAGEDATTN_AVX512_HEADER_END
