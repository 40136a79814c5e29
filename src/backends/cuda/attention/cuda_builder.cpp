// The CUDA backend's metadata builder: host planning into a fixed device workspace (see
// cuda_backend_internal.h for the layout and the CUDA-graph contract).
#if PAGEDATTN_HAS_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <span>

#include "backends/cuda/attention/cuda_backend_internal.h"
#include "backends/cuda/attention/kernel_launch.h"
#include "backends/cuda/attention/kernel_selection.h"
#include "backends/cuda/common/device_runtime.h"
#include "backends/cuda/common/kernel_override.h"
#include "pagedattn/batch_invariance.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn::cuda {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) [[unlikely]] {
    (void)cudaGetLastError();
    throw Error("device", detail::concat("CUDA builder: ", what, " failed: ", cudaGetErrorString(status)));
  }
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

CudaMetadataBuilder::CudaMetadataBuilder(KVCacheSpec spec, BuilderConfig config, Device device)
    : AttentionMetadataBuilder(std::move(spec)), config_(std::move(config)) {
  PAGEDATTN_CHECK(device == Device::cuda, "device", "CUDA builder: device = ", device_name(device),
                  ", expected cuda");
  if (config_.head_size == 0) {
    config_.head_size = spec_.head_size;
    if (config_.head_size_v == 0) config_.head_size_v = spec_.value_head_size();
  }
  if (config_.head_size_v == 0) config_.head_size_v = config_.head_size;
  if (config_.num_kv_heads == 0) config_.num_kv_heads = spec_.num_kv_heads;
  if (config_.num_heads == 0) config_.num_heads = config_.num_kv_heads;
  config_.batch_invariant = batch_invariant_mode(config_);
  const int kernel_head_size = std::max(config_.head_size, config_.head_size_v);
  PAGEDATTN_CHECK(attention_head_size_supported(kernel_head_size), "head_size",
                  "CUDA builder: head_size = ", config_.head_size, ", head_size_v = ", config_.head_size_v,
                  ": the kernel for max(head_size, head_size_v) = ", kernel_head_size,
                  " does not exist: expected one of 64, 80, 96, 128, 192, 256");
  PAGEDATTN_CHECK(config_.num_kv_heads > 0 && config_.num_heads % config_.num_kv_heads == 0,
                  "num_kv_heads", "CUDA builder: num_heads = ", config_.num_heads, " and num_kv_heads = ",
                  config_.num_kv_heads, ": expected num_heads to be a positive multiple of num_kv_heads");
  PAGEDATTN_CHECK(config_.max_num_seqs > 0 && config_.max_num_batched_tokens > 0 && config_.max_model_len > 0,
                  "config", "CUDA builder: max_num_seqs = ", config_.max_num_seqs,
                  ", max_num_batched_tokens = ", config_.max_num_batched_tokens, ", max_model_len = ",
                  config_.max_model_len, ": all must be > 0");
  const int head_size_v = config_.head_size_v;

  // The kernels of this builder's plans, chosen once (kernel_selection.h). The warp-specialized
  // kernel's 32-bit strides are checked here for the cache this spec allocates (contiguous, NHD
  // or HND: the NHD rows are the farther apart) and at forward for the tensors given.
  const KernelOverride choice = kernel_override();
  const bool cached = uses_kv_cache(config_.attn_type);
  const bool fp8_kv = cached && is_fp8(spec_.dtype);
  const int64_t row_elems = int64_t{config_.num_kv_heads} * kernel_head_size;
  const bool ws_strides_ok =
      !cached || ws_strides_fit(spec_.block_size * row_elems, row_elems, spec_.block_size * row_elems, row_elems,
                                spec_.block_size);
  const int fp8_format = fp8_kv ? fp8_format_of(spec_.dtype) : 0;
  kernel_ = select_attention_kernel(choice.prefill, config_.head_size, config_.head_size_v, fp8_format,
                                    wgmma_kernels_available(), ws_strides_ok);
  // Occupancy is the same for f16 and bf16 activations.
  const AttentionKernelInfo info = attention_kernel_info(kernel_head_size, DType::bf16, fp8_kv, kernel_);
  const int sms = config_.num_sms > 0 ? config_.num_sms : current_device_sm_count();
  resident_ctas_ = std::max(1, info.ctas_per_sm) * sms;
  decode_resident_ctas_ =  // 0: no decode-only kernel for this head size
      decode_kernel_head_size(kernel_head_size)
          ? attention_kernel_info(kernel_head_size, DType::bf16, fp8_kv, AttentionKernel::decode).ctas_per_sm * sms
          : 0;

  planner_.group_size = config_.num_heads / config_.num_kv_heads;
  planner_.num_kv_heads = config_.num_kv_heads;
  planner_.prefill_rows = info.rows_prefill;
  // Decode items over kv-head pairs (kernel_selection.h paired_decode_head_size): the d 64 kernels
  // run them on their D = 128 decode path, whose steps (and so the split chunks) are shorter.
  planner_.pair_kv_heads = paired_decode_head_size(kernel_head_size, fp8_kv) && config_.head_size == config_.head_size_v &&
                           config_.num_kv_heads % 2 == 0 && info.paired_decode_step_tiles > 0;
  planner_.decode_step_tiles = info.decode_step_tiles;  // 1 on the warp-specialized kernel
  planner_.paired_decode_step_tiles = std::max(1, info.paired_decode_step_tiles);
  planner_.resident_ctas = resident_ctas_;
  planner_.positional = config_.attn_type != AttentionType::encoder_decoder;
  planner_.sliding_window = config_.sliding_window;
  // Decode batches are planned for the decode-only kernel unless decode=unified (a graph captured
  // then runs that kernel, which computes any later plan too, only prefill items more slowly).
  // Under auto, where the layer's plans run the warp-specialized kernel, only the smaller batches
  // of decodes (<= 32 64-key tiles per SM) take the decode-only kernel: the warp-specialized
  // kernel streams larger ones faster, smaller ones slower (docs/perf/cuda.md, warp-specialized
  // kernel).
  planner_.decode_resident_ctas = choice.decode != DecodeKernelChoice::unified ? decode_resident_ctas_ : 0;
  // (With an fp8 cache the decode-only kernel takes every decode batch: the fp8 warp-specialized
  // kernel transposes V in its producer, which the decode stream was not measured with.)
  planner_.decode_kernel_max_tiles = kernel_ == AttentionKernel::ws && !fp8_kv &&
                                             choice.decode == DecodeKernelChoice::automatic
                                         ? int64_t{32} * resident_ctas_
                                         : 0;
  planner_.force_decode_kernel = choice.decode == DecodeKernelChoice::decode;
  // Batch-invariant plans: one kernel (kernel_) for every plan, never the decode-only one, and
  // splits of a fixed size (planner.h, kBatchInvariantSplitKeys); no cascade.
  if (config_.batch_invariant) {
    planner_.decode_resident_ctas = 0;
    planner_.fixed_split_tiles = kBatchInvariantSplitKeys / kKeysPerTile;
    const int64_t most_keys = int64_t{planner_.max_splits} * kBatchInvariantSplitKeys - kKeysPerTile;
    PAGEDATTN_CHECK(config_.max_model_len <= most_keys, "config.max_model_len", "CUDA builder: max_model_len = ",
                    config_.max_model_len, " in the batch-invariant mode: its fixed ", kBatchInvariantSplitKeys,
                    "-key splits merge at most ", planner_.max_splits, " per request, i.e. ", most_keys, " keys");
  }
  // Cascade needs room for two states per query row (prefix + suffix), one combine item per
  // request item and the prefix items.
  cascade_possible_ = config_.attn_type == AttentionType::decoder && !config_.sliding_window &&
                      !config_.use_alibi && !config_.batch_invariant;
  const int64_t max_unsplit = max_unsplit_work_items(planner_, config_.max_num_seqs, config_.max_num_batched_tokens);
  cascade_max_tokens_ = std::min(config_.max_num_batched_tokens, kCascadeMaxTokens);
  const int64_t cascade_rows =
      cascade_possible_ ? 2 * static_cast<int64_t>(cascade_max_tokens_) * config_.num_heads : 0;
  // Split-KV states: 64 rows per CTA twice over; decode-only plans (wave-balanced splits of
  // every item) about 4 splits of every request's heads. Items: every unsplit item cut up to 4
  // times beside the fill-the-device splits; combine groups: one per unsplit item.
  const int64_t max_resident = std::max(resident_ctas_, decode_resident_ctas_);
  const int64_t decode_split_rows =
      decode_resident_ctas_ > 0 ? 4 * static_cast<int64_t>(config_.max_num_seqs) * config_.num_heads : 0;
  // Batch-invariant plans: what the fixed splits need at most (fixed_split_capacity).
  const FixedSplitCapacity fixed = fixed_split_capacity(planner_, config_.max_num_seqs,
                                                        config_.max_num_batched_tokens, config_.max_model_len);
  const int64_t partial_rows =
      std::max({2 * max_resident * 64, decode_split_rows, fixed.partial_rows}) + cascade_rows;
  const int64_t max_items =
      std::max(4 * max_unsplit + 3 * max_resident, fixed.work_items) +
      (cascade_possible_ ? max_prefix_work_items(planner_, cascade_max_tokens_) : 0);
  const int64_t max_combine = std::max(max_resident + max_unsplit, fixed.combine_items);
  PAGEDATTN_CHECK(partial_rows <= INT32_MAX && max_items <= INT32_MAX, "config",
                  "CUDA builder: max_num_seqs = ", config_.max_num_seqs, ", max_num_batched_tokens = ",
                  config_.max_num_batched_tokens, " with num_heads = ", config_.num_heads,
                  " need a plan larger than 2^31 rows or items: lower them");
  planner_.partial_rows_capacity = static_cast<int>(partial_rows);
  planner_.max_combine_items = static_cast<int>(max_combine);
  planner_.max_work_items = static_cast<int>(max_items);
  planner_.max_splits = 256;

  max_block_table_cols_ = uses_kv_cache(config_.attn_type)
                              ? static_cast<int>(cdiv(config_.max_model_len, spec_.block_size))
                              : 0;
  max_slots_ = config_.max_num_batched_tokens;

  size_t offset = align_up(sizeof(PlanHeader), 256);
  items_offset_ = offset;
  offset = align_up(offset + sizeof(WorkItem) * planner_.max_work_items, 256);
  combine_offset_ = offset;
  offset = align_up(offset + sizeof(CombineItem) * planner_.max_combine_items, 256);
  block_table_offset_ = offset;
  offset = align_up(offset + sizeof(int32_t) * static_cast<size_t>(config_.max_num_seqs) * max_block_table_cols_, 256);
  slots_offset_ = offset;
  offset = align_up(offset + sizeof(int64_t) * static_cast<size_t>(max_slots_), 256);
  partial_out_offset_ = offset;
  offset = align_up(offset + sizeof(float) * static_cast<size_t>(planner_.partial_rows_capacity) * head_size_v, 256);
  partial_lse_offset_ = offset;
  offset = align_up(offset + sizeof(float) * static_cast<size_t>(planner_.partial_rows_capacity), 256);
  workspace_ = Tensor(Shape{static_cast<int64_t>(offset)}, DType::u8, Device::cuda);
  staging_.resize(combine_offset_ + sizeof(CombineItem) * planner_.max_combine_items);
  // A plan with no items until the first build (a replayed graph then does nothing).
  std::memset(staging_.data(), 0, staging_.size());
  check_cuda(cudaMemcpyAsync(workspace_.data(), staging_.data(), sizeof(PlanHeader), cudaMemcpyHostToDevice,
                             static_cast<cudaStream_t>(current_cuda_stream())),
             "cudaMemcpyAsync(plan header)");
}

