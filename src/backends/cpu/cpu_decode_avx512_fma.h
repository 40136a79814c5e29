// Direct decode kernel (AVX-512F, f32 FMA in 16 lanes) of the CPU backend: the per-(chunk, KV
// head) compute of the direct decode driver (cpu_decode_direct.h), the AVX2 kernel's algorithm
// (cpu_decode_avx2.h) at twice its width. Included by the AVX-512 translation units
// (cpu_kernels_avx512f.cpp; cpu_kernels_avx512.cpp and cpu_kernels_amx.cpp, where
// AttentionArgs::direct_fma picks it over the bf16 dot-product kernel); internal linkage only.
//
// Why a second AVX-512 kernel: cpu_decode_avx512.h computes with vdpbf16ps, which a Zen 5 core runs
// at 1.85x its f32 FMA FLOP rate, but an Intel Xeon (family 6 model 207) at half of it; there the
// same dot products in f32 FMA took 1.4-1.5x fewer cycles (bench/cpu_dot_probe), and decode
// 0.79-0.89x the time (docs/perf/cpu.md). CPUs without AVX512_BF16 (the avx512f path) have only
// this one.
//
// Items (direct_decode_fma_applies): the driver's shape conditions, D = Dv a multiple of 32, and a
// bf16, f16, fp8 e4m3 or fp8 e5m2 cache; any activation dtype (Q is converted to f32, as by the
// tile kernel).
//
// Cache rows are widened to f32 in registers, 32 elements (one group) at a time (widen32_f32):
//   bf16   one 64-byte load, vpunpck{l,h}wd with zero -> 2 zmm in a permuted dim order (lo: dims
//          8k + j, hi: dims 8k + 4 + j of lane 4k + j, k < 4, j < 4): Q rows are stored in that
//          order at setup and O rows are kept in it, put back once per row at the end (unpermute).
//   f16    vcvtph2ps; e5m2: the byte is the high half of an f16 (zero-extend, shift, vcvtph2ps).
//   e4m3   the sign-extended byte << 7 with bits 15, 13..7 kept is the f16 of value / 256 (as the
//          AVX2 kernel; the 256 folds into the logit scale and the output normalisation). Its NaN
//          code reads as a finite f16, so each (chunk, head) checks its K and V rows for it after
//          the first row block's Q·Kᵀ and, when one is there, is computed again from the start with
//          the NaN-exact widening (fma_rows_of, cpu_decode_avx2.h).
// Tiling per (chunk of 16 keys, KV head), rows in blocks of R <= 4:
//   S = Q·Kᵀ  key pairs (2i, 2i+1): per group, the two K rows widened once, times the R query rows
//             (f32, loaded from L1 into registers) into 2R zmm accumulators; each pair folded once
//             and the chunk's 16 logits reduced as the bf16 kernel (cpu_decode_softmax512.h).
//   softmax   direct_softmax16, P in f32.
//   O += P·V  per group of 32 dims: R x 2 accumulators over the chunk's keys, each V row widened
//             once and multiplied by the broadcast P of every row; V rows read only for the rows
//             that see their keys (ragged keys row by row, as the other direct kernels).
// Per key and row: D + Dv FMAs (16 lanes) and one widening of the key's K and V rows per row block.
// Memory traffic: each K/V byte read once (the decode floor); the driver's prefetch plan
// (DirectPrefetch, the bf16 kernel's), paced by the Q·Kᵀ loop's FMAs.
//
// Precision: exact conversions to f32 (as the AVX2 kernel and the tile kernel's f32 path), f32 FMA
// accumulation, P in f32, one rounding at the output.
#pragma once

#include "cpu_decode_avx2.h"
#include "cpu_decode_softmax512.h"

PAGEDATTN_AVX512_HEADER_BEGIN  // (cpu_avx512f_ops.h)

