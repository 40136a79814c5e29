// MLA cache ops (mla.h): concat_and_cache_mla, gather_and_maybe_dequant_cache, and vLLM's
// chunked-prefill workspace rule.
//
// What they compute:
//   concat_and_cache_mla: for every token t < N' (N' = slot_mapping length) with slot s != -1,
//     cache[s / bs, s % bs, 0:L]   = convert(kv_c[t, :] / scale?)
//     cache[s / bs, s % bs, L:L+R] = convert(k_pe[t, :] / scale?)
//     where "/ scale" applies only to fp8 caches (vLLM kFp8 scaled_convert) and convert is the
//     core store_f32 rounding (RNE; fp8 saturates).
//   gather_and_maybe_dequant_cache: for request r < batch_size and i < cu[r+1] - cu[r], token
//     position p = seq_starts[r] + i, dst[cu[r] + i, :] = cache[block_table[r, p / bs], p % bs, :]
//     (fp8: * scale), rounded once to dst's dtype.
// Host path: one pass, OpenMP over tokens when large; each element read once and written once:
// traffic = rows * (L + R) * (src + dst element bytes); no reuse, so the floor is the copy
// bandwidth. Precision: one rounding at the store (the fp8 division / multiplication is in f32).
// Device path: every shape/dtype/stride/scale is checked here; slot, block-table and cu_seq_lens
// contents stay on the device (no host sync in `run`) and the kernels skip out-of-range slots /
// block ids (src/ops/cuda_ops.h). On the host every content is checked before a byte is written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "ops/cuda_ops.h"
#include "ops/ops_checks.h"
#include "pagedattn/error.h"
#include "pagedattn/mla.h"

namespace pagedattn {
namespace {

using ops_detail::check_activation_dtype;
using ops_detail::check_rank;
using ops_detail::check_same_device;
using ops_detail::check_slot_mapping;

void check_last_dim_contiguous(std::string_view op, const TensorView& t,
                               std::string_view argument) {
  PAGEDATTN_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, std::string(argument), op, ": ", argument,
                  " has strides ", t.strides().str(), ", expected the last dim contiguous (stride 1)");
}

void check_scale(std::string_view op, float scale) {
  PAGEDATTN_CHECK(std::isfinite(scale) && scale > 0.f, "scale", op, ": scale = ", scale,
                  " must be a finite value > 0");
}

void check_has_data(std::string_view op, const TensorView& t, std::string_view argument) {
  PAGEDATTN_CHECK(t.numel() == 0 || t.data() != nullptr, std::string(argument), op, ": ",
                  argument, " ", t.describe(), " has no data");
}

int64_t read_i32(const TensorView& t, int64_t i) {
  return t.data_as<const int32_t>()[i * t.stride(0)];
}

void check_i32_vector(std::string_view op, const TensorView& t, std::string_view argument,
                      int64_t min_length, std::string_view layout) {
  const std::string arg(argument);
  PAGEDATTN_CHECK(t.defined(), arg, op, ": ", argument, " is required: expected int32 ", layout);
  PAGEDATTN_CHECK(t.dtype() == DType::i32, arg, op, ": ", argument, " is ", dtype_name(t.dtype()),
                  ", expected int32 ", layout);
  PAGEDATTN_CHECK(t.ndim() == 1 && t.size(0) >= min_length, arg, op, ": ", argument,
                  " has shape ", t.shape().str(), ", expected ", layout, " with at least ",
                  min_length, " entries");
  check_has_data(op, t, argument);
}

}  // namespace

// ---- concat_and_cache_mla ---------------------------------------------------------------------

