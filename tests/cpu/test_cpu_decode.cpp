// The direct decode kernels of the CPU backend (cpu_decode_direct.h: head-fused decode items
// computed on the cache rows in place; cpu_decode_avx512.h, bf16 dot products over bf16 and fp8
// caches; cpu_decode_avx512_fma.h and cpu_decode_avx2.h, f32 FMA over bf16, f16 and fp8 caches;
// the avx512 and amx paths run in both forms, PAGEDATTN_CPU_DECODE_KERNEL=dot / fma) against the
// REFERENCE (fp64) on fresh
// random inputs: GQA groups 1..8 (register blocks of 1..4 rows and several blocks per head), head
// sizes 32..256, block sizes 16/32/64, NHD and HND, contexts that end inside a page,
// 1-3 query tokens per request (and speculative decodes of 2, 4 and 8), sinks, soft-cap, ALiBi, sliding and symmetric windows, the LSE,
// logits scaled up so that the running max jumps by more than the lazy-rescale slack, 1 and 2
// threads. Every case checks that the path actually ran (direct_decode_items_run) and that the
// tile kernel (PAGEDATTN_CPU_DECODE_KERNEL=tile) gives the same answer within tolerance; the
// items no kernel applies to (f32 caches, blocks of 8/24, D != Dv) are checked to stay on the
// tile kernel. Every path also runs the other cache dtypes (fp8 e4m3 with its NaN code, fp8 e5m2,
// f16; on the dot form the f16 cache and f32 activations take the FMA kernel). The AVX2 kernel
// also runs under both vendors' plans (set_cpu_vendor_override): CpuDirectDecodeVendors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_backend.h"
#include "../../src/backends/cpu/cpu_internal.h"
#include "conformance/env_guard.h"
#include "conformance/harness.h"
#include "sanitized_build.h"

namespace pagedattn::cpu {
namespace {

using conformance::ConformanceCase;
using conformance::ConformanceResult;

using conformance::EnvGuard;

// The kernel tables the direct decode kernels live in: avx2 (the AVX2 kernel), avx512f (the
// AVX-512 FMA kernel; the AVX2 one where D is not a multiple of 32), avx512, amx (where AMX runs)
// and the AMX kernels with an emulated tile unit (wherever avx512 runs).
enum class Path { avx2, avx512f, avx512, amx, amx_emulated };

// A path, and the decode kernel choice its direct runs take: auto, or on the avx512 and amx paths
// each form (dot: bf16 dot products; fma: f32 FMA).
struct PathForm {
  Path path;
  DecodeKernel form;
};

std::string path_name(const ::testing::TestParamInfo<PathForm>& info) {
  std::string name;
  switch (info.param.path) {
    case Path::avx2: name = "avx2"; break;
    case Path::avx512f: name = "avx512f"; break;
    case Path::avx512: name = "avx512"; break;
    case Path::amx: name = "amx"; break;
    default: name = "amx_emulated"; break;
  }
  switch (info.param.form) {
    case DecodeKernel::fma: return name + "_fma";
    case DecodeKernel::dot: return name + "_dot";
    default: return name;
  }
}

class CpuDirectDecode : public ::testing::TestWithParam<PathForm> {
 protected:
  void SetUp() override {
    switch (GetParam().path) {
      case Path::avx2:
        if (!isa_supported(Isa::avx2)) GTEST_SKIP() << "avx2 is not available here";
        set_isa_override(Isa::avx2);
        break;
      case Path::avx512f:
        if (!isa_supported(Isa::avx512f)) GTEST_SKIP() << "avx512f is not available here";
        set_isa_override(Isa::avx512f);
        break;
      case Path::avx512:
        if (!isa_supported(Isa::avx512)) GTEST_SKIP() << "avx512 is not available here";
        set_isa_override(Isa::avx512);
        break;
      case Path::amx:
        if (!isa_supported(Isa::amx)) GTEST_SKIP() << "amx is not available here";
        set_isa_override(Isa::amx);
        break;
      case Path::amx_emulated:
        if (!isa_supported(Isa::avx512)) GTEST_SKIP() << "needs avx512";
        set_kernel_table_override(amx_emulated_kernel_table());
        break;
    }
  }
  void TearDown() override {
    set_kernel_table_override(nullptr);
    clear_isa_override();
    clear_decode_kernel_override();
  }

