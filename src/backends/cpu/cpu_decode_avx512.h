// Direct decode kernel (AVX-512 BF16) of the CPU backend: the per-(chunk, KV head) compute of the
// direct decode driver (cpu_decode_direct.h: head-fused decode items computed on the cache rows in
// place, no K transpose, no V pack). Included by the AVX-512 translation units
// (cpu_kernels_avx512.cpp, cpu_kernels_amx.cpp); internal linkage only.
//
// Items (direct_decode_applies): the driver's shape conditions, D = Dv a multiple of 32, and a bf16
// cache with bf16 activations or an fp8 (e4m3 / e5m2) cache with any activations (both
// Precision::bf16_dot: Q rounded to bf16, as the tile kernel does). On the AVX-512 and AMX paths
// the f32 FMA kernel (cpu_decode_avx512_fma.h) takes the other head-fused decode items (f16
// caches, f32 / f16 activations), and every one on CPUs where it is the faster form
// (AttentionArgs::direct_fma); split-KV and cascade items run the tile kernel.
// PAGEDATTN_CPU_DECODE_KERNEL=tile turns it off, =fma selects the other form (cpu_dispatch.cpp).
//
// fp8 caches are widened to bf16 in registers (widen32), exactly (every e4m3 / e5m2 value is a
// bf16), NaN and inf codes included, so no check pass is needed; the rest of the kernel is the
// bf16 one. bf16 rather than f32: each widened K or V vector then feeds vdpbf16ps (32 products
// per instruction, half the dot-product instructions of f32 FMA) and the widening is 7 integer
// instructions per 32 elements, which run beside the dot products (an f32 widening costs twice
// that per element, and twice the FMAs).
//
// Tiling: per (chunk of 16 keys, KV head) its rows (query heads of the group x query tokens) in
// register blocks of R <= 4:
//   S = Q·Kᵀ  per key t: the D/32 zmm of its K row (32 bf16 each) x the R query rows (held in
//             registers as bf16 pairs) with vdpbf16ps -> R accumulators of 16 partial sums. Keys
//             2i, 2i+1 are folded at once (unpack lo/hi + add); the 8 folded pairs per row go
//             through a 3-level transposed reduction (unpack pd, two shuffle_f32x4 levels) to one
//             zmm = the 16 logits of the chunk, lane j = key t0 + j.
//   softmax   per row on that zmm: scale, soft-cap, ALiBi, mask, exp, P rounded to bf16 (16
//             values), l kept as 16 lane sums. Lazy max (as the AMX path): the running max m is
//             kept while no logit of the chunk exceeds it by more than kDirectRescaleSlack, so
//             alpha = 1 and O is not rescaled (exact: P <= e^8, O and l stay relative to the same
//             m); the common case costs one compare instead of a horizontal max.
//   O += P·V  per key pair (2i, 2i+1) that the rows can see (direct_pv_dims) and 32 dims: vpunpck{l,h}wd of the two V rows gives 2 zmm
//             of (v[2i][d], v[2i+1][d]) dword pairs, times the broadcast (p[2i], p[2i+1]) pair
//             with vdpbf16ps; dims are taken 64 at a time (R x 4 accumulators). The unpacks
//             leave the dims of each 32-dim chunk permuted (lo: d = 8k + j, hi: d = 8k + 4 + j for
//             lane 4k + j); O stays in that order in scratch and is put back once per row at the
//             end (two vpermt2ps per 32 dims).
//   Instructions (measured, D = Dv = 128, G = 4, one 16-key chunk of 8 KV heads = 64 KiB of K + V):
//   ~19k (the tile kernel: ~33k), of which 4096 vdpbf16ps and 2048 prefetches; ~6.5k cycles when
//   the data is cached, i.e. ~45 GB/s per core of compute rate.
//
// Memory traffic: each K/V byte of the request is read once (the decode floor); the prefetches
// (the driver's DirectPrefetch plan) are issued inside the Q·Kᵀ loop, two rows per key pair,
// paced by its dot products (zero_after). Floor and measurements: docs/perf/cpu.md ("Direct
// decode kernel").
//
// Precision points (the same as the tile kernel's bf16_dot path): Q rounded to bf16 (as stored for
// bf16 activations); K/V bf16 as stored, or fp8 widened exactly (times a power of two); products
// summed in f32 by vdpbf16ps; P rounded to bf16 once (l sums the rounded values); O
// accumulated in f32; the output rounded once at the store.
#pragma once