void concat_and_cache_mla(const TensorView& kv_c, const TensorView& k_pe_in,
                          const TensorView& kv_cache, const TensorView& slot_mapping,
                          std::string_view kv_cache_dtype, float scale) {
  constexpr std::string_view op = "concat_and_cache_mla";
  validate_kv_cache_dtype(kv_cache_dtype);
  check_rank(op, kv_c, "kv_c", 2, "(num_tokens, kv_lora_rank)");
  check_activation_dtype(op, kv_c, "kv_c");
  PAGEDATTN_CHECK(k_pe_in.defined(), "k_pe", op,
                  ": k_pe is required: expected (num_tokens, qk_rope_head_dim) or (num_tokens, 1, "
                  "qk_rope_head_dim)");
  TensorView k_pe = k_pe_in;
  if (k_pe.ndim() == 3) {
    PAGEDATTN_CHECK(k_pe.size(1) == 1, "k_pe", op, ": k_pe has shape ", k_pe.shape().str(),
                    ", expected (num_tokens, 1, qk_rope_head_dim) (one rope key per token)");
    k_pe = k_pe.select(1, 0);
  }
  PAGEDATTN_CHECK(k_pe.ndim() == 2, "k_pe", op, ": k_pe has shape ", k_pe_in.shape().str(),
                  ", expected (num_tokens, qk_rope_head_dim) or (num_tokens, 1, qk_rope_head_dim)");
  PAGEDATTN_CHECK(k_pe.dtype() == kv_c.dtype(), "k_pe", op, ": k_pe is ", dtype_name(k_pe.dtype()),
                  ", expected the dtype of kv_c (", dtype_name(kv_c.dtype()), ")");
  const int64_t n = kv_c.size(0);
  const int64_t lora = kv_c.size(1);
  const int64_t rope = k_pe.size(1);
  PAGEDATTN_CHECK(k_pe.size(0) == n, "k_pe", op, ": k_pe has ", k_pe.size(0),
                  " tokens, expected ", n, " (the tokens of kv_c)");
  PAGEDATTN_CHECK(lora > 0, "kv_c", op, ": kv_c has shape ", kv_c.shape().str(),
                  ": kv_lora_rank (dim 1) must be > 0");
  PAGEDATTN_CHECK(rope > 0, "k_pe", op, ": k_pe has shape ", k_pe_in.shape().str(),
                  ": qk_rope_head_dim (last dim) must be > 0");
  check_last_dim_contiguous(op, kv_c, "kv_c");
  check_last_dim_contiguous(op, k_pe, "k_pe");

  check_rank(op, kv_cache, "kv_cache", 3, "(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)");
  const int64_t num_blocks = kv_cache.size(0);
  const int64_t block_size = kv_cache.size(1);
  PAGEDATTN_CHECK(block_size > 0 && kv_cache.size(2) == lora + rope, "kv_cache", op,
                  ": kv_cache has shape ", kv_cache.shape().str(), ", expected (num_blocks, "
                  "block_size > 0, ", lora + rope, ") = kv_lora_rank ", lora,
                  " + qk_rope_head_dim ", rope);
  const DType cache_dtype = kv_cache_storage_dtype(kv_cache_dtype, kv_c.dtype());
  PAGEDATTN_CHECK(kv_cache.dtype() == cache_dtype, "kv_cache", op, ": kv_cache is ",
                  dtype_name(kv_cache.dtype()), ", expected ", dtype_name(cache_dtype),
                  " for kv_cache_dtype \"", kv_cache_dtype, "\" and ", dtype_name(kv_c.dtype()),
                  " kv_c");
  check_last_dim_contiguous(op, kv_cache, "kv_cache");

  const int64_t num_tokens = check_slot_mapping(op, slot_mapping, n, "kv_c holds");

  const Device device = kv_c.device();
  const int device_index = kv_c.device_index();
  check_same_device(op, k_pe, "k_pe", device, device_index);
  check_same_device(op, kv_cache, "kv_cache", device, device_index);
  check_same_device(op, slot_mapping, "slot_mapping", device, device_index);
  check_scale(op, scale);
  if (num_tokens > 0) {
    check_has_data(op, kv_c, "kv_c");
    check_has_data(op, k_pe, "k_pe");
    check_has_data(op, slot_mapping, "slot_mapping");
    check_has_data(op, kv_cache, "kv_cache");
  }

  if (device == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    detail::cuda_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, cache_dtype, scale);
    return;
#else
    throw Error("kv_c", detail::concat(op, ": kv_c is on cuda but pagedattn was built without CUDA"));
#endif
  }

  const auto* slots = slot_mapping.data_as<const int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    PAGEDATTN_CHECK(slot == -1 || (slot >= 0 && slot < num_slots), "slot_mapping", op,
                    ": slot_mapping[", t, "] = ", slot,
                    " is out of range: expected -1 or a slot in [0, ", num_slots, ")");
  }
  const bool quantize = is_fp8(cache_dtype);
  const DType src_dtype = kv_c.dtype();