namespace pagedattn::cpu {
namespace {

// Whether the AVX-512 FMA kernel runs this item (see the file comment).
inline bool direct_decode_fma_applies(const AttentionArgs& a, const WorkItem& it) {
  return direct_decode_avx2_applies(a, it) && a.head_size % 32 == 0;  // (widening groups of 32)
}

// 32 elements of a cache row (type DT) at src, as f32: lo, hi (see the file comment for the
// order). kNanSafe (e4m3 only): the NaN code reads as NaN.
template <DType DT, bool kNanSafe>
__attribute__((always_inline)) inline void widen32_f32(const char* src, __m512& lo, __m512& hi) {
  if constexpr (DT == DType::bf16) {
    const __m512i x = _mm512_loadu_si512(src);
    const __m512i z = _mm512_setzero_si512();
    lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
    hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
  } else if constexpr (DT == DType::f16) {
    lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32)));
  } else {
    static_assert(DT == DType::fp8_e4m3 || DT == DType::fp8_e5m2);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    __m512i h;
    if constexpr (DT == DType::fp8_e5m2) {  // the high half of an f16
      h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
    } else {  // the f16 of value / 256 (see the file comment)
      const __m512i s = _mm512_cvtepi8_epi16(bytes);
      h = _mm512_and_si512(_mm512_slli_epi16(s, 7), _mm512_set1_epi16(static_cast<short>(0xBF80)));
      if constexpr (kNanSafe) {  // the NaN code's words become an f16 NaN
        const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(s, _mm512_set1_epi16(0x7F)),
                                                      _mm512_set1_epi16(0x7F));
        h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7E00));
      }
    }
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
}

template <DType DT>
constexpr int64_t kFmaElemBytes = DT == DType::bf16 || DT == DType::f16 ? 2 : 1;

// Logits of R rows (q: R rows of D f32 in the kernel's order, row stride D) for the 16 keys of a
// chunk (key t at k + t * k_stride; from `live` on, the zero row): logits[r] lane j = key j.
// red: scratch of R x 8 x 16 f32. prefetch_into: nullptr or the head's prefetch plan.
template <DType DT, bool kNanSafe, int R, bool kFull>
__attribute__((always_inline)) inline void fma_qk(const float* q, int d, const char* k,
                                                  int64_t k_stride, int live, float* red,
                                                  __m512* logits,
                                                  const DirectPrefetch* prefetch_into) {
  // A local copy: the vector stores below may alias any memory.
  const bool prefetch = prefetch_into != nullptr;
  DirectPrefetch pf;
  if (prefetch) pf = *prefetch_into;
  for (int tp = 0; tp < kDirectChunk / 2; ++tp) {
    const char* ka = direct_key_row<kFull>(k, k_stride, live, 2 * tp);
    const char* kb = direct_key_row<kFull>(k, k_stride, live, 2 * tp + 1);
    __m512 a[R], b[R];
    for (int r = 0; r < R; ++r) {
      a[r] = _mm512_setzero_ps();
      b[r] = _mm512_setzero_ps();
    }
    for (int g = 0; g < d; g += 32) {
      __m512 al, ah, bl, bh;
      widen32_f32<DT, kNanSafe>(ka + g * kFmaElemBytes<DT>, al, ah);
      widen32_f32<DT, kNanSafe>(kb + g * kFmaElemBytes<DT>, bl, bh);
      for (int r = 0; r < R; ++r) {
        const float* qr = q + static_cast<size_t>(r) * d + g;
        __m512 q0 = _mm512_loadu_ps(qr), q1 = _mm512_loadu_ps(qr + 16);
        // In registers: as memory operands of both keys' FMAs each Q vector would be loaded twice.
        asm("" : "+v"(q0), "+v"(q1));
        a[r] = _mm512_fmadd_ps(q0, al, a[r]);
        b[r] = _mm512_fmadd_ps(q0, bl, b[r]);
        a[r] = _mm512_fmadd_ps(q1, ah, a[r]);
        b[r] = _mm512_fmadd_ps(q1, bh, b[r]);
      }
    }
    for (int r = 0; r < R; ++r) direct_fold_pair(red, r, tp, a[r], b[r]);
    if (prefetch) direct_prefetch_pair(pf, tp, zero_after(b[0]));
  }
  for (int r = 0; r < R; ++r) logits[r] = direct_chunk_logits(red, r);
}

// P of row `row` into the P scratch as f32 (16 values); direct_softmax16's store_p.
struct DirectStorePF32 {
  __m512 operator()(void* p_scratch, int row, __m512 e) const {
    _mm512_storeu_ps(static_cast<float*>(p_scratch) + static_cast<size_t>(row) * kDirectChunk, e);
    return e;
  }
};