std::string CudaMetadataBuilder::capacity_problem(const CommonAttentionMetadata& common) const {
  if (common.num_reqs > config_.max_num_seqs) {
    return detail::concat("num_reqs = ", common.num_reqs, " exceeds the builder's max_num_seqs = ",
                          config_.max_num_seqs);
  }
  if (common.num_actual_tokens > config_.max_num_batched_tokens) {
    return detail::concat("num_actual_tokens = ", common.num_actual_tokens,
                          " exceeds the builder's max_num_batched_tokens = ", config_.max_num_batched_tokens);
  }
  if (common.slot_mapping.defined() && common.slot_mapping.size(0) > max_slots_) {
    return detail::concat("slot_mapping has ", common.slot_mapping.size(0),
                          " entries but the builder holds max_num_batched_tokens = ", max_slots_);
  }
  if (uses_kv_cache(config_.attn_type) && common.max_seq_len > config_.max_model_len) {
    return detail::concat("max_seq_len = ", common.max_seq_len, " exceeds the builder's max_model_len = ",
                          config_.max_model_len);
  }
  return {};
}

bool CudaMetadataBuilder::can_run_in_cudagraph(const CommonAttentionMetadata& common) const {
  return capacity_problem(common).empty();
}

std::shared_ptr<const AttentionMetadata> CudaMetadataBuilder::build(int common_prefix_len,
                                                                    const CommonAttentionMetadata& common,
                                                                    bool fast_build) {
  PAGEDATTN_CHECK(common_prefix_len >= 0, "common_prefix_len", "CUDA builder: common_prefix_len = ",
                  common_prefix_len, " must be >= 0");
  // fast_build: no cascade decision (the prefix is ignored) and no split-KV search (batch-invariant
  // builders: the same fixed splits as build()).
  return build_plan(common, false, fast_build ? 0 : common_prefix_len, !fast_build);
}

