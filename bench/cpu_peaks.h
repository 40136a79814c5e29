// Measured CPU peaks shared by the CPU benchmarks (cpu_bench, cpu_mla_bench): memory copy / read
// bandwidth, the loads-only rate of a paged decode read, f32 FMA rates at 8 and 16 lanes, the bf16
// dot (vdpbf16ps) and AMX tdpbf16ps rates, all threads of the OpenMP team. x86-64 with AVX2 at
// least; each peak needing more runs only where CPUID reports it (0 otherwise).
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

// The widest f32 FMA the CPU runs: 16 lanes (AVX-512F) or 8 (AVX2 + FMA).
inline bool has_avx512f() { return __builtin_cpu_supports("avx512f"); }
inline bool has_avx512bf16() { return __builtin_cpu_supports("avx512bf16"); }

// Read-only streaming over [p, p + bytes) (bytes a multiple of 256): 4 independent chains of
// vector loads, 64-byte (AVX-512) or 32-byte (AVX2) wide; returns a value that depends on every
// byte.
__attribute__((target("avx512f"))) inline int64_t read_stream_avx512(const char* p, size_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < bytes; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
}

__attribute__((target("avx2"))) inline int64_t read_stream_avx2(const char* p, size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < bytes; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  return _mm256_extract_epi64(x, 0) + _mm256_extract_epi64(x, 1) + _mm256_extract_epi64(x, 2) +
         _mm256_extract_epi64(x, 3);
}

inline int64_t read_stream(const char* p, size_t bytes) {
  return has_avx512f() ? read_stream_avx512(p, bytes) : read_stream_avx2(p, bytes);
}

// Best of 7 passes over 1 GiB (memcpy: read + write bytes, the STREAM-copy convention; read:
// read_stream). Every thread streams its own contiguous part.
inline double measure_bandwidth_gbs(bool read_only) {
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
        sink += read_stream(src + begin, chunk);
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

// The loads-only floor of a paged decode read: every thread takes whole requests (dynamic
// schedule, as the decode plan's head-fused items) and reads each of its pages whole, K then V
// (block_bytes each, at k_base / v_base + block * block_stride), in passes with the page two
// ahead prefetched into L2 line by line while the current one is read and passes without
// software prefetches (the hardware prefetchers alone; on the Zen 3 guest a page read front to
// back streams faster that way, docs/perf/cpu.md session 29). No compute: the rate of the access
// pattern itself, the ceiling of a decode kernel that reads the same pages. Best of 3 passes of
// each.
inline double measure_paged_read_gbs(const char* k_base, const char* v_base, int64_t block_stride,
                                     int64_t block_bytes, const int32_t* block_table,
                                     int64_t table_stride, int num_reqs, int blocks_per_req) {
  double best = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const bool prefetch = rep % 2 == 0;
    const double start = omp_get_wtime();
    int64_t sink = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : sink)
    for (int r = 0; r < num_reqs; ++r) {
      const int32_t* blocks = block_table + static_cast<int64_t>(r) * table_stride;
      for (int j = 0; j < blocks_per_req; ++j) {
        if (prefetch && j + 2 < blocks_per_req) {
          const int64_t ahead = static_cast<int64_t>(blocks[j + 2]) * block_stride;
          for (int64_t line = 0; line < block_bytes; line += 64) {
            __builtin_prefetch(k_base + ahead + line, 0, 2);
            __builtin_prefetch(v_base + ahead + line, 0, 2);
          }
        }
        const int64_t at = static_cast<int64_t>(blocks[j]) * block_stride;
        sink += read_stream(k_base + at, static_cast<size_t>(block_bytes));
        sink += read_stream(v_base + at, static_cast<size_t>(block_bytes));
      }
    }
    benchmark::DoNotOptimize(sink);
    const double bytes = 2.0 * static_cast<double>(block_bytes) * num_reqs * blocks_per_req;
    best = std::max(best, bytes / seconds_since(start) / 1e9);
  }
  return best;
}

// FLOP rate of loop(iters) (independent accumulator chains) run on every thread at once,
// flops_per_iteration FLOPs per iteration and thread, best of 3 passes.
template <class Loop>
inline double measure_rate_gflops(Loop loop, double flops_per_iteration) {
  const int64_t iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double start = omp_get_wtime();
    int threads = 1;
#pragma omp parallel
    {
#pragma omp single
      threads = omp_get_num_threads();
      benchmark::DoNotOptimize(loop(iters));
    }
    const double flops = static_cast<double>(iters) * threads * flops_per_iteration;
    best = std::max(best, flops / seconds_since(start) / 1e9);
  }
  return best;
}

__attribute__((target("avx512f"))) inline float fma_chains_avx512(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) inline float fma_chains_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  float lanes[8];
  _mm256_storeu_ps(lanes, s);
  return lanes[0] + lanes[7];
}

__attribute__((target("avx512f,avx512bf16"))) inline float dpbf16_chains(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  const __m512bh ab = _mm512_cvtne2ps_pbh(a, a), bb = _mm512_cvtne2ps_pbh(b, b);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], ab, bb);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// f32 FMA rate with `lanes` = 16 (AVX-512F) or 8 (AVX2) lanes: 12 independent chains per thread,
// 2 FLOP per lane. 0 when the CPU lacks the width.
inline double measure_fma_gflops(int lanes) {
  if (lanes == 16 && !has_avx512f()) return 0;
  return measure_rate_gflops(lanes == 16 ? fma_chains_avx512 : fma_chains_avx2, 12.0 * lanes * 2);
}

// vdpbf16ps rate (AVX-512 BF16): 12 chains per thread, 16 lanes x 2 pairs x 2 FLOP per
// instruction. 0 when the CPU lacks AVX512_BF16.
inline double measure_dpbf16_gflops() {
  if (!has_avx512bf16()) return 0;
  return measure_rate_gflops(dpbf16_chains, 12.0 * 64);
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
