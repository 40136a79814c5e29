// libFuzzer target: CommonAttentionMetadata::validate and make_common_attention_metadata.
//
// Input byte 0 picks the entry point:
//   even: validate(num_blocks, block_size) on views built from a decoded batch (fuzz_batch.h,
//         layout perturbation on). Property: it throws pagedattn::Error, or every invariant
//         metadata.h promises holds when re-checked here by independent code. The batch
//         utilities that rely on validate (split_decodes_and_prefills, common_prefix_len, the
//         host accessors) then run on it; on a rejected batch they run too and may only throw
//         Error.
//   odd:  make_common_attention_metadata(args, cpu, num_blocks, block_size) on decoded args.
//         Property: Error, or a result whose mirrors equal the arguments, whose padding is
//         as documented, which validates again, and whose views survive a move.
// Padding sizes (num_reqs_padded, num_tokens_padded, max_num_blocks_per_req with an empty
// table) are allocations the caller asks for; inputs that would ask for more than 4 MiB are
// skipped, so an out-of-memory report always means an allocation the caller did not ask for.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_batch.h"
#include "fuzz_input.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn::fuzz {
namespace {

// Independent element reads (strides honoured) for the re-check.
int64_t at1(const TensorView& t, int64_t i) {
  const int64_t off = i * t.stride(0);
  return t.dtype() == DType::i64 ? t.data_as<const int64_t>()[off] : t.data_as<const int32_t>()[off];
}
int64_t at2(const TensorView& t, int64_t r, int64_t c) {
  return t.data_as<const int32_t>()[r * t.stride(0) + c * t.stride(1)];
}

std::string str(int64_t v) { return std::to_string(v); }

// What validate() promises about a batch it accepted (metadata.h).
void check_validated(const CommonAttentionMetadata& m, int64_t num_blocks, int block_size) {
  const int64_t n = m.num_reqs;
  PAGEDATTN_FUZZ_ASSERT(n >= 0 && m.num_actual_tokens >= 0, "negative scalars accepted");
  for (const TensorView* v : {&m.query_start_loc_cpu, &m.seq_lens_cpu, &m.num_computed_tokens_cpu}) {
    PAGEDATTN_FUZZ_ASSERT(v->dtype() == DType::i32 && v->ndim() == 1 && v->device() == Device::cpu,
                          "host mirror layout: " + v->describe());
    PAGEDATTN_FUZZ_ASSERT(v->numel() == 0 || v->data() != nullptr, "null host mirror accepted");
  }
  PAGEDATTN_FUZZ_ASSERT(m.query_start_loc_cpu.size(0) == n + 1, "query_start_loc_cpu size");
  PAGEDATTN_FUZZ_ASSERT(m.seq_lens_cpu.size(0) == n && m.num_computed_tokens_cpu.size(0) == n,
                        "seq_lens_cpu / num_computed_tokens_cpu size");
  PAGEDATTN_FUZZ_ASSERT(at1(m.query_start_loc_cpu, 0) == 0, "query_start_loc_cpu[0] != 0 accepted");
  int64_t max_q = 0, max_s = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t q = at1(m.query_start_loc_cpu, r + 1) - at1(m.query_start_loc_cpu, r);
    const int64_t s = at1(m.seq_lens_cpu, r);
    PAGEDATTN_FUZZ_ASSERT(q >= 0, "negative query length accepted at request " + str(r));
    PAGEDATTN_FUZZ_ASSERT(s >= q, "seq_len < query_len accepted at request " + str(r));
    PAGEDATTN_FUZZ_ASSERT(at1(m.num_computed_tokens_cpu, r) == s - q,
                          "num_computed_tokens != seq_len - query_len accepted at request " + str(r));
    PAGEDATTN_FUZZ_ASSERT(m.query_len(static_cast<int>(r)) == q && m.seq_len(static_cast<int>(r)) == s &&
                              m.num_computed_tokens(static_cast<int>(r)) == s - q,
                          "host accessors disagree with the mirrors at request " + str(r));
    max_q = std::max(max_q, q);
    max_s = std::max(max_s, s);
  }
  PAGEDATTN_FUZZ_ASSERT(m.num_actual_tokens == at1(m.query_start_loc_cpu, n), "num_actual_tokens");
  PAGEDATTN_FUZZ_ASSERT(m.max_query_len == max_q && m.max_seq_len == max_s, "max_query_len / max_seq_len");