#include "cpu_avx512_ops.h"
#include "cpu_decode_direct.h"
#include "cpu_decode_softmax512.h"

PAGEDATTN_AVX512_HEADER_BEGIN  // (cpu_avx512f_ops.h)

namespace pagedattn::cpu {
namespace {

// Whether the AVX-512 direct kernel runs this item (see the file comment).
inline bool direct_decode_applies(const AttentionArgs& a, const WorkItem& it) {
  const DType dt = a.kv.dtype;
  const bool cache = (dt == DType::bf16 && a.q_dtype == DType::bf16) || dt == DType::fp8_e4m3 ||
                     dt == DType::fp8_e5m2;
  return cache && a.precision == Precision::bf16_dot && a.head_size % 32 == 0 &&
         direct_decode_shape_applies(a, it);
}

template <DType DT>
constexpr int64_t kDirectElemBytes = DT == DType::bf16 ? 2 : 1;

// Magnitude tables of the fp8 widening (bf16 bit patterns, vpermw: 32 words; see widen32).
// e4m3, index (code + 1) & 0x7F for the codes 0x7F (index 0: NaN) and 0x00 .. 0x0E: the
// subnormals M * 2^-9 and the first normals, times 256.
alignas(64) constexpr uint16_t kE4m3Specials[32] = {
    0x7FC0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4020, 0x4040,
    0x4060, 0x4080, 0x4090, 0x40A0, 0x40B0, 0x40C0, 0x40D0, 0x40E0};
// e5m2, index (code + 4) & 0x7F for the codes 0x7C .. 0x7F (inf, NaN x 3) and 0x00 .. 0x03 (the
// subnormals M * 2^-16), times 2^16.
alignas(64) constexpr uint16_t kE5m2Specials[32] = {0x7F80, 0x7FC0, 0x7FC0, 0x7FC0,
                                                    0x0000, 0x3F80, 0x4000, 0x4040};

// 32 cache elements of type DT at src as bf16 (one zmm of words, in element order). bf16: the
// row itself. fp8: exact, every code (NaN and, for e5m2, inf included), scaled by a power of two
// (e4m3: 2^8, e5m2: 2^16; DirectAvx512::key_factor / value_factor divide it out again). The byte
// sign-extended to a word s (bit 15 = the sign); s << 4 (e4m3) or << 5 (e5m2) puts the code's
// exponent and mantissa at the bf16's, and OR 0x4000 adds 128 to the exponent: the bf16 of a
// normal code's value times 2^(128 - 120) = 2^8 (e4m3, exponent bias 7) or 2^(128 - 112) = 2^16
// (e5m2, bias 15). The codes this cannot give (subnormals, NaN; e5m2 inf) take their magnitude
// from a table (vpermw, masked to them: one test finds them, as the codes whose magnitude plus 1
// (e4m3; 127 + 1 wraps to 0) or plus 4 (e5m2; 124 .. 127 wrap to 0 .. 3) is below 16 or 8; the
// e4m3 table also holds the first normals, 8 .. 14), and the sign goes back on last. 7
// instructions per 32 elements; the values are those of the tile kernel's conversion
// (Bf16Ops::convert_row) times the power of two.
template <DType DT>
__attribute__((always_inline)) inline __m512i widen32(const char* src) {
  if constexpr (DT == DType::bf16) {
    return _mm512_loadu_si512(src);
  } else {
    static_assert(DT == DType::fp8_e4m3 || DT == DType::fp8_e5m2);
    constexpr bool e4m3 = DT == DType::fp8_e4m3;
    const __m512i s =
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    // (a & exponent/mantissa bits) | 0x4000; the destination operand first (a, then magnitude:
    // both dead after), so that no register copy is needed.
    const __m512i normal =
        _mm512_ternarylogic_epi32(_mm512_slli_epi16(s, e4m3 ? 4 : 5),
                                  _mm512_set1_epi16(e4m3 ? 0x07F0 : 0x0FE0),
                                  _mm512_set1_epi16(0x4000), 0xEA);
    const __m512i idx = _mm512_add_epi16(s, _mm512_set1_epi16(e4m3 ? 1 : 4));
    const __mmask32 special = _mm512_testn_epi16_mask(idx, _mm512_set1_epi16(e4m3 ? 0x70 : 0x78));
    const __m512i magnitude = _mm512_mask_permutexvar_epi16(
        normal, special, idx, _mm512_load_si512(e4m3 ? kE4m3Specials : kE5m2Specials));
    // bit 15 from s (the sign), the rest from magnitude: C ? B : A
    return _mm512_ternarylogic_epi32(magnitude, s, _mm512_set1_epi16(static_cast<short>(0x8000)),
                                     0xD8);
  }
}

inline __m512bh as_bh(__m512i x) {
  __m512bh r;
  std::memcpy(&r, &x, sizeof(r));
  return r;
}

// Logits of R rows (q: R rows of D bf16, row stride D) for the 16 keys of a chunk (key t at
// k + t * k_stride, or the zero row from `live` on): logits[r] lane t = q_r . k_t.
// red: scratch of R x 8 x 16 f32 (the key pairs folded once). prefetch_into: nullptr or what to
// prefetch (DirectPrefetch).
template <DType DT, int R, int NC, bool kFull>
__attribute__((always_inline)) inline void direct_qk(const uint16_t* q, int head_size,
                                                     const char* k, int64_t k_stride, int live,
                                                     float* red, __m512* logits,
                                                     const DirectPrefetch* prefetch_into) {
  // A local copy (scalar fields): the vector stores below may alias any memory, so fields read
  // through the pointer would be reloaded after each of them.
  const bool prefetch = prefetch_into != nullptr;
  DirectPrefetch pf;
  if (prefetch) pf = *prefetch_into;
  __m512bh qv[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c)
      qv[r][c] = as_bh(_mm512_loadu_si512(q + static_cast<size_t>(r) * head_size + 32 * c));
  for (int tp = 0; tp < kDirectChunk / 2; ++tp) {
    const char* ka = direct_key_row<kFull>(k, k_stride, live, 2 * tp);
    const char* kb = direct_key_row<kFull>(k, k_stride, live, 2 * tp + 1);
    __m512 a[R], b[R];
    for (int r = 0; r < R; ++r) {
      a[r] = _mm512_setzero_ps();
      b[r] = _mm512_setzero_ps();
    }
    for (int c = 0; c < NC; ++c) {
      const __m512bh kc = as_bh(widen32<DT>(ka + 32 * kDirectElemBytes<DT> * c));
      for (int r = 0; r < R; ++r) a[r] = _mm512_dpbf16_ps(a[r], qv[r][c], kc);
    }
    for (int c = 0; c < NC; ++c) {
      const __m512bh kc = as_bh(widen32<DT>(kb + 32 * kDirectElemBytes<DT> * c));
      for (int r = 0; r < R; ++r) b[r] = _mm512_dpbf16_ps(b[r], qv[r][c], kc);
    }
    for (int r = 0; r < R; ++r) direct_fold_pair(red, r, tp, a[r], b[r]);
    // Rows 2tp, 2tp + 1. The prefetch loops are unrolled for fp8 rows (fewer instructions in a
    // compute-bound loop); bf16 keeps them (unrolled, its prefetches issued ahead of the pacing
    // and the memory-bound decode was slower: docs/perf/cpu.md, fp8 section).
    if (prefetch) direct_prefetch_pair<DT == DType::bf16 ? 0 : 32 * NC>(pf, tp, zero_after(b[0]));
  }
  for (int r = 0; r < R; ++r) logits[r] = direct_chunk_logits(red, r);
}

// O[r] (permuted dims, see the file comment) += P[r] · V over the chunk's keys (keys t0 + j), for
// dims [d0, d0 + 32 * NCG). p: R rows of 16 bf16; v: key t at v + t * v_stride. Each V row is read
// only for the rows that can see its key (lo[r] <= key < hi[r], key < t0 + live): key pairs every
// row of the block sees run for all rows at once; the few "ragged" pairs (a causal end between the
// tokens of a multi-token decode, a window start, the chunk's last live key) row by row with the
// keys a row cannot see replaced by zeros; pairs no row sees are not read. So a row never
// multiplies a V row it cannot see (P = 0 would keep a NaN or an infinity there: 0 * NaN = NaN),
// and the output does not depend on what masked slots hold.
template <DType DT, int R, int NCG, bool kFull>
__attribute__((always_inline)) inline void direct_pv_dims(float* o, int head_size_v,
                                                          const uint16_t* p, const char* v,
                                                          int64_t v_stride, int live, int d0,
                                                          const int32_t* lo, const int32_t* hi,
                                                          int t0, const ChunkKeys& keys) {
  const int n = kFull ? kDirectChunk : live;
  // Pairs with both keys in [all_lo, all_hi); the pairs that overlap [any_lo, any_hi) besides.
  const int full_begin = (keys.all_lo + 1) / 2;
  const int full_end = imax(full_begin, keys.all_hi / 2);
  __m512 acc[R][2 * NCG];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * NCG; ++j)
      acc[r][j] = _mm512_loadu_ps(o + static_cast<size_t>(r) * head_size_v + d0 + 16 * j);
  const auto pair = [&](int tp, int r_first, int r_last, bool sees_a, bool sees_b) {
    constexpr int64_t eb = kDirectElemBytes<DT>;
    const char* va = v + (2 * tp) * v_stride + eb * d0;
    const char* vb = va + v_stride;
    __m512bh lo_v[NCG], hi_v[NCG];
    for (int c = 0; c < NCG; ++c) {
      const __m512i x = sees_a ? widen32<DT>(va + 32 * eb * c) : _mm512_setzero_si512();
      const __m512i y = sees_b ? widen32<DT>(vb + 32 * eb * c) : _mm512_setzero_si512();
      lo_v[c] = as_bh(_mm512_unpacklo_epi16(x, y));
      hi_v[c] = as_bh(_mm512_unpackhi_epi16(x, y));
    }
    for (int r = 0; r < R; ++r) {
      if (r < r_first || r > r_last) continue;
      const __m512bh pb = as_bh(broadcast_dword(p + r * kDirectChunk + 2 * tp));
      for (int c = 0; c < NCG; ++c) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], pb, lo_v[c]);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], pb, hi_v[c]);
      }
    }
  };
