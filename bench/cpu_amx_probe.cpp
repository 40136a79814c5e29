// cpu_amx_probe: TSC cycles of the AMX path's tile sequences (cpu_kernels_amx.cpp) on one core,
// per 16-row x 64-key block at D = Dv = 128 (16 tdpbf16ps each for Q·Kᵀ and P·V = 256 cycles at
// the tile unit's 1024 FLOP/cycle), outside the kernel:
//   qk / pv steady   the kernel's Q·Kᵀ block (1 A + 4 B loads a 32-dim step, S stored) and P·V
//                    block (O loaded into 4 C tiles, 2 key steps, O stored), back to back, over
//                    32 / 128 / 256 rows (Q, S, O of 4 KiB .. 128 KiB: L1 or L2)
//   after an AVX gap qk over 128 rows after N iterations of an AVX-512 FMA loop (4 chains), as
//                    when the kernel ran a whole tile's softmax between its Q·Kᵀ and P·V phases
// Why: inside the kernel (rdtsc around its phases) Q·Kᵀ and P·V cost 3-8x the 256-cycle floor;
// this separates the tile sequences from the rest of the kernel. On the shared 2-vCPU VM its
// steady figures moved 3-4x between runs (the tile unit's rate is what the host leaves, as
// Peak/amx_bf16 moves), so compare rows of one run only (docs/perf/cpu.md, "AMX prefill
// (2026-12-06, session 24, issue 22)").
// Build: PAGEDATTN_BUILD_BENCH=ON on x86-64; run on a CPU with AMX-BF16 (the backend's
// cpu::isa_supported checks CPUID and obtains the tile state from Linux; elsewhere it prints that
// and exits).
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "backends/cpu/cpu_kernels.h"

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#define LD(T, p, s) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(p), "r"((size_t)(s)) : "memory")
#define ST(T, p, s) __asm__ volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(p), "r"((size_t)(s)) : "memory")
#define DP(C, A, B) __asm__ volatile("tdpbf16ps %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)
#define ZERO(T) __asm__ volatile("tilezero %%tmm" #T ::)

alignas(64) uint16_t g_q[256 * 128];  // rows x D bf16
alignas(64) uint32_t g_k[64 * 64];    // K pack [D/2][64] dwords
alignas(64) float g_s[256 * 64];
alignas(64) uint16_t g_p[256 * 64];
alignas(64) uint32_t g_v[32 * 128];   // V pack [32][Dv] dwords
alignas(64) float g_o[256 * 128];

void qk(int rows) {  // as AmxOps::qk_tile_step over a block
  for (int i = 0; i < rows; i += 16) {
    const uint16_t* q = g_q + i * 128;
    float* s = g_s + i * 64;
    ZERO(0); ZERO(1); ZERO(2); ZERO(3);
    for (int d0 = 0; d0 < 128; d0 += 32) {
      const uint32_t* kb = g_k + (d0 / 2) * 64;
      LD(4, q + d0, 256);
      LD(5, kb, 256); DP(0, 4, 5);
      LD(6, kb + 16, 256); DP(1, 4, 6);
      LD(7, kb + 32, 256); DP(2, 4, 7);
      LD(5, kb + 48, 256); DP(3, 4, 5);
    }
    ST(0, s, 256); ST(1, s + 16, 256); ST(2, s + 32, 256); ST(3, s + 48, 256);
  }
}

void pv(int rows) {  // as AmxOps::pv_tile_part over a block, Dv = 128
  for (int i = 0; i < rows; i += 16) {
    for (int d0 = 0; d0 < 128; d0 += 64) {
      float* o = g_o + i * 128 + d0;
      const uint16_t* p = g_p + i * 64;
      const uint16_t* vp = reinterpret_cast<const uint16_t*>(g_v) + 2 * d0;
      LD(0, o, 512); LD(1, o + 16, 512); LD(2, o + 32, 512); LD(3, o + 48, 512);
      for (int ks = 0; ks < 2; ++ks) {
        const uint16_t* vb = vp + 2 * 16 * ks * 128;
        LD(4, p + 32 * ks, 128);
        LD(5, vb, 512); DP(0, 4, 5);
        LD(6, vb + 32, 512); DP(1, 4, 6);
        LD(7, vb + 64, 512); DP(2, 4, 7);
        LD(5, vb + 96, 512); DP(3, 4, 5);
      }
      ST(0, o, 512); ST(1, o + 16, 512); ST(2, o + 32, 512); ST(3, o + 48, 512);
    }
  }
}

__attribute__((target("avx512f"))) float avx_loop(int iterations) {
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  for (int i = 0; i < iterations; ++i) {
    c0 = _mm512_fmadd_ps(a, b, c0); c1 = _mm512_fmadd_ps(a, b, c1);
    c2 = _mm512_fmadd_ps(a, b, c2); c3 = _mm512_fmadd_ps(a, b, c3);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
}
volatile float g_sink;

// Median of 7 runs of TSC cycles per 16-row block of f(rows), each after avx_loop(gap).
template <class F>
double cycles_per_block(F f, int rows, int gap) {
  std::vector<double> runs;
  for (int r = 0; r < 7; ++r) {
    uint64_t total = 0;
    for (int it = 0; it < 200; ++it) {
      if (gap > 0) g_sink = avx_loop(gap);
      _mm_lfence();
      const uint64_t t0 = __rdtsc();
      _mm_lfence();
      f(rows);
      _mm_lfence();
      total += __rdtsc() - t0;
    }
    runs.push_back(static_cast<double>(total) / 200 / (rows / 16));
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

}  // namespace

int main() {
  if (!pagedattn::cpu::isa_supported(pagedattn::cpu::Isa::amx)) {
    std::printf("cpu_amx_probe: no AMX-BF16 tiles here\n");
    return 0;
  }
  for (auto& x : g_q) x = 0x3C00;
  for (auto& x : g_k) x = 0x3C003C00;
  for (auto& x : g_p) x = 0x3C00;
  for (auto& x : g_v) x = 0x3C003C00;
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
  std::printf("TSC cycles per 16-row x 64-key block, D = Dv = 128 (16 tdpbf16ps = 256 cycles at peak)\n");
  for (int rows : {32, 128, 256}) {
    std::printf("  steady, %3d rows: qk %5.0f  pv %5.0f\n", rows, cycles_per_block(qk, rows, 0),
                cycles_per_block(pv, rows, 0));
  }
  for (int gap : {250, 500, 1000, 2000, 4000, 16000}) {
    std::printf("  qk of 128 rows after %5d AVX-512 loop iterations: %5.0f\n", gap,
                cycles_per_block(qk, 128, gap));
  }
  __asm__ volatile("tilerelease");
  return 0;
}
