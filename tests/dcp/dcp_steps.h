// Steps of the DCP tests (tests/dcp on the host, tests/gpu_dcp on GPUs): requests of (context,
// query) tokens, and the global step of a batch of them over a table of virtual blocks.
#pragma once

#include <algorithm>
#include <vector>

#include "pagedattn/metadata.h"

namespace pagedattn::dcp_test {

struct Req {
  int context = 0, query = 0;
};

// The global step of `reqs` (fill: the contexts as new tokens from position 0, requests without one
// left out), with a table of virtual blocks of block * n tokens, distinct ids per request;
// *num_blocks: the blocks a rank's cache needs.
inline CommonAttentionMetadataArgs global_step(const std::vector<Req>& reqs, int n, bool fill, int block,
                                               int* num_blocks) {
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0};
  int cols = 1, next = 0;
  for (const Req& r : reqs) cols = std::max(cols, (r.context + r.query + block * n - 1) / (block * n));
  a.max_num_blocks_per_req = cols;
  for (const Req& r : reqs) {
    const int used = (r.context + r.query + block * n - 1) / (block * n);
    const int first = next;
    next += used;
    if (fill && r.context == 0) continue;
    const int q = fill ? r.context : r.query;
    a.query_start_loc.push_back(a.query_start_loc.back() + q);
    a.seq_lens.push_back(fill ? r.context : r.context + r.query);
    for (int c = 0; c < cols; ++c) a.block_table.push_back(c < used ? first + c : 0);
  }
  *num_blocks = next + 1;
  return a;
}

}  // namespace pagedattn::dcp_test
