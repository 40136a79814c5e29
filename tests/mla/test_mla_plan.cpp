// MLACommonMetadataBuilder: the decode/prefill split, the chunked-context plan (vLLM's rule, hand
// computed), device views, the workspace size, the plan_decode hook and the batch errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../../src/backends/mla/mla_common.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

const MLADimensions kDims{64, 32, 16, 32};  // L, P, R, V

BuilderConfig config(int max_seqs, int max_tokens, int max_model_len, int64_t workspace) {
  BuilderConfig c;
  c.num_heads = 4;
  c.num_kv_heads = 1;
  c.head_size = kDims.latent_head_size();
  c.max_num_seqs = max_seqs;
  c.max_num_batched_tokens = max_tokens;
  c.max_model_len = max_model_len;
  c.mla_dimensions = kDims;
  c.mla_dtype = DType::f32;
  c.mla_chunked_prefill_workspace_tokens = workspace;
  return c;
}

// Requests (context_len, query_len) in the given order; block ids 0, 1, 2, ... row by row.
OwnedCommonAttentionMetadata batch(const std::vector<std::pair<int, int>>& reqs, int bs = 16) {
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0};
  int cols = 1;
  for (const auto& [ctx, q] : reqs) {
    a.query_start_loc.push_back(a.query_start_loc.back() + q);
    a.seq_lens.push_back(ctx + q);
    cols = std::max(cols, (ctx + q + bs - 1) / bs);
  }
  a.max_num_blocks_per_req = cols;
  int32_t next = 0;
  for (size_t r = 0; r < reqs.size(); ++r) {
    for (int c = 0; c < cols; ++c) a.block_table.push_back(next++);
  }
  for (size_t r = 0; r < reqs.size(); ++r) {
    const int ctx = reqs[r].first;
    for (int j = 0; j < reqs[r].second; ++j) {
      const int pos = ctx + j;
      a.slot_mapping.push_back(int64_t{a.block_table[r * cols + pos / bs]} * bs + pos % bs);
    }
  }
  return make_common_attention_metadata(a, Device::cpu);
}

