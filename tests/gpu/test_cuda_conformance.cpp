// The CUDA backend against the REFERENCE (fp64) through the conformance harness: the harness's
// own grid (the cases CUDA supports) plus a CUDA grid that walks every head size, both activation
// dtypes, every KV dtype, block sizes 16..64 and 48, both layouts, every feature, GQA groups up to
// 32, and the batch shapes that exercise the kernel's paths: 1-token decodes (decode path),
// spec-decode rows, long prefill chunks with context (several 128-row tiles), split-KV (few long
// requests) and no split (many requests), empty requests and padding.
// PAGEDATTN_FULL_GRID=1 also runs the harness's full grid; PAGEDATTN_GPU_SMALL_GRID=1 runs every
// 8th CUDA case only (the sanitizer runs of scripts/gpu-check).
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "conformance/harness.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using conformance::ConformanceCase;
using conformance::RequestShape;

std::vector<std::vector<RequestShape>> cuda_batches() {
  return {
      {{0, 5}, {17, 1}, {9, 0}, {33, 7}, {5, 1}},           // mixed, an empty query
      {{700, 1}, {1500, 1}, {64, 1}, {2100, 1}},            // long decodes: split-KV
      {{40, 100}, {130, 1}, {0, 0}},                        // a 100-token chunk with context
      {{300, 4}, {77, 3}, {500, 2}},                        // spec-decode style rows
      {{0, 150}},                                           // plain causal prefill, several tiles
  };
}

// Many requests (no split): more work items than resident CTAs.
std::vector<RequestShape> wide_batch() {
  std::vector<RequestShape> batch;
  for (int i = 0; i < 72; ++i) batch.push_back({40 + (i * 37) % 200, i % 9 == 0 ? 3 : 1});
  return batch;
}

std::vector<ConformanceCase> cuda_grid() {
  std::vector<ConformanceCase> cases;
  const int head_sizes[] = {64, 80, 96, 128, 192, 256};
  const int block_sizes[] = {16, 32, 64, 48};
  const std::pair<int, int> heads[] = {{8, 2}, {4, 4}, {16, 1}, {32, 1}, {16, 2}};
  const char* kv_dtypes[] = {"auto", "fp8_e4m3", "fp8_e5m2"};
  const auto batches = cuda_batches();
  size_t index = 0;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int d : head_sizes) {
      for (int variant = 0; variant < 6; ++variant, ++index) {
        ConformanceCase c;
        c.dtype = dtype;
        c.head_size = d;
        c.block_size = block_sizes[index % 4];
        c.layout = index % 3 == 0 ? KVCacheLayout::HND : KVCacheLayout::NHD;
        const auto [hq, hkv] = heads[index % 5];
        c.num_heads = hq;
        c.num_kv_heads = hkv;
        c.kv_cache_dtype = kv_dtypes[(index / 2) % 3];
        c.per_head_kv_scales = c.kv_cache_dtype != "auto" && index % 4 == 1;
        c.batch = batches[index % batches.size()];
        c.distribution = index % 2 ? conformance::Distribution::normal : conformance::Distribution::uniform;
        c.return_lse = index % 2 == 0;
        switch (variant) {
          case 0:
            break;
          case 1:
            c.sliding_window = 1 + static_cast<int>(index * 13 % 90);
            break;
          case 2:
            c.alibi = true;
            c.soft_cap = 5.f;
            break;
          case 3:
            c.sinks = true;
            c.return_lse = true;
            c.pad_tokens = 5;
            break;
          case 4:
            c.attn_type = index % 2 ? AttentionType::encoder_only : AttentionType::encoder;
            c.kv_cache_dtype = "auto";
            c.per_head_kv_scales = false;
            c.batch = {{0, 70}, {0, 1}, {0, 0}, {0, 33}};
            c.sliding_window = index % 4 == 0 ? std::optional<int>(9) : std::nullopt;
            c.alibi = index % 4 == 2;
            break;
          case 5:
            c.attn_type = AttentionType::encoder_decoder;
            c.batch = {{120, 1}, {300, 4}, {7, 0}, {65, 65}};
            c.sinks = index % 2 == 0;
            c.soft_cap = index % 2 ? std::optional<float>(3.f) : std::nullopt;
            c.return_lse = true;
            break;
        }
        cases.push_back(c);
      }
    }
  }
  // Paths that need specific shapes.
  ConformanceCase wide;
  wide.dtype = DType::bf16;
  wide.head_size = 128;
  wide.num_heads = 8;
  wide.num_kv_heads = 2;
  wide.batch = wide_batch();
  wide.return_lse = true;
  cases.push_back(wide);
  ConformanceCase cascade = wide;  // a shared prefix: the CUDA plan ignores it (one pass)
  cascade.batch = {{64, 3}, {80, 1}, {96, 9}, {64, 1}, {70, 1}, {66, 2}, {65, 1}, {99, 1}};
  cascade.cascade_prefix = 64;
  cases.push_back(cascade);
  ConformanceCase non_causal = wide;
  non_causal.batch = {{30, 20}, {5, 1}};
  cases.push_back(non_causal);
  return cases;
}

