// MLA plan (vLLM MLACommonMetadataBuilder): the step workspace, the decode/prefill split and the
// chunked-context plan, with device copies of the small arrays.
//
// Lifetimes (as vLLM): on the CPU the plan VIEWS the caller's block table and slot mapping
// (common.block_table_tensor rows, common.slot_mapping), the small arrays are views of the plan's
// own vectors and the step buffers a pool shared with the builder (mla_common.h), so a CPU plan
// outlives later builds and its builder. On CUDA every array a decode step reads is a copy in the
// builder's persistent device arrays, which the next build() overwrites (the plan's PlanStamp then
// says stale and the impls throw): the slot mapping (padded with -1 to max_num_batched_tokens) and
// the decodes' block-table rows (row stride cdiv(max_model_len, block_size)). So a CUDA graph
// captured on one decode plan reads the same addresses in every later plan of the builder
// (CUDA_MLA: build_for_cudagraph_capture); the prefill part views the caller's rows.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/mla/mla_common.h"
#include "core/device_memory.h"
#include "pagedattn/batch_invariance.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {

size_t MLAStepBuffers::bytes() const {
  size_t total = 0;
  for (const Tensor* t : {&q_latent, &o_latent, &decode_lse, &gather, &kv_up, &k_full, &suffix_out,
                          &chunk_out, &context_out, &suffix_lse, &chunk_lse, &context_lse,
                          &merged_lse, &gemm_a_stage, &gemm_c_stage}) {
    total += t->nbytes();
  }
  return total;
}

namespace mla {
namespace {

constexpr const char* kWho = "MLA build: ";

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int32_t read_i32_at(const TensorView& t, int64_t i) {
  const int64_t at = i * t.stride(0);
  return t.dtype() == DType::i64 ? static_cast<int32_t>(t.data_as<const int64_t>()[at])
                                 : t.data_as<const int32_t>()[at];
}

TensorView host_i32_view(std::vector<int32_t>& v, Shape shape) {
  return TensorView(v.data(), DType::i32, shape, Device::cpu);
}

// The rows `reqs` (ascending) of the step's block table, for one part of the plan: a view when they
// are consecutive (no padding request among them: the usual case), else a copy gathered into
// `storage` on the table's device (held by the plan; on CUDA one row copy each, issued on the
// current stream before anything the plan runs).
TensorView part_block_table(const TensorView& bt, const std::vector<int>& reqs, std::shared_ptr<Tensor>& storage) {
  const int64_t n = static_cast<int64_t>(reqs.size());
  if (n == 0) return bt.narrow(0, 0, 0);
  if (reqs.back() - reqs.front() + 1 == n) return bt.narrow(0, reqs.front(), n);
  const int64_t cols = bt.size(1);
  storage = std::make_shared<Tensor>(Shape{n, cols}, DType::i32, bt.device(), bt.device_index());
  auto* dst = storage->data_as<int32_t>();
  const auto* src = bt.data_as<const int32_t>();
  if (bt.device() == Device::cpu) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < cols; ++c) dst[i * cols + c] = src[reqs[i] * bt.stride(0) + c * bt.stride(1)];
    }
    return storage->view();
  }
  PAGEDATTN_CHECK(bt.stride(1) == 1, "common.block_table_tensor", kWho, "block_table_tensor is ",
                  bt.describe(), ": a batch with padding requests (query_len 0) among others needs "
                  "its rows packed (column stride 1) to gather them");
  for (int64_t i = 0; i < n; ++i) {
    detail::memcpy_d2d(dst + i * cols, src + reqs[i] * bt.stride(0), static_cast<size_t>(cols) * sizeof(int32_t));
  }
  return storage->view();
}

