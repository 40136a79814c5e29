// Helpers shared by the metadata tests: random valid batches and error-message capture.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn::testing {

// Runs f, expects a pagedattn::Error, returns its message ("" + a test failure otherwise).
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a pagedattn::Error";
  return "";
}

// Expects f to throw an Error whose message contains every one of `parts`.
template <typename F>
void expect_error_mentions(F&& f, std::initializer_list<std::string> parts) {
  const std::string message = error_message(std::forward<F>(f));
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos) << "message: " << message << "\nmissing: " << part;
  }
}

// A consistent batch: query lens, context lens, a block table of distinct block ids drawn from
// [0, num_blocks), and the slot of every query token (block_table[r][p / bs] * bs + p % bs).
inline CommonAttentionMetadataArgs batch_args(const std::vector<int32_t>& query_lens,
                                              const std::vector<int32_t>& context_lens,
                                              int block_size, int extra_cols, std::mt19937& rng,
                                              int64_t* num_blocks_out) {
  const size_t n = query_lens.size();
  CommonAttentionMetadataArgs args;
  args.query_start_loc.assign(1, 0);
  int max_blocks = 0;
  for (size_t r = 0; r < n; ++r) {
    args.query_start_loc.push_back(args.query_start_loc.back() + query_lens[r]);
    const int32_t s = context_lens[r] + query_lens[r];
    args.seq_lens.push_back(s);
    max_blocks = std::max(max_blocks, (s + block_size - 1) / block_size);
  }
  const int cols = max_blocks + extra_cols;
  args.max_num_blocks_per_req = cols;
  const int64_t num_blocks = static_cast<int64_t>(n) * cols + 3;
  std::vector<int32_t> pool(static_cast<size_t>(num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  args.block_table.assign(pool.begin(), pool.begin() + static_cast<int64_t>(n) * cols);
  for (size_t r = 0; r < n; ++r) {
    for (int32_t i = 0; i < query_lens[r]; ++i) {
      const int32_t pos = context_lens[r] + i;
      const int32_t block = args.block_table[r * cols + pos / block_size];
      args.slot_mapping.push_back(int64_t{block} * block_size + pos % block_size);
    }
  }
  *num_blocks_out = num_blocks;
  return args;
}

// Metadata with only the query lens mattering (context 5 per request, no block table, slots -1).
inline OwnedCommonAttentionMetadata metadata_from_query_lens(const std::vector<int32_t>& query_lens) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc.assign(1, 0);
  for (int32_t q : query_lens) {
    args.query_start_loc.push_back(args.query_start_loc.back() + q);
    args.seq_lens.push_back(q + 5);
  }
  args.max_num_blocks_per_req = 0;
  args.slot_mapping.assign(static_cast<size_t>(args.query_start_loc.back()), -1);
  return make_common_attention_metadata(args);
}

}  // namespace pagedattn::testing