#pragma GCC unroll 2
  for (int tp = full_begin; tp < full_end; ++tp) pair(tp, 0, R - 1, true, true);
  const auto ragged = [&](int tp_begin, int tp_end) {  // the rows that see each pair's keys
    for (int tp = tp_begin; tp < tp_end; ++tp) {
      const int ka = t0 + 2 * tp, kb = ka + 1;
      for (int r = 0; r < R; ++r) {
        const bool sees_a = ka >= lo[r] && ka < hi[r] && 2 * tp < n;
        const bool sees_b = kb >= lo[r] && kb < hi[r] && 2 * tp + 1 < n;
        if (sees_a || sees_b) pair(tp, r, r, sees_a, sees_b);
      }
    }
  };
  ragged(keys.any_lo / 2, full_begin);
  ragged(full_end, (keys.any_hi + 1) / 2);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * NCG; ++j)
      _mm512_storeu_ps(o + static_cast<size_t>(r) * head_size_v + d0 + 16 * j, acc[r][j]);
}

// P of row `row` rounded to bf16 into the P scratch (16 values); returns the rounded values (what
// l sums). direct_softmax16's store_p.
struct DirectStorePBf16 {
  __m512 operator()(void* p_scratch, int row, __m512 e) const {
    const __m256bh eb = _mm512_cvtneps_pbh(e);
    __m256i bits;
    std::memcpy(&bits, &eb, sizeof(bits));
    uint16_t* prow = static_cast<uint16_t*>(p_scratch) + static_cast<size_t>(row) * kDirectChunk;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow), bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
};

