// The CUDA attention kernel's variants (src/backends/cuda/attention/attention_kernel_choice.h) against the
// REFERENCE (fp64) through the conformance harness: the Hopper wgmma prefill path (head sizes 64,
// 128, 256) and the mma.sync prefill path, each on prefill-heavy batches with every
// feature: causal chunks with context (ragged 64-row blocks), split-KV prefill items (partials),
// sliding windows, ALiBi + soft-cap, sinks + LSE + padding, encoder (non-causal) and cross
// attention, GQA groups 1..32, block sizes 16 / 64, both layouts, f16 and bf16. Every case draws
// fresh random inputs and poisons the outputs (the harness).
// The decode-only kernel (head sizes <= 128) against the REFERENCE on decode batches with every
// feature, under PAGEDATTN_CUDA_DECODE_KERNEL decode (the decode-only kernel) and unified (the
// paged attention kernel), and which plans take it under auto.
// PAGEDATTN_GPU_SMALL_GRID=1 runs every 4th case (the sanitizer runs of scripts/gpu-check).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "../../src/backends/cuda/attention/attention_kernel_choice.h"
#include "../../src/backends/cuda/attention/cuda_backend_internal.h"
#include "../../src/backends/cuda/attention/kernel_launch.h"
#include "../../src/backends/cuda/common/device_runtime.h"
#include "conformance/harness.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using conformance::ConformanceCase;
using cuda::AttentionKernelChoice;

// Forces a choice (attention_kernel_choice.h) and restores the environment's when the test ends.
template <class Choice, void (*Set)(std::optional<Choice>)>
struct Guard {
  explicit Guard(Choice c) { Set(c); }
  ~Guard() { Set(std::nullopt); }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;
};
using ChoiceGuard = Guard<AttentionKernelChoice, cuda::set_attention_kernel_choice>;
using DecodeChoiceGuard = Guard<cuda::DecodeKernelChoice, cuda::set_decode_kernel_choice>;

bool small_grid() {
  const char* v = std::getenv("PAGEDATTN_GPU_SMALL_GRID");
  return v != nullptr && std::string(v) == "1";
}

