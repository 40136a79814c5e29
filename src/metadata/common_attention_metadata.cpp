// CommonAttentionMetadata: host accessors, validate(), and make_common_attention_metadata().
//
// validate() is the single gate every builder relies on: after it passes, every host loop over
// the batch may index the mirrors, the block table columns a request uses and the slot mapping
// without further checks. Order of the checks: scalars, host-mirror shapes, host-mirror contents,
// device-tensor shapes and device, the block-table width each request needs (from the mirrors;
// only when a cache size is given), then the contents of the device tensors that live on the
// host (a CPU backend's query_start_loc / seq_lens against their mirrors, block ids, slots, and
// the -1 tail of slot_mapping). Tensors on a CUDA device are never read: "device tensors are
// checked only for dtype/shape/device" in metadata.h means tensors on a CUDA device.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "metadata/host_read.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {

using metadata_detail::cdiv;
using metadata_detail::read_i32;
using metadata_detail::read_i64;

namespace {

constexpr const char* kWho = "common_attn_metadata: ";

// dtype / ndim / non-null data of one tensor field.
void check_field(const TensorView& t, const char* field, DType dtype, int ndim) {
  PAGEDATTN_CHECK(t.defined(), field, kWho, field, " is not set: expected a ", dtype_name(dtype),
                  " tensor with ", ndim, " dimension(s)");
  PAGEDATTN_CHECK(t.dtype() == dtype, field, kWho, field, " has dtype ", dtype_name(t.dtype()),
                  " (", t.describe(), "): expected ", dtype_name(dtype));
  PAGEDATTN_CHECK(t.ndim() == ndim, field, kWho, field, " has ", t.ndim(), " dimension(s) (",
                  t.describe(), "): expected ", ndim);
  PAGEDATTN_CHECK(t.numel() == 0 || t.data() != nullptr, field, kWho, field,
                  " has a null data pointer for ", t.numel(), " elements");
}

// Bounds- and dtype-checked read of element `index` of a host mirror (the accessors below).
int32_t read_mirror(const TensorView& mirror, const char* field, int64_t index) {
  PAGEDATTN_CHECK(mirror.defined() && mirror.dtype() == DType::i32 && mirror.ndim() == 1 &&
                      mirror.device() == Device::cpu && index < mirror.size(0) &&
                      mirror.data() != nullptr,
                  field, kWho, field, " (", mirror.describe(), ") has no i32 host entry ", index);
  return read_i32(mirror, index);
}

// Element-wise equality of two host tensors of one shape (1-D i64 or 2-D i32).
bool same_contents(const TensorView& a, const TensorView& b) {
  if (a.ndim() == 1) {
    for (int64_t i = 0; i < a.size(0); ++i)
      if (read_i64(a, i) != read_i64(b, i)) return false;
    return true;
  }
  for (int64_t r = 0; r < a.size(0); ++r)
    for (int64_t c = 0; c < a.size(1); ++c)
      if (read_i32(a, r, c) != read_i32(b, r, c)) return false;
  return true;
}

void check_request_index(int req, int num_reqs) {
  PAGEDATTN_CHECK(req >= 0 && req < num_reqs, "req", kWho, "request index ", req,
                  " is out of range: expected [0, ", num_reqs, ")");
}

}  // namespace

int CommonAttentionMetadata::query_len(int req) const {
  check_request_index(req, num_reqs);
  return read_mirror(query_start_loc_cpu, "query_start_loc_cpu", req + 1) -
         read_mirror(query_start_loc_cpu, "query_start_loc_cpu", req);
}

int CommonAttentionMetadata::seq_len(int req) const {
  check_request_index(req, num_reqs);
  return read_mirror(seq_lens_cpu, "seq_lens_cpu", req);
}

int CommonAttentionMetadata::num_computed_tokens(int req) const {
  check_request_index(req, num_reqs);
  return read_mirror(num_computed_tokens_cpu, "num_computed_tokens_cpu", req);
}