// One register block of R rows (global rows row0 ..) of one KV head over one chunk: Q·Kᵀ, the
// online softmax, O += P·V.
template <DType DT, int R, int NC, bool kFull>
inline void direct_rows(const ItemContext& c, float* lsum, float* red, int row0, const char* k,
                        int64_t k_stride, const char* v, int64_t v_stride, int t0, int live,
                        const DirectPrefetch* pf) {
  __m512 logits[R];
  direct_qk<DT, R, NC, kFull>(
      static_cast<const uint16_t*>(c.q) + static_cast<size_t>(row0) * c.head_size, c.head_size, k,
      k_stride, live, red, logits, pf);
  const int dv = c.head_size_v;
  float* o = c.o + static_cast<size_t>(row0) * dv;
  if (direct_softmax16(c, lsum, row0, R, logits, t0, DirectStorePBf16{})) {  // rare (lazy max)
    direct_rescale_rows(o, dv, c.alpha + row0, R);
  }
  const uint16_t* p = static_cast<const uint16_t*>(c.p) + static_cast<size_t>(row0) * kDirectChunk;
  int d0 = 0;
  const int32_t* lo = c.lo + row0;
  const int32_t* hi = c.hi + row0;
  const ChunkKeys keys = chunk_keys_seen(lo, hi, R, t0, kFull ? kDirectChunk : live);
  for (; d0 + 64 <= dv; d0 += 64) {
    direct_pv_dims<DT, R, 2, kFull>(o, dv, p, v, v_stride, live, d0, lo, hi, t0, keys);
  }
  if (d0 < dv) direct_pv_dims<DT, R, 1, kFull>(o, dv, p, v, v_stride, live, d0, lo, hi, t0, keys);
}

