// Fused fp8 e4m3 output of CUDA_MLA (MLAAttention::forward with output_scale, DeepSeek dims):
//   MatchesReferenceMla      e4m3 output vs REFERENCE_MLA's e4m3 output (the fp64 oracle, one
//                            rounding) within the project's fp8 tolerance (6e-2 relative L2, as
//                            CudaFp8Output), on decode-only, new-tokens-only and mixed batches
//                            with chunked context, an fp8 cache, a (T, H * V) padded output, 16
//                            and 128 heads (mma.sync and wgmma decode), a saturating scale; the
//                            harness poisons the output with NaN and counts unwritten elements
//   IsItsOwnOutputQuantized  e4m3 output vs CUDA_MLA's own bf16 output of the same inputs
//                            quantized on the host: every staged row (decode gemm, new-token
//                            prefill, final merge) goes through one device quantize pass, so the
//                            two agree to within one e4m3 step
//   LayerSelectsCudaMla      fp8_output = true selects CUDA_MLA on a GPU
// Rejected calls (the cache byte-identical) and invalid device scales (all-NaN output) are in
// test_cuda_rejected_calls.cpp (conformance/rejected_calls.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../src/backends/cuda/mla/mla_cuda_backend.h"
#include "conformance/mla_harness.h"
#include "gpu_test_util.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

namespace cm = conformance::mla;

bool small_grid() {
  const char* e = std::getenv("PAGEDATTN_GPU_SMALL_GRID");
  return e != nullptr && *e == '1';
}

cm::MLACase deepseek_case(const char* name, std::vector<cm::MLARequest> batch, int heads = 16,
                          int block_size = 64, int64_t workspace_tokens = 0) {
  cm::MLACase c;
  c.name = name;
  c.dtype = DType::bf16;
  c.dims = {512, 128, 64, 128};
  c.num_heads = heads;
  c.block_size = block_size;
  c.workspace_tokens = workspace_tokens;
  c.batch = std::move(batch);
  c.output_scale = 1.f / 128.f;
  return c;
}

// Decodes only; new tokens only; decodes + a prefill without context + one whose context takes
// 3 chunks (W = 4 requests x 64 = 256 tokens); the same over an fp8 cache; a padded (T, H * V)
// output; a saturating scale; 128 heads.
std::vector<cm::MLACase> fp8_output_cases() {
  std::vector<cm::MLACase> cases;
  cases.push_back(deepseek_case("decode", {{200, 1}, {64, 1}, {1000, 1}, {3, 1}}));
  cases.push_back(deepseek_case("prefill", {{0, 40}, {0, 7}}));
  const std::vector<cm::MLARequest> mixed = {{300, 1}, {50, 1}, {0, 9}, {700, 12}};
  cases.push_back(deepseek_case("mixed-chunked", mixed, 16, 64, 256));
  cm::MLACase c = deepseek_case("mixed-chunked-fp8-cache", mixed, 16, 64, 256);
  c.kv_cache_dtype = "fp8_e4m3";
  cases.push_back(c);
  c = deepseek_case("decode-out2d-pad", {{90, 1}, {17, 1}});
  c.output_2d = true;
  c.pad_tokens = 3;
  cases.push_back(c);
  c = deepseek_case("mixed-saturating", mixed, 16, 64, 256);
  c.output_scale = 1.f / 4096.f;
  cases.push_back(c);
  if (!small_grid()) {
    cases.push_back(deepseek_case("h128", {{24, 1}, {100, 1}, {20, 4}}, 128, 16, 48));
  }
  return cases;
}

TEST(CudaMlaFp8Output, MatchesReferenceMla) {
  PAGEDATTN_REQUIRE_GPU();
  uint64_t seed = 300;
  for (const cm::MLACase& c : fp8_output_cases()) {
    const std::vector<std::string> reasons = cm::unsupported_reasons(cuda_mla_backend(), Device::cuda, c);
    ASSERT_TRUE(reasons.empty()) << c.describe() << ": " << reasons.front();
    const cm::MLAResult r = cm::run_mla_case(cuda_mla_backend(), "", Device::cuda, c, seed++);
    EXPECT_TRUE(r.passed()) << r.describe();
    EXPECT_EQ(r.unwritten, 0) << r.describe();
    std::printf("%s\n", r.describe().c_str());
  }
}

TEST(CudaMlaFp8Output, IsItsOwnOutputQuantized) {
  PAGEDATTN_REQUIRE_GPU();
  uint64_t seed = 400;
  for (cm::MLACase c : fp8_output_cases()) {
    SCOPED_TRACE(c.describe());
    const float scale = c.output_scale;
    const cm::MLAOutputs fp8 = cm::run_mla_outputs(cuda_mla_backend(), "", Device::cuda, c, seed);
    c.output_scale = 0.f;
    const cm::MLAOutputs act = cm::run_mla_outputs(cuda_mla_backend(), "", Device::cuda, c, seed);
    ++seed;
    ASSERT_EQ(fp8.output.dtype(), DType::fp8_e4m3);
    ASSERT_EQ(act.output.dtype(), DType::bf16);
    const int64_t n = act.num_actual_tokens * c.num_heads * c.dims.v_head_dim;
    const cm::QuantizedComparison r = cm::compare_with_quantized(fp8.output, act.output, scale, n);
    std::printf("%s: %s\n", c.describe().c_str(), r.describe().c_str());
    EXPECT_EQ(r.unwritten, 0) << r.describe();
    EXPECT_LE(r.max_steps, 1) << r.describe();
    EXPECT_LE(r.mismatches, n / 100) << r.describe();
    if (scale < 1.f / 2048.f) EXPECT_GT(r.saturated, 0) << r.describe();
    // The LSE (live columns) does not depend on the output's quantization.
    const int64_t cols = fp8.lse.shape()[1];
    double diff = 0;
    for (int64_t h = 0; h < c.num_heads; ++h) {
      for (int64_t t = 0; t < act.num_actual_tokens; ++t) {
        const float a = fp8.lse.data_as<const float>()[h * cols + t];
        const float b = act.lse.data_as<const float>()[h * cols + t];
        diff = std::max(diff, std::isfinite(a) ? std::abs(double{a} - b) : INFINITY);
      }
    }
    EXPECT_LE(diff, 1e-5) << "largest LSE difference";
  }
}

TEST(CudaMlaFp8Output, LayerSelectsCudaMla) {
  PAGEDATTN_REQUIRE_GPU();
  MLAAttentionLayerParams p;
  p.num_heads = 16;
  p.kv_lora_rank = 512;
  p.qk_nope_head_dim = 128;
  p.qk_rope_head_dim = 64;
  p.qk_head_dim = 192;
  p.v_head_dim = 128;
  p.dtype = DType::bf16;
  p.device = Device::cuda;
  p.fp8_output = true;
  MLAAttention layer(p);
  EXPECT_EQ(layer.backend().name(), "CUDA_MLA");
  EXPECT_TRUE(layer.impl().fused_output_quant_supported(QuantKey{}));
  const auto& features = layer.backend().capabilities().features;
  EXPECT_NE(std::find(features.begin(), features.end(), "fp8_output"), features.end());
  EXPECT_TRUE(cuda_mla_backend().validate_configuration(layer.selector_config()).empty());
}

}  // namespace
}  // namespace pagedattn
