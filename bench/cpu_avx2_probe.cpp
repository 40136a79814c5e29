// cpu_avx2_probe: the AVX2 direct decode kernel's inner loops (cpu_decode_avx2.h) on one core, in
// several formulations, per (16-key chunk, KV head) at 4 query rows and D = 128, in core cycles
// (TSC cycles scaled by the ratio of an FMA throughput loop's TSC cycles to its 2 FMAs a cycle).
//   qk_pair_unpack   the kernel's Q·Kᵀ before session 29: key pairs, 8 accumulators (4 rows x 2
//                    keys, 2 dependent FMAs a group each), Q loaded into registers, bf16 widened
//                    with vpunpck{l,h}wd, pairs folded with vhaddps
//   qk_key_8chain    one key at a time, 8 accumulators (4 rows x lo / hi dims, 1 FMA a group
//                    each), Q as FMA memory operands; per key lo + hi stored, folded at the end
//   qk_pair_shift    as qk_pair_unpack, bf16 widened as even (x << 16) / odd (x & 0xFFFF0000) dims
//   pv_unpack        the kernel's P·V: per 16-dim group, 4 rows x 2 accumulators over the keys,
//                    vpunpck widening, P broadcast from memory
//   pv_shift         the same with the even / odd widening
//   (_e4m3: the same loops over fp8 e4m3 rows, widened to the f16 of value / 256 + vcvtph2ps)
// Rows at the NHD stride of the Llama-3-8B cache (8 KV heads: 2 KiB bf16, 1 KiB fp8) or dense;
// the chunk's rows resident in L1 or L2 (a set of chunks cycled). Prints cycles per (chunk, head);
// the FMAs alone take 512 cycles for each of Q·Kᵀ and P·V (1024 8-lane FMAs, 2 a cycle).
// Why: inside the kernel these loops take much more than their FMAs (docs/perf/cpu.md, session 29);
// this separates the loops' own costs from the kernel's memory and bookkeeping.
// Build: the `cpu_avx2_probe` target (PAGEDATTN_BUILD_BENCH=ON, x86-64; runs on AVX2 + FMA + F16C).
// Run: cpu_avx2_probe [heads (row stride in heads x D elements, default 8)] [chunks cycled (1)]
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kD = 128, kKeys = 16, kRows = 4;

__attribute__((noinline)) float fma_clock(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  return _mm256_cvtss_f32(s);
}

enum class W { unpack, shift, e4m3 };

template <W w>
__attribute__((always_inline)) inline void widen(const char* p, __m256& lo, __m256& hi) {
  if constexpr (w == W::unpack) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
  } else if constexpr (w == W::shift) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
}

template <W w>
constexpr int64_t kGroupBytes = w == W::e4m3 ? 16 : 32;