void CommonAttentionMetadata::validate(int64_t num_blocks, int block_size) const {
  // ---- scalars ---------------------------------------------------------------------------
  PAGEDATTN_CHECK(num_reqs >= 0, "num_reqs", kWho, "num_reqs = ", num_reqs, " must be >= 0");
  PAGEDATTN_CHECK(num_actual_tokens >= 0, "num_actual_tokens", kWho, "num_actual_tokens = ",
                  num_actual_tokens, " must be >= 0");

  // ---- host mirrors: shapes --------------------------------------------------------------
  check_field(query_start_loc_cpu, "query_start_loc_cpu", DType::i32, 1);
  PAGEDATTN_CHECK(query_start_loc_cpu.device() == Device::cpu, "query_start_loc_cpu", kWho,
                  "query_start_loc_cpu is on ", device_name(query_start_loc_cpu.device()),
                  ": host mirrors must be on the cpu");
  PAGEDATTN_CHECK(query_start_loc_cpu.size(0) == int64_t{num_reqs} + 1, "query_start_loc_cpu", kWho,
                  "query_start_loc_cpu has shape ", query_start_loc_cpu.shape().str(),
                  ": expected (num_reqs + 1,) = (", int64_t{num_reqs} + 1, ",)");
  for (const auto& [view, name] : {std::pair{&seq_lens_cpu, "seq_lens_cpu"},
                                   std::pair{&num_computed_tokens_cpu, "num_computed_tokens_cpu"}}) {
    check_field(*view, name, DType::i32, 1);
    PAGEDATTN_CHECK(view->device() == Device::cpu, name, kWho, name, " is on ",
                    device_name(view->device()), ": host mirrors must be on the cpu");
    PAGEDATTN_CHECK(view->size(0) == num_reqs, name, kWho, name, " has shape ", view->shape().str(),
                    ": expected (num_reqs,) = (", num_reqs, ",)");
  }

  // ---- host mirrors: contents ------------------------------------------------------------
  const int32_t qsl0 = read_i32(query_start_loc_cpu, 0);
  PAGEDATTN_CHECK(qsl0 == 0, "query_start_loc_cpu", kWho, "query_start_loc_cpu[0] = ", qsl0,
                  ": expected 0");
  int64_t max_q = 0;
  int64_t max_s = 0;
  for (int r = 0; r < num_reqs; ++r) {
    const int32_t start = read_i32(query_start_loc_cpu, r);
    const int32_t end = read_i32(query_start_loc_cpu, r + 1);
    PAGEDATTN_CHECK(end >= start, "query_start_loc_cpu", kWho, "query_start_loc_cpu[", r + 1,
                    "] = ", end, " is smaller than query_start_loc_cpu[", r, "] = ", start,
                    ": query_start_loc must be non-decreasing (request ", r,
                    " would have a negative query length)");
    const int64_t q = int64_t{end} - start;
    const int32_t s = read_i32(seq_lens_cpu, r);
    PAGEDATTN_CHECK(s >= q, "seq_lens_cpu", kWho, "seq_lens_cpu[", r, "] = ", s,
                    " is smaller than query_len ", q, " (query_start_loc_cpu[", r + 1,
                    "] - query_start_loc_cpu[", r, "]) of request ", r);
    const int32_t computed = read_i32(num_computed_tokens_cpu, r);
    PAGEDATTN_CHECK(computed == s - q, "num_computed_tokens_cpu", kWho, "num_computed_tokens_cpu[",
                    r, "] = ", computed, ": expected seq_lens_cpu[", r, "] - query_len = ", s, " - ",
                    q, " = ", s - q, " for request ", r);
    max_q = std::max(max_q, q);
    max_s = std::max<int64_t>(max_s, s);
  }
  const int32_t total = read_i32(query_start_loc_cpu, num_reqs);
  PAGEDATTN_CHECK(num_actual_tokens == total, "num_actual_tokens", kWho, "num_actual_tokens = ",
                  num_actual_tokens, " does not match query_start_loc_cpu[num_reqs = ", num_reqs,
                  "] = ", total);
  PAGEDATTN_CHECK(max_query_len == max_q, "max_query_len", kWho, "max_query_len = ", max_query_len,
                  " does not match the longest query in query_start_loc_cpu (", max_q, ")");
  PAGEDATTN_CHECK(max_seq_len == max_s, "max_seq_len", kWho, "max_seq_len = ", max_seq_len,
                  " does not match the largest entry of seq_lens_cpu (", max_s, ")");

  // ---- device tensors: dtype, shape, one device --------------------------------------------
  check_field(query_start_loc, "query_start_loc", DType::i32, 1);
  PAGEDATTN_CHECK(query_start_loc.size(0) >= int64_t{num_reqs} + 1, "query_start_loc", kWho,
                  "query_start_loc has shape ", query_start_loc.shape().str(),
                  ": expected at least num_reqs + 1 = ", int64_t{num_reqs} + 1, " entries");
  check_field(seq_lens, "seq_lens", DType::i32, 1);
  PAGEDATTN_CHECK(seq_lens.size(0) >= num_reqs, "seq_lens", kWho, "seq_lens has shape ",
                  seq_lens.shape().str(), ": expected at least num_reqs = ", num_reqs, " entries");
  check_field(block_table_tensor, "block_table_tensor", DType::i32, 2);
  PAGEDATTN_CHECK(block_table_tensor.size(0) >= num_reqs, "block_table_tensor", kWho,
                  "block_table_tensor has shape ", block_table_tensor.shape().str(),
                  ": expected at least num_reqs = ", num_reqs, " rows");
  check_field(slot_mapping, "slot_mapping", DType::i64, 1);
  PAGEDATTN_CHECK(slot_mapping.size(0) >= num_actual_tokens, "slot_mapping", kWho,
                  "slot_mapping has shape ", slot_mapping.shape().str(),
                  ": expected at least num_actual_tokens = ", num_actual_tokens, " entries");
  const Device device = query_start_loc.device();
  const int device_index = query_start_loc.device_index();
  for (const auto& [view, name] : {std::pair{&seq_lens, "seq_lens"},
                                   std::pair{&block_table_tensor, "block_table_tensor"},
                                   std::pair{&slot_mapping, "slot_mapping"}}) {
    PAGEDATTN_CHECK(view->device() == device && view->device_index() == device_index, name, kWho,
                    name, " is on ", device_name(view->device()), ":", view->device_index(),
                    " but query_start_loc is on ", device_name(device), ":", device_index,
                    ": every device tensor must be on the same device");
  }

  // ---- optional host mirrors of the block table and slot mapping ----------------------------
  for (const auto& [mirror, of, name] :
       {std::tuple{&block_table_cpu, &block_table_tensor, "block_table_cpu"},
        std::tuple{&slot_mapping_cpu, &slot_mapping, "slot_mapping_cpu"}}) {
    if (!mirror->defined()) continue;
    check_field(*mirror, name, of->dtype(), of->ndim());
    PAGEDATTN_CHECK(mirror->device() == Device::cpu, name, kWho, name, " is on ",
                    device_name(mirror->device()), ": host mirrors must be on the cpu");
    PAGEDATTN_CHECK(mirror->shape() == of->shape(), name, kWho, name, " has shape ",
                    mirror->shape().str(), ": expected the shape of the tensor it mirrors, ",
                    of->shape().str());
  }

  // ---- block-table width needed by each request (reads only the host mirrors) ---------------
  const bool check_blocks = num_blocks >= 0 && block_size > 0;
  const int64_t table_cols = block_table_tensor.size(1);
  if (check_blocks) {
    for (int r = 0; r < num_reqs; ++r) {
      const int32_t s = read_i32(seq_lens_cpu, r);
      const int64_t needed = cdiv(s, block_size);
      PAGEDATTN_CHECK(needed <= table_cols, "block_table_tensor", kWho, "block_table_tensor has ",
                      table_cols, " columns but request ", r, " needs cdiv(seq_lens_cpu[", r,
                      "] = ", s, ", block_size = ", block_size, ") = ", needed, " blocks");
    }
  }

  // ---- contents of device tensors that live on the host ------------------------------------
  if (device == Device::cpu) check_host_device_tensors();
  // Block ids and slots: from the host mirrors when given, else from host device tensors.
  const TensorView& table = block_table_cpu.defined() ? block_table_cpu : block_table_tensor;
  const TensorView& slots = slot_mapping_cpu.defined() ? slot_mapping_cpu : slot_mapping;
  if (table.device() != Device::cpu || slots.device() != Device::cpu) return;
  if (device == Device::cpu) {
    for (const auto& [mirror, of, name] :
         {std::tuple{&block_table_cpu, &block_table_tensor, "block_table_cpu"},
          std::tuple{&slot_mapping_cpu, &slot_mapping, "slot_mapping_cpu"}}) {
      PAGEDATTN_CHECK(!mirror->defined() || same_contents(*mirror, *of), name, kWho, name,
                      " differs from the host tensor it mirrors");
    }
  }
  check_block_ids_and_slots(table, slots, num_blocks, block_size);
}