// CUDA: the step's slot mapping into `storage` (max_num_batched_tokens entries of the caller's
// dtype), every entry past the step -1, so a kernel captured for more tokens skips them.
TensorView copy_slot_mapping_into(const Tensor& storage, const TensorView& slots, int64_t tokens) {
  const size_t es = slots.element_size();
  const int64_t capacity = static_cast<int64_t>(storage.nbytes() / es);
  auto* dst = static_cast<uint8_t*>(storage.data());
  if (tokens > 0) {
    if (slots.stride(0) == 1) {
      detail::memcpy_d2d(dst, slots.data(), static_cast<size_t>(tokens) * es);
    } else {
      detail::memcpy_d2d_2d(dst, es, slots.data(), static_cast<size_t>(slots.stride(0)) * es, es, static_cast<size_t>(tokens));
    }
  }
  detail::device_memset(dst + tokens * es, 0xFF, static_cast<size_t>(capacity - tokens) * es);
  return TensorView(dst, slots.dtype(), Shape{tokens}, slots.device(), storage.view().device_index());
}

// CUDA: the decode requests' block-table rows (their first `cols` columns) into `table` (rows of
// table.size(1) columns), one 2-D copy per run of consecutive requests.
TensorView copy_rows_into(const Tensor& table, const TensorView& bt, const std::vector<int>& reqs, int64_t cols) {
  const int64_t n = static_cast<int64_t>(reqs.size());
  const int64_t stride = table.shape()[1];
  auto* dst = static_cast<int32_t*>(table.data());
  if (n > 0 && cols > 0) {
    PAGEDATTN_CHECK(bt.stride(1) == 1, "common.block_table_tensor", kWho, "block_table_tensor is ", bt.describe(),
                    ": CUDA plans copy its rows and need them packed (column stride 1)");
    const auto* src = bt.data_as<const int32_t>();
    for (int64_t i = 0; i < n;) {
      int64_t run = 1;
      while (i + run < n && reqs[i + run] == reqs[i] + run) ++run;
      detail::memcpy_d2d_2d(dst + i * stride, static_cast<size_t>(stride) * sizeof(int32_t),
                            src + reqs[i] * bt.stride(0), static_cast<size_t>(bt.stride(0)) * sizeof(int32_t),
                            static_cast<size_t>(cols) * sizeof(int32_t), static_cast<size_t>(run));
      i += run;
    }
  }
  return TensorView(dst, DType::i32, Shape{n, stride}, Shape{stride, 1}, bt.device(), table.view().device_index());
}

// min(max_num_batched_tokens, max_num_seqs * the reorder threshold): the most decode tokens a step
// holds (MLACommonMetadataBuilder::max_decode_tokens).
int64_t decode_token_capacity(const BuilderConfig& c) {
  return std::min<int64_t>(c.max_num_batched_tokens, int64_t{c.max_num_seqs} * mla_decode_threshold(c));
}

int64_t workspace_tokens_of(const BuilderConfig& c, int block_size) {
  if (c.mla_chunked_prefill_workspace_tokens > 0) return c.mla_chunked_prefill_workspace_tokens;
  return mla_chunked_prefill_workspace_tokens(c.max_model_len, c.max_num_seqs, block_size);
}

std::unique_ptr<MLAStepBuffers> make_step_buffers(const BuilderConfig& c, int64_t w,
                                                  Device device) {
  const MLADimensions& d = c.mla_dimensions;
  const int64_t h = c.num_heads, t = c.max_num_batched_tokens;
  const int64_t s = decode_token_capacity(c);  // decode rows
  const int64_t rows = std::max(t, w);
  const int64_t l = d.kv_lora_rank, r = d.qk_rope_head_dim, p = d.qk_nope_head_dim,
                v = d.v_head_dim;
  const DType a = c.mla_dtype;
  auto b = std::make_unique<MLAStepBuffers>();
  b->q_latent = Tensor(Shape{s, h, l + r}, a, device);
  b->o_latent = Tensor(Shape{s, h, l}, a, device);
  b->decode_lse = Tensor(Shape{h, s}, DType::f32, device);
  b->gather = Tensor(Shape{w, l + r}, a, device);
  b->kv_up = Tensor(Shape{rows, h, p + v}, a, device);
  b->k_full = Tensor(Shape{rows, h, p + r}, a, device);
  b->suffix_out = Tensor(Shape{t, h, v}, a, device);
  b->chunk_out = Tensor(Shape{t, h, v}, a, device);
  b->context_out = Tensor(Shape{t, h, v}, a, device);
  b->suffix_lse = Tensor(Shape{h, t}, DType::f32, device);
  b->chunk_lse = Tensor(Shape{h, t}, DType::f32, device);
  b->context_lse = Tensor(Shape{h, t}, DType::f32, device);
  b->merged_lse = Tensor(Shape{h, t}, DType::f32, device);
  if (c.batch_invariant) {  // mla::batched_gemm_fixed_rows
    const int64_t stage_rows = kFixedGemmRows;
    b->gemm_a_stage = Tensor(Shape{stage_rows * std::max(h * p, h * l)}, a, device);
    b->gemm_c_stage = Tensor(Shape{stage_rows * std::max(h * l, h * (p + v))}, a, device);
    b->gemm_a_stage.fill_bytes(0);
    b->gemm_c_stage.fill_bytes(0);
  }
  return b;
}

