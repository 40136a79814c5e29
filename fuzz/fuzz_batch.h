// Decoding fuzz bytes into a batch (the host arrays of a CommonAttentionMetadata) and into the
// tensor views a CommonAttentionMetadata is made of, shared by the metadata and builder targets.
//
// decode_batch() builds a CONSISTENT batch first (query lengths, context lengths, a block table
// from a rotated pool of block ids, optionally with a prefix of blocks shared by every request,
// the slots of the new tokens) and then applies a few
// corruptions (a field or an entry replaced by a corner value), so that most inputs are valid
// batches and every kind of invalid batch is a short mutation away. BatchViews lays the arrays
// out as tensor views, by default exactly as make_common_attention_metadata does; with layout
// perturbation on, a field may get the wrong dtype or rank, one entry too few or too many, a
// column or element stride of 2, a null data pointer or the cuda device label (never read by the
// host code: views always describe memory they own, as the API requires).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_input.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn::fuzz {

struct BatchLimits {
  int max_reqs = 6;
  int max_query_len = 12;
  int max_context_len = 40;
  int num_blocks = 16;    // block ids are drawn from [0, num_blocks)
  int block_size = 4;
  int spare_columns = 1;  // block-table columns beyond the widest request
};

struct RawBatch {
  std::vector<int32_t> query_start_loc;      // (num_reqs + 1,)
  std::vector<int32_t> seq_lens;             // (num_reqs,)
  std::vector<int32_t> num_computed_tokens;  // (num_reqs,)
  std::vector<int32_t> block_table;          // (num_reqs, cols) row-major
  int cols = 0;
  std::vector<int64_t> slot_mapping;         // (>= num_actual_tokens,), tail -1
  int num_reqs = 0;
  int num_actual_tokens = 0;
  int max_query_len = 0;
  int max_seq_len = 0;
  bool causal = true;
};

inline int32_t wrap_i32(int64_t v) { return static_cast<int32_t>(v); }  // modular (C++20)