void CommonAttentionMetadata::check_host_device_tensors() const {
  for (int r = 0; r <= num_reqs; ++r) {
    const int32_t d = read_i32(query_start_loc, r);
    const int32_t h = read_i32(query_start_loc_cpu, r);
    PAGEDATTN_CHECK(d == h, "query_start_loc", kWho, "query_start_loc[", r, "] = ", d,
                    " differs from its host mirror query_start_loc_cpu[", r, "] = ", h);
  }
  for (int r = 0; r < num_reqs; ++r) {
    const int32_t d = read_i32(seq_lens, r);
    const int32_t h = read_i32(seq_lens_cpu, r);
    PAGEDATTN_CHECK(d == h, "seq_lens", kWho, "seq_lens[", r, "] = ", d,
                    " differs from its host mirror seq_lens_cpu[", r, "] = ", h);
  }
}

void CommonAttentionMetadata::check_block_ids_and_slots(const TensorView& table,
                                                        const TensorView& slots,
                                                        int64_t num_blocks, int block_size) const {
  const bool check_blocks = num_blocks >= 0 && block_size > 0;
  if (check_blocks) {
    for (int r = 0; r < num_reqs; ++r) {
      const int64_t used = cdiv(read_i32(seq_lens_cpu, r), block_size);
      for (int64_t c = 0; c < used; ++c) {
        const int32_t id = read_i32(table, r, c);
        PAGEDATTN_CHECK(id >= 0 && id < num_blocks, "block_table_tensor", kWho,
                        "block_table_tensor[", r, "][", c, "] = ", id,
                        " is out of range: expected a block id in [0, ", num_blocks,
                        ") (request ", r, " uses its first ", used, " columns)");
      }
    }
  }
  // Slots lie in [0, num_blocks * block_size); the product need not fit in int64 (num_blocks is
  // the caller's), so the check divides, and the message says 2^63 where the product overflows.
  const bool slots_fit = check_blocks && num_blocks <= std::numeric_limits<int64_t>::max() / block_size;
  for (int64_t i = 0; i < num_actual_tokens; ++i) {
    const int64_t slot = read_i64(slots, i);
    if (check_blocks) {
      PAGEDATTN_CHECK(slot == -1 || (slot >= 0 && slot / block_size < num_blocks), "slot_mapping",
                      kWho, "slot_mapping[", i, "] = ", slot,
                      " is out of range: expected -1 or a slot in [0, ",
                      slots_fit ? std::to_string(num_blocks * block_size) : std::string("2^63"),
                      ") (num_blocks = ", num_blocks, " x block_size = ", block_size, ")");
    } else {
      PAGEDATTN_CHECK(slot >= -1, "slot_mapping", kWho, "slot_mapping[", i, "] = ", slot,
                      " is negative: expected -1 (skip) or a slot >= 0");
    }
  }
  for (int64_t i = num_actual_tokens; i < slots.size(0); ++i) {
    const int64_t slot = read_i64(slots, i);
    PAGEDATTN_CHECK(slot == -1, "slot_mapping", kWho, "slot_mapping[", i, "] = ", slot,
                    " lies past num_actual_tokens = ", num_actual_tokens,
                    ": the padded tail must be -1");
  }
}

