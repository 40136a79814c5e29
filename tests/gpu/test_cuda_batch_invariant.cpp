// Batch-invariant mode on the GPU backends (issue 21): every request of a pool gives the same bits
// alone and in >= 50 random batches (sizes, orders, decode-only and mixed steps, BuilderConfig
// num_sms 0 / 7 / 33 / 132, so the planner's SM count changes too), through the shared harness
// (conformance/batch_invariance.h) on CUDA (the warp-specialized kernel at head size 128, mma.sync
// at 96, an fp8 cache, a sliding window) and CUDA_MLA (16 heads: the mma.sync kernel; 128 heads:
// the wgmma kernel). The default mode is shown NOT invariant on the same CUDA pool, so the check
// can fail. And the mode computes the same attention: the CI conformance grid of CUDA and the
// full MLA grid of CUDA_MLA against the fp64 oracles with every builder in the mode. Skips
// without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "conformance/batch_invariance.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using conformance::RequestShape;
using conformance::invariance::check_batch_invariance;
using conformance::invariance::InvarianceCase;
using conformance::invariance::InvarianceReport;
using conformance::invariance::registered_backend;

void expect_invariant(const AttentionBackend& backend, const InvarianceCase& c, uint64_t seed) {
  conformance::invariance::expect_batch_invariant(backend, Device::cuda, c, seed);
}

// Decodes over short and long contexts (5000 and 9000 keys: three and five fixed 2048-key chunks;
// split to fill the device in the default mode), speculative decodes, prefills of more than one
// 128-row tile, chunked prefills over a context.
InvarianceCase cuda_case(int head_size) {
  InvarianceCase c;
  c.name = "cuda-d" + std::to_string(head_size);
  c.dtype = DType::bf16;
  c.head_size = head_size;
  c.num_heads = 16;
  c.num_kv_heads = 4;
  c.pool = {{5000, 1}, {9000, 1}, {700, 1}, {40, 1}, {0, 1}, {300, 3}, {2040, 4},
            {0, 150},  {600, 70}, {3000, 33}, {2100, 1}, {100, 1}};
  c.num_sms = {0, 7, 33, 132};
  return c;
}

TEST(CudaBatchInvariant, WarpSpecializedD128) {
  PAGEDATTN_REQUIRE_GPU();
  expect_invariant(cuda_backend(), cuda_case(128), 101);
}

TEST(CudaBatchInvariant, MmaD96F16) {
  PAGEDATTN_REQUIRE_GPU();
  InvarianceCase c = cuda_case(96);
  c.dtype = DType::f16;
  expect_invariant(cuda_backend(), c, 102);
}

TEST(CudaBatchInvariant, Fp8CacheD128) {
  PAGEDATTN_REQUIRE_GPU();
  InvarianceCase c = cuda_case(128);
  c.name = "cuda-fp8";
  c.kv_cache_dtype = "fp8_e4m3";
  expect_invariant(cuda_backend(), c, 103);
}

TEST(CudaBatchInvariant, SlidingWindowD64) {
  PAGEDATTN_REQUIRE_GPU();
  InvarianceCase c = cuda_case(64);
  c.name = "cuda-window";
  c.sliding_window = 1000;
  c.num_kv_heads = 2;
  c.block_size = 32;
  expect_invariant(cuda_backend(), c, 104);
}

// The check finds what the default mode changes: the decode-only kernel for decode-only batches,
// splits that follow the batch and the SM count.
TEST(CudaBatchInvariantControl, DefaultModeDiffers) {
  PAGEDATTN_REQUIRE_GPU();
  InvarianceCase c = cuda_case(128);
  c.compositions = 5;
  const InvarianceReport report =
      check_batch_invariance(cuda_backend(), Device::cuda, c, 101, /*batch_invariant=*/false);
  EXPECT_FALSE(report.invariant()) << report.describe();
}

// DeepSeek's latent sizes (the CUDA_MLA kernels are built for L 512, R 64); decodes over long
// contexts (fixed 2048-key segments) and prefills with context (fixed chunks of a workspace of 4
// pages per request).
InvarianceCase mla_case(int num_heads) {
  InvarianceCase c;
  c.name = "cuda-mla-h" + std::to_string(num_heads);
  c.mla = true;
  c.dtype = DType::bf16;
  c.num_heads = num_heads;
  c.mla_dims = {512, 128, 64, 128};
  c.block_size = 64;
  c.pool = {{5000, 1}, {700, 1}, {30, 1}, {0, 1}, {2100, 1}, {9000, 1},
            {0, 40},   {300, 25}, {900, 60}, {1500, 9}};
  c.mla_workspace_tokens = static_cast<int64_t>(c.pool.size()) * 4 * c.block_size;
  c.num_sms = {0, 7, 33, 132};
  return c;
}

TEST(CudaMlaBatchInvariant, SixteenHeads) {
  PAGEDATTN_REQUIRE_GPU();
  expect_invariant(registered_backend("CUDA_MLA"), mla_case(16), 201);
}

TEST(CudaMlaBatchInvariant, HundredTwentyEightHeads) {
  PAGEDATTN_REQUIRE_GPU();
  expect_invariant(registered_backend("CUDA_MLA"), mla_case(128), 202);
}

void expect_conformant_in_the_mode(const AttentionBackend& backend, bool mla) {
  const conformance::invariance::ModeConformance result =
      conformance::invariance::conformance_in_the_mode(backend, Device::cuda, mla, /*full_mla_grid=*/true);
  // CUDA_MLA runs the DeepSeek-dim cases of the full MLA grid (its kernels are built for L 512, R 64).
  EXPECT_GT(result.ran, 0) << backend.name();
  for (const std::string& failure : result.failures) ADD_FAILURE() << failure;
}

TEST(CudaBatchInvariantConformance, CudaGrid) {
  PAGEDATTN_REQUIRE_GPU();
  expect_conformant_in_the_mode(cuda_backend(), false);
}

TEST(CudaBatchInvariantConformance, CudaMlaGrid) {
  PAGEDATTN_REQUIRE_GPU();
  expect_conformant_in_the_mode(registered_backend("CUDA_MLA"), true);
}

}  // namespace
}  // namespace pagedattn
