// Measured CPU peaks shared by the CPU benchmarks (cpu_bench, cpu_mla_bench): memory copy / read
// bandwidth, f32 FMA and bf16 dot (vdpbf16ps) rates, and the AMX tdpbf16ps rate, all threads
// of the OpenMP team. x86-64 with AVX-512 only (the benchmarks are built there).
#pragma once

#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../src/backends/cpu/cpu_kernels.h"

namespace pagedattn::bench {

inline double seconds_since(double start) { return omp_get_wtime() - start; }

// Best of 7 passes over 1 GiB (memcpy: read + write bytes, the STREAM-copy convention; read:
// AVX-512 loads, 4 independent chains). Every thread streams its own contiguous part.
__attribute__((target("avx512f"))) inline double measure_bandwidth_gbs(bool read_only) {
  const size_t bytes = size_t{1} << 30;
  char* src = static_cast<char*>(std::aligned_alloc(size_t{1} << 21, bytes));
  char* dst = read_only ? nullptr : static_cast<char*>(std::aligned_alloc(size_t{1} << 21, bytes));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(bytes >> 12); ++i) {
    std::memset(src + (i << 12), static_cast<int>(i), 4096);
    if (dst != nullptr) std::memset(dst + (i << 12), 0, 4096);
  }
  double best = 0;
  for (int rep = 0; rep < 7; ++rep) {
    const double start = omp_get_wtime();
    int64_t sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      const size_t nt = static_cast<size_t>(omp_get_num_threads());
      const size_t t = static_cast<size_t>(omp_get_thread_num());
      const size_t chunk = bytes / nt / 256 * 256, begin = chunk * t;
      if (read_only) {
        const char* p = src + begin;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i < chunk; i += 256) {
          a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
          a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
          a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
          a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
        }
        sink += _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
      } else {
        std::memcpy(dst + begin, src + begin, chunk);
      }
    }
    benchmark::DoNotOptimize(sink);
    benchmark::DoNotOptimize(dst);
    const double seconds = seconds_since(start);
    best = std::max(best, (read_only ? 1.0 : 2.0) * static_cast<double>(bytes) / seconds / 1e9);
  }
  std::free(src);
  std::free(dst);
  return best;
}

__attribute__((target("avx512f,avx512bf16"))) inline double measure_compute_gflops(bool bf16) {
  const int64_t iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double start = omp_get_wtime();
    int threads = 1;
#pragma omp parallel
    {
#pragma omp single
      threads = omp_get_num_threads();
      __m512 acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
      const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
      const __m512bh ab = _mm512_cvtne2ps_pbh(a, a), bb = _mm512_cvtne2ps_pbh(b, b);
      for (int64_t it = 0; it < iters; ++it) {
        for (int i = 0; i < 12; ++i) {
          acc[i] = bf16 ? _mm512_dpbf16_ps(acc[i], ab, bb) : _mm512_fmadd_ps(acc[i], a, b);
        }
      }
      __m512 s = acc[0];
      for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
      benchmark::DoNotOptimize(s);
    }
    // per instruction: 16 lanes x 2 FLOP (FMA) or 16 lanes x 2 pairs x 2 FLOP (dpbf16)
    const double flops = static_cast<double>(iters) * 12 * threads * (bf16 ? 64 : 32);
    best = std::max(best, flops / seconds_since(start) / 1e9);
  }
  return best;
}

// tdpbf16ps rate (AMX-BF16, all threads): 4 independent accumulator tiles, operands in tiles
// (no loads). Per instruction 16 x 16 x 32 multiply-adds = 16384 FLOP. 0 when AMX cannot run.
inline double measure_amx_gflops() {
  if (!cpu::isa_supported(cpu::Isa::amx)) return 0;  // also obtains the tile permission
  const int64_t iters = 2'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double start = omp_get_wtime();
    int threads = 1;
#pragma omp parallel
    {
#pragma omp single
      threads = omp_get_num_threads();
      struct alignas(64) {
        uint8_t palette = 1, start_row = 0, reserved[14] = {};
        uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
        uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
      } config;
      alignas(64) static thread_local uint16_t data[16 * 32];
      for (int i = 0; i < 16 * 32; ++i) data[i] = 0x3C00;  // bf16 0.0078
      const size_t stride = 64;
      __asm__ volatile("ldtilecfg %0" ::"m"(config));
      __asm__ volatile(
          "tilezero %%tmm0\n tilezero %%tmm1\n tilezero %%tmm2\n tilezero %%tmm3\n"
          "tileloadd (%0,%1,1), %%tmm4\n tileloadd (%0,%1,1), %%tmm5\n"
          "tileloadd (%0,%1,1), %%tmm6\n" ::"r"(data), "r"(stride) : "memory");
      for (int64_t it = 0; it < iters; ++it) {
        __asm__ volatile(
            "tdpbf16ps %%tmm5, %%tmm4, %%tmm0\n tdpbf16ps %%tmm6, %%tmm4, %%tmm1\n"
            "tdpbf16ps %%tmm5, %%tmm6, %%tmm2\n tdpbf16ps %%tmm6, %%tmm5, %%tmm3\n" ::);
      }
      __asm__ volatile("tilerelease" ::: "memory");
    }
    const double flops = static_cast<double>(iters) * 4 * threads * 16384;
    best = std::max(best, flops / seconds_since(start) / 1e9);
  }
  return best;
}

}  // namespace pagedattn::bench