OwnedCommonAttentionMetadata make_common_attention_metadata(const CommonAttentionMetadataArgs& args,
                                                            Device device, int64_t num_blocks,
                                                            int block_size) {
  constexpr const char* kFn = "make_common_attention_metadata: ";
  // ---- check the arguments before building anything ---------------------------------------
  PAGEDATTN_CHECK(!args.query_start_loc.empty(), "query_start_loc", kFn,
                  "query_start_loc is empty: expected num_reqs + 1 >= 1 entries");
  const int64_t num_reqs = static_cast<int64_t>(args.query_start_loc.size()) - 1;
  PAGEDATTN_CHECK(static_cast<int64_t>(args.seq_lens.size()) == num_reqs, "seq_lens", kFn,
                  "seq_lens has ", args.seq_lens.size(), " entries: expected num_reqs = ", num_reqs,
                  " (query_start_loc has ", args.query_start_loc.size(), ")");
  PAGEDATTN_CHECK(args.query_start_loc[0] == 0, "query_start_loc", kFn, "query_start_loc[0] = ",
                  args.query_start_loc[0], ": expected 0");
  for (int64_t r = 0; r < num_reqs; ++r) {
    PAGEDATTN_CHECK(args.query_start_loc[r + 1] >= args.query_start_loc[r], "query_start_loc", kFn,
                    "query_start_loc[", r + 1, "] = ", args.query_start_loc[r + 1],
                    " is smaller than query_start_loc[", r, "] = ", args.query_start_loc[r],
                    ": query_start_loc must be non-decreasing");
  }
  const int64_t num_actual_tokens = args.query_start_loc.back();
  PAGEDATTN_CHECK(args.num_reqs_padded == 0 || args.num_reqs_padded >= num_reqs, "num_reqs_padded",
                  kFn, "num_reqs_padded = ", args.num_reqs_padded, " is smaller than num_reqs = ",
                  num_reqs, ": expected 0 (no padding) or >= num_reqs");
  const int64_t rows = args.num_reqs_padded == 0 ? num_reqs : args.num_reqs_padded;
  PAGEDATTN_CHECK(args.max_num_blocks_per_req >= 0, "max_num_blocks_per_req", kFn,
                  "max_num_blocks_per_req = ", args.max_num_blocks_per_req, " must be >= 0");
  const int64_t cols = args.max_num_blocks_per_req;
  const int64_t given_rows =
      cols == 0 ? (args.block_table.empty() ? 0 : -1)
                : (static_cast<int64_t>(args.block_table.size()) % cols == 0
                       ? static_cast<int64_t>(args.block_table.size()) / cols
                       : -1);
  PAGEDATTN_CHECK((cols == 0 && given_rows == 0) || (given_rows >= num_reqs && given_rows <= rows),
                  "block_table", kFn, "block_table has ", args.block_table.size(),
                  " entries: expected rows x max_num_blocks_per_req (", cols,
                  ") with num_reqs (", num_reqs, ") <= rows <= num_reqs_padded (", rows, ")");
  PAGEDATTN_CHECK(static_cast<int64_t>(args.slot_mapping.size()) >= num_actual_tokens,
                  "slot_mapping", kFn, "slot_mapping has ", args.slot_mapping.size(),
                  " entries: expected at least num_actual_tokens = ", num_actual_tokens);
  PAGEDATTN_CHECK(args.num_tokens_padded == 0 || args.num_tokens_padded >= num_actual_tokens,
                  "num_tokens_padded", kFn, "num_tokens_padded = ", args.num_tokens_padded,
                  " is smaller than num_actual_tokens = ", num_actual_tokens,
                  ": expected 0 (as given) or >= num_actual_tokens");
  const int64_t slots =
      args.num_tokens_padded == 0 ? static_cast<int64_t>(args.slot_mapping.size()) : args.num_tokens_padded;

  // ---- host tensors (these become the device tensors of a cpu backend) ----------------------
  OwnedCommonAttentionMetadata owned;
  Tensor qsl(Shape{rows + 1}, DType::i32);        // (rows + 1,); padded requests: query_len 0
  Tensor seq(Shape{rows}, DType::i32);            // (rows,); padded requests: seq_len 0
  Tensor table(Shape{rows, cols}, DType::i32);    // (rows, cols):(cols, 1); padded rows: block 0
  Tensor slot(Shape{slots}, DType::i64);          // (slots,); tail past num_actual_tokens: -1
  owned.query_start_loc_cpu = Tensor(Shape{num_reqs + 1}, DType::i32);
  owned.seq_lens_cpu = Tensor(Shape{num_reqs}, DType::i32);
  owned.num_computed_tokens_cpu = Tensor(Shape{num_reqs}, DType::i32);

  int32_t max_q = 0;
  int32_t max_s = 0;
  for (int64_t r = 0; r <= rows; ++r) {
    qsl.data_as<int32_t>()[r] = static_cast<int32_t>(r <= num_reqs ? args.query_start_loc[r] : num_actual_tokens);
  }
  for (int64_t r = 0; r <= num_reqs; ++r) owned.query_start_loc_cpu.data_as<int32_t>()[r] = args.query_start_loc[r];
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t s = r < num_reqs ? args.seq_lens[r] : 0;
    seq.data_as<int32_t>()[r] = s;
    if (r >= num_reqs) continue;
    const int32_t q = args.query_start_loc[r + 1] - args.query_start_loc[r];
    owned.seq_lens_cpu.data_as<int32_t>()[r] = s;
    // May be negative for inconsistent input; validate() below names the request.
    owned.num_computed_tokens_cpu.data_as<int32_t>()[r] = static_cast<int32_t>(int64_t{s} - q);
    max_q = std::max(max_q, q);
    max_s = std::max(max_s, s);
  }
  std::fill_n(table.data_as<int32_t>(), rows * cols, 0);
  std::copy(args.block_table.begin(), args.block_table.end(), table.data_as<int32_t>());
  for (int64_t i = 0; i < slots; ++i) {
    slot.data_as<int64_t>()[i] = i < num_actual_tokens ? args.slot_mapping[i] : -1;
  }

  CommonAttentionMetadata& common = owned.common;
  common.num_reqs = static_cast<int>(num_reqs);
  common.num_actual_tokens = static_cast<int>(num_actual_tokens);
  common.max_query_len = max_q;
  common.max_seq_len = max_s;
  common.causal = args.causal;
  common.query_start_loc_cpu = owned.query_start_loc_cpu.view();
  common.seq_lens_cpu = owned.seq_lens_cpu.view();
  common.num_computed_tokens_cpu = owned.num_computed_tokens_cpu.view();

  // Full check (contents included) while everything is still on the host.
  common.query_start_loc = qsl.view();
  common.seq_lens = seq.view();
  common.block_table_tensor = table.view();
  common.slot_mapping = slot.view();
  common.validate(num_blocks, block_size);

  if (device == Device::cpu) {
    owned.query_start_loc = std::move(qsl);
    owned.seq_lens = std::move(seq);
    owned.block_table = std::move(table);
    owned.slot_mapping = std::move(slot);
  } else {
    owned.query_start_loc = qsl.to(device);
    owned.seq_lens = seq.to(device);
    owned.block_table = table.to(device);
    owned.slot_mapping = slot.to(device);
    // The host arrays stay as the mirrors builders check block ids and slots on.
    owned.block_table_cpu = std::move(table);
    owned.slot_mapping_cpu = std::move(slot);
    common.block_table_cpu = owned.block_table_cpu.view();
    common.slot_mapping_cpu = owned.slot_mapping_cpu.view();
  }
  // Tensor moves keep their allocation, so the views stay valid when `owned` is moved.
  common.query_start_loc = owned.query_start_loc.view();
  common.seq_lens = owned.seq_lens.view();
  common.block_table_tensor = owned.block_table.view();
  common.slot_mapping = owned.slot_mapping.view();
  common.validate(num_blocks, block_size);
  return owned;
}

}  // namespace pagedattn
