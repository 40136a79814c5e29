// make_local_attention_virtual_batches: chunked local attention (Llama 4 style, attention chunk
// of attn_chunk_size tokens) expressed as ordinary causal attention over "virtual" requests.
//
// Each request's query tokens are cut at attention-chunk boundaries (absolute positions that are
// multiples of attn_chunk_size); every piece becomes one virtual request whose keys are the part
// of its chunk up to its last query, and whose block table is the chunk's pages. This is vLLM's
// numpy code (utils.py, the version in reference/vllm-v1-attention-backends-utils.txt) written
// as one loop per request, with the same results, including its corner cases:
//   - tokens_in_last_block = c + (seq_len % -c) with Python's modulo (result in (-c, 0]), i.e.
//     c when seq_len is a multiple of c;
//   - page indices are clipped to block_table_cols - 1 (never above the row);
//   - a request with seq_len == 0 (an empty padding request) gets one virtual request with
//     q = 0, k = c and a page start of -c / block_size: torch's indexing then wraps negative
//     indices to the end of the row, and so does this code (an index below -block_table_cols is
//     an Error, as torch raises IndexError);
//   - query lengths of 0 are accepted (one virtual request with q = 0 over the last chunk).
// An empty batch (no requests) gives no virtual requests and cu_seqlens_q_local = [0] (numpy
// would fail on cu_num_blocks[-1]).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "metadata/host_read.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {

using metadata_detail::cdiv;
using metadata_detail::floor_div;
using metadata_detail::py_mod_neg;
using metadata_detail::py_mod_pos;

