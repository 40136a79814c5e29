// libFuzzer target: make_local_attention_virtual_batches (src/metadata/local_attention.cpp).
//
// Input: attn_chunk_size, block_size, a batch (query_start_loc not necessarily starting at 0,
// seq_lens, a block table whose entry (r, c) holds r * cols + c so that every page of the
// result names the row and column it came from), with corner values and mismatched sizes one
// mutation away. Property: pagedattn::Error, or a result whose invariants hold:
//   - array sizes match num_virtual_batches and pages_per_local_batch = chunk / block_size;
//   - cu_seqlens_q_local is the running sum of seqlens_q_local and ends at the batch's query
//     token count; each request's virtual requests, in order, cover its queries [s - q, s);
//   - every virtual request lies in ONE attention chunk: its keys start at the chunk start
//     (a multiple of the chunk) and end at its last query, at most one chunk long; a request
//     without queries gets one virtual request over the chunk of its last key (vLLM's corner
//     case: a full chunk when seq_len is 0);
//   - its pages are the request's block-table columns from key_start / block_size on, as long
//     as those columns exist (vLLM clips past the row's end, which this does not judge).
// Inputs whose result would need more than 64 Ki entries (a huge chunk over a tiny block size,
// or billions of query tokens: memory the caller asks for) are skipped.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn::fuzz {
namespace {

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
std::string str(int64_t v) { return std::to_string(v); }

void check_result(const LocalAttentionVirtualBatches& v, int64_t chunk, int64_t block_size,
                  const std::vector<int32_t>& qsl, const std::vector<int32_t>& seq_lens,
                  const std::vector<int32_t>& table, int64_t cols) {
  const int64_t nvb = v.num_virtual_batches;
  const int64_t pages = v.pages_per_local_batch;
  PAGEDATTN_FUZZ_ASSERT(pages == chunk / block_size, "pages_per_local_batch " + str(pages));
  PAGEDATTN_FUZZ_ASSERT(nvb >= 0 && static_cast<int64_t>(v.seqlens_q_local.size()) == nvb &&
                            static_cast<int64_t>(v.seqlens_k_local.size()) == nvb &&
                            static_cast<int64_t>(v.cu_seqlens_q_local.size()) == nvb + 1 &&
                            static_cast<int64_t>(v.block_table_local.size()) == nvb * pages,
                        "array sizes");
  PAGEDATTN_FUZZ_ASSERT(v.cu_seqlens_q_local[0] == 0, "cu_seqlens_q_local[0]");
  for (int64_t i = 0; i < nvb; ++i) {
    PAGEDATTN_FUZZ_ASSERT(int64_t{v.cu_seqlens_q_local[i + 1]} - v.cu_seqlens_q_local[i] == v.seqlens_q_local[i],
                          "cu_seqlens_q_local is not the running sum at " + str(i));
  }
  const int64_t n = static_cast<int64_t>(seq_lens.size());
  PAGEDATTN_FUZZ_ASSERT(v.cu_seqlens_q_local[nvb] == int64_t{qsl[n]} - qsl[0], "total query tokens");

  int64_t vb = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t q = int64_t{qsl[r + 1]} - qsl[r];
    const int64_t s = seq_lens[r];
    int64_t pos = s - q;  // next query position of request r
    bool first = true;
    while (first || pos < s) {
      PAGEDATTN_FUZZ_ASSERT(vb < nvb, "request " + str(r) + " ran out of virtual requests");
      const int64_t ql = v.seqlens_q_local[vb];
      const int64_t kl = v.seqlens_k_local[vb];
      const std::string where = "virtual request " + str(vb) + " (request " + str(r) + ", q " + str(q) +
                                ", seq " + str(s) + ", chunk " + str(chunk) + ")";
      PAGEDATTN_FUZZ_ASSERT(kl >= 1 && kl <= chunk, where + ": seqlens_k_local " + str(kl));
      int64_t key_start = 0;
      if (q == 0) {
        PAGEDATTN_FUZZ_ASSERT(ql == 0, where + ": a request without queries got queries");
        key_start = s == 0 ? -chunk : floor_div(s - 1, chunk) * chunk;
        PAGEDATTN_FUZZ_ASSERT(kl == (s == 0 ? chunk : s - key_start), where + ": keys of an empty query");
      } else {
        PAGEDATTN_FUZZ_ASSERT(ql >= 1 && pos + ql <= s, where + ": seqlens_q_local " + str(ql));
        const int64_t chunk_start = floor_div(pos, chunk) * chunk;
        PAGEDATTN_FUZZ_ASSERT(floor_div(pos + ql - 1, chunk) * chunk == chunk_start,
                              where + ": queries span two chunks");
        key_start = chunk_start;
        PAGEDATTN_FUZZ_ASSERT(kl == pos + ql - chunk_start, where + ": keys do not run from the chunk start "
                                                                  "to the last query");
        pos += ql;
      }
      const int64_t first_col = floor_div(key_start, block_size);
      const int64_t pages_used = (kl + block_size - 1) / block_size;
      for (int64_t j = 0; j < pages_used && first_col >= 0 && first_col + j < cols; ++j) {
        const int64_t got = v.block_table_local[static_cast<size_t>(vb * pages + j)];
        PAGEDATTN_FUZZ_ASSERT(got == table[static_cast<size_t>(r * cols + first_col + j)],
                              where + ": page " + str(j) + " is entry " + str(got) + ", expected column " +
                                  str(first_col + j));
      }
      ++vb;
      first = false;
    }
  }
  PAGEDATTN_FUZZ_ASSERT(vb == nvb, "more virtual requests than the requests' queries need");
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagedattn;
  using namespace pagedattn::fuzz;
  ByteReader in(data, size);
  const int block_size = in.u8() < 0xF0 ? in.small(1, 8) : in.length(8);
  const int chunk = in.u8() < 0xF0 ? static_cast<int>(int64_t{block_size} * in.small(1, 6))  // modular
                                   : in.length(64);
  const int n = in.small(0, 6);
  std::vector<int32_t> qsl = {in.length(0)};
  std::vector<int32_t> seq_lens;
  for (int r = 0; r < n; ++r) {
    const int32_t q = in.length(24);
    qsl.push_back(static_cast<int32_t>(int64_t{qsl.back()} + q));  // modular (C++20)
    seq_lens.push_back(static_cast<int32_t>(int64_t{q} + in.length(48)));
  }
  const uint8_t sizes = in.u8();
  if (sizes >= 0xF0 && !qsl.empty()) qsl.pop_back();            // query_start_loc one short
  if (sizes >= 0xE0 && sizes < 0xF0) seq_lens.push_back(in.length(48));  // seq_lens one long
  int64_t widest = 0;
  for (int32_t s : seq_lens) widest = std::max<int64_t>(widest, block_size > 0 ? (int64_t{s} + block_size - 1) / block_size : 0);
  int cols = static_cast<int>(std::min<int64_t>(widest, 64)) + in.small(0, 2);
  if (in.u8() >= 0xF0) cols = in.length(8);
  const int rows = std::max<int>(static_cast<int>(seq_lens.size()) - (in.u8() >= 0xF0 ? 1 : 0), 0);
  if (cols > 4096) return 0;
  std::vector<int32_t> table(static_cast<size_t>(rows) * std::max(cols, 0));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);

  // Skip results that would be larger than 4 Mi entries (see the top comment).
  if (chunk > 0 && block_size > 0) {
    int64_t virtual_estimate = 0;
    for (size_t r = 0; r + 1 < qsl.size() && r < seq_lens.size(); ++r) {
      virtual_estimate += 2 + std::max<int64_t>(int64_t{qsl[r + 1]} - qsl[r], 0) / chunk;
    }
    if (virtual_estimate * std::max<int64_t>(chunk / block_size, 1) > (int64_t{1} << 16)) return 0;
  }

  LocalAttentionVirtualBatches v;
  try {
    v = make_local_attention_virtual_batches(chunk, qsl, seq_lens, table, cols, block_size);
  } catch (const Error&) {
    return 0;
  }
  check_result(v, chunk, block_size, qsl, seq_lens, table, cols);
  return 0;
}
