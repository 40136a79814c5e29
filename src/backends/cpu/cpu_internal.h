// Host-side classes of the CPU backend: its plan (metadata), workspace, builder and impl.
// cpu_plan.cpp builds plans; cpu_backend.cpp holds the backend object and the impl.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cpu_kernels.h"
#include "../host_backend_common.h"
#include "../run_buffer_pool.h"
#include "pagedattn/backend.h"
#include "pagedattn/tensor.h"

namespace pagedattn::cpu {

// Only requests with at most this many query tokens are split along the keys (decode, spec
// decode; more when BuilderConfig::num_speculative_tokens asks for longer decodes: the
// workspace's max_split_query_len); longer ones have enough rows to fill the threads with q tiles.
inline constexpr int kMaxSplitQueryLen = 8;
// A split covers at least this many keys (the merge costs one partial row write + read).
inline constexpr int kMinSplitKeys = 256;
inline constexpr int kMaxSplits = 64;
// Target number of work items per thread (dynamic scheduling evens out the rest).
inline constexpr int kItemsPerThread = 4;

// Threads the backend uses: env PAGEDATTN_NUM_THREADS (a positive integer; anything else is an
// Error naming it) when set, else omp_get_max_threads(). `configured` > 0 (BuilderConfig.num_sms)
// takes precedence over both.
int resolve_num_threads(int configured);

// The buffers one forward writes: per-thread tile scratch and split-KV partial rows.
struct CpuRunBuffers {
  Tensor scratch;     // (num_threads * scratch_stride,) u8
  Tensor partial_o;   // (partial_capacity_rows, partial_o_stride) f32; undefined when 0 rows
  Tensor partial_ml;  // (partial_capacity_rows, 2) f32: running max, sum
  size_t bytes() const { return scratch.nbytes() + partial_o.nbytes() + partial_ml.nbytes(); }
};

// Allocates one CpuRunBuffers (shared by the CPU and CPU_MLA workspaces).
std::unique_ptr<CpuRunBuffers> make_run_buffers(int num_threads, size_t scratch_stride,
                                                int64_t partial_rows, int64_t partial_o_stride);

// Per-builder state shared by the plans it builds: the sizes, fixed at construction, and a pool
// of run buffers (run_buffer_pool.h): each forward leases one set, so plans of one builder (or
// one plan) can run on several threads at once; a second set is made only when forwards really
// overlap. Plans hold it by shared_ptr: a plan stays usable after later builds and after its
// builder is destroyed.
struct CpuWorkspace {
  int num_threads = 1;
  int max_rows = kMaxItemRows;
  int head_size = 0, head_size_v = 0;
  size_t scratch_stride = 0;          // bytes per thread, multiple of 64
  int max_split_query_len = kMaxSplitQueryLen;  // max(kMaxSplitQueryLen, 1 + num_speculative_tokens)
  int64_t partial_capacity_rows = 0;  // split-KV partial rows available
  int64_t partial_o_stride = 0;       // floats per partial row (Dv rounded up to 16)
  host::RunBufferPool<CpuRunBuffers> buffers;
  size_t bytes() const { return buffers.bytes(); }
};

// The plan: every host array the run needs is copied here by build().
struct CpuAttentionMetadata final : host::HostBatchPlan {
  int num_heads = 0, num_kv_heads = 0, head_size = 0, head_size_v = 0;
  std::vector<int32_t> first_query_pos;  // (num_reqs,) position of each request's first query
  std::vector<WorkItem> items;           // largest first
  std::vector<MergeTask> merges;
  int64_t partial_rows_used = 0;
  std::shared_ptr<CpuWorkspace> workspace;
};

class CpuMetadataBuilder final : public AttentionMetadataBuilder {
 public:
  CpuMetadataBuilder(KVCacheSpec spec, BuilderConfig config);
  std::shared_ptr<const AttentionMetadata> build(int common_prefix_len,
                                                 const CommonAttentionMetadata& common,
                                                 bool fast_build = false) override;
  bool supports_cascade() const override { return !config_.batch_invariant; }  // no cascade in the mode
  int reorder_batch_threshold() const override { return speculative_decode_threshold(config_); }
  size_t workspace_bytes() const override { return workspace_->bytes(); }
  int num_threads() const { return workspace_->num_threads; }

 private:
  BuilderConfig config_;
  std::shared_ptr<CpuWorkspace> workspace_;
};

class CpuAttentionImpl final : public AttentionImpl {
 public:
  explicit CpuAttentionImpl(AttentionImplParams params);

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

  bool can_return_lse_for_decode() const override { return true; }
  bool supports_quant_query_input() const override { return false; }
  bool fused_output_quant_supported(const QuantKey& key) const override;

 private:
  const CpuAttentionMetadata& checked_metadata(const AttentionMetadata& metadata,
                                               std::string_view entry) const;
  void check_kv_cache(const TensorView& kv_cache, const CpuAttentionMetadata& md,
                      std::string_view entry) const;
  void check_scales(const LayerScales& scales, std::string_view entry) const;
  DType cache_dtype_;
};

// Throws Error naming the offending parameter when the CPU backend cannot run `params`.
void check_impl_params(const AttentionImplParams& params);

// Runs a plan's items then its merges on the plan's threads (OpenMP), with the scratch and
// partial rows of `args` (a leased CpuRunBuffers).
void execute_plan(const CpuAttentionMetadata& md, const AttentionArgs& args,
                  const KernelTable& kernels);

}  // namespace pagedattn::cpu