inline RawBatch decode_batch(ByteReader& in, const BatchLimits& limits) {
  RawBatch b;
  const int n = in.small(0, limits.max_reqs);
  b.num_reqs = n;
  b.causal = (in.u8() & 0x0F) != 0x0F;
  std::vector<int64_t> q(static_cast<size_t>(n)), ctx(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    q[r] = in.small(0, limits.max_query_len);
    ctx[r] = in.small(0, limits.max_context_len);
  }
  const int bs = std::max(limits.block_size, 1);
  int64_t widest = 0;
  for (int r = 0; r < n; ++r) widest = std::max<int64_t>(widest, (q[r] + ctx[r] + bs - 1) / bs);
  b.cols = static_cast<int>(widest) + limits.spare_columns;
  // Block ids: a rotation of [0, num_blocks) chosen by one byte; requests take consecutive ids
  // (wrapping, so large batches share blocks — harmless for validation and for attention).
  const int pool = std::max(limits.num_blocks, 1);
  const int rotate = in.small(0, 255) % pool;
  b.block_table.resize(static_cast<size_t>(n) * b.cols);
  for (size_t i = 0; i < b.block_table.size(); ++i) {
    b.block_table[i] = static_cast<int32_t>((rotate + i) % pool);
  }
  // A shared prefix (prefix caching, cascade attention): the first `shared` columns of every row
  // are row 0's. Byte < 0xC0: none; < 0xF0: up to 3 columns, within every request's context (a
  // valid prefix); else up to 3 columns whatever the contexts.
  const uint8_t share = in.u8();
  int shared = share < 0xC0 ? 0 : (share & 3);
  if (share < 0xF0) {
    for (int r = 0; r < n; ++r) shared = static_cast<int>(std::min<int64_t>(shared, ctx[r] / bs));
  }
  shared = std::min(shared, b.cols);
  for (int r = 1; r < n; ++r) {
    for (int c = 0; c < shared; ++c) b.block_table[static_cast<size_t>(r) * b.cols + c] = b.block_table[c];
  }
  b.query_start_loc.push_back(0);
  for (int r = 0; r < n; ++r) {
    b.query_start_loc.push_back(wrap_i32(b.query_start_loc.back() + q[r]));
    b.seq_lens.push_back(wrap_i32(q[r] + ctx[r]));
    b.num_computed_tokens.push_back(wrap_i32(ctx[r]));
    b.max_query_len = std::max<int>(b.max_query_len, static_cast<int>(q[r]));
    b.max_seq_len = std::max<int>(b.max_seq_len, static_cast<int>(q[r] + ctx[r]));
    for (int64_t p = ctx[r]; p < ctx[r] + q[r]; ++p) {
      const int64_t block = b.block_table[static_cast<size_t>(r) * b.cols + p / bs];
      b.slot_mapping.push_back(block * bs + p % bs);
    }
  }
  b.num_actual_tokens = b.query_start_loc.back();
  const int pad = in.small(0, 3);  // padded slot tail
  for (int i = 0; i < pad; ++i) b.slot_mapping.push_back(-1);

  // Corruptions: none for most inputs (byte < 0xC0), else 1-4 of them.
  const uint8_t c = in.u8();
  const int corruptions = c < 0xC0 ? 0 : 1 + (c & 3);
  auto pick = [&in](size_t size) { return size == 0 ? size_t{0} : in.u8() % size; };
  for (int k = 0; k < corruptions; ++k) {
    switch (in.u8() % 12) {
      case 0: if (!b.query_start_loc.empty()) b.query_start_loc[pick(b.query_start_loc.size())] = in.length(64); break;
      case 1: if (!b.seq_lens.empty()) b.seq_lens[pick(b.seq_lens.size())] = in.length(64); break;
      case 2: if (!b.num_computed_tokens.empty()) b.num_computed_tokens[pick(b.num_computed_tokens.size())] = in.length(64); break;
      case 3: if (!b.block_table.empty()) b.block_table[pick(b.block_table.size())] = in.length(limits.num_blocks + 4); break;
      case 4: if (!b.slot_mapping.empty()) b.slot_mapping[pick(b.slot_mapping.size())] = in.length64(int64_t{pool} * bs + 8); break;
      case 5: b.num_reqs = in.length(limits.max_reqs + 2); break;
      case 6: b.num_actual_tokens = in.length(64); break;
      case 7: b.max_query_len = in.length(limits.max_query_len + 2); break;
      case 8: b.max_seq_len = in.length(64); break;
      case 9: if (!b.slot_mapping.empty()) b.slot_mapping.pop_back(); break;
      case 10: b.cols = std::max(0, b.cols - in.small(1, 3)); break;  // table narrower than needed
      default: {  // two requests swap their seq_lens (a consistent-looking but wrong batch)
        if (n >= 2) std::swap(b.seq_lens[pick(b.seq_lens.size())], b.seq_lens[pick(b.seq_lens.size())]);
        break;
      }
    }
  }
  if (static_cast<int64_t>(b.block_table.size()) != int64_t{n} * b.cols) {
    // cols changed: keep the leading columns of each row (a row-major table of the new width).
    std::vector<int32_t> narrowed;
    const int old_cols = static_cast<int>(b.block_table.size() / std::max(n, 1));
    for (int r = 0; r < n; ++r) {
      for (int col = 0; col < b.cols; ++col) narrowed.push_back(b.block_table[static_cast<size_t>(r) * old_cols + col]);
    }
    b.block_table = std::move(narrowed);
  }
  return b;
}

// Host memory behind the views of one CommonAttentionMetadata.
class BatchViews {
 public:
  // layout_perturbation: let the input choose wrong dtypes, ranks, sizes, strides, null data
  // and device labels (else: make_common_attention_metadata's layout, all on the cpu).
  BatchViews(ByteReader& in, const RawBatch& b, bool layout_perturbation) {
    common.num_reqs = b.num_reqs;
    common.num_actual_tokens = b.num_actual_tokens;
    common.max_query_len = b.max_query_len;
    common.max_seq_len = b.max_seq_len;
    common.causal = b.causal;
    const bool device_cuda = layout_perturbation && (in.u8() & 0x1F) == 0x1F;
    const Device device = device_cuda ? Device::cuda : Device::cpu;
    common.query_start_loc_cpu = vector_view(in, b.query_start_loc, layout_perturbation, Device::cpu);
    common.seq_lens_cpu = vector_view(in, b.seq_lens, layout_perturbation, Device::cpu);
    common.num_computed_tokens_cpu = vector_view(in, b.num_computed_tokens, layout_perturbation, Device::cpu);
    common.query_start_loc = vector_view(in, b.query_start_loc, layout_perturbation, device);
    common.seq_lens = vector_view(in, b.seq_lens, layout_perturbation, device);
    common.block_table_tensor = table_view(in, b.block_table, b.cols, layout_perturbation, device);
    common.slot_mapping = vector_view(in, b.slot_mapping, layout_perturbation, device);
  }
  BatchViews(const BatchViews&) = delete;
  BatchViews& operator=(const BatchViews&) = delete;