#pragma omp parallel for schedule(static) if (num_tokens * (lora + rope) >= (int64_t{1} << 16))
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    if (slot < 0) continue;  // -1: padding
    // kv_cache (num_blocks, block_size, L + R):(c0, c1, 1)
    const int64_t dst = (slot / block_size) * kv_cache.stride(0) + (slot % block_size) * kv_cache.stride(1);
    const int64_t src_c = t * kv_c.stride(0);
    const int64_t src_pe = t * k_pe.stride(0);
    for (int64_t i = 0; i < lora; ++i) {
      float x = load_f32(kv_c.data(), src_dtype, src_c + i);
      if (quantize) x = x / scale;
      store_f32(kv_cache.data(), cache_dtype, dst + i, x);
    }
    for (int64_t i = 0; i < rope; ++i) {
      float x = load_f32(k_pe.data(), src_dtype, src_pe + i);
      if (quantize) x = x / scale;
      store_f32(kv_cache.data(), cache_dtype, dst + lora + i, x);
    }
  }
}

// ---- gather_and_maybe_dequant_cache ----------------------------------------------------------

void gather_and_maybe_dequant_cache(const TensorView& src_cache, const TensorView& dst,
                                    const TensorView& block_table, const TensorView& cu_seq_lens,
                                    int batch_size, std::string_view kv_cache_dtype, float scale,
                                    const TensorView& seq_starts) {
  constexpr std::string_view op = "gather_and_maybe_dequant_cache";
  validate_kv_cache_dtype(kv_cache_dtype);
  PAGEDATTN_CHECK(batch_size >= 0, "batch_size", op, ": batch_size = ", batch_size,
                  " must be >= 0");
  check_rank(op, dst, "dst", 2, "(num_rows, kv_lora_rank + qk_rope_head_dim)");
  check_activation_dtype(op, dst, "dst");
  check_last_dim_contiguous(op, dst, "dst");
  check_rank(op, src_cache, "src_cache", 3,
             "(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)");
  const int64_t num_blocks = src_cache.size(0);
  const int64_t block_size = src_cache.size(1);
  const int64_t row = src_cache.size(2);
  PAGEDATTN_CHECK(block_size > 0 && row == dst.size(1), "src_cache", op, ": src_cache has shape ",
                  src_cache.shape().str(), ", expected (num_blocks, block_size > 0, ", dst.size(1),
                  ") (the row size of dst ", dst.shape().str(), ")");
  const DType cache_dtype = kv_cache_storage_dtype(kv_cache_dtype, dst.dtype());
  PAGEDATTN_CHECK(src_cache.dtype() == cache_dtype, "src_cache", op, ": src_cache is ",
                  dtype_name(src_cache.dtype()), ", expected ", dtype_name(cache_dtype),
                  " for kv_cache_dtype \"", kv_cache_dtype, "\" and a ", dtype_name(dst.dtype()),
                  " dst");
  check_last_dim_contiguous(op, src_cache, "src_cache");
  check_rank(op, block_table, "block_table", 2, "(batch_size, max_blocks) int32");
  PAGEDATTN_CHECK(block_table.dtype() == DType::i32, "block_table", op, ": block_table is ",
                  dtype_name(block_table.dtype()), ", expected int32");
  PAGEDATTN_CHECK(block_table.size(0) >= batch_size, "block_table", op, ": block_table has shape ",
                  block_table.shape().str(), ", expected at least batch_size = ", batch_size,
                  " rows");
  check_i32_vector(op, cu_seq_lens, "cu_seq_lens", int64_t{batch_size} + 1,
                   "(batch_size + 1,)");
  if (seq_starts.defined()) {
    check_i32_vector(op, seq_starts, "seq_starts", batch_size, "(batch_size,)");
  }
  const Device device = dst.device();
  const int device_index = dst.device_index();
  check_same_device(op, src_cache, "src_cache", device, device_index);
  check_same_device(op, block_table, "block_table", device, device_index);
  check_same_device(op, cu_seq_lens, "cu_seq_lens", device, device_index);
  if (seq_starts.defined()) check_same_device(op, seq_starts, "seq_starts", device, device_index);
  check_scale(op, scale);
  if (batch_size > 0) {
    check_has_data(op, block_table, "block_table");
    check_has_data(op, src_cache, "src_cache");
  }

  if (device == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    detail::cuda_gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens,
                                                batch_size, cache_dtype, scale, seq_starts);
    return;
#else
    throw Error("dst", detail::concat(op, ": dst is on cuda but pagedattn was built without CUDA"));
#endif
  }

  // Host: check every content before writing.
  const int64_t max_blocks = block_table.size(1);
  const auto* bt = block_table.data_as<const int32_t>();
  PAGEDATTN_CHECK(read_i32(cu_seq_lens, 0) >= 0, "cu_seq_lens", op, ": cu_seq_lens[0] = ",
                  read_i32(cu_seq_lens, 0), " must be >= 0");
  for (int r = 0; r < batch_size; ++r) {
    const int64_t begin = read_i32(cu_seq_lens, r);
    const int64_t end = read_i32(cu_seq_lens, r + 1);
    PAGEDATTN_CHECK(end >= begin, "cu_seq_lens", op, ": cu_seq_lens[", r + 1, "] = ", end,
                    " is below cu_seq_lens[", r, "] = ", begin, ": expected non-decreasing");
    PAGEDATTN_CHECK(end <= dst.size(0), "cu_seq_lens", op, ": cu_seq_lens[", r + 1, "] = ", end,
                    " exceeds the ", dst.size(0), " rows of dst");
    const int64_t start = seq_starts.defined() ? read_i32(seq_starts, r) : 0;
    PAGEDATTN_CHECK(start >= 0, "seq_starts", op, ": seq_starts[", r, "] = ", start,
                    " must be >= 0");
    if (end == begin) continue;
    const int64_t last_col = (start + (end - begin) - 1) / block_size;
    PAGEDATTN_CHECK(last_col < max_blocks, "block_table", op, ": request ", r,
                    " reads token positions [", start, ", ", start + (end - begin),
                    ") which need block-table column ", last_col, " but block_table has ",
                    max_blocks, " columns");
    for (int64_t col = start / block_size; col <= last_col; ++col) {
      const int64_t block = bt[r * block_table.stride(0) + col * block_table.stride(1)];
      PAGEDATTN_CHECK(block >= 0 && block < num_blocks, "block_table", op, ": block_table[", r,
                      "][", col, "] = ", block, " is out of range: expected a block in [0, ",
                      num_blocks, ")");
    }
  }
  const bool dequant = is_fp8(cache_dtype);
  const DType dst_dtype = dst.dtype();
  for (int r = 0; r < batch_size; ++r) {
    const int64_t begin = read_i32(cu_seq_lens, r);
    const int64_t len = read_i32(cu_seq_lens, r + 1) - begin;
    const int64_t start = seq_starts.defined() ? read_i32(seq_starts, r) : 0;
#pragma omp parallel for schedule(static) if (len * row >= (int64_t{1} << 16))
    for (int64_t i = 0; i < len; ++i) {
      const int64_t pos = start + i;
      const int64_t block = bt[r * block_table.stride(0) + (pos / block_size) * block_table.stride(1)];
      // src_cache (num_blocks, block_size, L + R):(c0, c1, 1); dst (rows, L + R):(d0, 1)
      const int64_t src = block * src_cache.stride(0) + (pos % block_size) * src_cache.stride(1);
      const int64_t out = (begin + i) * dst.stride(0);
      for (int64_t j = 0; j < row; ++j) {
        float x = load_f32(src_cache.data(), cache_dtype, src + j);
        if (dequant) x = x * scale;
        store_f32(dst.data(), dst_dtype, out + j, x);
      }
    }
  }
}

// ---- workspace rule --------------------------------------------------------------------------

int64_t mla_chunked_prefill_workspace_tokens(int64_t max_model_len, int64_t max_num_seqs,
                                             int block_size) {
  constexpr std::string_view fn = "mla_chunked_prefill_workspace_tokens";
  PAGEDATTN_CHECK(max_model_len > 0, "max_model_len", fn, ": max_model_len = ", max_model_len,
                  " must be > 0");
  PAGEDATTN_CHECK(max_num_seqs > 0, "max_num_seqs", fn, ": max_num_seqs = ", max_num_seqs,
                  " must be > 0");
  PAGEDATTN_CHECK(block_size > 0, "block_size", fn, ": block_size = ", block_size, " must be > 0");
  // vLLM MLACommonMetadataBuilder: min(max(8 * max_model_len, 4 * max_num_seqs * block_size),
  // 64 * 1024); vLLM then asserts >= max_num_seqs * block_size, we raise it to that instead.
  const int64_t rule =
      std::min<int64_t>(std::max<int64_t>(8 * max_model_len, 4 * max_num_seqs * block_size),
                        int64_t{64} * 1024);
  return std::max<int64_t>(rule, max_num_seqs * block_size);
}

}  // namespace pagedattn