// The features both grids share: feature 0 plain, 1 a sliding window of `window` keys, 2 ALiBi +
// soft-cap, 3 sinks + LSE + padded token rows. Returns false for other features (the caller's).
bool apply_shared_feature(ConformanceCase& c, int feature, int window) {
  switch (feature) {
    case 0:
      return true;
    case 1:
      c.sliding_window = window;
      return true;
    case 2:
      c.alibi = true;
      c.soft_cap = 5.f;
      return true;
    case 3:
      c.sinks = true;
      c.return_lse = true;
      c.pad_tokens = 3;
      return true;
    default:
      return false;
  }
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
        switch (apply_shared_feature(c, feature, 1 + index * 29 % 200) ? -1 : feature) {
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

// Runs `cases` on the CUDA backend against the REFERENCE (fresh inputs from seed0 + step * i);
// returns how many ran and, in *decode_plans, how many plans took the decode-only kernel.
int run_cases(const std::vector<ConformanceCase>& cases, uint64_t seed0, uint64_t step, int* decode_plans) {
  const AttentionBackend& backend = cuda_backend();
  int run = 0;
  *decode_plans = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(conformance::unsupported_reasons(backend, Device::cuda, cases[i]).empty()) << cases[i].describe();
    try {
      const conformance::CaseInputs inputs = conformance::make_inputs(cases[i], seed0 + step * i);
      conformance::PreparedRun prepared = conformance::prepare_run(backend, Device::cuda, inputs);
      const auto* md = dynamic_cast<const cuda::CudaAttentionMetadata*>(prepared.step_metadata.get());
      if (md == nullptr) {
        ADD_FAILURE() << "not a CUDA plan: " << cases[i].describe();
        continue;
      }
      *decode_plans += md->decode_kernel ? 1 : 0;
      conformance::execute(prepared);
      const conformance::ConformanceResult result =
          conformance::compare(inputs, conformance::collect(prepared),
                               conformance::run_backend(conformance::reference(), Device::cpu, inputs));
      EXPECT_TRUE(result.passed()) << result.describe();
      ++run;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "CUDA [" << cases[i].describe() << "] threw: " << e.what();
    }
  }
  return run;
}

void run_all(AttentionKernelChoice choice, const std::vector<int>& head_sizes, uint64_t seed0) {
  const ChoiceGuard guard(choice);
  int decode_plans = 0;
  const int run = run_cases(prefill_cases(head_sizes), seed0, 104729, &decode_plans);
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

// Which kernel runs (the warp-specialized one: 1 CTA of 384 threads per SM; the paged attention
// kernel: 2 at head sizes <= 128): under auto 16-bit head size 128 takes it, 64 and fp8 caches do
// not; under ws 64 and 128 take it; under wgmma none does.
TEST(CudaKernelVariants, WarpSpecializedSelectedOnHopper) {
  PAGEDATTN_REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "not an sm_90 device";
  {
    const ChoiceGuard guard(AttentionKernelChoice::automatic);
    EXPECT_EQ(cuda::attention_kernel_info(128, DType::bf16, false).ctas_per_sm, 1);
    EXPECT_TRUE(cuda::attention_kernel_info(128, DType::bf16, false).warp_specialized);
    EXPECT_EQ(cuda::attention_kernel_info(64, DType::bf16, false).ctas_per_sm, 1);
    EXPECT_TRUE(cuda::attention_kernel_info(64, DType::bf16, false).warp_specialized);
    EXPECT_FALSE(cuda::attention_kernel_info(256, DType::bf16, false).warp_specialized);
    EXPECT_EQ(cuda::attention_kernel_info(128, DType::f16, true).ctas_per_sm, 2);
  }
  {
    const ChoiceGuard guard(AttentionKernelChoice::wgmma);
    EXPECT_EQ(cuda::attention_kernel_info(128, DType::bf16, false).ctas_per_sm, 2);
  }
  const ChoiceGuard guard(AttentionKernelChoice::ws);
  EXPECT_EQ(cuda::attention_kernel_info(128, DType::bf16, false).ctas_per_sm, 1);
  EXPECT_EQ(cuda::attention_kernel_info(64, DType::f16, false).ctas_per_sm, 1);
  EXPECT_EQ(cuda::attention_kernel_info(128, DType::bf16, true).ctas_per_sm, 2);
}

TEST(CudaKernelVariants, WgmmaPrefillMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all(AttentionKernelChoice::wgmma, {64, 128, 256}, 0x3A11);
}

TEST(CudaKernelVariants, WarpSpecializedMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all(AttentionKernelChoice::ws, {64, 128}, 0x5E11);
}

TEST(CudaKernelVariants, MmaPrefillMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all(AttentionKernelChoice::mma, {64, 128, 256}, 0x77AA);
}


// Decode batches (every request's query_len * group <= 16 for the first three head layouts):
// long contexts that split, many short requests, spec-decode rows, contexts inside one tile.
std::vector<ConformanceCase> decode_cases() {
  std::vector<conformance::RequestShape> many;
  for (int i = 0; i < 40; ++i) many.push_back({1 + (i * 97) % 900, 1});
  const std::vector<std::vector<conformance::RequestShape>> batches = {
      {{700, 1}, {1500, 1}, {64, 1}, {2100, 1}},
      many,
      {{300, 4}, {77, 3}, {500, 2}, {0, 1}},
      {{0, 1}, {5, 1}, {1, 1}, {63, 1}},
  };
  const std::pair<int, int> heads[] = {{8, 2}, {4, 4}, {16, 1}, {12, 4}};
  std::vector<ConformanceCase> cases;
  int index = 0;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int d : {64, 80, 96, 128}) {
      for (int feature = 0; feature < 6; ++feature, ++index) {
        ConformanceCase c;
        c.dtype = dtype;
        c.head_size = d;
        c.block_size = index % 3 == 0 ? 64 : index % 3 == 1 ? 16 : 32;
        c.layout = index % 2 ? KVCacheLayout::HND : KVCacheLayout::NHD;
        c.num_heads = heads[index % 4].first;
        c.num_kv_heads = heads[index % 4].second;
        c.batch = batches[(index / 2) % batches.size()];
        if (c.num_heads / c.num_kv_heads == 16) c.batch = batches[(index / 2) % 2];  // 16 rows at most
        c.distribution = index % 2 ? conformance::Distribution::normal : conformance::Distribution::uniform;
        c.return_lse = index % 2 == 0;
        switch (apply_shared_feature(c, feature, 1 + index * 53 % 400) ? -1 : feature) {
          case 4:
            c.kv_cache_dtype = "fp8_e4m3";
            c.per_head_kv_scales = true;
            break;
          case 5:
            c.kv_cache_dtype = index % 2 ? "fp8_e5m2" : "auto";
            c.head_size_v = d == 64 ? 32 : 64;
            break;
        }
        cases.push_back(c);
      }
    }
  }
  if (small_grid()) {
    std::vector<ConformanceCase> small;
    for (size_t i = 0; i < cases.size(); i += 4) small.push_back(cases[i]);
    cases = small;
  }
  return cases;
}

void run_decode_cases(cuda::DecodeKernelChoice choice, uint64_t seed0) {
  const DecodeChoiceGuard guard(choice);
  int decode_plans = 0;
  const int run = run_cases(decode_cases(), seed0, 7919, &decode_plans);
  if (choice == cuda::DecodeKernelChoice::unified) {
    EXPECT_EQ(decode_plans, 0) << "unified: no plan may use the decode-only kernel";
  } else {
    EXPECT_EQ(decode_plans, run) << "decode: every decode batch takes the decode-only kernel";
  }
  std::cout << "[ variants ] " << run << " decode cases run, " << decode_plans << " on the decode-only kernel\n";
}

