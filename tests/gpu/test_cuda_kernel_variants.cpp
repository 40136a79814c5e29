// The CUDA attention kernels (src/backends/cuda/attention/kernel_selection.h) against the
// REFERENCE (fp64) through the conformance harness: the warp-specialized kernel (head sizes 64,
// 128), the Hopper wgmma prefill path (64, 128, 256) and the mma.sync prefill path, forced through
// the PAGEDATTN_CUDA_KERNEL override (kernel_override.h), each on prefill-heavy batches with every
// feature: causal chunks with context (ragged 64-row blocks), split-KV prefill items (partials),
// sliding windows, ALiBi + soft-cap, sinks + LSE + padding, encoder (non-causal) and cross
// attention, GQA groups 1..32, block sizes 16 / 64, both layouts, f16 and bf16, fused fp8 e4m3
// output on every 4th case. Every case draws fresh random inputs and poisons the outputs (the
// harness).
// The decode-only kernel (head sizes <= 128) against the REFERENCE on decode batches with every
// feature (speculative decodes of up to 8 tokens, fused fp8 output), under decode=decode (the
// decode-only kernel) and decode=unified (the paged attention kernel), and which plans take it
// under auto; which kernel each builder stores in its plans.
// PAGEDATTN_GPU_SMALL_GRID=1 runs every 4th case (the sanitizer runs of scripts/gpu-check).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "../../src/backends/cuda/attention/cuda_backend_internal.h"
#include "../../src/backends/cuda/attention/kernel_launch.h"
#include "../../src/backends/cuda/attention/kernel_selection.h"
#include "../../src/backends/cuda/common/device_runtime.h"
#include "../../src/backends/cuda/common/kernel_override.h"
#include "conformance/harness.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using conformance::ConformanceCase;
using cuda::AttentionKernel;

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
        c.fp8_output = index % 4 == 1;  // fused e4m3 output on every kernel path
        cases.push_back(c);
      }
    }
  }
  // fp8 caches: every head-size-128 and 256 case again with e4m3, every other one with e5m2 too
  // (the warp-specialized kernel's 8-bit path under auto and prefill=ws; mma.sync under the other
  // overrides), per-head scales on every other one; and one case at the first head size (mma.sync
  // under every override at 64).
  const size_t grid = cases.size();
  for (size_t i = 0; i < grid; ++i) {
    if ((cases[i].head_size != 128 && cases[i].head_size != 256) || cases[i].head_size_v != 0) continue;
    ConformanceCase fp8 = cases[i];
    fp8.kv_cache_dtype = "fp8_e4m3";
    fp8.per_head_kv_scales = i % 2 == 1;
    fp8.quant_query = i % 3 == 0;  // a pre-quantized e4m3 query with q_scale
    cases.push_back(fp8);
    fp8.quant_query = false;
    if (i % 2 == 0) {
      fp8.kv_cache_dtype = "fp8_e5m2";
      fp8.per_head_kv_scales = i % 4 == 0;
      cases.push_back(fp8);
    }
  }
  ConformanceCase fp8 = cases[0];
  fp8.kv_cache_dtype = "fp8_e4m3";
  fp8.head_size = head_sizes[0];
  cases.push_back(fp8);
  fp8.quant_query = true;
  cases.push_back(fp8);
  // Speculative decodes of 8 tokens at GQA 4 (32 rows: prefill-path items) beside shorter ones.
  for (int d : head_sizes) {
    ConformanceCase spec;
    spec.dtype = DType::bf16;
    spec.head_size = d;
    spec.num_heads = 8;
    spec.num_kv_heads = 2;
    spec.num_speculative_tokens = 7;
    spec.return_lse = true;
    spec.batch = {{300, 8}, {77, 5}, {1500, 2}, {0, 8}, {1000, 1}};
    cases.push_back(spec);
  }
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
  double max_fp8_error = -1, max_e4m3_mma_error = -1;
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
      *decode_plans += md->kernel == AttentionKernel::decode ? 1 : 0;
      conformance::execute(prepared);
      const conformance::ConformanceResult result =
          conformance::compare(inputs, conformance::collect(prepared),
                               conformance::run_backend(conformance::reference(), Device::cpu, inputs));
      EXPECT_TRUE(result.passed()) << result.describe();
      if (cases[i].fp8_kv() && md->kernel == AttentionKernel::ws) {
        // The 8-bit wgmma path also rounds Q (per row) and P to e4m3 (with either cache format):
        // the fp8 tolerance.
        max_e4m3_mma_error = std::max(max_e4m3_mma_error, result.output_rel_error);
      } else if (cases[i].fp8_kv()) {
        // The stored fp8 values are exact in f16 and bf16 and the REFERENCE reads the same ones,
        // so only the activation type's rounding (P, the output) remains: hold fp8 cases to the
        // 16-bit cache's tolerance, not the fp8 one (which also covers the quantization).
        ConformanceCase c16 = cases[i];
        c16.kv_cache_dtype = "auto";
        EXPECT_LE(result.output_rel_error, conformance::tolerance(c16)) << result.describe();
        EXPECT_LE(result.lse_rel_error, conformance::tolerance(c16)) << result.describe();
        max_fp8_error = std::max(max_fp8_error, result.output_rel_error);
      }
      ++run;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "CUDA [" << cases[i].describe() << "] threw: " << e.what();
    }
  }
  if (max_fp8_error >= 0) std::cout << "[ variants ] largest output rel error of an fp8 case: " << max_fp8_error << "\n";
  if (max_e4m3_mma_error >= 0) {
    std::cout << "[ variants ] largest output rel error of an fp8 case on the 8-bit wgmma path: " << max_e4m3_mma_error
              << "\n";
  }
  return run;
}

