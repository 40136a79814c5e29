// cpu_dot_probe: the cost of the AVX-512 direct decode kernel's Q·Kᵀ inner work (cpu_decode_avx512.h,
// direct_qk) on one core, per 32 cache elements, on rows resident in L1, in four formulations:
//   bf16 dpbf16     the kernel's: 32 bf16 of a K row times 4 query rows with vdpbf16ps (4 a group)
//   bf16 f32 fma    the same K row widened to 2 x 16 f32 (even / odd elements: a shift and a mask),
//                   Q kept as f32 in that order: 8 vfmadd a group
//   e4m3 dpbf16     the kernel's fp8 path: widen32 (exact e4m3 -> bf16, 7 instructions), vdpbf16ps
//   e4m3 f32 fma    e4m3 -> the f16 of value / 256 (as the AVX2 kernel: sign-extend, shift, mask;
//                   the NaN code not handled), vcvtph2ps to 2 x 16 f32, 8 vfmadd a group
// Key pairs as direct_qk (8 accumulators, folded per pair), 4 query rows, D = 128. Prints TSC
// cycles per 32 elements (the best of 7 repetitions); compare the rows with each other, and with
// `cpu_bench`'s Peak/fma_f32 and Peak/dpbf16 (whose ratio is the machine's dpbf16 / FMA rate).
// Why: on an Intel Xeon (family 6 model 207) vdpbf16ps ran at half the f32 FMA's FLOP rate, where
// the direct kernel was designed on a Zen 5 that runs it at 1.85x (docs/perf/cpu.md, 2026-12-06).
// Build: PAGEDATTN_BUILD_BENCH=ON on x86-64 with a compiler that takes -mavx512bf16; run on a CPU
// with AVX-512 BF16.
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "backends/cpu/cpu_decode_avx512.h"

// GCC 12's AVX-512 headers: the false -Wuninitialized that cpu_decode_avx512.h also silences.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

using pagedattn::DType;
using pagedattn::cpu::as_bh;
using pagedattn::cpu::widen32;

constexpr int kRows = 4, kGroups = 4, kD = 32 * kGroups, kKeys = 16;

enum class Form { bf16_dpbf16, bf16_fma, e4m3_dpbf16, e4m3_fma };

template <Form F>
__attribute__((noinline)) float run(const char* k, const uint16_t* q16, const float* q32, int iters) {
  constexpr bool fp8 = F == Form::e4m3_dpbf16 || F == Form::e4m3_fma;
  constexpr int64_t row_bytes = fp8 ? kD : 2 * kD;
  __m512 out = _mm512_setzero_ps();
  __m512bh qv[kRows][kGroups];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kGroups; ++c) qv[r][c] = as_bh(_mm512_loadu_si512(q16 + r * kD + 32 * c));
  // 32 elements of a K row as two f32 vectors (x0, x1) matching q32's order.
  const auto widen_f32 = [](const char* p, __m512& x0, __m512& x1) {
    if constexpr (F == Form::bf16_fma) {
      const __m512i x = _mm512_loadu_si512(p);
      x0 = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      x1 = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    } else {
      const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512i h = _mm512_and_si512(_mm512_slli_epi16(s, 7), _mm512_set1_epi16(static_cast<short>(0xBF80)));
      x0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      x1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    }
  };
  for (int it = 0; it < iters; ++it) {
    for (int tp = 0; tp < kKeys / 2; ++tp) {
      const char* ka = k + (2 * tp) * row_bytes;
      const char* kb = ka + row_bytes;
      __m512 a[kRows], b[kRows];
      for (int r = 0; r < kRows; ++r) a[r] = b[r] = _mm512_setzero_ps();
      for (int c = 0; c < kGroups; ++c) {
        if constexpr (F == Form::bf16_dpbf16 || F == Form::e4m3_dpbf16) {
          constexpr DType dt = fp8 ? DType::fp8_e4m3 : DType::bf16;
          const __m512bh x = as_bh(widen32<dt>(ka + (row_bytes / kGroups) * c));
          const __m512bh y = as_bh(widen32<dt>(kb + (row_bytes / kGroups) * c));
          for (int r = 0; r < kRows; ++r) {
            a[r] = _mm512_dpbf16_ps(a[r], qv[r][c], x);
            b[r] = _mm512_dpbf16_ps(b[r], qv[r][c], y);
          }
        } else {
          __m512 x0, x1, y0, y1;
          widen_f32(ka + (row_bytes / kGroups) * c, x0, x1);
          widen_f32(kb + (row_bytes / kGroups) * c, y0, y1);
          for (int r = 0; r < kRows; ++r) {
            const __m512 q0 = _mm512_loadu_ps(q32 + r * kD + 32 * c);
            const __m512 q1 = _mm512_loadu_ps(q32 + r * kD + 32 * c + 16);
            a[r] = _mm512_fmadd_ps(q1, x1, _mm512_fmadd_ps(q0, x0, a[r]));
            b[r] = _mm512_fmadd_ps(q1, y1, _mm512_fmadd_ps(q0, y0, b[r]));
          }
        }
      }
      for (int r = 0; r < kRows; ++r)
        out = _mm512_add_ps(out, _mm512_add_ps(_mm512_unpacklo_ps(a[r], b[r]), _mm512_unpackhi_ps(a[r], b[r])));
    }
  }
  return _mm512_reduce_add_ps(out);
}

}  // namespace

int main() {
  std::vector<char> k(kKeys * kD * 2);
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<char>((i * 37) & 0x37);  // finite codes
  std::vector<uint16_t> q16(kRows * kD, 0x3F80);
  std::vector<float> q32(kRows * kD, 1.f);
  const int iters = 200000;
  const double groups = static_cast<double>(iters) * kKeys * kGroups;
  const auto time = [&](const char* name, auto fn) {
    double best = 1e300;
    float sink = 0.f;
    for (int rep = 0; rep < 7; ++rep) {
      const uint64_t t0 = __rdtsc();
      sink += fn();
      best = std::min(best, static_cast<double>(__rdtsc() - t0));
    }
    std::printf("%-14s %6.2f TSC cycles per 32 elements x %d rows (checksum %g)\n", name, best / groups, kRows,
                static_cast<double>(sink));
  };
  time("bf16 dpbf16", [&] { return run<Form::bf16_dpbf16>(k.data(), q16.data(), q32.data(), iters); });
  time("bf16 f32 fma", [&] { return run<Form::bf16_fma>(k.data(), q16.data(), q32.data(), iters); });
  time("e4m3 dpbf16", [&] { return run<Form::e4m3_dpbf16>(k.data(), q16.data(), q32.data(), iters); });
  time("e4m3 f32 fma", [&] { return run<Form::e4m3_fma>(k.data(), q16.data(), q32.data(), iters); });
  return 0;
}
