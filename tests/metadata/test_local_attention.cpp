// make_local_attention_virtual_batches: the reference page's worked example, corner cases of the
// numpy code (Python modulo, page clipping, negative page indices), argument errors, and a seeded
// property test against an independent brute force (walk every query position, group by chunk).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "metadata/metadata_test_util.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

using testing::expect_error_mentions;

std::vector<int32_t> iota_table(int rows, int cols) {
  std::vector<int32_t> table(static_cast<size_t>(rows * cols));
  std::iota(table.begin(), table.end(), 0);
  return table;
}

TEST(LocalAttention, ReferenceExample) {
  // attn_chunk_size 4, q_seqlens [4, 10, 5], k_seqlens [6, 17, 9], block_size 2, table 3 x 10.
  const std::vector<int32_t> query_start_loc = {0, 4, 14, 19};
  const std::vector<int32_t> seq_lens = {6, 17, 9};
  const std::vector<int32_t> table = iota_table(3, 10);
  const LocalAttentionVirtualBatches v =
      make_local_attention_virtual_batches(4, query_start_loc, seq_lens, table, 10, 2);
  EXPECT_EQ(v.num_virtual_batches, 8);
  EXPECT_EQ(v.pages_per_local_batch, 2);
  EXPECT_EQ(v.seqlens_q_local, (std::vector<int32_t>{2, 2, 1, 4, 4, 1, 4, 1}));
  EXPECT_EQ(v.cu_seqlens_q_local, (std::vector<int32_t>{0, 2, 4, 5, 9, 13, 14, 18, 19}));
  EXPECT_EQ(v.seqlens_k_local, (std::vector<int32_t>{4, 2, 4, 4, 4, 1, 4, 1}));
  EXPECT_EQ(v.block_table_local, (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19,
                                                       22, 23, 24, 25}));
}