// O[r] += P[r] · V over the chunk's keys (keys t0 + j), every group of 32 dims. Each V row is read
// only for the rows that can see its key (lo[r] <= key < hi[r], key < t0 + live): keys every row
// of the block sees run for all rows at once, the ragged ones row by row, keys no row sees are
// not read (as avx2_pv: a row never multiplies a V row it cannot see).
template <DType DT, bool kNanSafe, int R, bool kFull>
__attribute__((always_inline)) inline void fma_pv(float* o, int dv, const float* p, const char* v,
                                                  int64_t v_stride, int live, const int32_t* lo,
                                                  const int32_t* hi, int t0) {
  const ChunkKeys keys = chunk_keys_seen(lo, hi, R, t0, kFull ? kDirectChunk : live);
  for (int g = 0; g < dv; g += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_loadu_ps(o + static_cast<size_t>(r) * dv + g);
      acc[r][1] = _mm512_loadu_ps(o + static_cast<size_t>(r) * dv + g + 16);
    }
    const char* vg = v + g * kFmaElemBytes<DT>;
    const auto key = [&](int t, bool ragged) {
      __m512 vl, vh;
      widen32_f32<DT, kNanSafe>(vg + t * v_stride, vl, vh);
      for (int r = 0; r < R; ++r) {
        if (ragged && (t0 + t < lo[r] || t0 + t >= hi[r])) continue;
        const __m512 pb = _mm512_set1_ps(p[r * kDirectChunk + t]);
        acc[r][0] = _mm512_fmadd_ps(pb, vl, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pb, vh, acc[r][1]);
      }
    };
#pragma GCC unroll 4
    for (int t = keys.all_lo; t < keys.all_hi; ++t) key(t, false);
    for (int t = keys.any_lo; t < keys.all_lo; ++t) key(t, true);
    for (int t = keys.all_hi; t < keys.any_hi; ++t) key(t, true);
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o + static_cast<size_t>(r) * dv + g, acc[r][0]);
      _mm512_storeu_ps(o + static_cast<size_t>(r) * dv + g + 16, acc[r][1]);
    }
  }
}

// The AVX-512 f32 FMA kernel of the direct decode driver (cpu_decode_direct.h).
struct DirectAvx512Fma {
  // The bf16 widening's dim order of each 32-float group (see the file comment; the inverse of
  // direct_unpermute32): lane 4k + j of the first 16 holds dim 8k + j, of the second 16 dim
  // 8k + 4 + j.
  static void to_widening_order(const float* src, float* dst, int n) {
    direct_permute32(src, dst, n, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                     _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
  }

  static void setup(ItemContext& c) {
    setup_item_rows<F32Ops<Vec512>>(c);  // Q rows as f32 (dimension order), masks; O = 0
    if (c.args->kv.dtype == DType::bf16) {  // in place (each group is loaded whole first)
      float* q = static_cast<float*>(c.q);
      for (int row = 0; row < c.rows; ++row) {
        float* qr = q + static_cast<size_t>(row) * c.head_size;
        to_widening_order(qr, qr, c.head_size);
      }
    }
  }

  static float key_factor(const AttentionArgs& a) { return DirectAvx2::key_factor(a); }
  static float value_factor(const AttentionArgs& a) { return key_factor(a); }
  static float lane_sum(const float* lanes) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lanes)); }

  static void unpermute(const AttentionArgs& a, const float* o, float* dst, int dv) {
    if (a.kv.dtype == DType::bf16) {
      direct_unpermute32(o, dst, dv);
    } else {
      std::memcpy(dst, o, static_cast<size_t>(dv) * sizeof(float));
    }
  }

  // The block steps of fma_rows_of (cpu_decode_avx2.h).
  template <int R>
  using Logits = __m512[R];
  template <DType DT, bool kNanSafe, int R, bool kFull>
  static void qk(const float* q, int d, const char* k, int64_t k_stride, int live, float* red,
                 Logits<R>& logits, const DirectPrefetch* pf) {
    fma_qk<DT, kNanSafe, R, kFull>(q, d, k, k_stride, live, red, logits, pf);
  }
  static bool softmax(const ItemContext& c, float* lsum, int i, int rows, const __m512* logits, int t0) {
    return direct_softmax16(c, lsum, i, rows, logits, t0, DirectStorePF32{});
  }
  template <DType DT, bool kNanSafe, int R, bool kFull>
  static void pv(float* o, int dv, const float* p, const char* v, int64_t v_stride, int live,
                 const int32_t* lo, const int32_t* hi, int t0) {
    fma_pv<DT, kNanSafe, R, kFull>(o, dv, p, v, v_stride, live, lo, hi, t0);
  }

  template <bool kFull>
  static void head_chunk(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                         const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                         int live, const DirectPrefetch& pf) {
    fma_head_chunk<DirectAvx512Fma, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0,
                                           live, pf);
  }
};

}  // namespace
}  // namespace pagedattn::cpu

PAGEDATTN_AVX512_HEADER_END