std::shared_ptr<MLAWorkspace> make_workspace(const BuilderConfig& c, int block_size,
                                             Device device) {
  auto ws = std::make_shared<MLAWorkspace>();
  ws->device = device;
  ws->dtype = c.mla_dtype;
  ws->dims = c.mla_dimensions;
  ws->num_heads = c.num_heads;
  ws->max_tokens = c.max_num_batched_tokens;
  ws->max_seqs = c.max_num_seqs;
  ws->workspace_tokens = workspace_tokens_of(c, block_size);
  if (device == Device::cpu) {
    ws->host_buffers.start(
        [c, w = ws->workspace_tokens] { return make_step_buffers(c, w, Device::cpu); });
  } else {
    ws->device_buffers = make_step_buffers(c, ws->workspace_tokens, device);
  }
  return ws;
}

void check_builder_config(const KVCacheSpec& spec, const BuilderConfig& c) {
  const char* who = "MLACommonMetadataBuilder: ";
  const MLADimensions& d = c.mla_dimensions;
  PAGEDATTN_CHECK(spec.kind == KVCacheSpecKind::mla, "spec", who, "spec kind = ",
                  kv_cache_spec_kind_name(spec.kind), ", expected mla");
  PAGEDATTN_CHECK(spec.block_size > 0, "spec.block_size", who, "block_size = ", spec.block_size,
                  " must be > 0");
  PAGEDATTN_CHECK(d.kv_lora_rank > 0 && d.qk_rope_head_dim > 0 && d.qk_nope_head_dim > 0 &&
                      d.v_head_dim > 0,
                  "config.mla_dimensions", who, "mla_dimensions = ", d.to_string(),
                  ": every dimension must be > 0");
  PAGEDATTN_CHECK(spec.head_size == d.latent_head_size(), "spec.head_size", who,
                  "spec head_size = ", spec.head_size, ", expected kv_lora_rank + qk_rope_head_dim = ",
                  d.latent_head_size());
  PAGEDATTN_CHECK(c.num_heads > 0, "config.num_heads", who, "num_heads = ", c.num_heads,
                  " must be > 0");
  PAGEDATTN_CHECK(c.mla_dtype == DType::f32 || c.mla_dtype == DType::f16 ||
                      c.mla_dtype == DType::bf16,
                  "config.mla_dtype", who, "mla_dtype = ", dtype_name(c.mla_dtype),
                  " must be float32, float16 or bfloat16");
  PAGEDATTN_CHECK(c.max_num_seqs > 0, "config.max_num_seqs", who, "max_num_seqs = ",
                  c.max_num_seqs, " must be > 0");
  PAGEDATTN_CHECK(c.max_num_batched_tokens > 0, "config.max_num_batched_tokens", who,
                  "max_num_batched_tokens = ", c.max_num_batched_tokens, " must be > 0");
  PAGEDATTN_CHECK(c.max_model_len > 0, "config.max_model_len", who, "max_model_len = ",
                  c.max_model_len, " must be > 0");
  PAGEDATTN_CHECK(c.mla_chunked_prefill_workspace_tokens == 0 ||
                      c.mla_chunked_prefill_workspace_tokens >=
                          int64_t{c.max_num_seqs} * spec.block_size,
                  "config.mla_chunked_prefill_workspace_tokens", who,
                  "mla_chunked_prefill_workspace_tokens = ", c.mla_chunked_prefill_workspace_tokens,
                  " must be 0 (vLLM's rule) or >= max_num_seqs * block_size = ",
                  int64_t{c.max_num_seqs} * spec.block_size,
                  " (every prefill gets at least one page per chunk)");
}

}  // namespace

