// Pieces shared by the host (CPU-memory) backends, REFERENCE and CPU: the accepted dtype
// vocabulary and the standard cache write of a step.
#pragma once

#include <functional>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/backend.h"

namespace pagedattn::host {

// f32 / f16 / bf16.
bool is_activation_dtype(DType dtype);
// "auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32".
bool is_accepted_kv_cache_dtype(std::string_view kv_cache_dtype);
std::string accepted_kv_cache_dtypes();  // the list above, comma separated
std::vector<std::string> kv_cache_dtype_names();  // the list above

// Stores a double into element `index` of a buffer of `dtype` (f32 / f16 / bf16 / fp8), rounding
// ONCE: f32 is a plain double -> float rounding; the narrower types go double -> float with
// round-to-odd, then the library's round-to-nearest-even float -> f16 / bf16 / fp8 (saturating)
// conversion, which together equal one correct rounding of the double (the targets have at most
// 11 significant bits, far fewer than float's 24 - 2). The fp64 oracles' output store.
void store_rounded_f64(void* data, DType dtype, int64_t index, double value);

// The selector reasons every host backend shares: device must be cpu, no sparse attention,
// f32/f16/bf16 activations, a known kv_cache_dtype. Appends full sentences naming `who`.
void add_host_selector_reasons(const SelectorConfig& config, std::string_view who,
                               std::vector<std::string>& reasons);

struct HostBatchPlan;
// The standard 5-D cache a host impl reads: defined, on the host, `cache_dtype`, shape
// (2, num_blocks, block_size, Hkv, max(D, Dv)) with plan.block_size, large enough for every
// block and slot of the plan (plan.cache_footprint). `who` + `entry` prefix messages.
void check_standard_kv_cache(const AttentionImplParams& params, DType cache_dtype,
                             const TensorView& kv_cache, const HostBatchPlan& plan,
                             std::string_view who, std::string_view entry);

// Layer scales of a host impl: per-head scales f32 (num_kv_heads,) on the host when given;
// per-tensor k/v scales positive and finite when the cache is fp8. `who` + `entry` prefix
// messages ("CPU forward: ...").
void check_layer_scales(const AttentionImplParams& params, DType cache_dtype,
                        const LayerScales& scales, std::string_view who, std::string_view entry);

// do_kv_cache_update of a standard 5-D host cache (kv_cache.h) for a step whose host slot
// mapping is `slots` ((num_slots,) i64): encoder types write nothing; key/value not given means
// every slot must be -1 (cross-attention after the encoder step); slots past key's rows must be
// -1; then reshape_and_cache_flash, which checks every slot before writing a byte.
// `check_cache_and_scales` (the backend's own checks of kv_cache against its plan and of the
// scales) runs once key/value are known to be given, before anything is written. `who` prefixes
// messages ("CPU", "REFERENCE").
void write_step_kv_cache(const AttentionImplParams& params, const LayerScales& scales,
                         const TensorView& key, const TensorView& value,
                         const TensorView& kv_cache, const TensorView& slots, std::string_view who,
                         const std::function<void()>& check_cache_and_scales);

// The host part of a plan, common to the host backends: every host array the run needs is
// COPIED here by build(), so the plan stays valid (and unchanged) when the caller reuses or
// frees its CommonAttentionMetadata.
struct HostBatchPlan : AttentionMetadata {
  AttentionType attn_type = AttentionType::decoder;
  bool causal = true;        // decoder only: common.causal (vLLM honours it); others: false
  int block_size = 0;        // tokens per cache block (the spec's)
  int block_table_cols = 0;  // columns of block_table
  int max_query_len = 0;
  int max_seq_len = 0;
  std::vector<int32_t> query_start_loc;  // (num_reqs + 1,)
  std::vector<int32_t> seq_lens;         // (num_reqs,)
  std::vector<int32_t> block_table;      // (num_reqs, block_table_cols) row-major; empty for the
                                         // no-cache types (encoder, encoder_only)
  Tensor slot_mapping_storage;  // (num_slots,) i64; AttentionMetadata::slot_mapping views it

  int query_len(int req) const { return query_start_loc[req + 1] - query_start_loc[req]; }
  const int32_t* block_row(int req) const {
    return block_table.data() + static_cast<int64_t>(req) * block_table_cols;
  }
};

// build() of a host backend up to its own planning: validates `common` (host tensors, the
// builder's limits), copies the arrays into `plan`, keeps the slots written this step (the
// first num_actual_tokens; all of them for cross-attention, whose slots map encoder tokens),
// and decides cascade: common_prefix_len > 0 && causal decoder && no window && no ALiBi, with
// the prefix a multiple of block_size, cached for every request and on blocks every request
// shares (else an Error naming common_prefix_len). fast_build and config.batch_invariant (the
// builder resolved batch_invariant_mode into it): no cascade decision (the prefix is only checked
// >= 0). `who` prefixes messages ("CPU build: ").
void fill_host_batch_plan(HostBatchPlan& plan, int common_prefix_len,
                          const CommonAttentionMetadata& common, const KVCacheSpec& spec,
                          const BuilderConfig& config, std::string_view who, bool fast_build);

}  // namespace pagedattn::host