  struct CaseInputsHolder {
    conformance::CaseInputs inputs;
    conformance::RunOptions options;
    conformance::BackendOutputs reference;
  };

  struct Outcome {
    ConformanceResult result;
    uint64_t direct_items = 0;  // items the run sent to the direct decode kernel
    int fused_items = 0;        // head-fused items of its plan
  };

  // Runs the case with the given decode kernel choice against the REFERENCE.
  static Outcome run(const CaseInputsHolder& holder, DecodeKernel kernel) {
    set_decode_kernel_override(kernel);
    conformance::PreparedRun prepared =
        conformance::prepare_run(cpu_backend(), Device::cpu, holder.inputs, holder.options);
    const auto& md = dynamic_cast<const CpuAttentionMetadata&>(*prepared.step_metadata);
    Outcome outcome;
    for (const WorkItem& item : md.items) outcome.fused_items += item.num_kv_heads > 1 ? 1 : 0;
    const uint64_t before = direct_decode_items_run();
    conformance::execute(prepared);
    outcome.direct_items = direct_decode_items_run() - before;
    outcome.result =
        conformance::compare(holder.inputs, conformance::collect(prepared), holder.reference);
    return outcome;
  }

  static CaseInputsHolder prepare(const ConformanceCase& c, uint64_t seed, float logit_boost = 1.f,
                                  std::optional<bool> causal = std::nullopt) {
    CaseInputsHolder holder;
    holder.inputs = conformance::make_inputs(c, seed);
    holder.inputs.scale *= logit_boost;
    holder.options.causal = causal;
    holder.reference = conformance::run_backend(conformance::reference(), Device::cpu,
                                                holder.inputs, holder.options);
    return holder;
  }

  // The case on the direct kernel (the path's form; every fused item must take it) and on the
  // tile kernel (none may), both against the REFERENCE.
  void expect_direct_matches(const ConformanceCase& c, uint64_t seed, float logit_boost = 1.f,
                             std::optional<bool> causal = std::nullopt) const {
    const CaseInputsHolder holder = prepare(c, seed, logit_boost, causal);
    const Outcome direct = run(holder, GetParam().form);
    EXPECT_GT(direct.fused_items, 0) << c.describe() << ": the plan fused no decode";
    EXPECT_EQ(direct.direct_items, static_cast<uint64_t>(direct.fused_items))
        << c.describe() << ": every head-fused item should run the direct decode kernel";
    EXPECT_TRUE(direct.result.passed()) << "direct: " << direct.result.describe();
    const Outcome tile = run(holder, DecodeKernel::tile);
    EXPECT_EQ(tile.direct_items, 0u) << c.describe();
    EXPECT_TRUE(tile.result.passed()) << "tile: " << tile.result.describe();
  }

  // The case must stay on the tile kernel (and still match).
  void expect_tile_only(const ConformanceCase& c, uint64_t seed) const {
    const CaseInputsHolder holder = prepare(c, seed);
    const Outcome outcome = run(holder, GetParam().form);
    EXPECT_GT(outcome.fused_items, 0) << c.describe();
    EXPECT_EQ(outcome.direct_items, 0u) << c.describe() << ": not a direct decode case";
    EXPECT_TRUE(outcome.result.passed()) << outcome.result.describe();
  }

