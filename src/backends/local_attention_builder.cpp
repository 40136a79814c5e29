// The local-attention builder (local_attention_builder.h): chunked local attention as the
// backend's ordinary causal attention over vLLM's virtual batches.
//
// build(common_prefix_len, common, fast_build), host work only:
//   1. checks `common` against the group's limits (max_num_seqs, max_num_batched_tokens,
//      max_model_len) and that its block table has the columns every request needs (the virtual
//      block tables clip page indices to the last column, which would hide a narrow table);
//   2. reads query_start_loc / seq_lens from the host mirrors and the block-table rows in use to
//      the host (a device table: one device->host copy of the span they cover, on the current
//      stream, which orders it after the caller's writes);
//   3. make_local_attention_virtual_batches: each request's queries are cut at chunk boundaries;
//      each piece is a virtual request whose keys are its chunk up to its last query and whose
//      block-table row is the chunk's pages;
//   4. a CommonAttentionMetadata of the virtual requests: query_start_loc, seq_lens,
//      num_computed_tokens and block table rewritten (copied to the builder's device);
//      slot_mapping, num_actual_tokens and the token order unchanged (the virtual requests cover
//      the batch's tokens in order), so output row i is token i of the real batch and the cache
//      write is the real one;
//   5. the inner builder plans that, with common_prefix_len 0: cascade is off for local
//      attention (vLLM: use_cascade_attention(..., use_local_attention = true) is false). A
//      caller that passes a prefix anyway gets the same answer without the cascade path.
// The plan returned is the inner builder's plan; it also owns the virtual metadata's tensors, so
// it stays valid after the caller frees its CommonAttentionMetadata (the host builders copy
// every array; the CUDA builder copies the block table device->device on the stream).
//
// CUDA graphs: never, as vLLM's chunked local builder: the number of virtual requests depends on
// where each request's tokens fall in their chunks, not only on the batch shape.
// Reorder: the inner builder's threshold. Pieces of a prefill can be as short as a decode and
// sit after longer pieces; split_decodes_and_prefills then counts them as prefills, which every
// backend's prefill path computes exactly.
#include "backends/local_attention_builder.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "metadata/host_read.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn::local_attention {
namespace {

using metadata_detail::cdiv;
using metadata_detail::read_i32;

constexpr const char* kWho = "chunked local attention build: ";

// Rows [0, num_reqs) of a (rows, cols) i32 block table, on the host, row-major.
std::vector<int32_t> host_block_table(const TensorView& table, int num_reqs) {
  const int64_t cols = table.size(1);
  std::vector<int32_t> rows(static_cast<size_t>(num_reqs * cols));
  if (rows.empty()) return rows;
  const int64_t s0 = table.stride(0), s1 = table.stride(1);
  const int32_t* src = table.data_as<const int32_t>();
  Tensor staging;
  if (table.device() != Device::cpu) {
    // One copy of the elements from the first to the last one in use, then a host gather.
    const int64_t span = (num_reqs - 1) * s0 + (cols - 1) * s1 + 1;
    staging = Tensor(Shape{span}, DType::i32, Device::cpu);
    staging.copy_from(TensorView(table.data(), DType::i32, Shape{span}, table.device(),
                                 table.device_index()));
    src = staging.data_as<const int32_t>();
  }
  for (int64_t r = 0; r < num_reqs; ++r) {
    for (int64_t c = 0; c < cols; ++c) rows[static_cast<size_t>(r * cols + c)] = src[r * s0 + c * s1];
  }
  return rows;
}

Tensor host_tensor(const std::vector<int32_t>& values, Shape shape) {
  Tensor t(shape, DType::i32, Device::cpu);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// The virtual requests' metadata and the tensors behind it.
struct VirtualBatch {
  Tensor query_start_loc_cpu, seq_lens_cpu, num_computed_tokens_cpu, block_table_cpu;
  Tensor query_start_loc, seq_lens, block_table;  // device copies; empty for a cpu builder
  CommonAttentionMetadata common;
};

// What the returned plan points into: the inner plan, kept with the virtual batch it was built
// from (the returned shared_ptr aliases `plan` and owns both).
struct LocalPlan {
  VirtualBatch batch;
  std::shared_ptr<const AttentionMetadata> plan;
};

class LocalAttentionMetadataBuilder final : public AttentionMetadataBuilder {
 public:
  LocalAttentionMetadataBuilder(KVCacheSpec spec, BuilderConfig config, Device device,
                                std::unique_ptr<AttentionMetadataBuilder> inner)
      : AttentionMetadataBuilder(std::move(spec)), config_(std::move(config)), device_(device),
        inner_(std::move(inner)) {}

  std::shared_ptr<const AttentionMetadata> build(int common_prefix_len,
                                                 const CommonAttentionMetadata& common,
                                                 bool fast_build) override;
  bool can_run_in_cudagraph(const CommonAttentionMetadata& /*common*/) const override {
    return false;
  }
  CudaGraphSupport cudagraph_support() const override { return CudaGraphSupport::never; }
  bool use_cascade_attention(int /*common_prefix_len*/, std::span<const int32_t> /*query_lens*/,
                             int /*num_query_heads*/, int /*num_kv_heads*/, bool /*use_alibi*/,
                             bool /*use_sliding_window*/, bool /*use_local_attention*/,
                             int /*num_sms*/) const override {
    return false;
  }
  bool supports_cascade() const override { return false; }
  int reorder_batch_threshold() const override { return inner_->reorder_batch_threshold(); }
  std::optional<BatchReorder> reorder_batch(
      std::span<const int32_t> num_scheduled_tokens) const override {
    return inner_->reorder_batch(num_scheduled_tokens);
  }
  size_t workspace_bytes() const override { return inner_->workspace_bytes(); }

 private:
  void check_limits(const CommonAttentionMetadata& common) const;
  Tensor on_device(const Tensor& host, int device_index) const {
    Tensor t(host.shape(), DType::i32, device_, device_index);
    t.copy_from(host.view());
    return t;
  }

  BuilderConfig config_;
  Device device_;
  std::unique_ptr<AttentionMetadataBuilder> inner_;
};

void LocalAttentionMetadataBuilder::check_limits(const CommonAttentionMetadata& common) const {
  PAGEDATTN_CHECK(common.num_reqs <= config_.max_num_seqs, "common.num_reqs", kWho, "num_reqs = ",
                  common.num_reqs, " exceeds the builder's max_num_seqs = ", config_.max_num_seqs);
  PAGEDATTN_CHECK(common.num_actual_tokens <= config_.max_num_batched_tokens,
                  "common.num_actual_tokens", kWho, "num_actual_tokens = ",
                  common.num_actual_tokens, " exceeds the builder's max_num_batched_tokens = ",
                  config_.max_num_batched_tokens);
  PAGEDATTN_CHECK(common.max_seq_len <= config_.max_model_len, "common.max_seq_len", kWho,
                  "max_seq_len = ", common.max_seq_len, " exceeds the builder's max_model_len = ",
                  config_.max_model_len);
  PAGEDATTN_CHECK(common.causal, "common.causal", kWho,
                  "common.causal = false: chunked local attention is causal (a query at position "
                  "p sees the keys of its chunk up to p)");
  const int64_t cols = common.block_table_tensor.size(1);
  const int64_t needed = cdiv(common.max_seq_len, spec_.block_size);
  PAGEDATTN_CHECK(common.num_reqs == 0 || needed <= cols, "common.block_table_tensor", kWho,
                  "block_table_tensor has ", cols, " columns: max_seq_len = ", common.max_seq_len,
                  " with block_size = ", spec_.block_size, " needs ", needed);
}

std::shared_ptr<const AttentionMetadata> LocalAttentionMetadataBuilder::build(
    int common_prefix_len, const CommonAttentionMetadata& common, bool fast_build) {
  PAGEDATTN_CHECK(common_prefix_len >= 0, "common_prefix_len", kWho, "common_prefix_len = ",
                  common_prefix_len, " must be >= 0");
  common.validate(-1, spec_.block_size);
  check_device(common.query_start_loc, "common.query_start_loc", device_);
  check_limits(common);

  const int num_reqs = common.num_reqs;
  std::vector<int32_t> query_start_loc(static_cast<size_t>(num_reqs) + 1);
  std::vector<int32_t> seq_lens(static_cast<size_t>(num_reqs));
  for (int r = 0; r <= num_reqs; ++r) query_start_loc[r] = read_i32(common.query_start_loc_cpu, r);
  for (int r = 0; r < num_reqs; ++r) seq_lens[r] = read_i32(common.seq_lens_cpu, r);
  const int cols = static_cast<int>(common.block_table_tensor.size(1));
  // The host mirror when the caller gave one (no device copy), else the table itself.
  const std::vector<int32_t> block_table = host_block_table(
      common.block_table_cpu.defined() ? common.block_table_cpu : common.block_table_tensor, num_reqs);
  const LocalAttentionVirtualBatches v = make_local_attention_virtual_batches(
      spec_.attention_chunk_size, query_start_loc, seq_lens, block_table, cols, spec_.block_size);

  auto local = std::make_shared<LocalPlan>();
  VirtualBatch& b = local->batch;
  const int64_t n = v.num_virtual_batches;
  std::vector<int32_t> computed(static_cast<size_t>(n));
  for (size_t i = 0; i < computed.size(); ++i) computed[i] = v.seqlens_k_local[i] - v.seqlens_q_local[i];
  b.query_start_loc_cpu = host_tensor(v.cu_seqlens_q_local, Shape{n + 1});
  b.seq_lens_cpu = host_tensor(v.seqlens_k_local, Shape{n});
  b.num_computed_tokens_cpu = host_tensor(computed, Shape{n});
  b.block_table_cpu = host_tensor(v.block_table_local, Shape{n, v.pages_per_local_batch});
  CommonAttentionMetadata& c = b.common;
  if (device_ == Device::cpu) {
    c.query_start_loc = b.query_start_loc_cpu.view();
    c.seq_lens = b.seq_lens_cpu.view();
    c.block_table_tensor = b.block_table_cpu.view();
  } else {
    const int index = common.query_start_loc.device_index();
    b.query_start_loc = on_device(b.query_start_loc_cpu, index);
    b.seq_lens = on_device(b.seq_lens_cpu, index);
    b.block_table = on_device(b.block_table_cpu, index);
    c.query_start_loc = b.query_start_loc.view();
    c.seq_lens = b.seq_lens.view();
    c.block_table_tensor = b.block_table.view();
    // Host mirrors: the inner builder checks block ids and slots on them (no device copy).
    c.block_table_cpu = b.block_table_cpu.view();
    c.slot_mapping_cpu = common.slot_mapping_cpu;
  }
  c.slot_mapping = common.slot_mapping;
  c.query_start_loc_cpu = b.query_start_loc_cpu.view();
  c.seq_lens_cpu = b.seq_lens_cpu.view();
  c.num_computed_tokens_cpu = b.num_computed_tokens_cpu.view();
  c.num_reqs = static_cast<int>(n);
  c.num_actual_tokens = common.num_actual_tokens;
  c.max_query_len = n == 0 ? 0 : *std::max_element(v.seqlens_q_local.begin(), v.seqlens_q_local.end());
  c.max_seq_len = n == 0 ? 0 : *std::max_element(v.seqlens_k_local.begin(), v.seqlens_k_local.end());
  c.causal = true;

  local->plan = inner_->build(0, c, fast_build);
  PAGEDATTN_CHECK(local->plan != nullptr, "backend", kWho, "the backend's builder returned no plan");
  const AttentionMetadata* plan = local->plan.get();
  return std::shared_ptr<const AttentionMetadata>(std::move(local), plan);
}

}  // namespace

void check_local_attention_spec(const KVCacheSpec& spec, const BuilderConfig& config,
                                std::string_view backend) {
  const int chunk = spec.attention_chunk_size;
  PAGEDATTN_CHECK(chunk > 0, "spec.attention_chunk_size", backend, " make_builder: ",
                  "attention_chunk_size = ", chunk, " must be > 0");
  // vLLM's make_local_attention_virtual_batches asserts attn_chunk_size % block_size == 0: a
  // virtual request's block table is whole pages of one chunk.
  PAGEDATTN_CHECK(spec.block_size > 0 && chunk % spec.block_size == 0, "spec.attention_chunk_size",
                  backend, " make_builder: attention_chunk_size = ", chunk,
                  " must be a multiple of block_size = ", spec.block_size,
                  " (a local-attention chunk covers whole pages)");
  PAGEDATTN_CHECK(config.attn_type == AttentionType::decoder, "config.attn_type", backend,
                  " make_builder: chunked local attention is only defined for attn_type=decoder, "
                  "not ", attention_type_name(config.attn_type));
  PAGEDATTN_CHECK(!config.sliding_window, "config.sliding_window", backend,
                  " make_builder: a chunked_local_attention spec with sliding_window = ",
                  config.sliding_window.value_or(0), ": a layer has one or the other");
  for (const auto& [value, arg] : {std::pair{config.max_num_seqs, "config.max_num_seqs"},
                                   std::pair{config.max_num_batched_tokens, "config.max_num_batched_tokens"},
                                   std::pair{config.max_model_len, "config.max_model_len"}}) {
    PAGEDATTN_CHECK(value > 0, arg, backend, " make_builder: ", arg, " = ", value, " must be > 0");
  }
}

KVCacheSpec inner_spec(const KVCacheSpec& spec) {
  return KVCacheSpec::full_attention(spec.block_size, spec.num_kv_heads, spec.head_size,
                                     spec.dtype, spec.head_size_v);
}

BuilderConfig inner_config(const KVCacheSpec& spec, const BuilderConfig& config) {
  // Request r with q_r >= 1 query tokens splits into 1 + cdiv(q_r - f_r, C) virtual requests,
  // f_r >= 1 its tokens in the first chunk: at most 2 + floor((q_r - 1) / C), and at most q_r.
  // Summed: <= 2 * max_num_seqs + max_num_batched_tokens / C, and <= max_num_seqs +
  // max_num_batched_tokens. Each sees at most C keys.
  BuilderConfig c = config;
  const int64_t chunk = spec.attention_chunk_size;
  const int64_t seqs = config.max_num_seqs, tokens = config.max_num_batched_tokens;
  const int64_t virtual_seqs = std::min(2 * seqs + tokens / chunk, seqs + tokens);
  c.max_num_seqs = static_cast<int>(std::min<int64_t>(virtual_seqs, INT_MAX));
  c.max_model_len = static_cast<int>(chunk);
  return c;
}

std::unique_ptr<AttentionMetadataBuilder> make_local_attention_builder(
    const KVCacheSpec& spec, const BuilderConfig& config, Device device,
    std::unique_ptr<AttentionMetadataBuilder> inner) {
  PAGEDATTN_CHECK(inner != nullptr, "backend",
                  "make_local_attention_builder: the backend's builder is null");
  return std::make_unique<LocalAttentionMetadataBuilder>(spec, config, device, std::move(inner));
}

}  // namespace pagedattn::local_attention