// Device copies of the plan arrays (CUDA only; sized for the builder's limits).
struct MLACommonMetadataBuilder::DeviceArrays {
  int64_t max_chunks = 0;
  int64_t max_blocks = 0;        // block-table columns: cdiv(max_model_len, block_size)
  Tensor slot_mapping;           // (T,) i64 storage, read as the caller's dtype; -1 past the step
  Tensor decode_block_table;     // (S, max_blocks) the decodes' rows
  Tensor decode_seq_lens;        // (S,)
  Tensor query_start_loc;        // (S + 1,)
  Tensor seq_lens, context_lens; // (S,)
  Tensor chunk_starts;           // (max_chunks * S,)
  Tensor cu_seq_lens;            // (max_chunks * (S + 1),)
};

MLACommonMetadataBuilder::MLACommonMetadataBuilder(KVCacheSpec spec, const BuilderConfig& config,
                                                   Device device)
    : AttentionMetadataBuilder(std::move(spec)), config_(config), device_(device) {
  check_builder_config(spec_, config_);
  config_.batch_invariant = batch_invariant_mode(config_);
  workspace_ = make_workspace(config_, spec_.block_size, device_);
  if (device_ == Device::cuda) {
    arrays_ = std::make_unique<DeviceArrays>();
    const int64_t s = config_.max_num_seqs;
    arrays_->max_chunks = std::max<int64_t>(1, cdiv(config_.max_model_len, min_context_chunk()));
    arrays_->max_blocks = cdiv(config_.max_model_len, spec_.block_size);
    arrays_->slot_mapping = Tensor(Shape{config_.max_num_batched_tokens}, DType::i64, device_);
    arrays_->decode_block_table = Tensor(Shape{s, arrays_->max_blocks}, DType::i32, device_);
    arrays_->decode_seq_lens = Tensor(Shape{s}, DType::i32, device_);
    arrays_->query_start_loc = Tensor(Shape{s + 1}, DType::i32, device_);
    arrays_->seq_lens = Tensor(Shape{s}, DType::i32, device_);
    arrays_->context_lens = Tensor(Shape{s}, DType::i32, device_);
    arrays_->chunk_starts = Tensor(Shape{arrays_->max_chunks * s}, DType::i32, device_);
    arrays_->cu_seq_lens = Tensor(Shape{arrays_->max_chunks * (s + 1)}, DType::i32, device_);
  }
}

int64_t MLACommonMetadataBuilder::max_decode_tokens() const { return decode_token_capacity(config_); }

int64_t MLACommonMetadataBuilder::min_context_chunk() const {
  const int64_t bs = spec_.block_size;
  return std::max<int64_t>(bs, (workspace_->workspace_tokens / config_.max_num_seqs) / bs * bs);
}

// Plans built by this builder read its device arrays (CUDA): they become stale with it.
MLACommonMetadataBuilder::~MLACommonMetadataBuilder() { generation_->fetch_add(1); }

size_t MLACommonMetadataBuilder::workspace_bytes() const {
  size_t total = workspace_->bytes();
  if (arrays_) {
    for (const Tensor* t : {&arrays_->slot_mapping, &arrays_->decode_block_table, &arrays_->decode_seq_lens, &arrays_->query_start_loc,
                            &arrays_->seq_lens, &arrays_->context_lens, &arrays_->chunk_starts,
                            &arrays_->cu_seq_lens}) {
      total += t->nbytes();
    }
  }
  return total;
}

std::shared_ptr<MLAMetadata> MLACommonMetadataBuilder::make_metadata() const {
  return std::make_shared<MLAMetadata>();
}