// Decode items on the warp-specialized kernel (unified: no decode-only plans; head sizes 80 / 96,
// fp8 caches and head_size_v != head_size keep the paged attention kernel).
TEST(CudaKernelVariants, WarpSpecializedDecodeMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  const ChoiceGuard guard(AttentionKernelChoice::ws);
  run_decode_cases(cuda::DecodeKernelChoice::unified, 0x5EDC);
}

TEST(CudaKernelVariants, DecodeKernelMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_decode_cases(cuda::DecodeKernelChoice::decode, 0xDEC0);
}

TEST(CudaKernelVariants, UnifiedDecodeMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_decode_cases(cuda::DecodeKernelChoice::unified, 0x0DEC);
}

// Which plans take the decode-only kernel under auto: decode batches of head size <= 128 (not 256,
// not the large ones of 128 where the warp-specialized kernel runs, not a batch with a prefill chunk,
// not one request whose split would leave 3-tile chunks).
// (The smallest batches' choice depends on the SM count; these hold for 100+ SMs.)
TEST(CudaKernelVariants, DecodeKernelPlanChoice) {
  PAGEDATTN_REQUIRE_GPU();
  const DecodeChoiceGuard guard(cuda::DecodeKernelChoice::automatic);
  const std::vector<conformance::RequestShape> decodes(128, conformance::RequestShape{300, 1});
  std::vector<conformance::RequestShape> spec = decodes;
  spec[5] = {300, 4};
  std::vector<conformance::RequestShape> mixed = decodes;
  mixed[7] = {0, 40};
  const auto plan_uses_decode_kernel = [](int head_size, std::vector<conformance::RequestShape> batch,
                                          int num_kv_heads = 2) {
    ConformanceCase c;
    c.dtype = DType::bf16;
    c.head_size = head_size;
    c.num_heads = 4 * num_kv_heads;
    c.num_kv_heads = num_kv_heads;
    c.batch = std::move(batch);
    const conformance::CaseInputs inputs = conformance::make_inputs(c, 11);
    const conformance::PreparedRun run = conformance::prepare_run(cuda_backend(), Device::cuda, inputs);
    const auto* md = dynamic_cast<const cuda::CudaAttentionMetadata*>(run.step_metadata.get());
    EXPECT_NE(md, nullptr);
    return md != nullptr && md->decode_kernel;
  };
  EXPECT_TRUE(plan_uses_decode_kernel(128, decodes));
  // Head size 128 on sm_90a runs the warp-specialized kernel, which keeps the larger decode batches
  // (over 32 64-key tiles per SM): 128 requests of 1300 keys over 2 kv heads, 5376 tiles (up to
  // 168 SMs).
  const bool ws128 = cuda::attention_kernel_info(128, DType::bf16, false).warp_specialized;
  const std::vector<conformance::RequestShape> large(128, conformance::RequestShape{1299, 1});
  EXPECT_EQ(plan_uses_decode_kernel(128, large), !ws128);
  EXPECT_TRUE(plan_uses_decode_kernel(64, spec));
  EXPECT_FALSE(plan_uses_decode_kernel(256, decodes));
  EXPECT_FALSE(plan_uses_decode_kernel(128, mixed));
  // One request over 8 kv heads: filling the device leaves 3-tile chunks (the unified kernel's).
  EXPECT_FALSE(plan_uses_decode_kernel(128, {{8000, 1}}, 8));
  {
    const DecodeChoiceGuard forced(cuda::DecodeKernelChoice::decode);
    EXPECT_TRUE(plan_uses_decode_kernel(128, {{8000, 1}}, 8));
  }
  {
    const DecodeChoiceGuard unified(cuda::DecodeKernelChoice::unified);
    EXPECT_FALSE(plan_uses_decode_kernel(128, decodes));
  }
}

TEST(CudaKernelVariants, DecodeKernelEnvValues) {
  EXPECT_EQ(cuda::parse_decode_kernel_choice(nullptr), cuda::DecodeKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_decode_kernel_choice("auto"), cuda::DecodeKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_decode_kernel_choice("unified"), cuda::DecodeKernelChoice::unified);
  EXPECT_EQ(cuda::parse_decode_kernel_choice("decode"), cuda::DecodeKernelChoice::decode);
  try {
    cuda::parse_decode_kernel_choice("fused");
    ADD_FAILURE() << "no Error for an unknown value";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("PAGEDATTN_CUDA_DECODE_KERNEL"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fused"), std::string::npos) << e.what();
  }
}

TEST(CudaKernelVariants, PrefillKernelEnvValues) {
  EXPECT_EQ(cuda::parse_prefill_kernel_choice(nullptr), AttentionKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice(""), AttentionKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice("auto"), AttentionKernelChoice::automatic);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice("mma"), AttentionKernelChoice::mma);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice("ws"), AttentionKernelChoice::ws);
  EXPECT_EQ(cuda::parse_prefill_kernel_choice("wgmma"), AttentionKernelChoice::wgmma);
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