bool small_grid() {
  const char* v = std::getenv("PAGEDATTN_GPU_SMALL_GRID");
  return v != nullptr && std::string(v) == "1";
}

void run_cases(const std::vector<ConformanceCase>& cases, uint64_t seed0, int* run, int* skipped) {
  const AttentionBackend& cuda = cuda_backend();
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!conformance::unsupported_reasons(cuda, Device::cuda, cases[i]).empty()) {
      ++*skipped;
      continue;
    }
    ++*run;
    try {
      const conformance::ConformanceResult result =
          conformance::run_case(cuda, Device::cuda, cases[i], seed0 + 7919 * i);
      EXPECT_TRUE(result.passed()) << result.describe();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "CUDA [" << cases[i].describe() << "] threw: " << e.what();
    }
  }
}

TEST(CudaConformance, CudaGridMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  std::vector<ConformanceCase> grid = cuda_grid();
  if (small_grid()) {
    std::vector<ConformanceCase> small;
    for (size_t i = 0; i < grid.size(); i += 8) small.push_back(grid[i]);
    grid = small;
  }
  int run = 0, skipped = 0;
  run_cases(grid, 0xC0DA, &run, &skipped);
  std::cout << "[ conformance ] CUDA: " << run << " CUDA-grid cases run, " << skipped << " unsupported\n";
  EXPECT_EQ(skipped, 0) << "every case of the CUDA grid is in the backend's capabilities";
}

TEST(CudaConformance, HarnessGridMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  if (small_grid()) GTEST_SKIP() << "PAGEDATTN_GPU_SMALL_GRID=1: the CUDA grid's sample only";
  const std::vector<ConformanceCase> grid = conformance::conformance_grid();
  int run = 0, skipped = 0;
  run_cases(grid, 0xC0FFEE, &run, &skipped);
  std::cout << "[ conformance ] CUDA: " << run << " of " << grid.size()
            << " harness-grid cases run (the rest are outside its capabilities)\n";
  EXPECT_GT(run, 0);
}

TEST(CudaConformance, ValidateConfigurationNamesWhatIsMissing) {
  const AttentionBackend& cuda = cuda_backend();
  SelectorConfig ok;
  ok.device = Device::cuda;
  ok.dtype = DType::bf16;
  ok.head_size = 128;
  ok.block_size = 16;
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(cuda.validate_configuration(ok).empty());
  }
  const auto reasons_for = [&](auto mutate) {
    SelectorConfig c = ok;
    mutate(c);
    std::ostringstream all;
    for (const std::string& r : cuda.validate_configuration(c)) all << r << "\n";
    return all.str();
  };
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.head_size = 72; }).find("head_size = 72"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.block_size = 8; }).find("block_size = 8"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.dtype = DType::f32; }).find("dtype = float32"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.head_size_v = 64; }).find("head_size_v = 64"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.kv_cache_dtype = "float32"; }).find("kv_cache_dtype"),
            std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.use_mla = true; }).find("use_mla"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.fp8_output = true; }).find("fp8_output"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.device = Device::cpu; }).find("device = cpu"), std::string::npos);
}

}  // namespace
}  // namespace pagedattn