void run_all(const char* override_spec, const std::vector<int>& head_sizes, uint64_t seed0) {
  const gpu_test::KernelOverrideScope guard(override_spec);
  int decode_plans = 0;
  const int run = run_cases(prefill_cases(head_sizes), seed0, 104729, &decode_plans);
  std::cout << "[ variants ] " << run << " cases run\n";
}

// The kernel the CUDA builder stores in the plan of case c's step (inputs drawn from seed 11).
AttentionKernel planned_kernel(const ConformanceCase& c) {
  const conformance::CaseInputs inputs = conformance::make_inputs(c, 11);
  const conformance::PreparedRun run = conformance::prepare_run(cuda_backend(), Device::cuda, inputs);
  const auto* md = dynamic_cast<const cuda::CudaAttentionMetadata*>(run.step_metadata.get());
  EXPECT_NE(md, nullptr) << "not a CUDA plan: " << c.describe();
  return md != nullptr ? md->kernel : AttentionKernel::mma;
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

// The kernel a builder stores in its (prefill) plans, chosen once from the layer, the cache, the
// device and the override: under auto 16-bit head sizes 64, 128 and 256 and fp8 (e4m3, e5m2) at 128
// and 256 take the warp-specialized kernel (1 CTA of 384 threads per SM), fp8 at other head sizes and
// head_size_v != head_size mma.sync (2 CTAs per SM at head sizes <= 128); under prefill=wgmma no plan takes ws; under
// prefill=mma every plan runs mma.sync.
TEST(CudaKernelVariants, WarpSpecializedSelectedOnHopper) {
  PAGEDATTN_REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "not an sm_90 device";
  const auto plan_kernel = [](int head_size, DType dtype, const char* kv_cache_dtype, int head_size_v = 0) {
    ConformanceCase c;
    c.dtype = dtype;
    c.head_size = head_size;
    c.head_size_v = head_size_v;
    c.kv_cache_dtype = kv_cache_dtype;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.batch = {{40, 100}};
    return planned_kernel(c);
  };
  {
    const gpu_test::KernelOverrideScope guard("");
    EXPECT_EQ(plan_kernel(128, DType::bf16, "auto"), AttentionKernel::ws);
    EXPECT_EQ(plan_kernel(64, DType::f16, "auto"), AttentionKernel::ws);
    EXPECT_EQ(plan_kernel(256, DType::bf16, "auto"), AttentionKernel::ws);
    EXPECT_EQ(plan_kernel(96, DType::bf16, "auto"), AttentionKernel::mma);
    EXPECT_EQ(plan_kernel(128, DType::bf16, "fp8_e4m3"), AttentionKernel::ws);
    EXPECT_EQ(plan_kernel(128, DType::bf16, "fp8_e5m2"), AttentionKernel::ws);
    EXPECT_EQ(plan_kernel(256, DType::bf16, "fp8_e5m2"), AttentionKernel::ws);
    EXPECT_EQ(plan_kernel(64, DType::f16, "fp8_e5m2"), AttentionKernel::mma);
    EXPECT_EQ(plan_kernel(256, DType::f16, "fp8_e4m3"), AttentionKernel::ws);
    EXPECT_EQ(plan_kernel(64, DType::bf16, "fp8_e4m3"), AttentionKernel::mma);
    EXPECT_EQ(plan_kernel(128, DType::bf16, "auto", 64), AttentionKernel::mma);
  }
  {
    const gpu_test::KernelOverrideScope guard("prefill=wgmma");
    EXPECT_EQ(plan_kernel(128, DType::bf16, "auto"), AttentionKernel::wgmma);
  }
  {
    const gpu_test::KernelOverrideScope guard("prefill=mma");
    EXPECT_EQ(plan_kernel(128, DType::bf16, "auto"), AttentionKernel::mma);
  }
  EXPECT_EQ(cuda::attention_kernel_info(128, DType::bf16, false, AttentionKernel::ws).ctas_per_sm, 1);
  EXPECT_EQ(cuda::attention_kernel_info(64, DType::f16, false, AttentionKernel::ws).ctas_per_sm, 1);
  EXPECT_EQ(cuda::attention_kernel_info(256, DType::bf16, false, AttentionKernel::ws).ctas_per_sm, 1);
  EXPECT_EQ(cuda::attention_kernel_info(128, DType::bf16, false, AttentionKernel::wgmma).ctas_per_sm, 2);
  EXPECT_EQ(cuda::attention_kernel_info(128, DType::f16, true, AttentionKernel::mma).ctas_per_sm, 2);
  EXPECT_EQ(cuda::attention_kernel_info(128, DType::f16, true, AttentionKernel::ws).ctas_per_sm, 1);
  EXPECT_EQ(cuda::attention_kernel_info(256, DType::bf16, true, AttentionKernel::ws).ctas_per_sm, 1);
  EXPECT_EQ(cuda::attention_kernel_info(128, DType::bf16, false, AttentionKernel::decode).ctas_per_sm, 3);
  // A kernel without an instance for the head size / cache is an Error, not another kernel.
  EXPECT_THROW(cuda::attention_kernel_info(96, DType::bf16, false, AttentionKernel::ws), Error);
  EXPECT_THROW(cuda::attention_kernel_info(64, DType::bf16, true, AttentionKernel::ws), Error);
  EXPECT_THROW(cuda::attention_kernel_info(128, DType::bf16, true, AttentionKernel::wgmma), Error);
  EXPECT_THROW(cuda::attention_kernel_info(256, DType::bf16, false, AttentionKernel::decode), Error);
}

TEST(CudaKernelVariants, WgmmaPrefillMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all("prefill=wgmma", {64, 128, 256}, 0x3A11);
}

TEST(CudaKernelVariants, WarpSpecializedMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all("prefill=ws", {64, 128, 256}, 0x5E11);
}

TEST(CudaKernelVariants, MmaPrefillMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_all("prefill=mma", {64, 128, 256}, 0x77AA);
}


// Decode batches (every request's query_len * group <= 16 for the first three head layouts):
// long contexts that split, many short requests, spec-decode rows, contexts inside one tile; the
// window, ALiBi + soft-cap and sinks cases also over an fp8 cache (e4m3 and e5m2).
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
            c.quant_query = index % 2 == 0;
            break;
          case 5:
            c.kv_cache_dtype = index % 2 ? "fp8_e5m2" : "auto";
            c.head_size_v = d == 64 ? 32 : 64;
            break;
        }
        c.fp8_output = index % 4 == 3;  // fused e4m3 output (decode path and split combine)
        cases.push_back(c);
        if (feature >= 1 && feature <= 3) {  // the same window / ALiBi + soft-cap / sinks over an fp8 cache
          c.kv_cache_dtype = index % 2 ? "fp8_e4m3" : "fp8_e5m2";
          c.per_head_kv_scales = feature == 2;
          c.quant_query = feature == 1;  // e4m3 query (q_scale) over both fp8 formats
          cases.push_back(c);
        }
      }
    }
  }
  // Speculative decodes whose rows fit the decode path: up to 8 tokens at GQA 1 and 2, up to 4 at
  // GQA 4 (num_speculative_tokens 7 / 3), a 16-bit and an fp8 cache, fp8 output once.
  for (int d : {64, 128}) {
    for (const char* kv : {"auto", "fp8_e4m3"}) {
      ConformanceCase c;
      c.dtype = DType::bf16;
      c.head_size = d;
      c.kv_cache_dtype = kv;
      c.num_heads = d == 64 ? 4 : 8;
      c.num_kv_heads = d == 64 ? 4 : 2;
      c.num_speculative_tokens = d == 64 ? 7 : 3;
      c.return_lse = true;
      c.fp8_output = d == 128 && std::string(kv) == "auto";
      c.quant_query = std::string(kv) == "fp8_e4m3";
      c.batch = d == 64 ? std::vector<conformance::RequestShape>{{300, 8}, {77, 5}, {1500, 2}, {0, 4}, {1000, 1}, {64, 8}}
                        : std::vector<conformance::RequestShape>{{300, 4}, {77, 3}, {1500, 2}, {0, 4}, {1000, 1}, {64, 4}};
      cases.push_back(c);
    }
  }
  if (small_grid()) {
    std::vector<ConformanceCase> small;
    for (size_t i = 0; i < cases.size(); i += 4) small.push_back(cases[i]);
    cases = small;
  }
  return cases;
}