  CommonAttentionMetadata common;

 private:
  // Storage that outlives the views (8-byte aligned; never reallocated after a view is made).
  void* allocate(size_t bytes) {
    buffers_.emplace_back((bytes + 7) / 8 + 1, 0);
    return buffers_.back().data();
  }

  static void store(void* base, DType dtype, int64_t index, int64_t value) {
    switch (dtype) {
      case DType::i64: static_cast<int64_t*>(base)[index] = value; break;
      case DType::i32: static_cast<int32_t*>(base)[index] = static_cast<int32_t>(value); break;
      default: static_cast<float*>(base)[index] = static_cast<float>(value); break;
    }
  }

  // A 1-D view of `values` in their natural dtype (i32 for int32 vectors, i64 for int64 ones).
  template <typename T>
  TensorView vector_view(ByteReader& in, const std::vector<T>& values, bool perturb, Device device) {
    const DType natural = sizeof(T) == 8 ? DType::i64 : DType::i32;
    DType dtype = natural;
    int64_t n = static_cast<int64_t>(values.size());
    int64_t stride = 1;
    int ndim = 1;
    bool null_data = false;
    Device dev = device;
    if (perturb) {
      const uint8_t p = in.u8();
      if (p >= 0xE0) {
        switch (p & 0x7) {
          case 0: dtype = natural == DType::i32 ? DType::i64 : DType::i32; break;
          case 1: dtype = DType::f32; break;
          case 2: n = std::max<int64_t>(0, n - 1); break;
          case 3: n += 1; break;
          case 4: stride = 2; break;
          case 5: ndim = 2; break;
          case 6: null_data = n > 0; break;
          default: dev = dev == Device::cpu ? Device::cuda : Device::cpu; break;
        }
      }
    }
    const int64_t extent = n == 0 ? 0 : (n - 1) * stride + 1;
    void* base = allocate(static_cast<size_t>(extent) * dtype_size(dtype));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = i < static_cast<int64_t>(values.size()) ? int64_t{values[i]} : -1;
      store(base, dtype, i * stride, v);
    }
    if (null_data) base = nullptr;
    if (ndim == 2) return TensorView(base, dtype, Shape{n, 1}, Shape{stride, 1}, dev);
    return TensorView(base, dtype, Shape{n}, Shape{stride}, dev);
  }

  // The (rows, cols) block table, row-major, optionally with padded rows or strided columns.
  TensorView table_view(ByteReader& in, const std::vector<int32_t>& values, int cols, bool perturb,
                        Device device) {
    int64_t rows = cols > 0 ? static_cast<int64_t>(values.size()) / cols : 0;
    DType dtype = DType::i32;
    int64_t col_stride = 1, row_pad = 0;
    int ndim = 2;
    if (perturb) {
      const uint8_t p = in.u8();
      if (p >= 0xE0) {
        switch (p & 0x7) {
          case 0: dtype = DType::i64; break;
          case 1: rows = std::max<int64_t>(0, rows - 1); break;
          case 2: rows += 1; break;
          case 3: col_stride = 2; break;
          case 4: row_pad = 3; break;
          case 5: ndim = 1; break;
          case 6: device = device == Device::cpu ? Device::cuda : Device::cpu; break;
          default: break;
        }
      }
    }
    const int64_t row_stride = cols * col_stride + row_pad;
    const int64_t extent = rows == 0 || cols == 0 ? 0 : (rows - 1) * row_stride + (cols - 1) * col_stride + 1;
    void* base = allocate(static_cast<size_t>(extent) * dtype_size(dtype));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        store(base, dtype, r * row_stride + c * col_stride, i < values.size() ? values[i] : 0);
      }
    }
    if (ndim == 1) return TensorView(base, dtype, Shape{rows * cols}, device);
    return TensorView(base, dtype, Shape{rows, cols}, Shape{row_stride, col_stride}, device);
  }

  std::vector<std::vector<uint64_t>> buffers_;
};

}  // namespace pagedattn::fuzz