  const TensorView* device_views[] = {&m.query_start_loc, &m.seq_lens, &m.block_table_tensor, &m.slot_mapping};
  const DType device_dtypes[] = {DType::i32, DType::i32, DType::i32, DType::i64};
  const int device_ndims[] = {1, 1, 2, 1};
  for (int i = 0; i < 4; ++i) {
    const TensorView& v = *device_views[i];
    PAGEDATTN_FUZZ_ASSERT(v.dtype() == device_dtypes[i] && v.ndim() == device_ndims[i],
                          "device tensor " + str(i) + " layout: " + v.describe());
    PAGEDATTN_FUZZ_ASSERT(v.numel() == 0 || v.data() != nullptr, "null device tensor accepted");
    PAGEDATTN_FUZZ_ASSERT(v.device() == m.query_start_loc.device(), "mixed devices accepted");
  }
  PAGEDATTN_FUZZ_ASSERT(m.query_start_loc.size(0) >= n + 1 && m.seq_lens.size(0) >= n &&
                            m.block_table_tensor.size(0) >= n &&
                            m.slot_mapping.size(0) >= m.num_actual_tokens,
                        "device tensor too small accepted");
  const bool check_blocks = num_blocks >= 0 && block_size > 0;
  const int64_t cols = m.block_table_tensor.size(1);
  if (check_blocks) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t used = (at1(m.seq_lens_cpu, r) + block_size - 1) / block_size;
      PAGEDATTN_FUZZ_ASSERT(used <= cols, "block table narrower than request " + str(r) + " needs");
    }
  }
  if (m.query_start_loc.device() != Device::cpu) return;
  for (int64_t r = 0; r <= n; ++r) {
    PAGEDATTN_FUZZ_ASSERT(at1(m.query_start_loc, r) == at1(m.query_start_loc_cpu, r), "query_start_loc != mirror");
  }
  for (int64_t r = 0; r < n; ++r) {
    PAGEDATTN_FUZZ_ASSERT(at1(m.seq_lens, r) == at1(m.seq_lens_cpu, r), "seq_lens != mirror");
  }
  if (check_blocks) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t used = (at1(m.seq_lens_cpu, r) + block_size - 1) / block_size;
      for (int64_t c = 0; c < used; ++c) {
        const int64_t id = at2(m.block_table_tensor, r, c);
        PAGEDATTN_FUZZ_ASSERT(id >= 0 && id < num_blocks, "block id " + str(id) + " accepted for request " +
                                                              str(r) + " with num_blocks " + str(num_blocks));
      }
    }
  }
  for (int64_t i = 0; i < m.slot_mapping.size(0); ++i) {
    const int64_t slot = at1(m.slot_mapping, i);
    if (i >= m.num_actual_tokens) {
      PAGEDATTN_FUZZ_ASSERT(slot == -1, "padded slot tail entry " + str(slot) + " accepted");
    } else if (check_blocks) {
      // slot < num_blocks * block_size, written without the product (it may not fit in int64).
      const bool in_range = slot >= 0 && slot / block_size < num_blocks;
      PAGEDATTN_FUZZ_ASSERT(slot == -1 || in_range, "slot " + str(slot) + " accepted");
    } else {
      PAGEDATTN_FUZZ_ASSERT(slot >= -1, "negative slot " + str(slot) + " accepted");
    }
  }
}

// The batch utilities documented to work on metadata: on a validated batch they must succeed
// or throw Error (e.g. a block_size they reject); on any other they may only throw Error.
void run_batch_utilities(ByteReader& in, const CommonAttentionMetadata& m, int block_size) {
  const int threshold = in.small(0, 4);
  try {
    const DecodePrefillSplit split = split_decodes_and_prefills(m, threshold, in.flag());
    PAGEDATTN_FUZZ_ASSERT(split.num_decodes >= 0 && split.num_prefills >= 0 &&
                              split.num_decodes + split.num_prefills == m.num_reqs,
                          "split_decodes_and_prefills counts");
  } catch (const Error&) {
  }
  try {
    const int prefix = common_prefix_len(m, block_size);
    PAGEDATTN_FUZZ_ASSERT(prefix >= 0 && prefix % block_size == 0, "common_prefix_len " + str(prefix));
  } catch (const Error&) {
  }
}

void fuzz_validate(ByteReader& in) {
  BatchLimits limits;
  limits.block_size = in.small(1, 8);
  limits.num_blocks = in.small(1, 24);
  const RawBatch batch = decode_batch(in, limits);
  BatchViews views(in, batch, /*layout_perturbation=*/true);
  // The cache size validate() checks against: usually the batch's own, or a corner value.
  const uint8_t which = in.u8();
  int64_t num_blocks = limits.num_blocks;
  int block_size = limits.block_size;
  if (which >= 0xC0) {
    num_blocks = in.length64(32);
    block_size = in.length(16);
  } else if (which >= 0x80) {
    num_blocks = -1;  // skip the cache checks
  }
  bool accepted = false;
  try {
    views.common.validate(num_blocks, block_size);
    accepted = true;
  } catch (const Error&) {
  }
  if (accepted) check_validated(views.common, num_blocks, block_size);
  run_batch_utilities(in, views.common, std::max(block_size, 1));
}