TEST(LocalAttention, SeqLenMultipleOfChunkGivesAFullLastChunk) {
  // seq_len % -4 == 0 in Python, so tokens_in_last_block = 4 (not 0).
  const LocalAttentionVirtualBatches v =
      make_local_attention_virtual_batches(4, std::vector<int32_t>{0, 8}, std::vector<int32_t>{8},
                                           iota_table(1, 6), 6, 2);
  EXPECT_EQ(v.seqlens_q_local, (std::vector<int32_t>{4, 4}));
  EXPECT_EQ(v.seqlens_k_local, (std::vector<int32_t>{4, 4}));
  EXPECT_EQ(v.block_table_local, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(LocalAttention, DecodeAndEmptyQuery) {
  // Request 0: decode at position 12 (seq 13): chunk [12, 16), k = 1.
  // Request 1: no query tokens, seq 6: one virtual request over the last chunk, k = 6 % 4 = 2.
  const LocalAttentionVirtualBatches v = make_local_attention_virtual_batches(
      4, std::vector<int32_t>{0, 1, 1}, std::vector<int32_t>{13, 6}, iota_table(2, 8), 8, 2);
  EXPECT_EQ(v.seqlens_q_local, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(v.cu_seqlens_q_local, (std::vector<int32_t>{0, 1, 1}));
  EXPECT_EQ(v.seqlens_k_local, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(v.block_table_local, (std::vector<int32_t>{6, 7, 10, 11}));
}

TEST(LocalAttention, PageIndicesAreClippedToTheLastColumn) {
  // seq 5 = q 5, chunk 4, block 2, only 3 columns: the second chunk starts at page 2 and its
  // second page (3) is clipped to column 2, as numpy's clip(max=cols - 1).
  const LocalAttentionVirtualBatches v = make_local_attention_virtual_batches(
      4, std::vector<int32_t>{0, 5}, std::vector<int32_t>{5}, std::vector<int32_t>{40, 41, 42}, 3, 2);
  EXPECT_EQ(v.seqlens_q_local, (std::vector<int32_t>{4, 1}));
  EXPECT_EQ(v.seqlens_k_local, (std::vector<int32_t>{4, 1}));
  EXPECT_EQ(v.block_table_local, (std::vector<int32_t>{40, 41, 42, 42}));
}

TEST(LocalAttention, EmptyRequestWrapsNegativePagesLikeTorch) {
  // seq_len 0: tokens_in_last_block = 4 + (0 % -4) = 4, first key -4, first page -2: torch
  // reads columns -2, -1 = the last two of the row.
  const LocalAttentionVirtualBatches v = make_local_attention_virtual_batches(
      4, std::vector<int32_t>{0, 0}, std::vector<int32_t>{0}, iota_table(1, 5), 5, 2);
  EXPECT_EQ(v.seqlens_q_local, (std::vector<int32_t>{0}));
  EXPECT_EQ(v.seqlens_k_local, (std::vector<int32_t>{4}));
  EXPECT_EQ(v.block_table_local, (std::vector<int32_t>{3, 4}));
  // With one column, page -2 is outside the row (torch raises IndexError).
  expect_error_mentions(
      [] {
        make_local_attention_virtual_batches(4, std::vector<int32_t>{0, 0}, std::vector<int32_t>{0},
                                             std::vector<int32_t>{9}, 1, 2);
      },
      {"page index -2", "block_table_cols = 1"});
}

TEST(LocalAttention, EmptyBatch) {
  const LocalAttentionVirtualBatches v = make_local_attention_virtual_batches(
      8, std::vector<int32_t>{0}, std::vector<int32_t>{}, std::vector<int32_t>{}, 0, 4);
  EXPECT_EQ(v.num_virtual_batches, 0);
  EXPECT_EQ(v.pages_per_local_batch, 2);
  EXPECT_TRUE(v.seqlens_q_local.empty());
  EXPECT_EQ(v.cu_seqlens_q_local, (std::vector<int32_t>{0}));
  EXPECT_TRUE(v.block_table_local.empty());
}

TEST(LocalAttention, RejectsBadArguments) {
  const std::vector<int32_t> qsl = {0, 4};
  const std::vector<int32_t> seq = {6};
  const std::vector<int32_t> table = iota_table(1, 4);
  expect_error_mentions([&] { make_local_attention_virtual_batches(6, qsl, seq, table, 4, 4); },
                        {"attn_chunk_size = 6", "not divisible by block_size = 4"});
  expect_error_mentions([&] { make_local_attention_virtual_batches(0, qsl, seq, table, 4, 4); },
                        {"attn_chunk_size = 0"});
  expect_error_mentions([&] { make_local_attention_virtual_batches(8, qsl, seq, table, 4, 0); },
                        {"block_size = 0"});
  expect_error_mentions(
      [&] { make_local_attention_virtual_batches(8, std::vector<int32_t>{0, 4, 5}, seq, table, 4, 4); },
      {"query_start_loc has 3 entries", "len(seq_lens) + 1 = 2"});
  expect_error_mentions(
      [&] { make_local_attention_virtual_batches(8, std::vector<int32_t>{4, 2}, seq, table, 4, 4); },
      {"query_start_loc[1] = 2", "non-decreasing"});
  expect_error_mentions(
      [&] { make_local_attention_virtual_batches(8, qsl, std::vector<int32_t>{3}, table, 4, 4); },
      {"seq_lens[0] = 3", "query_len 4"});
  expect_error_mentions(
      [&] { make_local_attention_virtual_batches(8, qsl, seq, std::vector<int32_t>{1, 2, 3}, 4, 4); },
      {"block_table has 3 entries"});
  expect_error_mentions([&] { make_local_attention_virtual_batches(8, qsl, seq, table, 0, 4); },
                        {"block_table_cols = 0"});
}

// Independent oracle: walk the query positions of each request, cut at multiples of the chunk.
struct ExpectedVirtualBatch {
  int request;
  int32_t q;
  int32_t k;
  int64_t k_start;
};

std::vector<ExpectedVirtualBatch> brute_force(int chunk, const std::vector<int32_t>& q_lens,
                                              const std::vector<int32_t>& seq_lens) {
  std::vector<ExpectedVirtualBatch> out;
  for (size_t r = 0; r < q_lens.size(); ++r) {
    const int64_t s = seq_lens[r];
    const int64_t first = s - q_lens[r];
    if (q_lens[r] == 0) {  // no queries: the chunk holding the last key (s > 0 here)
      const int64_t start = (s - 1) / chunk * chunk;
      out.push_back({static_cast<int>(r), 0, static_cast<int32_t>(s - start), start});
      continue;
    }
    for (int64_t p = first; p < s; ++p) {
      const int64_t start = p / chunk * chunk;
      if (p == first || p % chunk == 0) out.push_back({static_cast<int>(r), 0, 0, start});
      out.back().q += 1;
      out.back().k = static_cast<int32_t>(p + 1 - start);  // causal: keys up to the last query
    }
  }
  return out;
}

TEST(LocalAttention, RandomBatchesMatchBruteForce) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 400; ++trial) {
    const int block_size = 1 << std::uniform_int_distribution<int>(0, 4)(rng);
    const int chunk = block_size * std::uniform_int_distribution<int>(1, 6)(rng);
    const int num_reqs = std::uniform_int_distribution<int>(1, 10)(rng);
    std::vector<int32_t> q_lens;
    std::vector<int32_t> seq_lens;
    std::vector<int32_t> qsl = {0};
    int max_pages = 1;
    for (int r = 0; r < num_reqs; ++r) {
      const int32_t q = std::uniform_int_distribution<int>(0, 3)(rng) == 0
                            ? std::uniform_int_distribution<int>(0, 1)(rng)
                            : std::uniform_int_distribution<int>(1, 5 * chunk)(rng);
      const int32_t context = std::uniform_int_distribution<int>(q == 0 ? 1 : 0, 6 * chunk)(rng);
      q_lens.push_back(q);
      seq_lens.push_back(q + context);
      qsl.push_back(qsl.back() + q);
      max_pages = std::max(max_pages, (q + context + block_size - 1) / block_size);
    }
    // Sometimes a table narrower than the chunks need (exercises the clip), otherwise wide enough.
    const int cols = trial % 4 == 0 ? std::max(1, max_pages - 2) : max_pages + (trial % 3);
    std::vector<int32_t> table(static_cast<size_t>(num_reqs * cols));
    std::uniform_int_distribution<int32_t> block_id(0, 100000);
    for (auto& id : table) id = block_id(rng);

    const LocalAttentionVirtualBatches v =
        make_local_attention_virtual_batches(chunk, qsl, seq_lens, table, cols, block_size);
    const std::vector<ExpectedVirtualBatch> expected = brute_force(chunk, q_lens, seq_lens);
    const int pages = chunk / block_size;
    ASSERT_EQ(v.num_virtual_batches, static_cast<int>(expected.size())) << "trial " << trial;
    ASSERT_EQ(v.pages_per_local_batch, pages);
    ASSERT_EQ(v.cu_seqlens_q_local.size(), expected.size() + 1);
    ASSERT_EQ(v.block_table_local.size(), expected.size() * static_cast<size_t>(pages));
    std::vector<int64_t> q_per_request(static_cast<size_t>(num_reqs), 0);
    for (size_t i = 0; i < expected.size(); ++i) {
      const ExpectedVirtualBatch& e = expected[i];
      ASSERT_EQ(v.seqlens_q_local[i], e.q) << "trial " << trial << " virtual " << i;
      ASSERT_EQ(v.seqlens_k_local[i], e.k) << "trial " << trial << " virtual " << i;
      ASSERT_LE(v.seqlens_k_local[i], chunk);
      ASSERT_EQ(v.cu_seqlens_q_local[i + 1] - v.cu_seqlens_q_local[i], e.q);
      q_per_request[static_cast<size_t>(e.request)] += v.seqlens_q_local[i];
      for (int j = 0; j < pages; ++j) {
        const int64_t column = std::min<int64_t>(e.k_start / block_size + j, cols - 1);
        ASSERT_EQ(v.block_table_local[i * static_cast<size_t>(pages) + static_cast<size_t>(j)],
                  table[static_cast<size_t>(e.request * cols + column)])
            << "trial " << trial << " virtual " << i << " page " << j;
      }
    }
    for (int r = 0; r < num_reqs; ++r) ASSERT_EQ(q_per_request[static_cast<size_t>(r)], q_lens[r]);
    ASSERT_EQ(v.cu_seqlens_q_local.back(), qsl.back());
  }
}

}  // namespace
}  // namespace pagedattn