void expect_error(const std::function<void()>& fn, const std::string& argument) {
  try {
    fn();
    ADD_FAILURE() << "expected an Error naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

const KVCacheSpec kSpec = KVCacheSpec::mla(16, kDims.latent_head_size(), DType::f32);

// The decode / prefill split of a plan: requests and tokens of each part.
void expect_parts(const MLAMetadata& md, int decodes, int decode_tokens, int prefills, int prefill_tokens) {
  EXPECT_EQ(md.num_decodes, decodes);
  EXPECT_EQ(md.num_decode_tokens, decode_tokens);
  EXPECT_EQ(md.num_prefills, prefills);
  EXPECT_EQ(md.num_prefill_tokens, prefill_tokens);
}

TEST(MLAPlan, SplitAndChunkedContextAsVllm) {
  mla::MLACommonMetadataBuilder builder(kSpec, config(5, 64, 512, 80), Device::cpu);
  EXPECT_EQ(builder.reorder_batch_threshold(), 1);
  // 2 decodes, then prefills with context 100, 40 and 0.
  const auto common = batch({{19, 1}, {4, 1}, {100, 3}, {40, 2}, {0, 2}});
  const auto base = builder.build(0, common.common);
  const auto& md = dynamic_cast<const MLAMetadata&>(*base);
  EXPECT_EQ(md.num_actual_tokens, 9);
  expect_parts(md, 2, 2, 3, 7);
  EXPECT_EQ(md.slot_mapping.size(0), 9);
  EXPECT_EQ(md.workspace->workspace_tokens, 80);
  EXPECT_EQ(md.decode.seq_lens, (std::vector<int32_t>{20, 5}));
  EXPECT_EQ(md.decode.max_seq_len, 20);
  EXPECT_EQ(md.decode.block_table.size(0), 2);
  EXPECT_EQ(md.decode.block_table.data(), common.common.block_table_tensor.data());
  EXPECT_EQ(md.decode.query_start_loc, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(md.decode.token_seq_lens, (std::vector<int32_t>{20, 5}));
  EXPECT_EQ(md.decode.seq_lens_device.data(), md.decode.seq_lens.data());
  ASSERT_TRUE(md.prefill.has_value());
  const MLAPrefillMetadata& p = *md.prefill;
  EXPECT_EQ(p.token_offset, 2);
  EXPECT_EQ(p.query_start_loc, (std::vector<int32_t>{0, 3, 5, 7}));
  EXPECT_EQ(p.seq_lens, (std::vector<int32_t>{103, 42, 2}));
  EXPECT_EQ(p.context_lens, (std::vector<int32_t>{100, 40, 0}));
  EXPECT_EQ(p.max_query_len, 3);
  EXPECT_EQ(p.max_seq_len, 103);
  EXPECT_EQ(p.block_table.size(0), 3);
  EXPECT_EQ(p.block_table.data_as<int32_t>(),
            common.common.block_table_tensor.data_as<int32_t>() + 2 * p.block_table.stride(0));
  // Two prefills have context: chunk = round_down(80 / 2, 16) = 32; cdiv(100, 32) = 4 chunks.
  ASSERT_TRUE(p.chunked_context.has_value());
  const MLAChunkedContextMetadata& cc = *p.chunked_context;
  EXPECT_EQ(cc.max_context_chunk, 32);
  EXPECT_EQ(cc.num_chunks, 4);
  EXPECT_EQ(cc.workspace_tokens, 80);
  EXPECT_EQ(cc.chunk_starts, (std::vector<int32_t>{0, 0, 0, 32, 32, 32, 64, 64, 64, 96, 96, 96}));
  EXPECT_EQ(cc.chunk_seq_lens, (std::vector<int32_t>{32, 32, 0, 32, 8, 0, 32, 0, 0, 4, 0, 0}));
  EXPECT_EQ(cc.cu_seq_lens,
            (std::vector<int32_t>{0, 32, 64, 64, 0, 32, 40, 40, 0, 32, 32, 32, 0, 4, 4, 4}));
  EXPECT_EQ(cc.chunk_total_tokens, (std::vector<int32_t>{64, 40, 32, 4}));
  EXPECT_EQ(cc.max_seq_lens, (std::vector<int32_t>{32, 32, 32, 4}));
  EXPECT_EQ(cc.chunk_starts_device.shape(), (Shape{4, 3}));
  EXPECT_EQ(cc.cu_seq_lens_device.shape(), (Shape{4, 4}));
  EXPECT_EQ(cc.cu_seq_lens_device.data(), cc.cu_seq_lens.data());
  EXPECT_EQ(p.context_lens_device.data_as<int32_t>()[1], 40);
}

// Padding requests (query_len 0) are in neither part: the decodes' and the prefills' block-table
// rows are gathered (views when they stay consecutive), their arrays hold the live requests only.
// Speculative decoding (num_speculative_tokens k): requests of up to 1 + k tokens are decodes,
// each token attending causally (token j of q sees seq_len - q + 1 + j keys) through its request's
// block-table row (one row per request); longer requests stay prefills. Without k the same batch is
// a decode and three prefills.
TEST(MLAPlan, SpeculativeDecodesAreDecodesOfTheirTokens) {
  BuilderConfig c = config(6, 64, 512, 96);
  c.num_speculative_tokens = 3;
  mla::MLACommonMetadataBuilder builder(kSpec, c, Device::cpu);
  EXPECT_EQ(builder.reorder_batch_threshold(), 4);
  EXPECT_EQ(builder.max_decode_tokens(), 24);
  // Decodes of 1, 4, 2 and 3 tokens (context 19, 30, 0 + padding, 7), then a 5-token prefill.
  const auto common = batch({{19, 1}, {30, 4}, {0, 0}, {0, 2}, {7, 3}, {40, 5}});
  const auto base = builder.build(0, common.common);
  const auto& md = dynamic_cast<const MLAMetadata&>(*base);
  expect_parts(md, 4, 10, 1, 5);
  EXPECT_EQ(md.decode.seq_lens, (std::vector<int32_t>{20, 34, 2, 10}));
  EXPECT_EQ(md.decode.query_start_loc, (std::vector<int32_t>{0, 1, 5, 7, 10}));
  EXPECT_EQ(md.decode.token_seq_lens, (std::vector<int32_t>{20, 31, 32, 33, 34, 1, 2, 8, 9, 10}));
  EXPECT_EQ(md.decode.max_seq_len, 34);
  const std::vector<int> decode_request = {0, 1, 3, 4};  // the step's rows of the 4 decodes
  const TensorView& bt = common.common.block_table_tensor;
  ASSERT_EQ(md.decode.block_table.size(0), 4);
  EXPECT_NE(md.decode.block_table_storage, nullptr);  // padding among them: gathered
  EXPECT_EQ(md.decode.seq_lens_device.size(0), 4);
  for (int i = 0; i < 4; ++i) {
    for (int64_t col = 0; col < bt.size(1); ++col) {
      EXPECT_EQ(md.decode.block_table.data_as<int32_t>()[i * md.decode.block_table.stride(0) + col],
                bt.data_as<int32_t>()[decode_request[i] * bt.stride(0) + col])
          << "decode " << i << " column " << col;
    }
  }
  ASSERT_TRUE(md.prefill.has_value());
  EXPECT_EQ(md.prefill->token_offset, 10);
  EXPECT_EQ(md.prefill->seq_lens, (std::vector<int32_t>{45}));

  mla::MLACommonMetadataBuilder plain(kSpec, config(6, 64, 512, 96), Device::cpu);
  EXPECT_EQ(plain.reorder_batch_threshold(), 1);
  const auto common1 = batch({{19, 1}, {30, 4}, {0, 2}, {7, 3}});
  const auto base1 = plain.build(0, common1.common);
  const auto& md1 = dynamic_cast<const MLAMetadata&>(*base1);
  expect_parts(md1, 1, 1, 3, 9);
  // A speculative decode after a prefill is out of order.
  expect_error([&] { builder.build(0, batch({{40, 5}, {19, 2}}).common); }, "common");
}

TEST(MLAPlan, PaddingRequestsAreLeftOutOfBothParts) {
  mla::MLACommonMetadataBuilder builder(kSpec, config(8, 64, 512, 128), Device::cpu);
  // requests: decode, pad, decode, pad (with context), prefill, pad, prefill, pad
  const auto common = batch({{19, 1}, {0, 0}, {4, 1}, {30, 0}, {100, 3}, {0, 0}, {40, 2}, {7, 0}});
  const auto base = builder.build(0, common.common);
  const auto& md = dynamic_cast<const MLAMetadata&>(*base);
  const TensorView& bt = common.common.block_table_tensor;
  const auto row = [](const TensorView& t, int r) {
    return std::vector<int32_t>(t.data_as<int32_t>() + r * t.stride(0), t.data_as<int32_t>() + r * t.stride(0) + t.size(1));
  };
  EXPECT_EQ(md.num_actual_tokens, 7);
  EXPECT_EQ(md.num_decodes, 2);
  EXPECT_EQ(md.num_decode_tokens, 2);
  EXPECT_EQ(md.num_prefills, 2);
  EXPECT_EQ(md.num_prefill_tokens, 5);
  EXPECT_EQ(md.decode.seq_lens, (std::vector<int32_t>{20, 5}));
  ASSERT_EQ(md.decode.block_table.size(0), 2);
  EXPECT_NE(md.decode.block_table_storage, nullptr);  // rows 0 and 2: gathered
  EXPECT_EQ(row(md.decode.block_table, 0), row(bt, 0));
  EXPECT_EQ(row(md.decode.block_table, 1), row(bt, 2));
  ASSERT_TRUE(md.prefill.has_value());
  const MLAPrefillMetadata& p = *md.prefill;
  EXPECT_EQ(p.token_offset, 2);
  EXPECT_EQ(p.query_start_loc, (std::vector<int32_t>{0, 3, 5}));
  EXPECT_EQ(p.seq_lens, (std::vector<int32_t>{103, 42}));
  EXPECT_EQ(p.context_lens, (std::vector<int32_t>{100, 40}));
  ASSERT_EQ(p.block_table.size(0), 2);
  EXPECT_EQ(row(p.block_table, 0), row(bt, 4));
  EXPECT_EQ(row(p.block_table, 1), row(bt, 6));
  // Padding only at the end (CUDA-graph style): the parts view the step's table.
  const auto tail = batch({{19, 1}, {4, 1}, {100, 3}, {0, 0}, {9, 0}});
  const auto tail_base = builder.build(0, tail.common);
  const auto& tmd = dynamic_cast<const MLAMetadata&>(*tail_base);
  EXPECT_EQ(tmd.num_decodes, 2);
  EXPECT_EQ(tmd.num_prefills, 1);
  EXPECT_EQ(tmd.decode.block_table_storage, nullptr);
  EXPECT_EQ(tmd.decode.block_table.data(), tail.common.block_table_tensor.data());
  EXPECT_EQ(tmd.prefill->block_table_storage, nullptr);
  // Only padding: an empty plan.
  const auto pads = batch({{0, 0}, {12, 0}});
  const auto pads_base = builder.build(0, pads.common);
  const auto& pmd = dynamic_cast<const MLAMetadata&>(*pads_base);
  EXPECT_EQ(pmd.num_decodes, 0);
  EXPECT_FALSE(pmd.prefill.has_value());
}

TEST(MLAPlan, DefaultWorkspaceRuleGivesOneChunk) {
  // max(8 * 512, 4 * 5 * 16) = 4096 tokens: chunk = round_down(4096 / 2, 16) = 2048.
  mla::MLACommonMetadataBuilder builder(kSpec, config(5, 64, 512, 0), Device::cpu);
  const auto common = batch({{100, 3}, {40, 2}});
  const auto plan = builder.build(0, common.common);
  const auto& md = dynamic_cast<const MLAMetadata&>(*plan);
  EXPECT_EQ(md.num_decodes, 0);
  ASSERT_TRUE(md.prefill && md.prefill->chunked_context);
  EXPECT_EQ(md.prefill->chunked_context->workspace_tokens, 4096);
  EXPECT_EQ(md.prefill->chunked_context->max_context_chunk, 2048);
  EXPECT_EQ(md.prefill->chunked_context->num_chunks, 1);
  // Prefills without context: no chunk plan; decodes only: no prefill part.
  const auto fresh = batch({{0, 3}, {0, 2}});
  const auto plan2 = builder.build(0, fresh.common);
  const auto& md2 = dynamic_cast<const MLAMetadata&>(*plan2);
  ASSERT_TRUE(md2.prefill.has_value());
  EXPECT_FALSE(md2.prefill->chunked_context.has_value());
  const auto decodes = batch({{7, 1}});
  const auto plan3 = builder.build(0, decodes.common);
  const auto& md3 = dynamic_cast<const MLAMetadata&>(*plan3);
  EXPECT_FALSE(md3.prefill.has_value());
  EXPECT_EQ(md3.num_decodes, 1);
}

TEST(MLAPlan, WorkspaceBytesByHand) {
  // S = 5, H = 4, T = 64, W = 80 (rows = 80), L = 64, R = 16, P = 32, V = 32, f32.
  mla::MLACommonMetadataBuilder builder(kSpec, config(5, 64, 512, 80), Device::cpu);
  const size_t expected = 4 * (5 * 4 * 80       // q_latent
                               + 5 * 4 * 64     // o_latent
                               + 4 * 5          // decode_lse
                               + 80 * 80        // gather
                               + 80 * 4 * 64    // kv_up
                               + 80 * 4 * 48    // k_full
                               + 3 * 64 * 4 * 32  // suffix / chunk / context out
                               + 4 * 4 * 64);   // four (H, T) LSEs
  EXPECT_EQ(builder.workspace_bytes(), expected);
}

class CountingBuilder final : public mla::MLACommonMetadataBuilder {
 public:
  using MLACommonMetadataBuilder::MLACommonMetadataBuilder;
  struct Plan final : MLAMetadata {
    int decode_partitions = 0;
  };
  int calls = 0;
  bool last_fast_build = false;

 protected:
  std::shared_ptr<MLAMetadata> make_metadata() const override { return std::make_shared<Plan>(); }
  void plan_decode(MLAMetadata& md, const CommonAttentionMetadata& common,
                   bool fast_build) override {
    ++calls;
    last_fast_build = fast_build;
    EXPECT_EQ(md.num_decodes, common.num_reqs - md.num_prefills);
    dynamic_cast<Plan&>(md).decode_partitions = md.num_decodes * 2;
  }
};

TEST(MLAPlan, PlanDecodeRunsOnlyWithDecodes) {
  CountingBuilder builder(kSpec, config(4, 64, 512, 64), Device::cpu);
  const auto prefills = batch({{0, 3}});
  builder.build(0, prefills.common);
  EXPECT_EQ(builder.calls, 0);
  const auto mixed = batch({{3, 1}, {9, 1}, {0, 2}});
  const auto md = builder.build(0, mixed.common);
  EXPECT_EQ(builder.calls, 1);
  EXPECT_EQ(dynamic_cast<const CountingBuilder::Plan&>(*md).decode_partitions, 4);
  EXPECT_FALSE(builder.last_fast_build);
  // fast_build reaches the backend's decode plan; build_for_drafting is a fast build.
  builder.build(0, mixed.common, /*fast_build=*/true);
  EXPECT_TRUE(builder.last_fast_build);
  builder.build(0, mixed.common);
  (void)builder.build_for_drafting(mixed.common, 2);
  EXPECT_TRUE(builder.last_fast_build);
  EXPECT_EQ(builder.calls, 4);
  expect_error([&] { (void)builder.build_for_drafting(mixed.common, -1); }, "draft_index");
}

TEST(MLAPlan, BatchErrors) {
  mla::MLACommonMetadataBuilder builder(kSpec, config(3, 16, 128, 48), Device::cpu);
  expect_error([&] { const auto c = batch({{0, 3}, {5, 1}}); builder.build(0, c.common); },
               "common");  // a decode after a prefill
  expect_error([&] { const auto c = batch({{1, 1}, {1, 1}, {1, 1}, {1, 1}}); builder.build(0, c.common); },
               "common.num_reqs");
  expect_error([&] { const auto c = batch({{0, 17}}); builder.build(0, c.common); },
               "common.num_actual_tokens");
  expect_error([&] { const auto c = batch({{200, 2}}); builder.build(0, c.common); },
               "common.max_seq_len");
  expect_error([&] { const auto c = batch({{0, 2}}); builder.build(-1, c.common); },
               "common_prefix_len");
}

TEST(MLAPlan, ConstructionErrors) {
  expect_error([] { mla::MLACommonMetadataBuilder b(kSpec, config(4, 64, 512, 63), Device::cpu); },
               "config.mla_chunked_prefill_workspace_tokens");  // < max_num_seqs * block_size
  const KVCacheSpec wrong = KVCacheSpec::mla(16, 72, DType::f32);
  expect_error([&] { mla::MLACommonMetadataBuilder b(wrong, config(4, 64, 512, 0), Device::cpu); },
               "spec.head_size");
  const KVCacheSpec full = KVCacheSpec::full_attention(16, 1, 80, DType::f32);
  expect_error([&] { mla::MLACommonMetadataBuilder b(full, config(4, 64, 512, 0), Device::cpu); },
               "spec");
  BuilderConfig no_heads = config(4, 64, 512, 0);
  no_heads.num_heads = 0;
  expect_error([&] { mla::MLACommonMetadataBuilder b(kSpec, no_heads, Device::cpu); },
               "config.num_heads");
}

}  // namespace
}  // namespace pagedattn