std::shared_ptr<const AttentionMetadata> CudaMetadataBuilder::build_for_cudagraph_capture(
    const CommonAttentionMetadata& common) {
  return build_plan(common, true, 0, true);  // never cascade for a capture
}

int CudaMetadataBuilder::cascade_prefix(int common_prefix_len, const CommonAttentionMetadata& common,
                                        bool causal) const {
  // As the REFERENCE: only causal decoder batches without window / ALiBi take the cascade path;
  // otherwise the prefix is attended like any other key (one pass).
  if (common_prefix_len <= 0 || !cascade_possible_ || !causal || common.num_reqs == 0) return 0;
  // A batch of more tokens than the cascade states were sized for attends the prefix in one pass
  // (same result; cascade pays off for decode-heavy batches, which are small in tokens).
  if (common.num_actual_tokens > cascade_max_tokens_) return 0;
  PAGEDATTN_CHECK(common_prefix_len % spec_.block_size == 0, "common_prefix_len",
                  "CUDA builder: common_prefix_len = ", common_prefix_len, " must be a multiple of block_size = ",
                  spec_.block_size);
  for (int r = 0; r < common.num_reqs; ++r) {
    const int computed = common.seq_len(r) - common.query_len(r);
    PAGEDATTN_CHECK(common_prefix_len <= computed, "common_prefix_len", "CUDA builder: common_prefix_len = ",
                    common_prefix_len, " exceeds num_computed_tokens = ", computed, " of request ", r,
                    ": the common prefix must be cached for every request");
  }
  return common_prefix_len;
}

