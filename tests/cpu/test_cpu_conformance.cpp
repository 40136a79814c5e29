// The CPU backend against the REFERENCE (fp64) on fresh random inputs, for EVERY kernel path
// this machine can run (scalar, avx2, avx512, amx — forced through the ISA override — and the
// AMX kernels on an emulated tile unit wherever avx512 runs): the shared
// conformance grid (CI grid, or the full one with PAGEDATTN_FULL_GRID=1) plus cases aimed at the
// CPU plan: head sizes 64..256, large GQA groups, long decodes (split-KV + merge), cascade
// groups, q-tiled prefills, block sizes that are not multiples of 16, a non-causal decoder,
// several thread counts. Outputs are poisoned with NaN and every element must be written.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_backend.h"
#include "../../src/backends/cpu/cpu_internal.h"
#include "conformance/env_guard.h"
#include "cpu_kernel_paths.h"
#include "conformance/harness.h"

namespace pagedattn::cpu {
namespace {

using conformance::ConformanceCase;
using conformance::ConformanceResult;
using conformance::RequestShape;

using conformance::EnvGuard;

// Every kernel path this machine runs (cpu_kernel_paths.h).
class CpuIsa : public KernelPathTest {
 protected:
  static void expect_matches(const ConformanceCase& c, uint64_t seed) {
    const ConformanceResult result = conformance::run_case(cpu_backend(), Device::cpu, c, seed);
    EXPECT_TRUE(result.passed()) << active_kernels().name << ": " << result.describe();
  }
};

INSTANTIATE_TEST_SUITE_P(Paths, CpuIsa, every_kernel_path(), kernel_path_name);

TEST_P(CpuIsa, SupportsAndMatchesEveryCaseOfTheConformanceGrid) {
  const std::vector<ConformanceCase> grid = conformance::conformance_grid();
  ASSERT_FALSE(grid.empty());
  const bool full = conformance::full_grid_requested();
  size_t run = 0;
  for (size_t i = 0; i < grid.size(); ++i) {
    const ConformanceCase& c = grid[i];
    const std::vector<std::string> reasons =
        conformance::unsupported_reasons(cpu_backend(), Device::cpu, c);
    if (c.quant_query) {  // no quantized-query path on the CPU (supports_quant_query_input false)
      ASSERT_EQ(reasons.size(), 1u) << c.describe();
      EXPECT_NE(reasons.front().find("quant_query"), std::string::npos) << reasons.front();
      continue;
    }
    if (!reasons.empty()) {
      // The other gaps, absent from the CI grid: head sizes that are not multiples of 16 (the full
      // grid has Dv = 40) and fp8 kv_cache_dtype on encoder layers (no cache to dequantize).
      ASSERT_TRUE(full) << c.describe() << ": " << reasons.front();
      ASSERT_EQ(reasons.size(), 1u) << c.describe() << ": " << reasons.front();
      const bool head_size_gap = reasons.front().find("multiples of 16") != std::string::npos;
      const bool encoder_fp8_gap = !uses_kv_cache(c.attn_type) && c.fp8_kv();
      ASSERT_TRUE(head_size_gap || encoder_fp8_gap) << reasons.front();
      continue;
    }
    ++run;
    expect_matches(c, 0xC9U + 31 * i);
  }
  EXPECT_GT(run, grid.size() * 8 / 10);
}

TEST_P(CpuIsa, HeadSizesFrom64To256WithGqaGroups) {
  const int head_sizes[] = {64, 80, 96, 128, 192, 256};
  const DType dtypes[] = {DType::bf16, DType::f16, DType::f32};
  for (size_t i = 0; i < std::size(head_sizes); ++i) {
    ConformanceCase c;
    c.dtype = dtypes[i % 3];
    c.head_size = head_sizes[i];
    c.num_heads = i % 2 == 0 ? 8 : 16;
    c.num_kv_heads = i % 2 == 0 ? 2 : 1;  // groups of 4 and 16
    c.block_size = i % 2 == 0 ? 16 : 32;
    c.layout = i % 2 == 0 ? KVCacheLayout::NHD : KVCacheLayout::HND;
    c.return_lse = true;
    c.distribution = conformance::Distribution::normal;
    c.batch = {{150, 1}, {0, 40}, {70, 11}, {33, 0}, {9, 1}};
    expect_matches(c, 100 + i);
  }
}

// Aimed at the AMX path (every path runs it): bf16 prefills with many 16-row tile blocks plus
// row tails, head sizes that are multiples of 32 (tiles) or not (vdpbf16ps fallback), value
// sizes of 1 to 4 C tiles per 64 dims, an fp8 cache, and logits scaled up 30x so that the
// running max jumps by more than the lazy-rescale slack (8) between key tiles.
TEST_P(CpuIsa, BfloatPrefillTileBlocksTailsAndLargeLogitJumps) {
  struct Shape {
    int d, dv, hq, hkv;
    const char* kv;
    float logit_boost;
  };
  const Shape shapes[] = {{128, 128, 8, 2, "auto", 1.f},  {64, 80, 4, 1, "auto", 30.f},
                          {96, 48, 6, 3, "fp8_e4m3", 1.f}, {80, 32, 4, 2, "auto", 30.f},
                          {128, 64, 16, 2, "auto", 30.f}};
  for (size_t i = 0; i < std::size(shapes); ++i) {
    ConformanceCase c;
    c.dtype = DType::bf16;
    c.kv_cache_dtype = shapes[i].kv;
    c.head_size = shapes[i].d;
    c.head_size_v = shapes[i].dv;
    c.num_heads = shapes[i].hq;
    c.num_kv_heads = shapes[i].hkv;
    c.return_lse = true;
    c.alibi = i == 4;
    c.distribution = conformance::Distribution::normal;
    c.batch = {{40, 50}, {0, 33}, {37, 1}, {120, 17}};
    conformance::CaseInputs inputs = conformance::make_inputs(c, 70 + i);
    inputs.scale *= shapes[i].logit_boost;
    const ConformanceResult result = conformance::compare(
        inputs, conformance::run_backend(cpu_backend(), Device::cpu, inputs),
        conformance::run_backend(conformance::reference(), Device::cpu, inputs));
    EXPECT_TRUE(result.passed()) << active_kernels().name << " shape " << i << ": "
                                 << result.describe();
  }
}

TEST_P(CpuIsa, QueryTilesOfLongPrefillsAndMha) {
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 64;
  c.num_heads = 2;
  c.num_kv_heads = 2;  // MHA: 128 rows = 128 tokens per q tile -> 2 tiles for 200 tokens
  c.batch = {{20, 200}, {0, 3}};
  c.return_lse = true;
  expect_matches(c, 7);
  c.num_heads = 8;  // GQA 4: 32 tokens per q tile
  c.num_kv_heads = 2;
  c.sliding_window = 37;
  c.dtype = DType::f16;
  expect_matches(c, 8);
}

TEST_P(CpuIsa, LongDecodesSplitTheKeysAndMerge) {
  const EnvGuard threads("PAGEDATTN_NUM_THREADS", "4");
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 128;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.return_lse = true;
  c.sinks = true;
  c.batch = {{900, 1}, {600, 1}, {40, 1}};
  const conformance::CaseInputs inputs = conformance::make_inputs(c, 11);
  conformance::PreparedRun run = conformance::prepare_run(cpu_backend(), Device::cpu, inputs);
  const auto& md = dynamic_cast<const CpuAttentionMetadata&>(*run.step_metadata);
  EXPECT_EQ(md.workspace->num_threads, 4);
  EXPECT_FALSE(md.merges.empty()) << "6 items for 4 threads: the long decodes must be split";
  conformance::execute(run);
  const conformance::BackendOutputs out = conformance::collect(run);
  const conformance::BackendOutputs ref =
      conformance::run_backend(conformance::reference(), Device::cpu, inputs);
  const ConformanceResult result = conformance::compare(inputs, out, ref);
  EXPECT_TRUE(result.passed()) << result.describe();

  // fp8 cache with per-head scales (v_scale applied after the merge), window, soft-cap.
  c.kv_cache_dtype = "fp8_e4m3";
  c.per_head_kv_scales = true;
  c.sinks = false;
  c.soft_cap = 5.f;
  c.sliding_window = 500;
  expect_matches(c, 12);
  c.kv_cache_dtype = "auto";
  c.dtype = DType::f32;
  c.alibi = true;
  c.per_head_kv_scales = false;
  expect_matches(c, 13);
}

// Head-fused decode items (all KV heads of a request in one item): per-head fp8 scales, LSE,
// sinks, HND and NHD layouts, a short prefill beside them, f16 activations on the f32 path.
TEST_P(CpuIsa, DecodeBatchesWithFusedKvHeads) {
  const EnvGuard threads("PAGEDATTN_NUM_THREADS", "2");
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 64;
  c.num_heads = 16;
  c.num_kv_heads = 4;
  c.return_lse = true;
  c.sinks = true;
  c.batch = {{130, 1}, {77, 1}, {0, 5}, {200, 1}, {16, 1}, {95, 2}, {64, 1}, {150, 1}, {33, 1}};
  const conformance::CaseInputs inputs = conformance::make_inputs(c, 61);
  conformance::PreparedRun run = conformance::prepare_run(cpu_backend(), Device::cpu, inputs);
  const auto& md = dynamic_cast<const CpuAttentionMetadata&>(*run.step_metadata);
  int fused = 0;
  for (const WorkItem& item : md.items) fused += item.num_kv_heads == 4 ? 1 : 0;
  EXPECT_GE(fused, 8) << "the decodes should be fused over their kv heads";
  conformance::execute(run);
  const ConformanceResult result = conformance::compare(
      inputs, conformance::collect(run),
      conformance::run_backend(conformance::reference(), Device::cpu, inputs));
  EXPECT_TRUE(result.passed()) << result.describe();

  c.kv_cache_dtype = "fp8_e4m3";
  c.per_head_kv_scales = true;
  c.layout = KVCacheLayout::HND;
  c.soft_cap = 4.f;
  expect_matches(c, 62);
  c.kv_cache_dtype = "auto";
  c.per_head_kv_scales = false;
  c.dtype = DType::f16;
  c.layout = KVCacheLayout::NHD;
  c.sliding_window = 40;
  c.alibi = true;
  expect_matches(c, 63);
}

TEST_P(CpuIsa, CascadeGroupsReadTheSharedPrefixOnce) {
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 64;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.return_lse = true;
  c.sinks = true;
  c.cascade_prefix = 96;
  c.batch = {{100, 1}, {130, 1}, {97, 2}, {200, 70}, {96, 1}, {150, 0}, {101, 1}};
  const conformance::CaseInputs inputs = conformance::make_inputs(c, 21);
  conformance::PreparedRun run = conformance::prepare_run(cpu_backend(), Device::cpu, inputs);
  const auto& md = dynamic_cast<const CpuAttentionMetadata&>(*run.step_metadata);
  ASSERT_TRUE(md.use_cascade);
  bool grouped = false;
  for (const WorkItem& item : md.items) grouped |= item.req_end - item.req_begin > 1;
  EXPECT_TRUE(grouped) << "decodes sharing the prefix should be grouped into one item";
  conformance::execute(run);
  const ConformanceResult result = conformance::compare(
      inputs, conformance::collect(run),
      conformance::run_backend(conformance::reference(), Device::cpu, inputs));
  EXPECT_TRUE(result.passed()) << result.describe();
  EXPECT_TRUE(result.used_cascade);
  c.dtype = DType::f16;
  c.kv_cache_dtype = "fp8_e5m2";
  c.head_size_v = 32;
  expect_matches(c, 22);
}

TEST_P(CpuIsa, BlockSizesThatAreNotMultiplesOf16) {
  for (int block_size : {1, 8, 24}) {
    ConformanceCase c;
    c.dtype = block_size == 8 ? DType::f32 : DType::bf16;
    c.head_size = 48;
    c.num_heads = 6;
    c.num_kv_heads = 3;
    c.block_size = block_size;
    c.layout = block_size == 24 ? KVCacheLayout::HND : KVCacheLayout::NHD;
    c.batch = {{75, 1}, {0, 19}, {31, 5}};
    expect_matches(c, 30 + block_size);
  }
}

TEST_P(CpuIsa, NonCausalDecoderWithSymmetricWindow) {
  ConformanceCase c;
  c.dtype = DType::f32;
  c.head_size = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.sliding_window = 6;
  c.return_lse = true;
  c.batch = {{20, 4}, {0, 9}, {13, 1}};
  conformance::RunOptions options;
  options.causal = false;
  const conformance::CaseInputs inputs = conformance::make_inputs(c, 41);
  const ConformanceResult result = conformance::compare(
      inputs, conformance::run_backend(cpu_backend(), Device::cpu, inputs, options),
      conformance::run_backend(conformance::reference(), Device::cpu, inputs, options));
  EXPECT_TRUE(result.passed()) << result.describe();
}

TEST_P(CpuIsa, EveryThreadCountGivesTheSameAnswer) {
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 1;
  c.return_lse = true;
  c.batch = {{600, 1}, {0, 50}, {300, 2}};
  for (const char* threads : {"1", "2", "3", "8"}) {
    const EnvGuard guard("PAGEDATTN_NUM_THREADS", threads);
    expect_matches(c, 50);
  }
}

}  // namespace
}  // namespace pagedattn::cpu
