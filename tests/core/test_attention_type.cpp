// AttentionType names, kernel block-size vocabulary and CUDA-graph support names.
#include <gtest/gtest.h>

#include <string>

#include "pagedattn/attention_type.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

TEST(AttentionTypeNames, RoundTripAndErrors) {
  for (AttentionType t : {AttentionType::decoder, AttentionType::encoder,
                          AttentionType::encoder_only, AttentionType::encoder_decoder}) {
    EXPECT_EQ(parse_attention_type(attention_type_name(t)), t);
  }
  EXPECT_EQ(attention_type_name(AttentionType::encoder_decoder), "encoder_decoder");
  try {
    parse_attention_type("cross");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "attn_type");
    EXPECT_NE(std::string(e.what()).find("'cross'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(uses_kv_cache(AttentionType::decoder));
  EXPECT_TRUE(uses_kv_cache(AttentionType::encoder_decoder));
  EXPECT_FALSE(uses_kv_cache(AttentionType::encoder_only));
  EXPECT_TRUE(is_causal(AttentionType::decoder));
  EXPECT_FALSE(is_causal(AttentionType::encoder_decoder));
}

TEST(KernelBlockSizes, SupportedAndDescribed) {
  const std::vector<KernelBlockSize> sizes{16, 32, MultipleOf{64}};
  EXPECT_TRUE(block_size_supported(sizes, 16));
  EXPECT_TRUE(block_size_supported(sizes, 32));
  EXPECT_TRUE(block_size_supported(sizes, 128));
  EXPECT_TRUE(block_size_supported(sizes, 64));
  EXPECT_FALSE(block_size_supported(sizes, 48));
  EXPECT_FALSE(block_size_supported(sizes, 8));
  EXPECT_FALSE(block_size_supported(sizes, 0));
  EXPECT_FALSE(block_size_supported(sizes, -64));
  EXPECT_EQ(describe_block_sizes(sizes), "16, 32, multiples of 64");
  const std::vector<KernelBlockSize> any{MultipleOf{1}};
  EXPECT_TRUE(block_size_supported(any, 7));
  EXPECT_EQ(describe_block_sizes(any), "any positive size");
  EXPECT_FALSE(block_size_supported({}, 16));
  EXPECT_EQ(describe_block_sizes({}), "none");
}

TEST(CudaGraphSupportNames, All) {
  EXPECT_EQ(cudagraph_support_name(CudaGraphSupport::never), "never");
  EXPECT_EQ(cudagraph_support_name(CudaGraphSupport::uniform_single_token_decode),
            "uniform_single_token_decode");
  EXPECT_EQ(cudagraph_support_name(CudaGraphSupport::uniform_batch), "uniform_batch");
  EXPECT_EQ(cudagraph_support_name(CudaGraphSupport::always), "always");
}

}  // namespace
}  // namespace pagedattn
