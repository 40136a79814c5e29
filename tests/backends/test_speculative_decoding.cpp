// Speculative decoding in the builders (BuilderConfig::num_speculative_tokens), host only (runs in
// every build): the standard builders' reorder_batch_threshold is 1 + k (0 without speculation),
// the MLA builders' stays 1; make_builder checks k; the CUDA planner puts the rows of a k-token
// decode on decode-path items of 16 rows (several per kv head when the rows are more than 16, up
// to kSpecDecodeMaxRows), and its capacity bounds cover such plans.
#include <gtest/gtest.h>

#include <algorithm>
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

TEST(SpeculativeDecoding, MlaBuildersKeepOneTokenDecodes) {
  MLADimensions dims;
  dims.kv_lora_rank = 64;
  dims.qk_rope_head_dim = 16;
  dims.qk_nope_head_dim = 32;
  dims.v_head_dim = 32;
  for (const char* name : {"CPU_MLA", "REFERENCE_MLA"}) {
    const AttentionBackend* backend = find_backend(name);
    ASSERT_NE(backend, nullptr) << name;
    BuilderConfig c;
    c.num_heads = 4;
    c.num_kv_heads = 1;
    c.head_size = dims.latent_head_size();
    c.mla_dimensions = dims;
    c.mla_dtype = DType::f32;
    c.num_speculative_tokens = 3;
    const auto builder = backend->make_builder(KVCacheSpec::mla(16, dims.latent_head_size(), DType::f32), c,
                                               Device::cpu);
    EXPECT_EQ(builder->reorder_batch_threshold(), 1)
        << name << ": the absorbed decode takes one token per request; a 4-token request is a prefill";
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

cuda::PlannerConfig planner_config(int group_size, int spec_decode_query_len) {
  cuda::PlannerConfig c;
  c.group_size = group_size;
  c.num_kv_heads = 2;
  c.prefill_rows = 128;
  c.resident_ctas = 1 << 12;
  c.decode_resident_ctas = 1 << 12;
  c.allow_split = false;
  c.spec_decode_query_len = spec_decode_query_len;
  c.partial_rows_capacity = 1 << 20;
  c.max_work_items = 1 << 20;
  c.max_combine_items = 1 << 20;
  return c;
}

struct Planned {
  cuda::AttentionPlan plan;
  std::vector<int32_t> query_start_loc;
};

Planned plan_of(const cuda::PlannerConfig& c, const std::vector<int32_t>& query_lens,
                const std::vector<int32_t>& seq_lens) {
  Planned p;
  p.query_start_loc = {0};
  for (int32_t q : query_lens) p.query_start_loc.push_back(p.query_start_loc.back() + q);
  p.plan = cuda::make_attention_plan(c, p.query_start_loc, seq_lens);
  return p;
}

TEST(SpeculativeDecodingCudaPlan, RowsOfAKTokenDecodeTakeSixteenRowDecodeItems) {
  // GQA 4: a 4-token decode is 16 rows (one item per kv head, as any decode); an 8-token one is
  // 32 rows: two decode-path items per kv head with a threshold of 8, one prefill item without.
  const std::vector<int32_t> lens = {8, 4, 1};
  const std::vector<int32_t> seqs = {3000, 2000, 1000};
  for (int threshold : {0, 8}) {
    const Planned p = plan_of(planner_config(4, threshold), lens, seqs);
    std::vector<int> rows_covered(3 * 2 * 32, 0);  // (request, kv head, row)
    for (const cuda::WorkItem& it : p.plan.items) {
      const bool decode = (it.flags & cuda::kItemDecodePath) != 0;
      if (it.request == 0) {
        EXPECT_EQ(decode, threshold == 8) << "threshold " << threshold;
        if (decode) EXPECT_EQ(it.num_rows, 16);
      } else {
        EXPECT_TRUE(decode) << "request " << it.request;
      }
      if (decode) EXPECT_LE(it.num_rows, cuda::kDecodeRows);
      // Causal: the item's keys end after its last row's position.
      const int last_token = (it.row_start + it.num_rows - 1) / 4;
      EXPECT_EQ(it.kv_end, seqs[static_cast<size_t>(it.request)] - lens[static_cast<size_t>(it.request)] + last_token + 1);
      for (int r = it.row_start; r < it.row_start + it.num_rows; ++r) {
        ++rows_covered[static_cast<size_t>((it.request * 2 + it.kv_head) * 32 + r)];
      }
    }
    for (int r = 0; r < 3; ++r) {
      for (int g = 0; g < 2; ++g) {
        for (int row = 0; row < 32; ++row) {
          const int expected = row < lens[static_cast<size_t>(r)] * 4 ? 1 : 0;
          EXPECT_EQ(rows_covered[static_cast<size_t>((r * 2 + g) * 32 + row)], expected)
              << "request " << r << " kv head " << g << " row " << row;
        }
      }
    }
    EXPECT_EQ(p.plan.decode_kernel, threshold == 8) << "a decode-only batch runs the decode-only kernel";
  }
}

TEST(SpeculativeDecodingCudaPlan, BeyondTheRowCapOrTheThresholdIsAPrefill) {
  // GQA 8 with a threshold of 16: 8 tokens are 64 rows (4 decode items), 9 tokens 72 rows
  // (> kSpecDecodeMaxRows: prefill path), as is anything beyond the threshold.
  const cuda::PlannerConfig c = planner_config(8, 16);
  EXPECT_TRUE(cuda::decodes_on_decode_path(c, 8));
  EXPECT_FALSE(cuda::decodes_on_decode_path(c, 9));
  EXPECT_TRUE(cuda::decodes_on_decode_path(planner_config(8, 0), 2)) << "16 rows: always a decode";
  EXPECT_FALSE(cuda::decodes_on_decode_path(planner_config(4, 4), 5)) << "20 rows past the threshold";
  EXPECT_EQ(cuda::decode_items_per_request(c), 4);
  EXPECT_EQ(cuda::decode_items_per_request(planner_config(4, 0)), 1);
  const Planned p = plan_of(c, {8, 9}, {500, 500});
  for (const cuda::WorkItem& it : p.plan.items) {
    EXPECT_EQ((it.flags & cuda::kItemDecodePath) != 0, it.request == 0) << "request " << it.request;
  }
}

// The workspace bounds (max_unsplit_work_items, fixed_split_capacity) hold for batches made of
// speculative decodes only, the case that has the most items per token.
TEST(SpeculativeDecodingCudaPlan, CapacityBoundsCoverSpeculativeBatches) {
  for (int group : {1, 4, 8}) {
    cuda::PlannerConfig c = planner_config(group, 8);
    const int max_seqs = 16, max_tokens = 128;
    std::vector<int32_t> lens, seqs;
    int tokens = 0;
    while (static_cast<int>(lens.size()) < max_seqs && tokens + 8 <= max_tokens) {
      lens.push_back(8);
      seqs.push_back(700);
      tokens += 8;
    }
    const Planned p = plan_of(c, lens, seqs);
    EXPECT_LE(static_cast<int64_t>(p.plan.items.size()), cuda::max_unsplit_work_items(c, max_seqs, max_tokens))
        << "group " << group;
    c.fixed_split_tiles = 2;  // 128-key chunks
    c.decode_resident_ctas = 0;
    const Planned fixed = plan_of(c, lens, seqs);
    const cuda::FixedSplitCapacity cap = cuda::fixed_split_capacity(c, max_seqs, max_tokens, 700);
    EXPECT_LE(static_cast<int64_t>(fixed.plan.items.size()), cap.work_items) << "group " << group;
    EXPECT_LE(fixed.plan.partial_rows, cap.partial_rows) << "group " << group;
    EXPECT_LE(static_cast<int64_t>(fixed.plan.combine.size()), cap.combine_items) << "group " << group;
  }
}

}  // namespace
}  // namespace pagedattn
