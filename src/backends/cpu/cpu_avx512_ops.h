// AVX-512 vector operations and the bf16 (vdpbf16ps) tile operations of the CPU backend, shared
// by the translation units compiled with the AVX-512 flags (cpu_kernels_avx512.cpp and
// cpu_kernels_amx.cpp, see module.cmake). Internal linkage only (see cpu_kernels.h for why):
// include this header from AVX-512 translation units only.
//
//   Vec512   f32 vector ops for cpu_attention_tile.h (16 lanes; exp, transpose, conversions):
//            cpu_avx512f_ops.h (no BF16 instruction; shared with the avx512f path).
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

#include "cpu_avx512f_ops.h"

namespace pagedattn::cpu {
namespace {

inline __m512i broadcast_dword(const void* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

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
    with_dtype(dtype, [&]<DType DT>() { convert_row<DT>(dst, src, n); });
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

  // P of keys [j, j + 32) rounded to bf16 (one vcvtne2ps2bf16) and stored; returns acc plus the
  // rounded values, summed in pairs by one vdpbf16ps against bf16 ones (each product exact, sums
  // in f32; denormal P flushed, as tdpbf16ps / vdpbf16ps flush them in P·V).
  static V store_p_pair(void* p, int row, int j, V e0, V e1, V acc) {
    const __m512bh h = _mm512_cvtne2ps_pbh(e1, e0);  // e0 -> keys j .. j+15
    _mm512_storeu_si512(static_cast<uint16_t*>(p) + static_cast<size_t>(row) * kKeyTile + j,
                        reinterpret_cast<const __m512i&>(h));
    const __m512i ones = _mm512_set1_epi16(0x3F80);  // bf16 1.0
    return _mm512_dpbf16_ps(acc, h, reinterpret_cast<const __m512bh&>(ones));
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

  // Computes every column (TileKeys unused: the vdpbf16ps blocks span the whole tile).
  static void qk(float* s, const void* q_tile, const void* k, int r0, int r1, int head_size,
                 const TileKeys& /*keys*/) {
    const uint16_t* q = static_cast<const uint16_t*>(q_tile);
    const uint32_t* kp = static_cast<const uint32_t*>(k);
    for_blocks<6>(r0, r1, [&](int i, auto mr) {
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
    for_blocks<6>(r0, r1, [&](int i, auto mr) {
      pv_block<decltype(mr)::value, NV>(o + static_cast<size_t>(i) * head_size_v, head_size_v,
                                        p + static_cast<size_t>(i) * kKeyTile, vp, alpha + i, d0);
    });
  }

  static void pv(float* o, const void* p_tile, const void* v_tile, const float* alpha, int r0,
                 int r1, int head_size_v, const TileKeys& /*keys*/) {
    const uint16_t* p = static_cast<const uint16_t*>(p_tile);
    const uint16_t* vp = static_cast<const uint16_t*>(v_tile);
    for_blocks<4>(0, head_size_v / 16, [&](int c, auto nv) {
      pv_columns<decltype(nv)::value>(o, p, vp, alpha, r0, r1, head_size_v, 16 * c);
    });
  }
};

}  // namespace
}  // namespace pagedattn::cpu