LocalAttentionVirtualBatches make_local_attention_virtual_batches(
    int attn_chunk_size, std::span<const int32_t> query_start_loc, std::span<const int32_t> seq_lens,
    std::span<const int32_t> block_table, int block_table_cols, int block_size) {
  constexpr const char* kFn = "make_local_attention_virtual_batches: ";
  // ---- arguments ----------------------------------------------------------------------------
  PAGEDATTN_CHECK(attn_chunk_size > 0, "attn_chunk_size", kFn, "attn_chunk_size = ",
                  attn_chunk_size, " must be > 0");
  PAGEDATTN_CHECK(block_size > 0, "block_size", kFn, "block_size = ", block_size, " must be > 0");
  PAGEDATTN_CHECK(attn_chunk_size % block_size == 0, "attn_chunk_size", kFn, "attn_chunk_size = ",
                  attn_chunk_size, " is not divisible by block_size = ", block_size,
                  ": a local-attention chunk must cover whole pages");
  const int64_t num_reqs = static_cast<int64_t>(seq_lens.size());
  PAGEDATTN_CHECK(static_cast<int64_t>(query_start_loc.size()) == num_reqs + 1, "query_start_loc",
                  kFn, "query_start_loc has ", query_start_loc.size(),
                  " entries: expected len(seq_lens) + 1 = ", num_reqs + 1);
  PAGEDATTN_CHECK(block_table_cols >= 0, "block_table_cols", kFn, "block_table_cols = ",
                  block_table_cols, " must be >= 0");
  const int64_t cols = block_table_cols;
  if (num_reqs > 0) {
    PAGEDATTN_CHECK(cols > 0, "block_table_cols", kFn, "block_table_cols = 0 but there are ",
                    num_reqs, " requests: every virtual request needs at least one page");
    const int64_t size = static_cast<int64_t>(block_table.size());
    PAGEDATTN_CHECK(size % cols == 0 && size / cols >= num_reqs, "block_table", kFn,
                    "block_table has ", size, " entries: expected rows x block_table_cols (", cols,
                    ") with at least num_reqs = ", num_reqs, " rows");
  }
  int64_t total_query_tokens = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q = int64_t{query_start_loc[r + 1]} - query_start_loc[r];
    total_query_tokens += q;
    PAGEDATTN_CHECK(q >= 0, "query_start_loc", kFn, "query_start_loc[", r + 1, "] = ",
                    query_start_loc[r + 1], " is smaller than query_start_loc[", r, "] = ",
                    query_start_loc[r], ": query_start_loc must be non-decreasing");
    PAGEDATTN_CHECK(seq_lens[r] >= q, "seq_lens", kFn, "seq_lens[", r, "] = ", seq_lens[r],
                    " is smaller than query_len ", q, " (query_start_loc[", r + 1,
                    "] - query_start_loc[", r, "]) of request ", r);
  }
  PAGEDATTN_CHECK(total_query_tokens <= std::numeric_limits<int32_t>::max(), "query_start_loc", kFn,
                  "the batch has ", total_query_tokens,
                  " query tokens: cu_seqlens_q_local must fit in int32");

  // ---- per request: first-chunk queries, last-chunk keys, number of virtual requests --------
  const int64_t c = attn_chunk_size;
  std::vector<int64_t> q_tokens_in_first_block(static_cast<size_t>(num_reqs));
  std::vector<int64_t> tokens_in_last_block(static_cast<size_t>(num_reqs));
  std::vector<int64_t> local_blocks(static_cast<size_t>(num_reqs));
  int64_t virtual_batches = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const auto i = static_cast<size_t>(r);
    const int64_t q = int64_t{query_start_loc[r + 1]} - query_start_loc[r];
    const int64_t s = seq_lens[r];
    q_tokens_in_first_block[i] = std::min(c - py_mod_pos(s - q, c), q);
    tokens_in_last_block[i] = c + py_mod_neg(s, c);
    local_blocks[i] = 1 + cdiv(q - q_tokens_in_first_block[i], c);
    virtual_batches += local_blocks[i];
  }
  const int64_t pages = c / block_size;  // pages_per_local_batch
  PAGEDATTN_CHECK(virtual_batches * pages <= std::numeric_limits<int32_t>::max(), "attn_chunk_size",
                  kFn, "the batch splits into ", virtual_batches, " virtual requests of ", pages,
                  " pages: more entries than an int32 block table can index");

  LocalAttentionVirtualBatches out;
  out.num_virtual_batches = static_cast<int>(virtual_batches);
  out.pages_per_local_batch = static_cast<int>(pages);
  out.seqlens_q_local.resize(static_cast<size_t>(virtual_batches));
  out.cu_seqlens_q_local.resize(static_cast<size_t>(virtual_batches) + 1);
  out.seqlens_k_local.resize(static_cast<size_t>(virtual_batches));
  out.block_table_local.resize(static_cast<size_t>(virtual_batches * pages));
  out.cu_seqlens_q_local[0] = 0;

  // ---- per virtual request -------------------------------------------------------------------
  int64_t v = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const auto i = static_cast<size_t>(r);
    const int64_t q = int64_t{query_start_loc[r + 1]} - query_start_loc[r];
    const int64_t s = seq_lens[r];
    const int64_t blocks = local_blocks[i];
    const int32_t* row = block_table.data() + r * cols;  // (cols,) block ids of request r
    for (int64_t a = 0; a < blocks; ++a, ++v) {           // a: arange, blocks - a - 1: rarange
      const auto vi = static_cast<size_t>(v);
      const int64_t rarange = blocks - a - 1;
      const int64_t q_local = a == 0 ? q_tokens_in_first_block[i]
                                     : std::min(q - q_tokens_in_first_block[i] - c * (a - 1), c);
      out.seqlens_q_local[vi] = static_cast<int32_t>(q_local);
      out.cu_seqlens_q_local[vi + 1] = static_cast<int32_t>(out.cu_seqlens_q_local[vi] + q_local);
      out.seqlens_k_local[vi] = static_cast<int32_t>(rarange == 0 ? tokens_in_last_block[i] : c);
      // First key of this virtual request (absolute position), then its first page.
      const int64_t k_start = s - (rarange * c + tokens_in_last_block[i]);
      const int64_t block_start = floor_div(k_start, block_size);
      for (int64_t j = 0; j < pages; ++j) {
        int64_t index = std::min(block_start + j, cols - 1);  // numpy clip(max=cols - 1)
        if (index < 0) index += cols;                         // torch negative indexing
        PAGEDATTN_CHECK(index >= 0, "block_table_cols", kFn, "virtual request ", v,
                        " (request ", r, ", seq_len ", s, ") needs page index ", index - cols,
                        ", outside a row of block_table_cols = ", cols, " pages");
        out.block_table_local[static_cast<size_t>(v * pages + j)] = row[index];
      }
    }
  }
  return out;
}

}  // namespace pagedattn