  // The e4m3 NaN code 0x7F in request 0's key 37, KV head 1, dim 5 of V and, with `in_k`, in
  // request 1's key 20, KV head 0, dim 9 of K (8 q / 2 kv heads, D 64, one token a request): NaN in
  // dim 5 of request 0's rows of head 1 and, with `in_k`, in every dim of request 1's rows of head
  // 0, nowhere else, on the direct kernel (the path's form) and on the tile kernel alike.
  void expect_e4m3_nan_codes_reach_the_output(bool in_k) const {
    const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");
    ConformanceCase c;
    c.dtype = DType::bf16;
    c.kv_cache_dtype = "fp8_e4m3";
    c.head_size = 64;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.batch = {{100, 1}, {50, 1}};
    const conformance::CaseInputs inputs = conformance::make_inputs(c, 801);
    for (DecodeKernel kernel : {GetParam().form, DecodeKernel::tile}) {
      set_decode_kernel_override(kernel);
      conformance::PreparedRun run = conformance::prepare_run(cpu_backend(), Device::cpu, inputs);
      const TensorView cache = run.kv_cache.view();  // (2, blocks, block_size, Hkv, D)
      const auto* table = static_cast<const int32_t*>(run.step_common.block_table.data());
      const int64_t cols = run.step_common.block_table.view().size(1);
      const auto put_code = [&](int req, int key, int head, int dim, bool value) {
        const int64_t block = table[req * cols + key / 16];
        const int64_t at = (value ? cache.stride(0) : 0) + block * cache.stride(1) +
                           (key % 16) * cache.stride(2) + head * cache.stride(3) +
                           dim * cache.stride(4);
        static_cast<uint8_t*>(run.kv_cache.data())[at] = 0x7F;
      };
      put_code(0, 37, 1, 5, true);
      if (in_k) put_code(1, 20, 0, 9, false);
      const uint64_t before = direct_decode_items_run();
      conformance::execute(run);
      EXPECT_EQ(direct_decode_items_run() - before, kernel == DecodeKernel::tile ? 0u : 2u);
      for (int token = 0; token < 2; ++token) {
        for (int h = 0; h < 8; ++h) {
          for (int d = 0; d < 64; ++d) {
            const float x =
                load_f32(run.output.data(), run.output.dtype(), (token * 8 + h) * 64 + d);
            const bool expect_nan =
                (token == 0 && h / 4 == 1 && d == 5) || (in_k && token == 1 && h / 4 == 0);
            EXPECT_EQ(std::isnan(x), expect_nan)
                << "token " << token << " head " << h << " dim " << d
                << (kernel == DecodeKernel::tile ? " (tile)" : "");
          }
        }
      }
    }
    clear_decode_kernel_override();
  }
};

INSTANTIATE_TEST_SUITE_P(Paths, CpuDirectDecode,
                         ::testing::Values(PathForm{Path::avx2, DecodeKernel::automatic},
                                           PathForm{Path::avx512f, DecodeKernel::automatic},
                                           PathForm{Path::avx512, DecodeKernel::dot},
                                           PathForm{Path::avx512, DecodeKernel::fma},
                                           PathForm{Path::amx, DecodeKernel::dot},
                                           PathForm{Path::amx, DecodeKernel::fma},
                                           PathForm{Path::amx_emulated, DecodeKernel::dot},
                                           PathForm{Path::amx_emulated, DecodeKernel::fma}),
                         path_name);

// Llama-3-8B's shape (32 q / 8 kv heads, D 128) over contexts that end anywhere in a page.
// Under ASan (tests/sanitized_build.h) the three long contexts are cut to 200, 128 and 324 keys,
// a third of the keys: the same nine requests, heads, thread counts, empty and one-page
// contexts, and offsets in the last page (1000, 512 and 1300 mod 16). The full batch took
// 25-30 s per path there, its cost (harness fill, reference, comparison) growing with the keys.
// Contexts of several hundred keys on the same D 128, group-of-4 direct kernels stay covered
// under ASan by LargeLogitJumpsRescale (600) and ReadsEveryCacheDtype (700). The Release run
// keeps the full batch.
TEST_P(CpuDirectDecode, GqaFourLlamaShapeRaggedContexts) {
  for (const char* threads : {"1", "2"}) {
    const EnvGuard guard("PAGEDATTN_NUM_THREADS", threads);
    ConformanceCase c;
    c.dtype = DType::bf16;
    c.head_size = 128;
    c.num_heads = 32;
    c.num_kv_heads = 8;
    c.return_lse = true;
    c.distribution = conformance::Distribution::normal;
    if (test_env::kSanitizedBuild) {
      c.batch = {{200, 1}, {36, 1}, {128, 1}, {15, 1}, {0, 1},
                 {257, 1}, {95, 1}, {324, 1}, {16, 1}};
    } else {
      c.batch = {{1000, 1}, {36, 1}, {512, 1},  {15, 1}, {0, 1},
                 {257, 1},  {95, 1}, {1300, 1}, {16, 1}};
    }
    expect_direct_matches(c, 201 + (threads[0] - '0'));
  }
}

// Groups of 1, 2, 6 and 8 rows per KV head (blocks of 1..4 rows, two blocks for 6 and 8), head
// sizes 32..256 (a 32-dim tail of P·V for 32, 96, 160), block sizes 16/32/64, both layouts, and 2-3
// token decodes (rows with different causal ends).
TEST_P(CpuDirectDecode, GroupsHeadSizesBlockSizesLayouts) {
  const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");
  struct Shape {
    int hq, hkv, d, dv, block;
    KVCacheLayout layout;
  };
  const Shape shapes[] = {{4, 4, 64, 64, 32, KVCacheLayout::HND},
                          {8, 4, 96, 96, 16, KVCacheLayout::NHD},
                          {12, 2, 256, 256, 64, KVCacheLayout::NHD},
                          {16, 2, 32, 32, 16, KVCacheLayout::HND},
                          {24, 4, 128, 128, 32, KVCacheLayout::NHD}};
  for (size_t i = 0; i < std::size(shapes); ++i) {
    ConformanceCase c;
    c.dtype = DType::bf16;
    c.num_heads = shapes[i].hq;
    c.num_kv_heads = shapes[i].hkv;
    c.head_size = shapes[i].d;
    c.head_size_v = shapes[i].dv;
    c.block_size = shapes[i].block;
    c.layout = shapes[i].layout;
    c.return_lse = i % 2 == 0;
    c.batch = {{300, 1}, {70, 2}, {1, 1}, {129, 3}, {64, 1}};
    expect_direct_matches(c, 300 + i);
  }
}

// Speculative decodes (BuilderConfig::num_speculative_tokens = 7): requests of 2, 4 and 8 query
// tokens (the last sampled token + drafts) beside 1-token decodes and a prefill chunk; each row
// attends causally to the cache and the earlier rows of its request. One thread: every decode is
// head-fused and runs the direct kernel; two threads: the decodes are split along the keys
// (split-KV, then merged) as well.
TEST_P(CpuDirectDecode, SpeculativeDecodesOfTwoFourAndEightTokens) {
  for (const char* threads : {"1", "2"}) {
    const EnvGuard guard("PAGEDATTN_NUM_THREADS", threads);
    ConformanceCase c;
    c.dtype = DType::bf16;
    c.head_size = 128;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.num_speculative_tokens = 7;
    c.return_lse = true;
    c.distribution = conformance::Distribution::normal;
    c.batch = {{700, 2}, {37, 4}, {1200, 8}, {15, 1}, {300, 8}, {64, 2}, {0, 40}, {513, 4}};
    expect_direct_matches(c, 410 + (threads[0] - '0'));
  }
}

// Sinks, soft-cap, ALiBi, sliding window (keys before the window skipped a chunk at a time), and a
// non-causal decoder with a symmetric window.
TEST_P(CpuDirectDecode, SinksSoftCapAlibiAndWindows) {
  const EnvGuard guard("PAGEDATTN_NUM_THREADS", "2");
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 64;
  c.num_heads = 16;
  c.num_kv_heads = 4;
  c.return_lse = true;
  c.sinks = true;
  c.batch = {{400, 1}, {33, 1}, {250, 2}, {90, 1}, {700, 1}, {17, 1}, {128, 1}, {64, 1}, {5, 1}};
  expect_direct_matches(c, 401);
  c.soft_cap = 3.f;
  c.sliding_window = 100;
  expect_direct_matches(c, 402);
  c.soft_cap.reset();
  c.sinks = false;
  c.alibi = true;
  c.sliding_window = 37;
  c.layout = KVCacheLayout::HND;
  expect_direct_matches(c, 403);
  c.alibi = false;
  c.sliding_window = 50;
  expect_direct_matches(c, 404, 1.f, /*causal=*/false);
}

// Logits scaled up 30x: the running max of a row jumps by more than the lazy-rescale slack (8)
// between chunks, so O and l are rescaled; plus a 1-key context and a 4-token request.
TEST_P(CpuDirectDecode, LargeLogitJumpsRescale) {
  const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 128;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.return_lse = true;
  c.distribution = conformance::Distribution::normal;
  c.batch = {{600, 1}, {0, 1}, {200, 4}, {47, 1}};
  expect_direct_matches(c, 501, 30.f);
  c.sinks = true;
  expect_direct_matches(c, 502, 10.f);
}

// What no direct kernel takes: f32 caches, block sizes that are not multiples of 16, D != Dv.
// Those fused items run the tile kernel.
TEST_P(CpuDirectDecode, OtherCachesAndBlockSizesStayOnTheTileKernel) {
  const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 64;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.batch = {{100, 1}, {37, 1}, {64, 1}};
  c.dtype = DType::f32;
  expect_tile_only(c, 603);
  c.dtype = DType::bf16;
  c.block_size = 24;
  expect_tile_only(c, 604);
  c.block_size = 8;
  expect_tile_only(c, 605);
  c.block_size = 16;
  c.head_size_v = 32;  // D != Dv: rows padded to max(D, Dv)
  expect_tile_only(c, 606);
}

// The kernels' other caches: f16 (f16 activations), fp8 e4m3 and e5m2 (bf16 and f32 activations,
// per-tensor and per-head scales), with windows, sinks and soft-cap, both layouts, D 128 and a
// head size that is not a multiple of 32 where a path has a kernel for it (80: the AVX2 kernel).
TEST_P(CpuDirectDecode, ReadsEveryCacheDtype) {
  const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");
  ConformanceCase c;
  c.head_size = 128;
  c.num_heads = 16;
  c.num_kv_heads = 4;
  c.return_lse = true;
  c.distribution = conformance::Distribution::normal;
  c.batch = {{700, 1}, {45, 1}, {256, 2}, {0, 1}, {130, 1}};
  c.dtype = DType::f16;
  expect_direct_matches(c, 701);
  c.dtype = DType::bf16;
  c.kv_cache_dtype = "fp8_e4m3";
  expect_direct_matches(c, 702);
  c.per_head_kv_scales = true;
  c.sinks = true;
  c.sliding_window = 200;
  expect_direct_matches(c, 703);
  c.kv_cache_dtype = "fp8_e5m2";
  c.layout = KVCacheLayout::HND;
  c.soft_cap = 5.f;
  expect_direct_matches(c, 704);
  c.dtype = DType::f32;
  // The AVX-512 kernels: D a multiple of 32 (96: a 32-dim tail); avx512f takes D 80 to the AVX2 one.
  const bool avx2_kernel_path = GetParam().path == Path::avx2 || GetParam().path == Path::avx512f;
  c.head_size = avx2_kernel_path ? 80 : 96;
  expect_direct_matches(c, 705, 20.f);
  if (GetParam().path == Path::avx512f) {
    c.head_size = 96;  // and D 96 to the AVX-512 FMA kernel
    expect_direct_matches(c, 706, 20.f);
  }
}

// The e4m3 NaN code S.1111.111 in a visible V row reaches the output as NaN (the FMA kernels' fast
// widening would read it as a finite value, the chunk's check switches to the exact one; the
// AVX-512 dot kernel's widening takes it from its table), in the same rows and dims as the tile
// kernel: request 0's rows of KV head 1, dim 5 only. More codes: test_cpu_fp8_nan_codes.cpp.
TEST_P(CpuDirectDecode, E4m3NanCodeReachesTheOutput) {
  expect_e4m3_nan_codes_reach_the_output(/*in_k=*/false);
}

// The AVX2 kernel's per-vendor plans (avx2_prefetch_plan) on every machine, through
// set_cpu_vendor_override: as on Intel (head by head, L1 prefetches only) and as on AMD (L2
// prefetches; key-major chunks, avx2_chunk_major, for NHD items of at most 4 rows a KV head), on
// the same inputs: G = 4 at D 128 (32 q / 8 kv heads, 1 and 2 threads) and D 64 (8 q / 2 kv, block
// size 32), every cache dtype the kernel reads, contexts that end inside a chunk; speculative
// decodes at G = 2 (2 tokens: 4 rows a head, key-major on AMD; 4 tokens: 8 rows, head by head);
// the e4m3 NaN code in a V and a K row.
class CpuDirectDecodeVendors : public CpuDirectDecode {
 protected:
  void TearDown() override {
    clear_cpu_vendor_override();
    CpuDirectDecode::TearDown();
  }

