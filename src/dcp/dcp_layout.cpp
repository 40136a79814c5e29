// Decode context parallelism: where a token lives and a rank's share of a step (pagedattn/dcp.h).
#include <algorithm>
#include <cstdint>

#include "pagedattn/dcp.h"
#include "pagedattn/error.h"

namespace pagedattn {

int dcp_owner(int64_t token, const DcpConfig& c) { return static_cast<int>((token / c.interleave) % c.world_size); }

int64_t dcp_local_position(int64_t token, const DcpConfig& c) {
  return token / (int64_t{c.interleave} * c.world_size) * c.interleave + token % c.interleave;
}

int32_t dcp_local_seq_len(int64_t seq_len, const DcpConfig& c) {
  // Whole rounds of N I tokens give I each; the last, partial round gives this rank what lies in
  // its slot [rank I, (rank + 1) I).
  const int64_t round = int64_t{c.interleave} * c.world_size;
  const int64_t rest = seq_len % round - int64_t{c.rank} * c.interleave;
  return static_cast<int32_t>(seq_len / round * c.interleave + std::clamp<int64_t>(rest, 0, c.interleave));
}

std::vector<int32_t> get_dcp_local_seq_lens(std::span<const int32_t> seq_lens, const DcpConfig& c) {
  std::vector<int32_t> out;
  out.reserve(seq_lens.size());
  for (int32_t s : seq_lens) out.push_back(dcp_local_seq_len(s, c));
  return out;
}

DcpLocalStep make_dcp_local_step(const CommonAttentionMetadataArgs& global, const DcpConfig& c, int block_size) {
  c.validate(block_size);
  const int num_reqs = static_cast<int>(global.seq_lens.size());
  const int cols = global.max_num_blocks_per_req;
  PAGEDATTN_CHECK(global.causal, "global.causal", "DCP: the step must be causal (a decoder step)");
  PAGEDATTN_CHECK(global.query_start_loc.size() == static_cast<size_t>(num_reqs) + 1 && cols >= 0 &&
                      global.block_table.size() >= static_cast<size_t>(num_reqs) * static_cast<size_t>(cols),
                  "global", "DCP: query_start_loc has ", global.query_start_loc.size(), " entries, block_table ",
                  global.block_table.size(), " for ", num_reqs, " requests of ", cols, " columns");
  const int64_t virtual_block = int64_t{block_size} * c.world_size;
  DcpLocalStep step;
  CommonAttentionMetadataArgs& a = step.args;
  a.query_start_loc = {0};
  a.max_num_blocks_per_req = cols;
  a.causal = true;
  // One local request: rows [first, last] of global request r (first at position first_pos + first)
  // over the local keys [0, local_len). A row's slot: where its token sits in the physical block its
  // virtual block names, on the owner only.
  const auto add_request = [&](int r, int64_t first_pos, int first, int last, int32_t local_len) {
    a.seq_lens.push_back(local_len);
    const auto row = global.block_table.begin() + static_cast<int64_t>(r) * cols;
    a.block_table.insert(a.block_table.end(), row, row + cols);
    for (int i = first; i <= last; ++i) {
      step.rows.push_back(global.query_start_loc[r] + i);
      const int64_t pos = first_pos + i;
      if (dcp_owner(pos, c) != c.rank) {
        a.slot_mapping.push_back(-1);
        continue;
      }
      const int64_t vb = pos / virtual_block;
      PAGEDATTN_CHECK(vb < cols, "global.block_table", "DCP: request ", r, " token ", pos, " needs virtual block ", vb,
                      " but the block table has ", cols, " columns (", virtual_block, " tokens each)");
      a.slot_mapping.push_back(int64_t{row[vb]} * block_size + dcp_local_position(pos, c) % block_size);
    }
    a.query_start_loc.push_back(a.query_start_loc.back() + (last - first + 1));
  };
  for (int r = 0; r < num_reqs; ++r) {
    const int q = global.query_start_loc[r + 1] - global.query_start_loc[r];
    const int64_t first_pos = int64_t{global.seq_lens[r]} - q;
    PAGEDATTN_CHECK(q >= 0 && first_pos >= 0, "global", "DCP: request ", r, " has query_len ", q, " and seq_len ",
                    global.seq_lens[r]);
    // Runs of rows whose tokens this rank holds are one request (each row adds its own key, so the
    // local causal positions hold); a row held elsewhere is a request of its own over the local
    // keys before it (none: left out). Every request's new tokens are then this rank's last keys.
    int open = -1;  // first row of the open run of held rows, -1 = none
    for (int i = 0; i < q; ++i) {
      const int64_t pos = first_pos + i;
      if (dcp_owner(pos, c) == c.rank) {
        if (open < 0) open = i;
        continue;
      }
      if (open >= 0) {
        add_request(r, first_pos, open, i - 1, dcp_local_seq_len(pos, c));
        open = -1;
      }
      if (const int32_t keys = dcp_local_seq_len(pos + 1, c); keys > 0) add_request(r, first_pos, i, i, keys);
    }
    if (open >= 0) add_request(r, first_pos, open, q - 1, dcp_local_seq_len(first_pos + q, c));
  }
  return step;
}

}  // namespace pagedattn