void MLACommonMetadataBuilder::plan_decode(MLAMetadata& /*metadata*/,
                                           const CommonAttentionMetadata& /*common*/,
                                           bool /*fast_build*/) {}

std::shared_ptr<const AttentionMetadata> MLACommonMetadataBuilder::build(
    int common_prefix_len, const CommonAttentionMetadata& common, bool fast_build) {
  // MLA has no cascade path (as vLLM's MLA backends): common_prefix_len is accepted and ignored.
  PAGEDATTN_CHECK(common_prefix_len >= 0, "common_prefix_len", kWho, "common_prefix_len = ",
                  common_prefix_len, " must be >= 0");
  common.validate(-1, spec_.block_size);
  check_device(common.query_start_loc, "common.query_start_loc", device_);
  check_device(common.seq_lens, "common.seq_lens", device_);
  check_device(common.block_table_tensor, "common.block_table_tensor", device_);
  check_device(common.slot_mapping, "common.slot_mapping", device_);
  const int num_reqs = common.num_reqs;
  PAGEDATTN_CHECK(num_reqs <= config_.max_num_seqs, "common.num_reqs", kWho, "num_reqs = ",
                  num_reqs, " exceeds the builder's max_num_seqs = ", config_.max_num_seqs);
  PAGEDATTN_CHECK(common.num_actual_tokens <= config_.max_num_batched_tokens,
                  "common.num_actual_tokens", kWho, "num_actual_tokens = ",
                  common.num_actual_tokens, " exceeds the builder's max_num_batched_tokens = ",
                  config_.max_num_batched_tokens);
  PAGEDATTN_CHECK(common.max_seq_len <= config_.max_model_len, "common.max_seq_len", kWho,
                  "max_seq_len = ", common.max_seq_len, " exceeds the builder's max_model_len = ",
                  config_.max_model_len);
  PAGEDATTN_CHECK(common.causal, "common.causal", kWho,
                  "causal = false is not supported: MLA layers are causal decoders");
  const TensorView& bt = common.block_table_tensor;
  const int64_t needed = cdiv(common.max_seq_len, spec_.block_size);
  PAGEDATTN_CHECK(num_reqs == 0 || needed <= bt.size(1), "common.block_table_tensor", kWho,
                  "block_table_tensor has ", bt.size(1), " columns: max_seq_len = ",
                  common.max_seq_len, " with block_size = ", spec_.block_size, " needs ", needed);

  std::vector<int32_t> qsl(static_cast<size_t>(num_reqs) + 1), seq_lens(num_reqs);
  for (int r = 0; r <= num_reqs; ++r) qsl[r] = read_i32_at(common.query_start_loc_cpu, r);
  for (int r = 0; r < num_reqs; ++r) seq_lens[r] = read_i32_at(common.seq_lens_cpu, r);

  // Decodes first (reorder_batch_threshold(): 1, or 1 + k with k speculative tokens): the requests
  // of 1 to threshold tokens, then those of more. Requests of query_len 0 (padding) may sit
  // anywhere: no-ops, left out of both parts (the tokens of the others stay contiguous, so only
  // the block-table rows need gathering: part_block_table).
  const int threshold = reorder_batch_threshold();
  std::vector<int> decode_reqs, prefill_reqs;
  int num_decode_tokens = 0;
  for (int r = 0; r < num_reqs; ++r) {
    const int q = qsl[r + 1] - qsl[r];
    if (q == 0) continue;
    if (q <= threshold) {
      PAGEDATTN_CHECK(prefill_reqs.empty(), "common", kWho, "request ", r, " has query_len ", q,
                      " <= reorder_batch_threshold ", threshold, " after a prefill (request ",
                      prefill_reqs.front(), "): the batch must be ordered decodes first (reorder_batch)");
      decode_reqs.push_back(r);
      num_decode_tokens += q;
    } else {
      prefill_reqs.push_back(r);
    }
  }
  const int num_decodes = static_cast<int>(decode_reqs.size());
  const int num_prefills = static_cast<int>(prefill_reqs.size());
  PAGEDATTN_CHECK(num_decode_tokens <= max_decode_tokens(), "common", kWho, "the step's decodes hold ",
                  num_decode_tokens, " tokens, more than the builder's ", max_decode_tokens(),
                  " (max_num_seqs x reorder_batch_threshold, at most max_num_batched_tokens)");

  std::shared_ptr<MLAMetadata> md = make_metadata();
  md->num_actual_tokens = common.num_actual_tokens;
  md->num_reqs = num_reqs;
  md->use_cascade = false;
  md->common_prefix_len = 0;
  md->batch_invariant = config_.batch_invariant;
  md->slot_mapping = common.slot_mapping.narrow(0, 0, common.num_actual_tokens);
  md->cache_footprint = kv_cache_footprint(common, spec_.block_size);
  md->num_decodes = num_decodes;
  md->num_decode_tokens = num_decode_tokens;
  md->num_prefills = num_prefills;
  md->num_prefill_tokens = common.num_actual_tokens - md->num_decode_tokens;
  md->workspace = workspace_;

  // decode part
  MLADecodeMetadata& dec = md->decode;
  dec.num_decodes = num_decodes;
  dec.num_decode_tokens = md->num_decode_tokens;
  dec.query_start_loc.assign(1, 0);
  for (int r : decode_reqs) {
    const int q = qsl[r + 1] - qsl[r];
    dec.seq_lens.push_back(seq_lens[r]);
    dec.query_start_loc.push_back(dec.query_start_loc.back() + q);
    for (int j = 0; j < q; ++j) dec.token_seq_lens.push_back(seq_lens[r] - q + 1 + j);
  }
  dec.max_seq_len = num_decodes > 0 ? *std::max_element(dec.seq_lens.begin(), dec.seq_lens.end()) : 0;
  if (device_ == Device::cpu) dec.block_table = part_block_table(bt, decode_reqs, dec.block_table_storage);

  // prefill part
  if (num_prefills > 0) {
    MLAPrefillMetadata& pre = md->prefill.emplace();
    pre.num_prefills = num_prefills;
    pre.num_prefill_tokens = md->num_prefill_tokens;
    pre.token_offset = md->num_decode_tokens;
    pre.query_start_loc.assign(static_cast<size_t>(num_prefills) + 1, 0);
    pre.seq_lens.resize(num_prefills);
    pre.context_lens.resize(num_prefills);
    for (int i = 0; i < num_prefills; ++i) {
      const int r = prefill_reqs[i];
      pre.query_start_loc[i + 1] = pre.query_start_loc[i] + (qsl[r + 1] - qsl[r]);
    }
    int max_context = 0, with_context = 0;
    for (int i = 0; i < num_prefills; ++i) {
      const int r = prefill_reqs[i];
      pre.seq_lens[i] = seq_lens[r];
      pre.context_lens[i] = seq_lens[r] - (qsl[r + 1] - qsl[r]);
      pre.max_query_len = std::max(pre.max_query_len, qsl[r + 1] - qsl[r]);
      pre.max_seq_len = std::max(pre.max_seq_len, seq_lens[r]);
      max_context = std::max(max_context, pre.context_lens[i]);
      with_context += pre.context_lens[i] > 0 ? 1 : 0;
    }
    pre.block_table = part_block_table(bt, prefill_reqs, pre.block_table_storage);
    if (with_context > 0) {
      // vLLM ChunkedContextMetadata (aot_schedule: the chunk is a whole number of pages).
      MLAChunkedContextMetadata& cc = pre.chunked_context.emplace();
      const int64_t w = workspace_->workspace_tokens;
      cc.workspace_tokens = w;
      // Batch-invariant: the chunk every prefill gets with the most prefills the builder takes,
      // whatever this batch holds, so a request's chunks (and their LSE merges) are its own.
      cc.max_context_chunk =
          config_.batch_invariant
              ? static_cast<int>(min_context_chunk())
              : static_cast<int>((w / with_context) / spec_.block_size * spec_.block_size);
      PAGEDATTN_CHECK(cc.max_context_chunk > 0, "config.mla_chunked_prefill_workspace_tokens",
                      kWho, "workspace of ", w, " tokens gives ", with_context,
                      " prefills with context less than one page of ", spec_.block_size,
                      " tokens each");
      cc.num_chunks = static_cast<int>(cdiv(max_context, cc.max_context_chunk));
      const size_t nc = static_cast<size_t>(cc.num_chunks), np = static_cast<size_t>(num_prefills);
      cc.chunk_starts.resize(nc * np);
      cc.chunk_seq_lens.resize(nc * np);
      cc.cu_seq_lens.assign(nc * (np + 1), 0);
      cc.chunk_total_tokens.resize(nc);
      cc.max_seq_lens.resize(nc);
      for (size_t c = 0; c < nc; ++c) {
        int32_t running = 0, longest = 0;
        for (size_t i = 0; i < np; ++i) {
          const int32_t start = static_cast<int32_t>(c) * cc.max_context_chunk;
          const int32_t end = std::min(pre.context_lens[i], start + cc.max_context_chunk);
          const int32_t len = std::max(0, end - start);
          cc.chunk_starts[c * np + i] = start;
          cc.chunk_seq_lens[c * np + i] = len;
          running += len;
          cc.cu_seq_lens[c * (np + 1) + i + 1] = running;
          longest = std::max(longest, len);
        }
        cc.chunk_total_tokens[c] = running;
        cc.max_seq_lens[c] = longest;
      }
      if (arrays_ && static_cast<int64_t>(nc) > arrays_->max_chunks) {
        throw Error("common.max_seq_len",
                    detail::concat(kWho, "the step needs ", nc, " context chunks but the builder "
                                   "sized its device arrays for ", arrays_->max_chunks));
      }
    }
  }

  // CUDA: from here on the device arrays (and the backend's decode plan) are overwritten, so
  // every earlier plan becomes stale first; this plan is stamped with the new generation.
  if (device_ == Device::cuda) {
    md->stamp = PlanStamp{generation_, generation_->fetch_add(1) + 1};
    if (md->prefill) md->prefill->stamp = md->stamp;
  }
  // Device copies (CPU: views of the vectors above; CUDA: the builder's persistent buffers).
  const auto place = [&](std::vector<int32_t>& v, Tensor* storage, Shape shape) -> TensorView {
    if (device_ == Device::cpu) return host_i32_view(v, shape);
    if (!v.empty()) detail::memcpy_h2d(storage->data(), v.data(), v.size() * sizeof(int32_t));
    return TensorView(storage->data(), DType::i32, shape, device_, storage->view().device_index());
  };
  DeviceArrays* a = arrays_.get();
  if (a != nullptr) {
    md->slot_mapping = copy_slot_mapping_into(a->slot_mapping, md->slot_mapping, common.num_actual_tokens);
    dec.block_table = copy_rows_into(a->decode_block_table, bt, decode_reqs, cdiv(dec.max_seq_len, spec_.block_size));
  }
  dec.seq_lens_device = place(dec.seq_lens, a ? &a->decode_seq_lens : nullptr, Shape{num_decodes});
  if (md->prefill) {
    MLAPrefillMetadata& pre = *md->prefill;
    const int64_t np = num_prefills;
    pre.query_start_loc_device = place(pre.query_start_loc, a ? &a->query_start_loc : nullptr, Shape{np + 1});
    pre.seq_lens_device = place(pre.seq_lens, a ? &a->seq_lens : nullptr, Shape{np});
    pre.context_lens_device = place(pre.context_lens, a ? &a->context_lens : nullptr, Shape{np});
    if (pre.chunked_context) {
      MLAChunkedContextMetadata& cc = *pre.chunked_context;
      cc.chunk_starts_device = place(cc.chunk_starts, a ? &a->chunk_starts : nullptr, Shape{cc.num_chunks, np});
      cc.cu_seq_lens_device = place(cc.cu_seq_lens, a ? &a->cu_seq_lens : nullptr, Shape{cc.num_chunks, np + 1});
    }
  }
  if (num_decodes > 0) plan_decode(*md, common, fast_build);
  return md;
}

}  // namespace mla
}  // namespace pagedattn