std::shared_ptr<CudaAttentionMetadata> CudaMetadataBuilder::build_plan(const CommonAttentionMetadata& common,
                                                                       bool for_cudagraph, int common_prefix_len,
                                                                       bool allow_split) {
  common.validate();
  const std::string problem = capacity_problem(common);
  PAGEDATTN_CHECK(problem.empty(), "metadata", "CUDA builder: ", problem,
                  " (the workspace is sized once, at construction)");
  const bool cached = uses_kv_cache(config_.attn_type);
  if (cached) {
    check_device(common.block_table_tensor, "block_table_tensor", Device::cuda);
    PAGEDATTN_CHECK(common.block_table_tensor.stride(1) == 1, "block_table_tensor",
                    "CUDA builder: block_table_tensor has strides ", common.block_table_tensor.strides().str(),
                    ": expected a unit stride on dim 1");
  }
  const std::span<const int32_t> query_start_loc(common.query_start_loc_cpu.data_as<const int32_t>(),
                                                 static_cast<size_t>(common.num_reqs) + 1);
  const std::span<const int32_t> seq_lens(common.seq_lens_cpu.data_as<const int32_t>(),
                                          static_cast<size_t>(common.num_reqs));
  if (!cached) {
    for (int r = 0; r < common.num_reqs; ++r) {
      PAGEDATTN_CHECK(seq_lens[r] == query_start_loc[r + 1] - query_start_loc[r], "metadata",
                      "CUDA builder: seq_lens[", r, "] = ", seq_lens[r], " but query_len = ",
                      query_start_loc[r + 1] - query_start_loc[r], ": ",
                      attention_type_name(config_.attn_type), " layers attend to the current tokens only");
    }
  }
  PlannerConfig planner = planner_;
  planner.causal = config_.attn_type == AttentionType::decoder && common.causal;
  planner.allow_split = allow_split;
  const int prefix = cascade_prefix(common_prefix_len, common, planner.causal);
  const AttentionPlan plan = make_attention_plan(planner, query_start_loc, seq_lens, prefix);

  // Every earlier plan reads the workspace written below: it becomes stale from here on, even
  // when a copy below fails.
  const PlanStamp stamp{generation_, generation_->fetch_add(1) + 1};
  // Host image of header + items + combine items; two async copies (no sync: pageable memory
  // is staged before cudaMemcpyAsync returns).
  PlanHeader header{};
  header.num_work_items = static_cast<int32_t>(plan.items.size());
  header.num_combine_items = static_cast<int32_t>(plan.combine.size());
  std::memcpy(staging_.data(), &header, sizeof(header));
  std::memcpy(staging_.data() + items_offset_, plan.items.data(), sizeof(WorkItem) * plan.items.size());
  std::memcpy(staging_.data() + combine_offset_, plan.combine.data(), sizeof(CombineItem) * plan.combine.size());
  const auto stream = static_cast<cudaStream_t>(current_cuda_stream());
  auto* ws = static_cast<uint8_t*>(workspace_.data());
  check_cuda(cudaMemcpyAsync(ws, staging_.data(), items_offset_ + sizeof(WorkItem) * plan.items.size(),
                             cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync(plan)");
  if (!plan.combine.empty()) {
    check_cuda(cudaMemcpyAsync(ws + combine_offset_, staging_.data() + combine_offset_,
                               sizeof(CombineItem) * plan.combine.size(), cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync(combine plan)");
  }
  // Block table rows in use, copied into the workspace (graph replays read this copy).
  if (cached && common.num_reqs > 0 && common.max_seq_len > 0) {
    const int64_t cols = std::min<int64_t>(cdiv(common.max_seq_len, spec_.block_size),
                                           common.block_table_tensor.size(1));
    check_cuda(cudaMemcpy2DAsync(ws + block_table_offset_, sizeof(int32_t) * max_block_table_cols_,
                                 common.block_table_tensor.data(),
                                 sizeof(int32_t) * common.block_table_tensor.stride(0), sizeof(int32_t) * cols,
                                 common.num_reqs, cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpy2DAsync(block table)");
  }
  // Slot mapping copy, padded with -1 up to the capacity.
  int64_t num_slots = 0;
  auto* slots = reinterpret_cast<int64_t*>(ws + slots_offset_);
  if (common.slot_mapping.defined() && cached) {
    check_device(common.slot_mapping, "slot_mapping", Device::cuda);
    num_slots = common.slot_mapping.size(0);
    if (num_slots > 0 && common.slot_mapping.stride(0) == 1) {
      check_cuda(cudaMemcpyAsync(slots, common.slot_mapping.data(), sizeof(int64_t) * num_slots,
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync(slot_mapping)");
    } else if (num_slots > 0) {
      check_cuda(cudaMemcpy2DAsync(slots, sizeof(int64_t), common.slot_mapping.data(),
                                   sizeof(int64_t) * common.slot_mapping.stride(0), sizeof(int64_t),
                                   num_slots, cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpy2DAsync(slot_mapping)");
    }
  }
  if (num_slots < max_slots_) {
    check_cuda(cudaMemsetAsync(slots + num_slots, 0xff, sizeof(int64_t) * (max_slots_ - num_slots), stream),
               "cudaMemsetAsync(slot_mapping padding)");
  }

  auto md = std::make_shared<CudaAttentionMetadata>();
  md->num_actual_tokens = common.num_actual_tokens;
  md->num_reqs = common.num_reqs;
  md->use_cascade = plan.cascade_prefix > 0;
  md->common_prefix_len = plan.cascade_prefix;
  md->batch_invariant = config_.batch_invariant;
  md->slot_mapping = TensorView(slots, DType::i64, Shape{num_slots}, Device::cuda, workspace_.view().device_index());
  // Block ids and slots, checked on the host (the mirrors, or one synchronous copy): forward and
  // do_kv_cache_update compare them with the cache they get before the first write.
  if (cached) md->cache_footprint = kv_cache_footprint(common, spec_.block_size);
  md->attn_type = config_.attn_type;
  md->causal = planner.causal;
  md->block_size = spec_.block_size;
  md->head_size = config_.head_size;
  md->head_size_v = config_.head_size_v;
  md->num_heads = config_.num_heads;
  md->num_kv_heads = config_.num_kv_heads;
  md->sliding_window = config_.sliding_window;
  md->num_work_items = header.num_work_items;
  md->num_combine_items = header.num_combine_items;
  md->kernel = plan.decode_kernel ? AttentionKernel::decode : kernel_;
  md->resident_ctas = plan.decode_kernel ? decode_resident_ctas_ : resident_ctas_;
  md->attention_grid = std::min(header.num_work_items, md->resident_ctas);
  md->combine_grid_capacity = std::max(1, std::min(planner_.max_combine_items, resident_ctas_));
  md->for_cudagraph = for_cudagraph;
  md->header = reinterpret_cast<const PlanHeader*>(ws);
  md->items = reinterpret_cast<const WorkItem*>(ws + items_offset_);
  md->combine_items = reinterpret_cast<const CombineItem*>(ws + combine_offset_);
  md->block_table = reinterpret_cast<const int32_t*>(ws + block_table_offset_);
  md->block_table_stride = max_block_table_cols_;
  md->partial_out = reinterpret_cast<float*>(ws + partial_out_offset_);
  md->partial_lse = reinterpret_cast<float*>(ws + partial_lse_offset_);
  md->stamp = stamp;
  return md;
}

}  // namespace pagedattn::cuda

#endif  // PAGEDATTN_HAS_CUDA