// Q·Kᵀ, pairs (the kernel before session 29).
template <W w>
__attribute__((noinline)) void qk_pair(const float* q, const char* k, int64_t ks, float* red, float* out) {
  for (int tp = 0; tp < kKeys / 2; ++tp) {
    const char* ka = k + 2 * tp * ks;
    const char* kb = ka + ks;
    __m256 a[kRows], b[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = b[r] = _mm256_setzero_ps();
    for (int g = 0; g < kD / 16; ++g) {
      __m256 al, ah, bl, bh;
      widen<w>(ka + g * kGroupBytes<w>, al, ah);
      widen<w>(kb + g * kGroupBytes<w>, bl, bh);
      for (int r = 0; r < kRows; ++r) {
        __m256 q0 = _mm256_loadu_ps(q + r * kD + 16 * g), q1 = _mm256_loadu_ps(q + r * kD + 16 * g + 8);
        asm("" : "+x"(q0), "+x"(q1));
        a[r] = _mm256_fmadd_ps(q0, al, a[r]);
        b[r] = _mm256_fmadd_ps(q0, bl, b[r]);
        a[r] = _mm256_fmadd_ps(q1, ah, a[r]);
        b[r] = _mm256_fmadd_ps(q1, bh, b[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(red + (r * 8 + tp) * 8, _mm256_hadd_ps(a[r], b[r]));
  }
  for (int r = 0; r < kRows; ++r) {
    for (int half = 0; half < 2; ++half) {
      const float* h = red + r * 64 + half * 32;
      const __m256 g0 = _mm256_hadd_ps(_mm256_loadu_ps(h), _mm256_loadu_ps(h + 8));
      const __m256 g1 = _mm256_hadd_ps(_mm256_loadu_ps(h + 16), _mm256_loadu_ps(h + 24));
      _mm256_storeu_ps(out + r * 16 + half * 8, _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                                              _mm256_permute2f128_ps(g0, g1, 0x31)));
    }
  }
}

// Q·Kᵀ, one key at a time, 8 chains, Q as memory operands.
template <W w>
__attribute__((noinline)) void qk_key(const float* q, const char* k, int64_t ks, float* red, float* out) {
  for (int t = 0; t < kKeys; ++t) {
    const char* kr = k + t * ks;
    __m256 lo[kRows], hi[kRows];
    for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int g = 0; g < kD / 16; ++g) {
      __m256 xl, xh;
      widen<w>(kr + g * kGroupBytes<w>, xl, xh);
      for (int r = 0; r < kRows; ++r) {
        lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * kD + 16 * g), xl, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * kD + 16 * g + 8), xh, hi[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(red + (r * 16 + t) * 8, _mm256_add_ps(lo[r], hi[r]));
  }
  for (int r = 0; r < kRows; ++r) {
    for (int half = 0; half < 2; ++half) {
      const float* h = red + (r * 16 + half * 8) * 8;
      const __m256 p0 = _mm256_hadd_ps(_mm256_loadu_ps(h), _mm256_loadu_ps(h + 8));
      const __m256 p1 = _mm256_hadd_ps(_mm256_loadu_ps(h + 16), _mm256_loadu_ps(h + 24));
      const __m256 p2 = _mm256_hadd_ps(_mm256_loadu_ps(h + 32), _mm256_loadu_ps(h + 40));
      const __m256 p3 = _mm256_hadd_ps(_mm256_loadu_ps(h + 48), _mm256_loadu_ps(h + 56));
      const __m256 g0 = _mm256_hadd_ps(p0, p1), g1 = _mm256_hadd_ps(p2, p3);
      _mm256_storeu_ps(out + r * 16 + half * 8, _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                                              _mm256_permute2f128_ps(g0, g1, 0x31)));
    }
  }
}

// P·V (the kernel's loop).
template <W w>
__attribute__((noinline)) void pv(const float* p, const char* v, int64_t vs, float* o) {
  for (int g = 0; g < kD / 16; ++g) {
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + r * kD + 16 * g);
      acc[r][1] = _mm256_loadu_ps(o + r * kD + 16 * g + 8);
    }
#pragma GCC unroll 4
    for (int t = 0; t < kKeys; ++t) {
      __m256 vl, vh;
      widen<w>(v + t * vs + g * kGroupBytes<w>, vl, vh);
      for (int r = 0; r < kRows; ++r) {
        const __m256 pb = _mm256_broadcast_ss(p + r * kKeys + t);
        acc[r][0] = _mm256_fmadd_ps(pb, vl, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, vh, acc[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_storeu_ps(o + r * kD + 16 * g, acc[r][0]);
      _mm256_storeu_ps(o + r * kD + 16 * g + 8, acc[r][1]);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t heads = argc > 1 ? std::atoi(argv[1]) : 8;   // NHD: row stride heads * D elements
  const int chunks = argc > 2 ? std::atoi(argv[2]) : 1;      // chunks cycled (footprint)
  // calibrate: core cycles per TSC cycle
  const int64_t fma_iters = 20'000'000;
  uint64_t t0 = __rdtsc();
  volatile float sink = fma_clock(fma_iters);
  const double core_per_tsc = (12.0 * fma_iters / 2) / static_cast<double>(__rdtsc() - t0);
  std::printf("core cycles per TSC cycle %.3f; rows %ld heads apart, %d chunk(s) cycled\n", core_per_tsc,
              static_cast<long>(heads), chunks);
  std::vector<float> q(kRows * kD), p(kRows * kKeys), o(kRows * kD), red(kRows * 16 * 8), out(kRows * 16);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 17);
  for (size_t i = 0; i < p.size(); ++i) p[i] = 0.05f;
  const auto run = [&](const char* name, int64_t elem, auto fn) {
    const int64_t stride = heads * kD * elem;  // bytes between a head's rows
    const int64_t chunk_bytes = kKeys * stride;
    std::vector<char> cache(static_cast<size_t>(chunk_bytes * chunks + 64));
    for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<char>((i * 37) & 0x37);
    const int iters = 20000;
    double best = 1e300;
    for (int rep = 0; rep < 7; ++rep) {
      const uint64_t start = __rdtsc();
      for (int it = 0; it < iters; ++it) fn(cache.data() + (it % chunks) * chunk_bytes, stride);
      best = std::min(best, static_cast<double>(__rdtsc() - start));
    }
    std::printf("%-18s %7.0f cycles per (chunk, head)\n", name, best * core_per_tsc / iters);
  };
  run("qk_pair_unpack", 2, [&](const char* k, int64_t s) { qk_pair<W::unpack>(q.data(), k, s, red.data(), out.data()); });
  run("qk_pair_shift", 2, [&](const char* k, int64_t s) { qk_pair<W::shift>(q.data(), k, s, red.data(), out.data()); });
  run("qk_key_unpack", 2, [&](const char* k, int64_t s) { qk_key<W::unpack>(q.data(), k, s, red.data(), out.data()); });
  run("qk_key_shift", 2, [&](const char* k, int64_t s) { qk_key<W::shift>(q.data(), k, s, red.data(), out.data()); });
  run("qk_pair_e4m3", 1, [&](const char* k, int64_t s) { qk_pair<W::e4m3>(q.data(), k, s, red.data(), out.data()); });
  run("qk_key_e4m3", 1, [&](const char* k, int64_t s) { qk_key<W::e4m3>(q.data(), k, s, red.data(), out.data()); });
  run("pv_unpack", 2, [&](const char* v, int64_t s) { pv<W::unpack>(p.data(), v, s, o.data()); });
  run("pv_shift", 2, [&](const char* v, int64_t s) { pv<W::shift>(p.data(), v, s, o.data()); });
  run("pv_e4m3", 1, [&](const char* v, int64_t s) { pv<W::e4m3>(p.data(), v, s, o.data()); });
  std::printf("(checksum %g %g %g)\n", static_cast<double>(sink), static_cast<double>(out[0]),
              static_cast<double>(o[0]));
  return 0;
}