void run_decode_cases(const char* override_spec, uint64_t seed0) {
  const gpu_test::KernelOverrideScope guard(override_spec);
  int decode_plans = 0;
  const int run = run_cases(decode_cases(), seed0, 7919, &decode_plans);
  if (cuda::kernel_override().decode == cuda::DecodeKernelChoice::unified) {
    EXPECT_EQ(decode_plans, 0) << "unified: no plan may use the decode-only kernel";
  } else {
    EXPECT_EQ(decode_plans, run) << "decode: every decode batch takes the decode-only kernel";
  }
  std::cout << "[ variants ] " << run << " decode cases run, " << decode_plans << " on the decode-only kernel\n";
}

// Decode items on the warp-specialized kernel (unified: no decode-only plans; head sizes 80 / 96,
// fp8 caches other than e4m3 at 128 and head_size_v != head_size keep the paged attention kernel).
TEST(CudaKernelVariants, WarpSpecializedDecodeMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_decode_cases("prefill=ws,decode=unified", 0x5EDC);
}

TEST(CudaKernelVariants, DecodeKernelMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_decode_cases("decode=decode", 0xDEC0);
}

TEST(CudaKernelVariants, UnifiedDecodeMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_decode_cases("decode=unified", 0x0DEC);
}

// Which plans take the decode-only kernel under auto: decode batches of head size <= 128 (not 256,
// not the large ones of 128 where the warp-specialized kernel runs, not a batch with a prefill chunk,
// not one request whose split would leave 3-tile chunks).
// (The smallest batches' choice depends on the SM count; these hold for 100+ SMs.)
TEST(CudaKernelVariants, DecodeKernelPlanChoice) {
  PAGEDATTN_REQUIRE_GPU();
  const gpu_test::KernelOverrideScope guard("");
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
    return planned_kernel(c) == AttentionKernel::decode;
  };
  EXPECT_TRUE(plan_uses_decode_kernel(128, decodes));
  // Head size 128 on sm_90a runs the warp-specialized kernel, which keeps the larger decode batches
  // (over 32 64-key tiles per SM): 128 requests of 1300 keys over 2 kv heads, 5376 tiles (up to
  // 168 SMs).
  const bool ws128 = cuda::select_attention_kernel(cuda::PrefillKernelChoice::automatic, 128, 128, 0,
                                                   cuda::wgmma_kernels_available(), true) == AttentionKernel::ws;
  const std::vector<conformance::RequestShape> large(128, conformance::RequestShape{1299, 1});
  EXPECT_EQ(plan_uses_decode_kernel(128, large), !ws128);
  EXPECT_TRUE(plan_uses_decode_kernel(64, spec));
  EXPECT_FALSE(plan_uses_decode_kernel(256, decodes));
  EXPECT_FALSE(plan_uses_decode_kernel(128, mixed));
  // One request over 8 kv heads: filling the device leaves 3-tile chunks (the unified kernel's).
  EXPECT_FALSE(plan_uses_decode_kernel(128, {{8000, 1}}, 8));
  {
    const gpu_test::KernelOverrideScope forced("decode=decode");
    EXPECT_TRUE(plan_uses_decode_kernel(128, {{8000, 1}}, 8));
  }
  {
    const gpu_test::KernelOverrideScope unified("decode=unified");
    EXPECT_FALSE(plan_uses_decode_kernel(128, decodes));
  }
}

}  // namespace
}  // namespace pagedattn
