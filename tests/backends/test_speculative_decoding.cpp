// Speculative decoding in the builders (BuilderConfig::num_speculative_tokens), host only (runs in
// every build): the standard builders' reorder_batch_threshold is 1 + k (0 without speculation),
// the MLA builders' stays 1; make_builder checks k; the CUDA planner's items for k-token decodes.
#include <gtest/gtest.h>

#include <vector>

#include "backends/cuda/attention/planner.h"
#include "backends/ops_test_util.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

using testing_ops::expect_error;

BuilderConfig standard_config(int num_speculative_tokens) {
  BuilderConfig c;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_size = 64;
  c.head_size_v = 64;
  c.max_num_batched_tokens = 512;
  c.num_speculative_tokens = num_speculative_tokens;
  return c;
}

const KVCacheSpec kStandardSpec = KVCacheSpec::full_attention(16, 2, 64, DType::bf16);

TEST(SpeculativeDecoding, StandardBuildersReportOnePlusKAsTheirDecodeThreshold) {
  for (const char* name : {"CPU", "REFERENCE"}) {
    const AttentionBackend* backend = find_backend(name);
    ASSERT_NE(backend, nullptr) << name;
    EXPECT_EQ(backend->make_builder(kStandardSpec, standard_config(0), Device::cpu)->reorder_batch_threshold(), 0)
        << name << ": no speculation, no reorder needed";
    for (int k : {1, 3, 7, 15}) {
      const auto builder = backend->make_builder(kStandardSpec, standard_config(k), Device::cpu);
      EXPECT_EQ(builder->reorder_batch_threshold(), 1 + k) << name;
      // A batch of 2-token speculative decodes after a prefill goes decodes first.
      const std::vector<int32_t> lens = {40, 1 + k, 1, 2 + k};
      const auto reorder = builder->reorder_batch(lens);
      ASSERT_TRUE(reorder.has_value()) << name;
      ASSERT_EQ(reorder->order.size(), lens.size());
      for (size_t i = 0; i < lens.size(); ++i) {
        EXPECT_EQ(lens[static_cast<size_t>(reorder->order[i])] <= 1 + k, i < 2)
            << name << " k = " << k << ": the decodes go first";
      }
    }
  }
}

// MLA builders take speculative requests as decodes too (their absorbed decode runs one row per
// token, MLADecodeMetadata): threshold 1 + k, and 1 without speculative decoding (decodes first
// always).
TEST(SpeculativeDecoding, MlaBuildersTakeSpeculativeDecodes) {
  MLADimensions dims;
  dims.kv_lora_rank = 64;
  dims.qk_rope_head_dim = 16;
  dims.qk_nope_head_dim = 32;
  dims.v_head_dim = 32;
  for (const char* name : {"CPU_MLA", "REFERENCE_MLA"}) {
    const AttentionBackend* backend = find_backend(name);
    ASSERT_NE(backend, nullptr) << name;
    for (const int k : {0, 3}) {
      BuilderConfig c;
      c.num_heads = 4;
      c.num_kv_heads = 1;
      c.head_size = dims.latent_head_size();
      c.mla_dimensions = dims;
      c.mla_dtype = DType::f32;
      c.num_speculative_tokens = k;
      const auto builder = backend->make_builder(KVCacheSpec::mla(16, dims.latent_head_size(), DType::f32), c,
                                                 Device::cpu);
      EXPECT_EQ(builder->reorder_batch_threshold(), 1 + k) << name << " k = " << k;
    }
  }
}

TEST(SpeculativeDecoding, MakeBuilderChecksTheNumberOfSpeculativeTokens) {
  const AttentionBackend& cpu = *find_backend("CPU");
  expect_error([&] { (void)cpu.make_builder(kStandardSpec, standard_config(-1), Device::cpu); },
               "config.num_speculative_tokens", ">= 0");
  expect_error([&] { (void)cpu.make_builder(kStandardSpec, standard_config(512), Device::cpu); },
               "config.num_speculative_tokens", "max_num_batched_tokens = 512");
  EXPECT_NO_THROW((void)cpu.make_builder(kStandardSpec, standard_config(511), Device::cpu));
}

// ---- the CUDA planner (pure host code) ----------------------------------------------------------

// A k-token decode is planned by its rows (planner.cpp): up to 16 rows per kv head one decode-path
// item (a decode-only batch then runs the decode-only kernel), more one prefill-path item per kv
// head, each reading the request's keys once, with the causal end of its last row.
TEST(SpeculativeDecodingCudaPlan, RowsOfAKTokenDecodeDecideItsPath) {
  cuda::PlannerConfig c;
  c.group_size = 4;
  c.num_kv_heads = 2;
  c.prefill_rows = 128;
  c.resident_ctas = 1 << 12;
  c.decode_resident_ctas = 1 << 12;
  c.allow_split = false;
  c.partial_rows_capacity = 1 << 20;
  c.max_work_items = 1 << 20;
  c.max_combine_items = 1 << 20;
  for (const std::vector<int32_t>& lens : {std::vector<int32_t>{4, 2, 1}, std::vector<int32_t>{8, 4, 1}}) {
    const std::vector<int32_t> seqs = {3000, 2000, 1000};
    std::vector<int32_t> qsl = {0};
    for (int32_t q : lens) qsl.push_back(qsl.back() + q);
    const cuda::AttentionPlan plan = cuda::make_attention_plan(c, qsl, seqs);
    ASSERT_EQ(plan.items.size(), 6u) << "one item per (request, kv head)";
    bool all_decode = true;
    for (const cuda::WorkItem& it : plan.items) {
      const int q = lens[static_cast<size_t>(it.request)];
      const bool decode = (it.flags & cuda::kItemDecodePath) != 0;
      EXPECT_EQ(decode, q * 4 <= cuda::kDecodeRows) << "query_len " << q;
      EXPECT_EQ(it.row_start, 0);
      EXPECT_EQ(it.num_rows, q * 4);
      EXPECT_EQ(it.kv_start, 0);
      EXPECT_EQ(it.kv_end, seqs[static_cast<size_t>(it.request)]) << "causal end of the last row";
      all_decode = all_decode && decode;
    }
    EXPECT_EQ(plan.decode_kernel, all_decode);
  }
}

}  // namespace
}  // namespace pagedattn
