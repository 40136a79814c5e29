// The CUDA attention kernel's variants (src/backends/cuda/attention_kernel_choice.h) against the
// REFERENCE (fp64) through the conformance harness: the Hopper wgmma prefill path (head sizes 64,
// 128, 256) and the mma.sync prefill path, each on prefill-heavy batches with every
// feature: causal chunks with context (ragged 64-row blocks), split-KV prefill items (partials),
// sliding windows, ALiBi + soft-cap, sinks + LSE + padding, encoder (non-causal) and cross
// attention, GQA groups 1..32, block sizes 16 / 64, both layouts, f16 and bf16. Every case draws
// fresh random inputs and poisons the outputs (the harness).
// PAGEDATTN_GPU_SMALL_GRID=1 runs every 4th case (the sanitizer runs of scripts/gpu-check).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "../../src/backends/cuda/attention_kernel_choice.h"
#include "conformance/harness.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using conformance::ConformanceCase;
using cuda::AttentionKernelChoice;

// Restores the environment's choice when the test ends.
struct ChoiceGuard {
  explicit ChoiceGuard(AttentionKernelChoice c) { cuda::set_attention_kernel_choice(c); }
  ~ChoiceGuard() { cuda::set_attention_kernel_choice(std::nullopt); }
  ChoiceGuard(const ChoiceGuard&) = delete;
  ChoiceGuard& operator=(const ChoiceGuard&) = delete;
};

bool small_grid() {
  const char* v = std::getenv("PAGEDATTN_GPU_SMALL_GRID");
  return v != nullptr && std::string(v) == "1";
}

std::vector<ConformanceCase> prefill_cases(const std::vector<int>& head_sizes) {
  const std::vector<std::vector<conformance::RequestShape>> batches = {
      {{0, 150}},                          // plain causal prefill: several 64-key tiles, ragged rows
      {{40, 100}, {130, 1}, {0, 0}},       // a chunk with context, a decode, an empty request
      {{1900, 70}},                        // long context, few items: split-KV prefill items
      {{0, 33}, {5, 1}, {300, 20}, {7, 9}},
  };
  const std::pair<int, int> heads[] = {{8, 2}, {4, 4}, {16, 1}, {32, 1}, {12, 4}};
  std::vector<ConformanceCase> cases;
  int index = 0;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int d : head_sizes) {
      for (int feature = 0; feature < 6; ++feature, ++index) {
        ConformanceCase c;
        c.dtype = dtype;
        c.head_size = d;
        c.block_size = index % 2 ? 64 : 16;
        c.layout = index % 3 == 0 ? KVCacheLayout::HND : KVCacheLayout::NHD;
        c.num_heads = heads[index % 5].first;
        c.num_kv_heads = heads[index % 5].second;
        c.batch = batches[index % batches.size()];
        c.distribution = index % 2 ? conformance::Distribution::normal : conformance::Distribution::uniform;
        c.return_lse = index % 2 == 0;
        switch (feature) {
          case 0:
            break;
          case 1:
            c.sliding_window = 1 + index * 29 % 200;
            break;
          case 2:
            c.alibi = true;
            c.soft_cap = 5.f;
            break;
          case 3:
            c.sinks = true;
            c.return_lse = true;
            c.pad_tokens = 3;
            break;
          case 4:
            c.attn_type = AttentionType::encoder;
            c.batch = {{0, 130}, {0, 1}, {0, 70}};
            c.sliding_window = index % 4 == 0 ? std::optional<int>(20) : std::nullopt;
            break;
          case 5:
            c.attn_type = AttentionType::encoder_decoder;
            c.batch = {{200, 90}, {65, 65}, {7, 0}};
            c.sinks = true;
            c.soft_cap = 3.f;
            c.return_lse = true;
            break;
        }
        cases.push_back(c);
      }
    }
  }
  // An fp8 cache: the wgmma choice keeps the mma.sync path there.
  ConformanceCase fp8 = cases[0];
  fp8.kv_cache_dtype = "fp8_e4m3";
  fp8.head_size = head_sizes[0];
  cases.push_back(fp8);
  if (small_grid()) {
    std::vector<ConformanceCase> small;
    for (size_t i = 0; i < cases.size(); i += 4) small.push_back(cases[i]);
    cases = small;
  }
  return cases;
}

void run_all(AttentionKernelChoice choice, const std::vector<int>& head_sizes, uint64_t seed0) {
  const ChoiceGuard guard(choice);
  const AttentionBackend& backend = cuda_backend();
  int run = 0;
  const std::vector<ConformanceCase> cases = prefill_cases(head_sizes);
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(conformance::unsupported_reasons(backend, Device::cuda, cases[i]).empty()) << cases[i].describe();
    try {
      const conformance::ConformanceResult result =
          conformance::run_case(backend, Device::cuda, cases[i], seed0 + 104729 * i);
      EXPECT_TRUE(result.passed()) << result.describe();
      ++run;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "CUDA [" << cases[i].describe() << "] threw: " << e.what();
    }
  }
  std::cout << "[ variants ] " << run << " cases run\n";
}

bool device_is_sm90() {
  int device = 0;
  cudaDeviceProp prop{};
  return cudaGetDevice(&device) == cudaSuccess && cudaGetDeviceProperties(&prop, device) == cudaSuccess &&
         prop.major == 9 && prop.minor == 0;
}

TEST(CudaKernelVariants, WgmmaImageLoadsOnHopper) {
  PAGEDATTN_REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "not an sm_90 device";
  EXPECT_TRUE(cuda::wgmma_kernels_available()) << "the sm_90a image is not the one the device runs";
}

TEST(CudaKernelVariants, WgmmaPrefillMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all(AttentionKernelChoice::automatic, {64, 128, 256}, 0x3A11);
}

TEST(CudaKernelVariants, MmaPrefillMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all(AttentionKernelChoice::mma, {64, 128, 256}, 0x77AA);
}

TEST(CudaKernelVariants, PrefillKernelEnvValues) {
  EXPECT_EQ(cuda::parse_prefill_kernel_choice(nullptr), AttentionKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice(""), AttentionKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice("auto"), AttentionKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice("mma"), AttentionKernelChoice::mma);
  try {
    cuda::parse_prefill_kernel_choice("wgmma2");
    ADD_FAILURE() << "no Error for an unknown value";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("PAGEDATTN_CUDA_PREFILL_KERNEL"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("wgmma2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pagedattn
