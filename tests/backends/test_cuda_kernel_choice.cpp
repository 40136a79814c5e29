// The CUDA backends' kernel choices on the host (no GPU needed: the selection and the override
// parser are pure C++, compiled in every build): the PAGEDATTN_CUDA_KERNEL grammar and its
// errors, the programmatic override, which attention kernel a layer's plans run, which CUDA_MLA
// decode kernel a plan runs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "../../src/backends/cuda/attention/kernel_selection.h"
#include "../../src/backends/cuda/common/kernel_override.h"
#include "../../src/backends/cuda/mla/mla_decode.h"
#include "backends/ops_test_util.h"

namespace pagedattn {
namespace {

using cuda::AttentionKernel;
using cuda::DecodeKernelChoice;
using cuda::MlaDecodeKernelChoice;
using cuda::PrefillKernelChoice;
using testing_ops::expect_error;

TEST(CudaKernelOverride, GrammarAndDefaults) {
  const cuda::KernelOverride none = cuda::parse_kernel_override("");
  EXPECT_EQ(none.prefill, PrefillKernelChoice::automatic);
  EXPECT_EQ(none.decode, DecodeKernelChoice::automatic);
  EXPECT_EQ(none.mla, MlaDecodeKernelChoice::automatic);
  const cuda::KernelOverride all = cuda::parse_kernel_override("prefill=wgmma,decode=unified,mla=mma");
  EXPECT_EQ(all.prefill, PrefillKernelChoice::wgmma);
  EXPECT_EQ(all.decode, DecodeKernelChoice::unified);
  EXPECT_EQ(all.mla, MlaDecodeKernelChoice::mma);
  const cuda::KernelOverride some = cuda::parse_kernel_override("decode=decode");
  EXPECT_EQ(some.prefill, PrefillKernelChoice::automatic);
  EXPECT_EQ(some.decode, DecodeKernelChoice::decode);
  EXPECT_EQ(cuda::parse_kernel_override("prefill=mma").prefill, PrefillKernelChoice::mma);
  EXPECT_EQ(cuda::parse_kernel_override("prefill=ws").prefill, PrefillKernelChoice::ws);
  EXPECT_EQ(cuda::parse_kernel_override("prefill=auto,mla=auto").prefill, PrefillKernelChoice::automatic);
}

TEST(CudaKernelOverride, ErrorsNameTheVariableAndTheGrammar) {
  for (const char* bad : {"wgmma", "prefill=wgmma2", "decode=fused", "mla=wgmma", "prefill", "prefill=",
                          "prefill=mma,", ",decode=unified", "prefill=mma,prefill=ws", "kernel=mma",
                          "prefill=mma decode=unified"}) {
    SCOPED_TRACE(bad);
    expect_error([&] { cuda::parse_kernel_override(bad); }, "PAGEDATTN_CUDA_KERNEL",
                 "prefill=auto|mma|wgmma|ws, decode=auto|decode|unified, mla=auto|mma");
  }
  expect_error([] { cuda::parse_kernel_override("decode=fused"); }, "PAGEDATTN_CUDA_KERNEL", "\"fused\"");
  expect_error([] { cuda::parse_kernel_override("mla=mma,mla=mma"); }, "PAGEDATTN_CUDA_KERNEL", "twice");
}

TEST(CudaKernelOverride, ProgrammaticOverrideWins) {
  cuda::set_kernel_override(cuda::parse_kernel_override("prefill=mma,mla=mma"));
  EXPECT_EQ(cuda::kernel_override().prefill, PrefillKernelChoice::mma);
  EXPECT_EQ(cuda::kernel_override().mla, MlaDecodeKernelChoice::mma);
  cuda::set_kernel_override(std::nullopt);
  if (std::getenv("PAGEDATTN_CUDA_KERNEL") == nullptr) {
    EXPECT_EQ(cuda::kernel_override().prefill, PrefillKernelChoice::automatic);
    EXPECT_EQ(cuda::kernel_override().mla, MlaDecodeKernelChoice::automatic);
  }
}

// Which kernel runs the plans that are not decode-only: ws (16-bit, D = 64 / 128 / 256, or fp8
// e4m3 / e5m2 at D = 128 / 256; equal head sizes, sm_90a image, strides that fit), else the wgmma path (16-bit, D =
// 64 / 128 / 256), else mma.sync.
TEST(CudaAttentionKernelSelection, ChoosesOncePerLayer) {
  const auto select = [](PrefillKernelChoice c, int d, int dv, int fp8, bool image = true, bool fits = true) {
    return cuda::select_attention_kernel(c, d, dv, fp8, image, fits);
  };
  constexpr auto kAuto = PrefillKernelChoice::automatic;
  EXPECT_EQ(select(kAuto, 128, 128, 0), AttentionKernel::ws);
  EXPECT_EQ(select(kAuto, 64, 64, 0), AttentionKernel::ws);
  EXPECT_EQ(select(kAuto, 256, 256, 0), AttentionKernel::ws);
  EXPECT_EQ(select(kAuto, 256, 256, 0, true, false), AttentionKernel::wgmma);  // strides over 32 bits
  for (int d : {80, 96, 192}) EXPECT_EQ(select(kAuto, d, d, 0), AttentionKernel::mma) << d;
  EXPECT_EQ(select(kAuto, 128, 128, 1), AttentionKernel::ws);             // fp8 e4m3 cache
  EXPECT_EQ(select(kAuto, 128, 128, 2), AttentionKernel::ws);             // fp8 e5m2 cache
  EXPECT_EQ(select(kAuto, 256, 256, 1), AttentionKernel::ws);
  EXPECT_EQ(select(kAuto, 256, 256, 2), AttentionKernel::ws);
  for (int fp8 : {1, 2}) {
    for (int d : {64, 96}) EXPECT_EQ(select(kAuto, d, d, fp8), AttentionKernel::mma) << d;
  }
  EXPECT_EQ(select(kAuto, 128, 64, 2), AttentionKernel::mma);  // head_size_v != head_size
  EXPECT_EQ(select(PrefillKernelChoice::wgmma, 128, 128, 1), AttentionKernel::mma);
  EXPECT_EQ(select(kAuto, 128, 128, 1, false), AttentionKernel::mma);  // no sm_90a image
  EXPECT_EQ(select(kAuto, 128, 64, 0), AttentionKernel::mma);           // head_size_v != head_size
  EXPECT_EQ(select(kAuto, 128, 128, 0, false), AttentionKernel::mma);   // no sm_90a image
  EXPECT_EQ(select(kAuto, 128, 128, 0, true, false), AttentionKernel::wgmma);  // strides over 32 bits
  EXPECT_EQ(select(PrefillKernelChoice::ws, 128, 128, 0), AttentionKernel::ws);
  EXPECT_EQ(select(PrefillKernelChoice::ws, 256, 256, 0), AttentionKernel::ws);
  EXPECT_EQ(select(PrefillKernelChoice::wgmma, 256, 256, 0), AttentionKernel::wgmma);
  EXPECT_EQ(select(PrefillKernelChoice::wgmma, 128, 128, 0), AttentionKernel::wgmma);
  EXPECT_EQ(select(PrefillKernelChoice::wgmma, 96, 96, 0), AttentionKernel::mma);
  EXPECT_EQ(select(PrefillKernelChoice::mma, 128, 128, 0), AttentionKernel::mma);
  EXPECT_STREQ(cuda::attention_kernel_name(AttentionKernel::decode), "decode");
  // 32-bit byte strides: a 16-token page of 8 heads x 128 is 32 KB; 2^31 elements is not.
  EXPECT_TRUE(cuda::ws_strides_fit(16 * 8 * 128, 8 * 128, 16 * 8 * 128, 8 * 128, 16));
  EXPECT_FALSE(cuda::ws_strides_fit(int64_t{1} << 31, 8 * 128, 16 * 8 * 128, 8 * 128, 16));
}

// The CUDA_MLA decode kernel of a plan, from the rows of a request (tokens_per_request x heads):
// the mma.sync kernel with 16 rows a CTA for <= 16 rows; above, wgmma on sm_90a (unless mla=mma)
// with a 16-bit cache, or an fp8 one above 32 rows; else the mma.sync kernel with 16 (<= 32) or 64
// rows a CTA.
TEST(CudaMlaDecodeKernelSelection, ChoosesOncePerBuilder) {
  namespace md = cuda::mla_decode;
  constexpr auto kAuto = MlaDecodeKernelChoice::automatic;
  EXPECT_EQ(md::select_decode_kernel(kAuto, 128, DType::bf16, true), md::DecodeKernel::wgmma);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 64, DType::f16, true), md::DecodeKernel::wgmma);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 16, DType::bf16, true), md::DecodeKernel::mma_16_rows);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 32, DType::bf16, true), md::DecodeKernel::wgmma);  // 16 heads x 2
  EXPECT_EQ(md::select_decode_kernel(kAuto, 32, DType::fp8_e4m3, true), md::DecodeKernel::mma_16_rows);
  EXPECT_EQ(md::select_decode_kernel(MlaDecodeKernelChoice::mma, 32, DType::bf16, true),
            md::DecodeKernel::mma_16_rows);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 48, DType::bf16, true), md::DecodeKernel::wgmma);  // 16 heads x 3 tokens
  EXPECT_EQ(md::select_decode_kernel(kAuto, 48, DType::fp8_e5m2, true), md::DecodeKernel::wgmma);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 48, DType::fp8_e5m2, false), md::DecodeKernel::mma_64_rows);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 16, DType::fp8_e4m3, true), md::DecodeKernel::mma_16_rows);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 128, DType::fp8_e4m3, true), md::DecodeKernel::wgmma);
  EXPECT_EQ(md::select_decode_kernel(MlaDecodeKernelChoice::mma, 128, DType::fp8_e4m3, true),
            md::DecodeKernel::mma_64_rows);
  EXPECT_EQ(md::select_decode_kernel(kAuto, 128, DType::bf16, false), md::DecodeKernel::mma_64_rows);
  EXPECT_EQ(md::select_decode_kernel(MlaDecodeKernelChoice::mma, 128, DType::bf16, true),
            md::DecodeKernel::mma_64_rows);
  EXPECT_EQ(md::rows_per_cta(md::DecodeKernel::mma_16_rows), 16);
  EXPECT_EQ(md::rows_per_cta(md::DecodeKernel::mma_64_rows), 64);
  EXPECT_EQ(md::rows_per_cta(md::DecodeKernel::wgmma), 64);
  EXPECT_EQ(md::row_tiles(md::DecodeKernel::mma_16_rows, 2 * 16), 2);
  EXPECT_EQ(md::row_tiles(md::DecodeKernel::wgmma, 8 * 16), 2);
  EXPECT_EQ(md::row_tiles(md::DecodeKernel::wgmma, 3 * 128), 6);
}

}  // namespace
}  // namespace pagedattn