// The AVX-512 BF16 kernel of the direct decode driver (cpu_decode_direct.h).
struct DirectAvx512 {
  static void setup(ItemContext& c) { setup_item_rows<Bf16Ops>(c); }  // Q rows as bf16
  // The powers of two widen32 scales fp8 codes by (exact).
  static float key_factor(const AttentionArgs& a) {
    switch (a.kv.dtype) {
      case DType::fp8_e4m3: return 1.f / 256.f;
      case DType::fp8_e5m2: return 1.f / 65536.f;
      default: return 1.f;
    }
  }
  static float value_factor(const AttentionArgs& a) { return key_factor(a); }

  template <DType DT, bool kFull>
  static void rows_of(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                      const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                      int live, const DirectPrefetch& pf) {
    for (int rb = 0; rb < rows; rb += kDirectRowBlock) {
      const DirectPrefetch* prefetch = rb == 0 ? &pf : nullptr;  // once per head
      with_static_int<kDirectRowBlock>(imin(kDirectRowBlock, rows - rb), [&](auto rr) {
        with_static_int<kMaxHeadSize / 32>(c.head_size / 32, [&](auto nc) {
          constexpr int R = decltype(rr)::value, NC = decltype(nc)::value;
          direct_rows<DT, R, NC, kFull>(c, lsum, red, row0 + rb, k, k_stride, v, v_stride, t0,
                                        live, prefetch);
        });
      });
    }
  }

  template <bool kFull>
  static void head_chunk(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                         const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                         int live, const DirectPrefetch& pf) {
    switch (c.args->kv.dtype) {
      case DType::fp8_e4m3:
        rows_of<DType::fp8_e4m3, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0,
                                        live, pf);
        break;
      case DType::fp8_e5m2:
        rows_of<DType::fp8_e5m2, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0,
                                        live, pf);
        break;
      default:  // bf16 (direct_decode_applies)
        rows_of<DType::bf16, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0, live,
                                    pf);
        break;
    }
  }

  static float lane_sum(const float* lanes) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lanes)); }

  // O rows are kept with the dims of each 32-dim chunk permuted (see the file comment).
  static void unpermute(const AttentionArgs&, const float* o, float* dst, int dv) {
    direct_unpermute32(o, dst, dv);
  }
};

}  // namespace
}  // namespace pagedattn::cpu

PAGEDATTN_AVX512_HEADER_END