void fuzz_make(ByteReader& in) {
  CommonAttentionMetadataArgs args;
  BatchLimits limits;
  limits.block_size = in.small(1, 8);
  limits.num_blocks = in.small(1, 24);
  const RawBatch batch = decode_batch(in, limits);
  args.query_start_loc = batch.query_start_loc;
  args.seq_lens = batch.seq_lens;
  args.block_table = batch.block_table;
  args.max_num_blocks_per_req = batch.cols;
  args.slot_mapping = batch.slot_mapping;
  args.causal = batch.causal;
  if (in.u8() >= 0xC0) args.num_reqs_padded = in.length(8);
  if (in.u8() >= 0xC0) args.num_tokens_padded = in.length(64);
  if (in.u8() >= 0xE0) args.max_num_blocks_per_req = in.length(8);
  if (in.u8() >= 0xF0) args.query_start_loc.clear();
  int64_t num_blocks = limits.num_blocks;
  int block_size = limits.block_size;
  const uint8_t which = in.u8();
  if (which >= 0xC0) {
    num_blocks = in.length64(32);
    block_size = in.length(16);
  } else if (which >= 0x80) {
    num_blocks = -1;
  }
  // Skip requests for large padded allocations (see the top comment).
  const int64_t rows = std::max<int64_t>({int64_t{args.num_reqs_padded}, int64_t{batch.num_reqs}, 0});
  if (rows > (1 << 18) || rows * std::max(args.max_num_blocks_per_req, 0) > (int64_t{1} << 20) ||
      args.num_tokens_padded > (1 << 19)) {
    return;
  }

  OwnedCommonAttentionMetadata owned;
  try {
    owned = make_common_attention_metadata(args, Device::cpu, num_blocks, block_size);
  } catch (const Error&) {
    return;
  }
  const CommonAttentionMetadata& m = owned.common;
  check_validated(m, num_blocks, block_size);
  const int64_t n = static_cast<int64_t>(args.query_start_loc.size()) - 1;
  PAGEDATTN_FUZZ_ASSERT(m.num_reqs == n, "num_reqs");
  for (int64_t r = 0; r <= n; ++r) {
    PAGEDATTN_FUZZ_ASSERT(at1(m.query_start_loc_cpu, r) == args.query_start_loc[r], "query_start_loc copy");
  }
  for (int64_t r = 0; r < n; ++r) {
    PAGEDATTN_FUZZ_ASSERT(at1(m.seq_lens_cpu, r) == args.seq_lens[r], "seq_lens copy");
  }
  const int64_t padded_rows = args.num_reqs_padded == 0 ? n : args.num_reqs_padded;
  PAGEDATTN_FUZZ_ASSERT(m.query_start_loc.size(0) == padded_rows + 1 && m.seq_lens.size(0) == padded_rows &&
                            m.block_table_tensor.size(0) == padded_rows &&
                            m.block_table_tensor.size(1) == args.max_num_blocks_per_req,
                        "padded shapes");
  for (int64_t r = n; r < padded_rows; ++r) {
    PAGEDATTN_FUZZ_ASSERT(at1(m.query_start_loc, r + 1) == m.num_actual_tokens && at1(m.seq_lens, r) == 0,
                          "padding requests must have query_len 0 and seq_len 0");
  }
  const size_t given = args.block_table.size();
  for (int64_t i = 0; i < m.block_table_tensor.numel(); ++i) {
    const int64_t cols = m.block_table_tensor.size(1);
    const int64_t expected = static_cast<size_t>(i) < given ? args.block_table[static_cast<size_t>(i)] : 0;
    PAGEDATTN_FUZZ_ASSERT(at2(m.block_table_tensor, i / cols, i % cols) == expected, "block table copy / zero padding");
  }
  const int64_t slots = args.num_tokens_padded == 0 ? static_cast<int64_t>(args.slot_mapping.size())
                                                    : args.num_tokens_padded;
  PAGEDATTN_FUZZ_ASSERT(m.slot_mapping.size(0) == slots, "slot_mapping length");
  for (int64_t i = 0; i < m.num_actual_tokens; ++i) {
    PAGEDATTN_FUZZ_ASSERT(at1(m.slot_mapping, i) == args.slot_mapping[static_cast<size_t>(i)], "slot copy");
  }
  // Views stay valid when the owner moves (metadata.h).
  OwnedCommonAttentionMetadata moved = std::move(owned);
  try {
    moved.common.validate(num_blocks, block_size);
  } catch (const Error& e) {
    property_failed(std::string("a moved metadata no longer validates: ") + e.what());
  }
  check_validated(moved.common, num_blocks, block_size);
  run_batch_utilities(in, moved.common, std::max(block_size, 1));
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pagedattn::fuzz::ByteReader in(data, size);
  if (in.u8() % 2 == 0) {
    pagedattn::fuzz::fuzz_validate(in);
  } else {
    pagedattn::fuzz::fuzz_make(in);
  }
  return 0;
}