  // The case under each vendor: every head-fused item on the direct kernel, matching REFERENCE.
  void expect_direct_matches_as_each_vendor(const ConformanceCase& c, uint64_t seed) const {
    const CaseInputsHolder holder = prepare(c, seed);
    for (CpuVendor vendor : {CpuVendor::intel, CpuVendor::amd}) {
      set_cpu_vendor_override(vendor);
      const Outcome direct = run(holder, GetParam().form);
      const char* name = vendor == CpuVendor::amd ? "amd" : "intel";
      EXPECT_GT(direct.fused_items, 0)
          << name << " " << c.describe() << ": the plan fused no decode";
      EXPECT_EQ(direct.direct_items, static_cast<uint64_t>(direct.fused_items))
          << name << " " << c.describe() << ": every head-fused item should run the direct kernel";
      EXPECT_TRUE(direct.result.passed()) << name << ": " << direct.result.describe();
    }
    clear_cpu_vendor_override();
  }
};

INSTANTIATE_TEST_SUITE_P(Paths, CpuDirectDecodeVendors,
                         ::testing::Values(PathForm{Path::avx2, DecodeKernel::automatic}),
                         path_name);

TEST_P(CpuDirectDecodeVendors, IntelAndAmdPlansMatchTheReference) {
  ConformanceCase c;
  c.return_lse = true;
  c.distribution = conformance::Distribution::normal;
  const std::vector<conformance::RequestShape> contexts = {{257, 1}, {15, 1}, {100, 1}, {16, 1},
                                                           {1, 1},   {37, 1}, {513, 1}, {0, 1}};
  uint64_t seed = 1001;
  for (const char* kv : {"bf16", "f16", "fp8_e4m3", "fp8_e5m2"}) {
    const std::string dtype = kv;
    c.dtype = dtype == "f16" ? DType::f16 : DType::bf16;
    c.kv_cache_dtype = dtype == "bf16" || dtype == "f16" ? "auto" : kv;
    c.per_head_kv_scales = dtype == "fp8_e4m3";
    c.batch = contexts;
    for (const char* threads : {"1", "2"}) {
      const EnvGuard guard("PAGEDATTN_NUM_THREADS", threads);
      c.head_size = 128;
      c.num_heads = 32;
      c.num_kv_heads = 8;
      c.block_size = 16;
      expect_direct_matches_as_each_vendor(c, seed++);
    }
    const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");
    c.head_size = 64;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.block_size = 32;
    expect_direct_matches_as_each_vendor(c, seed++);
    c.head_size = 128;
    c.num_kv_heads = 4;
    c.block_size = 16;
    c.num_speculative_tokens = 3;
    c.batch = {{300, 2}, {37, 2}, {129, 4}, {15, 1}, {64, 2}, {0, 4}};
    expect_direct_matches_as_each_vendor(c, seed++);
    c.num_speculative_tokens = 0;
  }
  for (CpuVendor vendor : {CpuVendor::intel, CpuVendor::amd}) {
    SCOPED_TRACE(vendor == CpuVendor::amd ? "amd" : "intel");
    set_cpu_vendor_override(vendor);
    expect_e4m3_nan_codes_reach_the_output(/*in_k=*/true);
  }
}

TEST(CpuDecodeKernel, ParsesChoicesAndRejectsUnknownNames) {
  EXPECT_EQ(parse_decode_kernel("auto", "x"), DecodeKernel::automatic);
  EXPECT_EQ(parse_decode_kernel("tile", "x"), DecodeKernel::tile);
  EXPECT_EQ(parse_decode_kernel("fma", "x"), DecodeKernel::fma);
  EXPECT_EQ(parse_decode_kernel("dot", "x"), DecodeKernel::dot);
  for (const char* bad : {"direct", "Tile", "FMA", ""}) {
    try {
      parse_decode_kernel(bad, "PAGEDATTN_CPU_DECODE_KERNEL");
      FAIL() << bad << " is not a choice";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "PAGEDATTN_CPU_DECODE_KERNEL");
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos);
    }
  }
  set_decode_kernel_override(DecodeKernel::tile);
  EXPECT_EQ(decode_kernel(), DecodeKernel::tile);
  clear_decode_kernel_override();
  if (std::getenv("PAGEDATTN_CPU_DECODE_KERNEL") == nullptr) {
    EXPECT_EQ(decode_kernel(), DecodeKernel::automatic);
  }
}

}  // namespace
}  // namespace pagedattn::cpu
