// Internal classes of the CUDA backend: its plan (metadata), builder and impl.
//
// Memory: the builder allocates ONE device workspace at construction, sized from its
// BuilderConfig (max_num_seqs, max_num_batched_tokens, max_model_len) and the device's resident
// CTA count:
//   [PlanHeader][WorkItem x max_items][CombineItem x max_combine][block table copy]
//   [slot_mapping copy][partial out f32 (rows, Dv)][partial LSE f32 (rows,)]
// Kernels: the builder chooses, once at construction, the kernel of the layer's plans
// (kernel_selection.h: the warp-specialized, wgmma or mma.sync one, from the layer, the cache, the
// device and the PAGEDATTN_CUDA_KERNEL override) and the decode-only kernel policy; each plan
// records its kernel (CudaAttentionMetadata::kernel): decode batches (every request's query_len *
// group <= 16, no cascade) the decode-only kernel (3 CTAs per SM, wave-balanced splits) when the
// policy lets them, every other plan the layer's kernel. The launch runs the plan's kernel. Each
// kernel computes any plan exactly, so a graph captures the kernel of its capture plan and
// replays any later plan with it (fast when the kinds match, as in vLLM's decode graphs).
// Partial rows: max(2 * resident CTAs * 64, 4 * max_num_seqs * num_heads) for split-KV, plus
// 2 * C * num_heads when the group can
// take the cascade path (decoder, no window, no ALiBi): the prefix states and the requests'
// states of a cascade batch, C = min(max_num_batched_tokens, kCascadeMaxTokens) tokens (33 MB at
// 32 heads, Dv 128). A batch of more tokens attends the prefix in one pass (use_cascade false).
// Cascade: build(common_prefix_len > 0) on a causal decoder batch plans the prefix / suffix
// split (planner.h) after checking common_prefix_len (a multiple of block_size, <= every
// request's computed tokens); that the prefix pages are shared is the caller's promise (the
// block table lives on the device and is not read back): the prefix is read through request 0's
// block-table row. build_for_cudagraph_capture never plans cascade.
// build() writes the plan (async host->device copy of pageable memory: returns once staged, no
// sync), copies the block table and slot mapping device->device into the workspace and pads the
// slot copy with -1. forward() only launches kernels that read the workspace, so a CUDA graph
// captured once replays ANY later plan of the same builder (cudagraph_support() == always),
// provided the layer's q / k / v / output / cache tensors keep their addresses (as vLLM's
// persistent buffers do). A plan is valid until the builder's next build(); forward on an
// older plan throws.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/cuda/attention/attention_plan.h"
#include "backends/cuda/attention/kernel_selection.h"
#include "backends/cuda/attention/planner.h"
#include "pagedattn/backend.h"
#include "pagedattn/tensor.h"

namespace pagedattn::cuda {

inline constexpr std::string_view kBackendName = "CUDA";

struct CudaAttentionMetadata final : AttentionMetadata {
  AttentionType attn_type = AttentionType::decoder;
  bool causal = true;
  int block_size = 0;
  int head_size = 0;
  int head_size_v = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  std::optional<int> sliding_window;   // the window the key ranges were planned with
  int num_work_items = 0;
  int num_combine_items = 0;
  int attention_grid = 0;              // CTAs when not capturing
  int resident_ctas = 0;               // CTAs of the plan's kernel when capturing (graph-safe)
  AttentionKernel kernel = AttentionKernel::mma;  // what the launch runs (the builder's choice)
  int combine_grid_capacity = 0;       // combine CTAs when capturing
  bool for_cudagraph = false;
  // Device plan (builder workspace).
  const PlanHeader* header = nullptr;
  const WorkItem* items = nullptr;
  const CombineItem* combine_items = nullptr;
  const int32_t* block_table = nullptr;  // (num_reqs, block_table_cols) copy
  int64_t block_table_stride = 0;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  // AttentionMetadata::stamp: the build() that wrote the workspace this plan reads.
};

class CudaMetadataBuilder final : public AttentionMetadataBuilder {
 public:
  CudaMetadataBuilder(KVCacheSpec spec, BuilderConfig config, Device device);
  // Its plans read the workspace freed here: they become stale (PlanStamp).
  ~CudaMetadataBuilder() override { generation_->fetch_add(1); }

