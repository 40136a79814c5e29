// kv_cache_footprint(): the largest block id and slot one step touches, found at plan time on
// the host, and KVCacheFootprint::check_fits(), the O(1) check every entry point makes against
// the cache it is given before its first write (metadata.h). This is what keeps a rejected call
// from having written the cache: the block table is only read by the attention that follows
// the cache write, so its ids must be known to fit before the write starts.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string_view>

#include "metadata/host_read.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {

using metadata_detail::cdiv;
using metadata_detail::read_i32;

namespace {

// `t` readable on the host: itself when it lives there, else a synchronous copy of the bytes
// it spans (strides kept, so the same element reads work on the copy).
TensorView host_readable(const TensorView& t, Tensor& storage) {
  if (t.device() == Device::cpu || t.numel() == 0) return t;
  const int64_t elements = static_cast<int64_t>(t.span_bytes() / t.element_size());
  storage = Tensor(Shape{elements}, t.dtype(), Device::cpu);
  storage.copy_from(TensorView(t.data(), t.dtype(), Shape{elements}, t.device(), t.device_index()));
  return TensorView(storage.data(), t.dtype(), t.shape(), t.strides(), Device::cpu);
}

}  // namespace

KVCacheFootprint kv_cache_footprint(const CommonAttentionMetadata& common, int block_size) {
  PAGEDATTN_CHECK(block_size > 0, "block_size", "kv_cache_footprint: block_size = ", block_size,
                  " must be > 0");
  Tensor table_copy, slots_copy;
  const TensorView table = host_readable(
      common.block_table_cpu.defined() ? common.block_table_cpu : common.block_table_tensor,
      table_copy);
  const TensorView slots = host_readable(
      common.slot_mapping_cpu.defined() ? common.slot_mapping_cpu : common.slot_mapping,
      slots_copy);
  KVCacheFootprint f;
  f.scanned = true;
  const int64_t cols = table.size(1);
  // Strides hoisted out of the loops (a TensorView::stride() call per element costs more than
  // the scan itself).
  const int32_t* table_data = table.data_as<const int32_t>();
  const int64_t row_stride = table.stride(0), col_stride = table.stride(1);
  for (int r = 0; r < common.num_reqs; ++r) {
    const int64_t used = std::min(cdiv(read_i32(common.seq_lens_cpu, r), block_size), cols);
    const int32_t* row = table_data + r * row_stride;
    // The row's min and max first (a branch-free pass the compiler vectorizes for a contiguous
    // row); the positions are looked up only for a negative id or a new maximum.
    int32_t row_min = std::numeric_limits<int32_t>::max(), row_max = -1;
    if (col_stride == 1) {
      for (int64_t c = 0; c < used; ++c) {
        row_min = std::min(row_min, row[c]);
        row_max = std::max(row_max, row[c]);
      }
    } else {
      for (int64_t c = 0; c < used; ++c) {
        row_min = std::min(row_min, row[c * col_stride]);
        row_max = std::max(row_max, row[c * col_stride]);
      }
    }
    if (row_min < 0 || row_max > f.max_block) {
      for (int64_t c = 0; c < used; ++c) {
        const int32_t id = row[c * col_stride];
        PAGEDATTN_CHECK(id >= 0, "block_table_tensor", "common_attn_metadata: block_table_tensor[",
                        r, "][", c, "] = ", id,
                        " is out of range: expected a block id >= 0 (request ", r,
                        " reads its first ", used, " columns)");
        if (id > f.max_block) {
          f.max_block = id;
          f.max_block_req = r;
          f.max_block_col = c;
        }
      }
    }
  }
  const int64_t* slot_data = slots.data_as<const int64_t>();
  const int64_t slot_stride = slots.numel() > 0 ? slots.stride(0) : 1;
  for (int64_t i = 0; i < slots.size(0); ++i) {
    const int64_t slot = slot_data[i * slot_stride];
    PAGEDATTN_CHECK(slot >= -1, "slot_mapping", "common_attn_metadata: slot_mapping[", i, "] = ",
                    slot, " is negative: expected -1 (skip) or a slot >= 0");
    if (slot > f.max_slot) {
      f.max_slot = slot;
      f.max_slot_index = i;
    }
  }
  return f;
}

void KVCacheFootprint::check_fits(int64_t num_blocks, int64_t block_size, std::string_view who,
                                  std::string_view entry) const {
  if (!scanned) return;
  PAGEDATTN_CHECK(max_block < num_blocks, "metadata", who, " ", entry, ": block_table[", max_block_req, "][",
                  max_block_col, "] = ", max_block, " is out of range: expected a block in [0, ",
                  num_blocks, ") of kv_cache (was the plan built for a larger cache?)");
  // max_slot / block_size: num_blocks * block_size need not fit in int64 for a fabricated view.
  PAGEDATTN_CHECK(max_slot < 0 || max_slot / block_size < num_blocks, "metadata", who, " ", entry, ": slot_mapping[",
                  max_slot_index, "] = ", max_slot, " is out of range: expected -1 or a slot in [0, ",
                  num_blocks * block_size, ") = num_blocks ", num_blocks, " x block_size ",
                  block_size, " of kv_cache");
}

}  // namespace pagedattn