  std::shared_ptr<const AttentionMetadata> build(int common_prefix_len,
                                                 const CommonAttentionMetadata& common,
                                                 bool fast_build = false) override;
  std::shared_ptr<const AttentionMetadata> build_for_cudagraph_capture(
      const CommonAttentionMetadata& common) override;
  bool can_run_in_cudagraph(const CommonAttentionMetadata& common) const override;
  CudaGraphSupport cudagraph_support() const override { return CudaGraphSupport::always; }
  bool supports_cascade() const override { return cascade_possible_; }
  int reorder_batch_threshold() const override { return speculative_decode_threshold(config_); }
  size_t workspace_bytes() const override { return workspace_.nbytes(); }

 private:
  // allow_split = false (fast_build): the planner makes no split-KV partition.
  std::shared_ptr<CudaAttentionMetadata> build_plan(const CommonAttentionMetadata& common,
                                                    bool for_cudagraph, int common_prefix_len,
                                                    bool allow_split);
  // The prefix length the plan uses (0 = no cascade); throws Error for an invalid one.
  int cascade_prefix(int common_prefix_len, const CommonAttentionMetadata& common, bool causal) const;
  // Empty when the batch fits the workspace; else the reason.
  std::string capacity_problem(const CommonAttentionMetadata& common) const;

  BuilderConfig config_;
  PlannerConfig planner_;
  bool cascade_possible_ = false;  // decoder, no sliding window, no ALiBi
  int cascade_max_tokens_ = 0;     // the largest batch (tokens) planned as cascade
  int resident_ctas_ = 0;
  int decode_resident_ctas_ = 0;   // the decode-only kernel's; 0: none for this head size
  AttentionKernel kernel_ = AttentionKernel::mma;  // the kernel of the plans that are not decode-only
  int max_block_table_cols_ = 0;
  int64_t max_slots_ = 0;
  // Workspace layout (byte offsets).
  size_t items_offset_ = 0, combine_offset_ = 0, block_table_offset_ = 0, slots_offset_ = 0,
         partial_out_offset_ = 0, partial_lse_offset_ = 0;
  Tensor workspace_;
  std::vector<uint8_t> staging_;  // host image of header + items + combine items
  // Bumped by every build_plan before it writes the workspace, and by the destructor.
  std::shared_ptr<std::atomic<uint64_t>> generation_ = std::make_shared<std::atomic<uint64_t>>(0);
};

class CudaAttentionImpl final : public AttentionImpl {
 public:
  explicit CudaAttentionImpl(AttentionImplParams params);

  void do_kv_cache_update(const LayerScales& scales, const TensorView& key, const TensorView& value,
                          const TensorView& kv_cache, const AttentionMetadata& metadata) override;
  void check_forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
                     const TensorView& value, const TensorView& kv_cache,
                     const AttentionMetadata& metadata, const TensorView& output,
                     const TensorView& output_scale = {},
                     const TensorView& output_lse = {}) const override;
  void forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
               const TensorView& value, const TensorView& kv_cache,
               const AttentionMetadata& metadata, const TensorView& output,
               const TensorView& output_scale = {}, const TensorView& output_lse = {}) override;
  // The attention kernel's parameters of one forward (checked by check_forward first), as forward
  // launches them; also what bench/ws_timeline_probe launches its traced kernel with.
  AttentionKernelParams kernel_params(const LayerScales& scales, const TensorView& query, const TensorView& key,
                                      const TensorView& value, const TensorView& kv_cache,
                                      const AttentionMetadata& metadata, const TensorView& output,
                                      const TensorView& output_scale, const TensorView& output_lse) const;
  bool can_return_lse_for_decode() const override { return true; }
  // A pre-quantized e4m3 query (q = q8 * scales.q_scale) with an fp8 cache, as vLLM's FA3 path:
  // converted exactly to the activation type on load (the fp8 kernel takes its bytes as they are).
  bool supports_quant_query_input() const override;
  // Fused fp8 e4m3 output (static per-tensor output_scale, output_store.cuh).
  bool fused_output_quant_supported(const QuantKey& key) const override {
    return key.kind == QuantKey::Kind::fp8_e4m3_per_tensor_static;
  }

 private:
  const CudaAttentionMetadata& checked_metadata(const AttentionMetadata& metadata,
                                                std::string_view entry) const;
  DType cache_dtype_;
  Tensor alibi_slopes_;  // (Hq,) f32 on the device, or empty
  Tensor sinks_;         // (Hq,) f32 on the device, or empty
};

// Reasons why the CUDA backend cannot run a layer (empty = it can).
std::vector<std::string> unsupported_reasons(const SelectorConfig& config);

}  // namespace pagedattn::cuda
